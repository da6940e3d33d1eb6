//! The JSON bodies of the HTTP API as types. The handlers read and write these, and the OpenAPI
//! document's schemas are derived from them (`utoipa::ToSchema`), so a body cannot change without
//! its description changing with it. The one exception is the V2 inference response, which
//! `json::write_response` writes without building a value (its hot path): its type here is the
//! description only, and a test checks real responses against it.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};
use serde_json::Value;
use utoipa::{
    openapi::{schema, RefOr},
    PartialSchema, ToSchema,
};

/// A V2 datatype name; the schema lists every datatype the core knows.
pub struct Datatype;

impl PartialSchema for Datatype {
    fn schema() -> RefOr<schema::Schema> {
        schema::ObjectBuilder::new()
            .schema_type(schema::Type::String)
            .enum_values(Some(ferrite_core::DataType::ALL.map(|d| d.as_str())))
            .into()
    }
}

impl ToSchema for Datatype {}

/// The V2 protocol's `parameters`: names to strings, numbers or booleans.
pub type Parameters = HashMap<String, Value>;

#[derive(Serialize, ToSchema)]
pub struct ServerMetadata {
    pub name: String,
    pub version: String,
    pub extensions: Vec<String>,
    pub onnxruntime_version: String,
}

#[derive(Serialize, ToSchema)]
pub struct Live {
    pub live: bool,
}

#[derive(Serialize, ToSchema)]
pub struct Ready {
    pub ready: bool,
}

#[derive(Serialize, ToSchema)]
pub struct ModelReady {
    pub name: String,
    pub ready: bool,
}

#[derive(Serialize, ToSchema)]
pub struct MetadataTensor {
    pub name: String,
    #[schema(value_type = Datatype)]
    pub datatype: &'static str,
    /// -1 for a variable dim (the batch dim first when the model batches).
    pub shape: Vec<i64>,
}

#[derive(Serialize, ToSchema)]
pub struct ModelMetadata {
    pub name: String,
    pub versions: Vec<String>,
    pub platform: String,
    pub inputs: Vec<MetadataTensor>,
    pub outputs: Vec<MetadataTensor>,
}

/// Bodies described as "an object" and what it is: their shape comes from elsewhere.
macro_rules! objects {
    ($($name:ident: $what:literal),*) => {$(
        pub struct $name;
        impl PartialSchema for $name {
            fn schema() -> RefOr<schema::Schema> {
                schema::ObjectBuilder::new().schema_type(schema::Type::Object).description(Some($what)).into()
            }
        }
        impl ToSchema for $name {}
    )*};
}

objects!(
    ModelConfig: "Triton's model configuration (model_config.proto) in JSON, resolved",
    OpenApi: "This document"
);

/// Triton's statistics extension, plus the response cache's state when there is one.
#[derive(Serialize, ToSchema)]
pub struct Statistics {
    #[schema(value_type = Vec<Object>)]
    pub model_stats: Vec<ferrite_core::telemetry::stats::StatsSnapshot>,
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub cache: Option<ferrite_core::cache::CacheSnapshot>,
}

#[derive(Deserialize, Default, ToSchema)]
pub struct RepositoryIndexRequest {
    /// Only the versions that are ready.
    #[serde(default)]
    pub ready: bool,
}

#[derive(Serialize, ToSchema)]
pub struct IndexRow {
    pub name: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub version: Option<String>,
    /// READY, UNAVAILABLE, LOADING or UNLOADING (Triton's states).
    pub state: &'static str,
    pub reason: String,
}

#[derive(Serialize, ToSchema)]
#[serde(transparent)]
pub struct RepositoryIndex(pub Vec<IndexRow>);

#[derive(Deserialize, Default, ToSchema)]
pub struct RepositoryRequest {
    /// Triton's load parameters; Ferrite takes none, and refuses any by name (their values are
    /// not kept: read as JSON values, a body of nested empty lists took ten times its size).
    #[serde(default)]
    #[schema(value_type = Object)]
    pub parameters: std::collections::BTreeMap<String, serde::de::IgnoredAny>,
}

#[derive(Serialize, ToSchema)]
pub struct Empty {}

