//! Text embeddings as their users call them, over the core's `pipeline::embed`: OpenAI's
//! `POST /v1/embeddings` (`input` a string or a list, `model`, `encoding_format` float or base64,
//! `usage.prompt_tokens`) and Hugging Face TEI's `POST /embed` (`inputs`, `normalize`, `truncate`),
//! so OpenAI's clients, LangChain and LlamaIndex work with a base URL change. Same auth, limits,
//! tenants, metrics and cache as `/v2/.../infer`.

use axum::{
    extract::State,
    http::{header, HeaderMap, StatusCode},
    response::{IntoResponse, Response},
};
use base64::Engine as _;
use bytes::Bytes;
use ferrite_core::embed;
use serde::Deserialize;
use utoipa::ToSchema;

use super::{
    bodies::{
        Embedding, OpenAiEmbedding, OpenAiEmbeddingResponse, OpenAiError, OpenAiErrorDetail, OpenAiUsage,
        TeiEmbedResponse,
    },
    tenant_of, ApiError, AppState,
};

/// A string or a list of strings (both APIs take either).
#[derive(Deserialize, ToSchema)]
#[serde(untagged)]
pub(super) enum Texts {
    One(String),
    Many(Vec<String>),
}

impl Texts {
    fn into_bytes(self) -> Vec<Bytes> {
        match self {
            Texts::One(t) => vec![Bytes::from(t)],
            Texts::Many(v) => v.into_iter().map(Bytes::from).collect(),
        }
    }
}

#[derive(Deserialize, ToSchema)]
#[schema(as = OpenAiEmbeddingRequest)]
pub(super) struct OpenAiRequest {
    input: Texts,
    model: String,
    /// `float` (default) or `base64`.
    #[serde(default)]
    encoding_format: Option<String>,
    /// Accepted when it is the model's own width (vectors are not cut).
    #[serde(default)]
    dimensions: Option<u64>,
    #[serde(default)]
    #[allow(dead_code)]
    user: Option<String>,
}

/// OpenAI's error body: `{"error": {"message", "type", "code"}}`.
fn openai_error(e: ApiError) -> Response {
    let kind = if e.status.is_client_error() { "invalid_request_error" } else { "server_error" };
    let body =
        OpenAiError { error: OpenAiErrorDetail { message: e.message, kind, param: None, code: e.status.as_u16() } };
    let mut resp = (e.status, axum::Json(body)).into_response();
    if let Some(secs) = e.retry_after {
        resp.headers_mut().insert(header::RETRY_AFTER, secs.into());
    }
    resp
}

fn parse<T: serde::de::DeserializeOwned>(body: &Bytes) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|e| ApiError::bad_request(format!("invalid request body: {e}")))
}

pub(super) async fn openai(
    State(s): State<AppState>,
    principal: Option<axum::Extension<crate::auth::Principal>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let answer = async {
        let req: OpenAiRequest = parse(&body)?;
        let base64 = match req.encoding_format.as_deref() {
            None | Some("float") => false,
            Some("base64") => true,
            Some(other) => {
                // Named, not echoed whole: a client's megabyte is not sent back.
                let shown: String = other.chars().take(32).collect();
                let more = if shown.len() < other.len() { "..." } else { "" };
                return Err(ApiError::bad_request(format!("encoding_format '{shown}{more}': float or base64")));
            }
        };
        let tenant = tenant_of(&s, principal.map(|p| p.0).as_ref(), &headers)?;
        let embedder = embed::Embedder::new(&s.core, &req.model)?;
        // A wrong size is refused before any text is embedded.
        if let Some(d) = req.dimensions.filter(|&d| embedder.width().is_some_and(|w| w as u64 != d)) {
            return Err(ApiError::bad_request(format!(
                "model '{}' answers vectors of its own size, not {d}",
                req.model
            )));
        }
        let e = embedder.embed(&s.core, req.input.into_bytes(), false, tenant).await?;
        if let Some(d) = req.dimensions.filter(|&d| Some(d as usize) != e.vectors.first().map(Vec::len)) {
            return Err(ApiError::bad_request(format!("model '{}' answers vectors of its own size, not {d}", e.model)));
        }
        let data = e
            .vectors
            .into_iter()
            .enumerate()
            .map(|(index, v)| {
                let embedding = if base64 {
                    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                    Embedding::Base64(base64::engine::general_purpose::STANDARD.encode(bytes))
                } else {
                    Embedding::Floats(v)
                };
                OpenAiEmbedding { object: "embedding", index, embedding }
            })
            .collect();
        let usage = OpenAiUsage { prompt_tokens: e.tokens, total_tokens: e.tokens };
        Ok(axum::Json(OpenAiEmbeddingResponse { object: "list", data, model: e.model, usage }).into_response())
    };
    answer.await.unwrap_or_else(openai_error)
}

#[derive(Deserialize, ToSchema)]
#[schema(as = TeiEmbedRequest)]
pub(super) struct TeiRequest {
    inputs: Texts,
    #[serde(default = "yes")]
    normalize: bool,
    /// Texts are always cut at the pipeline's `max_length`; `false` is accepted and does not
    /// refuse longer texts (TEI answers 422).
    #[serde(default)]
    truncate: bool,
    /// Ours: which model, when more than one answers embeddings.
    #[serde(default)]
    model: Option<String>,
}

fn yes() -> bool {
    true
}

pub(super) async fn tei(
    State(s): State<AppState>,
    principal: Option<axum::Extension<crate::auth::Principal>>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let req: TeiRequest = parse(&body)?;
    // Texts are cut at the tokenize step's max_length; TEI's truncate=false would refuse them.
    let _ = req.truncate;
    let model = match req.model {
        Some(m) => m,
        None => {
            let served = embed::models(&s.core);
            match served.as_slice() {
                [one] => one.clone(),
                [] => return Err(ApiError::new(StatusCode::NOT_FOUND, "no served model answers embeddings")),
                many => {
                    return Err(ApiError::bad_request(format!(
                        "several models answer embeddings ({}); name one in \"model\"",
                        many.join(", ")
                    )))
                }
            }
        }
    };
    let tenant = tenant_of(&s, principal.map(|p| p.0).as_ref(), &headers)?;
    let e =
        embed::Embedder::new(&s.core, &model)?.embed(&s.core, req.inputs.into_bytes(), req.normalize, tenant).await?;
    Ok(axum::Json(TeiEmbedResponse(e.vectors)).into_response())
}
