//! The one error enum of the core. Each front-end maps it once, exhaustively.

use std::time::Duration;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, Clone, thiserror::Error, PartialEq)]
pub enum Error {
    /// The request does not fit the model (names, dtypes, shapes, sizes, limits).
    #[error("{0}")]
    InvalidInput(String),
    /// No such model, version or tensor.
    #[error("{0}")]
    NotFound(String),
    /// The server or model cannot take work now (not ready, queue full, shutting down).
    #[error("{message}")]
    Unavailable { message: String, retry_after: Option<Duration> },
    /// Over a concurrency or rate limit: retry later (HTTP 429, gRPC RESOURCE_EXHAUSTED).
    #[error("{message}")]
    Overloaded { message: String, retry_after: Option<Duration> },
    /// The request holds more than the server ever holds for one (its bytes in flight and what
    /// they decode to): never to be retried as it is (HTTP 413, gRPC RESOURCE_EXHAUSTED with no
    /// retry hint).
    #[error("{0}")]
    TooLarge(String),
    /// The request's timeout ended before it could run.
    #[error("{0}")]
    DeadlineExceeded(String),
    /// The request asks for something this server or model does not do.
    #[error("{0}")]
    Unsupported(String),
    /// A fault inside the server or the backend.
    #[error("{0}")]
    Internal(String),
}

impl Error {
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::InvalidInput(message.into())
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::Internal(message.into())
    }

    pub fn unavailable(message: impl Into<String>, retry_after: Option<Duration>) -> Self {
        Self::Unavailable { message: message.into(), retry_after }
    }
}
