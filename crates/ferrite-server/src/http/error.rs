//! The one mapping from core errors to HTTP responses: `{"error": "..."}` with the status code.

use axum::{
    http::{header, HeaderValue, StatusCode},
    response::{IntoResponse, Response},
};
use ferrite_core::Error;

/// An error on its way to the client.
#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub retry_after: Option<u64>,
}

impl ApiError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        ApiError { status, message: message.into(), retry_after: None }
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }
}

impl From<Error> for ApiError {
    fn from(e: Error) -> Self {
        let status = match &e {
            Error::InvalidInput(_) => StatusCode::BAD_REQUEST,
            Error::NotFound(_) => StatusCode::NOT_FOUND,
            Error::Unavailable { .. } => StatusCode::SERVICE_UNAVAILABLE,
            Error::Overloaded { .. } => StatusCode::TOO_MANY_REQUESTS,
            Error::TooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            Error::DeadlineExceeded(_) => StatusCode::GATEWAY_TIMEOUT,
            Error::Unsupported(_) => StatusCode::NOT_IMPLEMENTED,
            Error::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        };
        let retry_after = match &e {
            Error::Unavailable { retry_after, .. } | Error::Overloaded { retry_after, .. } => {
                retry_after.map(|d| d.as_secs().max(1))
            }
            _ => None,
        };
        ApiError { status, message: e.to_string(), retry_after }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = serde_json::to_string(&super::bodies::Error { error: self.message }).unwrap_or_default();
        let mut resp = (self.status, [(header::CONTENT_TYPE, "application/json")], body).into_response();
        if let Some(secs) = self.retry_after {
            resp.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        resp
    }
}