/// A system shared-memory region to register: `byte_size` bytes of the POSIX shared-memory
/// object `key` (as `shm_open` names it) from `offset`.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RegisterRegion {
    pub key: String,
    #[serde(default)]
    pub offset: u64,
    pub byte_size: u64,
}

/// A registered system shared-memory region.
#[derive(Serialize, ToSchema)]
pub struct RegionStatus {
    pub name: String,
    pub key: String,
    pub offset: u64,
    pub byte_size: u64,
}

#[derive(Serialize, ToSchema)]
#[serde(transparent)]
pub struct RegionsStatus(pub Vec<RegionStatus>);

/// The V2 error body.
#[derive(Serialize, ToSchema)]
pub struct Error {
    pub error: String,
}

/// A requested output of a V2 inference request.
#[derive(Deserialize, ToSchema)]
#[schema(as = RequestOutput)]
pub struct JsonOutput {
    pub name: String,
    /// `binary_data`, `classification`.
    #[serde(default)]
    #[schema(value_type = Object)]
    pub parameters: super::decode::Params,
}

/// An output of a V2 inference response (JSON): `data` row-major, or `parameters.binary_data_size`
/// bytes after the JSON when the binary extension is asked for. (Read back only by the tests,
/// which hold the writer to this type.)
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[cfg_attr(not(test), allow(dead_code))]
pub struct ResponseOutput {
    pub name: String,
    #[schema(value_type = Datatype)]
    pub datatype: String,
    pub shape: Vec<u64>,
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub parameters: Option<Parameters>,
    #[serde(default)]
    #[schema(value_type = Option<Vec<Value>>)]
    pub data: Option<Vec<Value>>,
}

/// A V2 inference response (JSON; the same fields in MessagePack, with tensors as bytes).
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[cfg_attr(not(test), allow(dead_code))]
pub struct InferenceResponse {
    pub model_name: String,
    pub model_version: String,
    #[serde(default)]
    pub id: Option<String>,
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub parameters: Option<Parameters>,
    pub outputs: Vec<ResponseOutput>,
}

/// OpenAI's error body.
#[derive(Serialize, ToSchema)]
pub struct OpenAiError {
    pub error: OpenAiErrorDetail,
}

#[derive(Serialize, ToSchema)]
pub struct OpenAiErrorDetail {
    pub message: String,
    /// `invalid_request_error` or `server_error`.
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub param: Option<String>,
    /// The HTTP status.
    pub code: u16,
}

#[derive(Serialize, ToSchema)]
pub struct OpenAiEmbeddingResponse {
    /// Always `list`.
    pub object: &'static str,
    pub data: Vec<OpenAiEmbedding>,
    pub model: String,
    pub usage: OpenAiUsage,
}

#[derive(Serialize, ToSchema)]
pub struct OpenAiEmbedding {
    /// Always `embedding`.
    pub object: &'static str,
    pub index: usize,
    pub embedding: Embedding,
}

/// A vector: floats, or with `encoding_format: base64` its little-endian float32 bytes in base64.
#[derive(Serialize, ToSchema)]
#[serde(untagged)]
pub enum Embedding {
    Floats(Vec<f32>),
    Base64(String),
}

#[derive(Serialize, ToSchema)]
pub struct OpenAiUsage {
    pub prompt_tokens: u64,
    pub total_tokens: u64,
}

/// TEI's `/embed` answer: one vector per input.
#[derive(Serialize, ToSchema)]
#[serde(transparent)]
pub struct TeiEmbedResponse(pub Vec<Vec<f32>>);

/// One entry of a sparse vector that is not zero: its index (a vocabulary entry) and value.
#[derive(Serialize, ToSchema)]
pub struct TeiSparseValue {
    pub index: u32,
    pub value: f32,
}

/// TEI's `/embed_sparse` answer: one sparse vector per input, its entries in index order.
#[derive(Serialize, ToSchema)]
#[serde(transparent)]
pub struct TeiEmbedSparseResponse(pub Vec<Vec<TeiSparseValue>>);

