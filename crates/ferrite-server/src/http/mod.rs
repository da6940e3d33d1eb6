//! KServe V2 / Open Inference Protocol over HTTP/REST.

mod error;
mod json;

use axum::{
    body::Bytes,
    extract::{rejection::BytesRejection, DefaultBodyLimit, Path, State},
    http::{header, StatusCode},
    response::{IntoResponse, Response},
    routing::{get, post},
    Json, Router,
};
use ferrite_core::{Core, Model};
use serde::Deserialize;
use serde_json::{json, Value};
use std::sync::Arc;

pub use error::ApiError;

#[derive(Clone)]
pub struct AppState {
    pub core: Core,
}

/// Limits the HTTP front-end applies before anything reaches the core.
#[derive(Debug, Clone)]
pub struct HttpLimits {
    pub max_body_bytes: usize,
}

/// The whole V2 REST surface.
pub fn app(core: Core, limits: &HttpLimits) -> Router {
    let model_routes = Router::new()
        .route("/", get(model_metadata))
        .route("/ready", get(model_ready))
        .route("/config", get(model_config))
        .route("/stats", get(model_stats))
        .route("/infer", post(infer));
    Router::new()
        .route("/v2", get(server_metadata))
        .route("/v2/health/live", get(|| async { StatusCode::OK }))
        .route("/v2/health/ready", get(server_ready))
        .route("/v2/models/stats", get(all_stats))
        .nest("/v2/models/{model}", model_routes.clone())
        .nest("/v2/models/{model}/versions/{version}", model_routes)
        .fallback(|| async { ApiError::new(StatusCode::NOT_FOUND, "no such endpoint") })
        .layer(DefaultBodyLimit::max(limits.max_body_bytes))
        .with_state(AppState { core })
}

#[derive(Deserialize)]
struct ModelPath {
    model: String,
    version: Option<String>,
}

impl AppState {
    fn model(&self, p: &ModelPath) -> Result<&Arc<Model>, ApiError> {
        Ok(self.core.model(&p.model, p.version.as_deref())?)
    }
}

async fn server_metadata() -> Json<Value> {
    Json(json!({
        "name": "ferrite",
        "version": env!("CARGO_PKG_VERSION"),
        "extensions": ["model_configuration", "statistics"],
    }))
}

async fn server_ready(State(s): State<AppState>) -> StatusCode {
    if s.core.is_ready() {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    }
}

async fn model_ready(State(s): State<AppState>, Path(p): Path<ModelPath>) -> StatusCode {
    match s.core.model(&p.model, p.version.as_deref()) {
        Ok(_) if s.core.is_ready() => StatusCode::OK,
        Ok(_) => StatusCode::SERVICE_UNAVAILABLE,
        Err(_) => StatusCode::NOT_FOUND,
    }
}

/// Shape as clients see it: -1 for the batch dim when the model batches.
fn full_shape(m: &Model, dims: &[i64]) -> Vec<i64> {
    let batch = (m.spec.batch.max_batch_size > 0).then_some(-1);
    batch.into_iter().chain(dims.iter().copied()).collect()
}

async fn model_metadata(State(s): State<AppState>, Path(p): Path<ModelPath>) -> Result<Json<Value>, ApiError> {
    let m = s.model(&p)?;
    let tensors = |specs: &[ferrite_core::config::TensorSpec]| {
        specs
            .iter()
            .map(|t| json!({"name": t.name, "datatype": t.datatype.as_str(), "shape": full_shape(m, &t.dims)}))
            .collect::<Vec<_>>()
    };
    Ok(Json(json!({
        "name": m.spec.name,
        "versions": [m.spec.version.to_string()],
        "platform": m.spec.platform,
        "inputs": tensors(&m.spec.inputs),
        "outputs": tensors(&m.spec.outputs),
    })))
}

async fn model_config(State(s): State<AppState>, Path(p): Path<ModelPath>) -> Result<Json<Value>, ApiError> {
    let m = s.model(&p)?;
    let spec = &m.spec;
    let tensors = |specs: &[ferrite_core::config::TensorSpec]| {
        specs
            .iter()
            .map(|t| json!({"name": t.name, "data_type": t.datatype.config_name(), "dims": t.dims}))
            .collect::<Vec<_>>()
    };
    let mut config = json!({
        "name": spec.name,
        "platform": spec.platform,
        "backend": spec.backend,
        "max_batch_size": spec.batch.max_batch_size,
        "input": tensors(&spec.inputs),
        "output": tensors(&spec.outputs),
        "instance_group": [{"name": spec.name, "kind": "KIND_CPU", "count": spec.instance_count}],
        "version_policy": {"latest": {"num_versions": 1}},
        "parameters": {"threads": {"string_value": spec.threads.to_string()}},
    });
    if spec.batch.dynamic {
        config["dynamic_batching"] = json!({
            "preferred_batch_size": spec.batch.preferred_batch_sizes,
            "max_queue_delay_microseconds": spec.batch.max_queue_delay_us,
            "priority_levels": spec.batch.priority_levels,
            "default_priority_level": spec.batch.default_priority_level,
            "default_queue_policy": {
                "max_queue_size": spec.batch.max_queue_size,
                "default_timeout_microseconds": spec.batch.default_timeout_us,
            },
        });
    }
    Ok(Json(config))
}

async fn model_stats(State(s): State<AppState>, Path(p): Path<ModelPath>) -> Result<Json<Value>, ApiError> {
    let m = s.model(&p)?;
    Ok(Json(json!({"model_stats": [m.stats.snapshot(&m.spec.name, m.spec.version)]})))
}

async fn all_stats(State(s): State<AppState>) -> Json<Value> {
    let stats: Vec<_> = s.core.models().map(|m| m.stats.snapshot(&m.spec.name, m.spec.version)).collect();
    Json(json!({ "model_stats": stats }))
}

async fn infer(
    State(s): State<AppState>,
    Path(p): Path<ModelPath>,
    headers: axum::http::HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let body = body.map_err(|e| ApiError::new(e.status(), e.body_text()))?;
    if headers.contains_key("inference-header-content-length") {
        return Err(ApiError::from(ferrite_core::Error::Unsupported(
            "the binary tensor data extension is not supported yet; send JSON tensors".into(),
        )));
    }
    let parsed: json::JsonRequest<'_> =
        serde_json::from_slice(&body).map_err(|e| ApiError::bad_request(format!("invalid JSON request: {e}")))?;
    let req = json::to_core(&p.model, p.version, parsed, s.core.limits().max_elements)?;
    let resp = s.core.infer(req).await?;
    Ok(([(header::CONTENT_TYPE, "application/json")], json::write_response(&resp)).into_response())
}