/// TEI's `/embed_all` answer: per input, one vector per token it took (special tokens included).
#[derive(Serialize, ToSchema)]
#[serde(transparent)]
pub struct TeiEmbedAllResponse(pub Vec<Vec<Vec<f32>>>);

/// TEI's error body.
#[derive(Serialize, ToSchema)]
pub struct TeiError {
    pub error: String,
    /// `Validation` (413; 422 for a body that is not the call's JSON), `Empty` (400), `Backend`
    /// (424: the model does not do what the route asks), `Overloaded` (429), `Unhealthy` (503),
    /// `NotFound` (404, ours: no such model).
    pub error_type: &'static str,
}

/// One passage of TEI's `/rerank` answer, highest score first.
#[derive(Serialize, ToSchema)]
pub struct TeiRank {
    /// The passage's position in `texts`.
    pub index: usize,
    pub score: f32,
    /// The passage, with `return_text`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
}

/// TEI's `/rerank` answer.
#[derive(Serialize, ToSchema)]
#[serde(transparent)]
pub struct TeiRerankResponse(pub Vec<TeiRank>);

/// One class of TEI's `/predict` answer, highest score first.
#[derive(Serialize, ToSchema)]
pub struct TeiPrediction {
    pub score: f32,
    pub label: String,
}

/// TEI's `/predict` answer: a list of classes for one input, a list of such lists for several.
#[derive(Serialize, ToSchema)]
#[serde(untagged)]
pub enum TeiPredictResponse {
    One(Vec<TeiPrediction>),
    Many(Vec<Vec<TeiPrediction>>),
}

/// TEI's `/similarity` answer: the cosine similarity of each sentence to the source sentence.
#[derive(Serialize, ToSchema)]
#[serde(transparent)]
pub struct TeiSimilarityResponse(pub Vec<f32>);

/// One token of TEI's `/tokenize` answer.
#[derive(Serialize, ToSchema)]
pub struct TeiToken {
    pub id: u32,
    /// The input's text the token covers (the token itself for a special token).
    pub text: String,
    pub special: bool,
    /// Byte offsets into the input (`null` for a special token).
    pub start: Option<usize>,
    pub stop: Option<usize>,
}

/// TEI's `/tokenize` answer: the tokens of each input.
#[derive(Serialize, ToSchema)]
#[serde(transparent)]
pub struct TeiTokenizeResponse(pub Vec<Vec<TeiToken>>);

/// TEI's `/decode` answer: one text per list of ids.
#[derive(Serialize, ToSchema)]
#[serde(transparent)]
pub struct TeiDecodeResponse(pub Vec<String>);

/// TEI's `/info`: the model a route serves, and the server's limits.
#[derive(Serialize, ToSchema)]
pub struct TeiInfo {
    pub model_id: String,
    pub model_sha: Option<String>,
    pub model_dtype: String,
    /// `{"embedding": {"pooling"}}`, `{"reranker": {"id2label", "label2id"}}` or
    /// `{"classifier": {...}}`.
    #[schema(value_type = Object)]
    pub model_type: Value,
    pub max_concurrent_requests: usize,
    pub max_input_length: usize,
    pub max_batch_tokens: usize,
    pub max_batch_requests: Option<usize>,
    pub max_client_batch_size: usize,
    pub auto_truncate: bool,
    pub tokenization_workers: usize,
    pub version: String,
    pub sha: Option<String>,
    pub docker_label: Option<String>,
}

/// Cohere's and Jina's `/v1/rerank` answer.
#[derive(Serialize, ToSchema)]
pub struct RerankResponse {
    pub id: String,
    pub model: String,
    pub results: Vec<RerankResult>,
    pub usage: RerankUsage,
}

#[derive(Serialize, ToSchema)]
pub struct RerankResult {
    pub index: usize,
    /// The sigmoid of the model's score, in 0..1.
    pub relevance_score: f32,
    /// With `return_documents`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub document: Option<RerankDocument>,
}

#[derive(Serialize, Deserialize, ToSchema)]
pub struct RerankDocument {
    pub text: String,
}

#[derive(Serialize, ToSchema)]
pub struct RerankUsage {
    pub total_tokens: u64,
}
