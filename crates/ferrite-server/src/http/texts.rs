//! Text models as their users call them, over the core's `texts`: OpenAI's `POST /v1/embeddings`,
//! Hugging Face TEI's API (`/embed`, `/embed_sparse`, `/rerank`, `/predict`, `/similarity`,
//! `/tokenize`, `/decode`, `/info`, `/health` and its default route `POST /`, with its request
//! bodies, answers and `{"error", "error_type"}` errors) and Cohere's and Jina's `POST /v1/rerank`,
//! so their clients (OpenAI's, LangChain, LlamaIndex, the RAG frameworks) work with a base URL
//! change. A call names its model in `model` (`?model=` on `/info`), or leaves it to the one served
//! model of its task. Same auth, limits, tenants, metrics and cache as `/v2/.../infer`.

use axum::{
    extract::{Query, State},
    http::{header, StatusCode},
    response::{IntoResponse, Response},
};
use base64::Engine as _;
use bytes::Bytes;
use ferrite_core::{
    engine::spec::Task,
    texts::{self, shown, EmbedOptions, TextModel},
    Error,
};
use serde::{
    de::{SeqAccess, Visitor},
    Deserialize, Deserializer,
};
use utoipa::ToSchema;

use super::{
    bodies::{
        Embedding, OpenAiEmbedding, OpenAiEmbeddingResponse, OpenAiError, OpenAiErrorDetail, OpenAiUsage,
        RerankDocument, RerankResponse, RerankResult, RerankUsage, TeiDecodeResponse, TeiEmbedAllResponse,
        TeiEmbedResponse, TeiEmbedSparseResponse, TeiError, TeiInfo, TeiPredictResponse, TeiPrediction, TeiRank,
        TeiRerankResponse, TeiSimilarityResponse, TeiSparseValue, TeiToken, TeiTokenizeResponse,
    },
    caller_of,
    decode::{at_most, Most},
    tenant_of, ApiError, AppState, JsonBody,
};
use crate::auth::Acting;

/// A string or a list of strings (both APIs take either).
#[derive(Deserialize, ToSchema)]
#[serde(untagged)]
pub(super) enum Texts {
    One(String),
    Many(Vec<String>),
}

impl Texts {
    fn into_vec(self) -> Vec<String> {
        match self {
            Texts::One(t) => vec![t],
            Texts::Many(v) => v,
        }
    }
}

fn bytes(texts: Vec<String>) -> Vec<Bytes> {
    texts.into_iter().map(Bytes::from).collect()
}

/// Lists a call may give (texts, passages, documents, lists of ids): the most any of these APIs
/// takes (OpenAI's 2048 texts). Past it a list is refused as it is read, the rest left unread:
/// read whole, 64 MiB of empty strings (serde's untagged enums buffer them
/// first) took 1.4 GB.
const MAX_LIST: usize = texts::MAX_INPUTS;

/// A call's list of texts (passages, documents, lists of ids).
struct Listed;
impl Most for Listed {
    const MOST: usize = MAX_LIST;
    const WHAT: &'static str = "texts a call";
}

/// A list of at most `MAX_LIST` entries.
fn capped<'de, A: SeqAccess<'de>, T: Deserialize<'de>>(seq: A) -> Result<Vec<T>, A::Error> {
    super::decode::capped(seq, Listed::MOST, Listed::WHAT)
}

/// A text, or a list of at most `MAX_LIST` texts (in `/predict`'s lists, a pair when of two).
enum Entry {
    Text(String),
    List(Vec<String>),
}

impl<'de> Deserialize<'de> for Entry {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Entry, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Entry;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a text or a list of texts")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Entry, E> {
                Ok(Entry::Text(v.to_string()))
            }
            fn visit_string<E: serde::de::Error>(self, v: String) -> Result<Entry, E> {
                Ok(Entry::Text(v))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Entry, A::Error> {
                capped(seq).map(Entry::List)
            }
        }
        d.deserialize_any(V)
    }
}

/// A string or a list of strings, not more than `MAX_LIST` (`deserialize_with`: `Texts` as
/// serde's untagged enum would read it, without buffering the body's values first).
fn texts_in<'de, D: Deserializer<'de>>(d: D) -> Result<Texts, D::Error> {
    Ok(match Entry::deserialize(d)? {
        Entry::Text(t) => Texts::One(t),
        Entry::List(v) => Texts::Many(v),
    })
}

/// The body of an OpenAI or Cohere call, or 400.
async fn parse<T: serde::de::DeserializeOwned + Send + 'static>(body: JsonBody) -> Result<T, ApiError> {
    body.parse().await
}

// ---- OpenAI --------------------------------------------------------------------------------

#[derive(Deserialize, ToSchema)]
#[schema(as = OpenAiEmbeddingRequest)]
pub(super) struct OpenAiRequest {
    #[serde(deserialize_with = "texts_in")]
    input: Texts,
    model: String,
    /// `float` (default) or `base64`.
    #[serde(default)]
    encoding_format: Option<String>,
    /// Vectors cut to this many dimensions and normalized again (matryoshka models).
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

pub(super) async fn openai(State(s): State<AppState>, acting: Acting, body: JsonBody) -> Response {
    let answer = async {
        let req: OpenAiRequest = parse(body).await?;
        let base64 = match req.encoding_format.as_deref() {
            None | Some("float") => false,
            Some("base64") => true,
            Some(other) => {
                return Err(ApiError::bad_request(format!("encoding_format '{}': float or base64", shown(other))))
            }
        };
        let caller = caller_of(acting)?;
        let m = TextModel::new(&s.core, &req.model, Some(Task::Embed)).map_err(invalid_as_400)?;
        // OpenAI's vectors are unit vectors.
        let o = EmbedOptions { normalize: true, dimensions: req.dimensions, ..Default::default() };
        let e = m.embed(&s.core, bytes(req.input.into_vec()), &o, texts::MAX_INPUTS, caller).await?;
        let data = e
            .rows
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

/// OpenAI and Cohere answer a model of another kind as a bad request.
fn invalid_as_400(e: Error) -> ApiError {
    match e {
        Error::Unsupported(m) => ApiError::bad_request(m),
        e => e.into(),
    }
}

// ---- TEI -----------------------------------------------------------------------------------

/// A core error as TEI answers it: validation 413, a model of another task 424, a fault 424.
fn tei_status(e: &Error) -> StatusCode {
    match e {
        Error::InvalidInput(_) => StatusCode::PAYLOAD_TOO_LARGE,
        Error::Unsupported(_) | Error::Internal(_) => StatusCode::FAILED_DEPENDENCY,
        e => ApiError::from(e.clone()).status,
    }
}

/// TEI's error: `{"error", "error_type"}`, its type following the status.
pub(super) struct TeiFail(ApiError);

impl From<Error> for TeiFail {
    fn from(e: Error) -> Self {
        let status = tei_status(&e);
        TeiFail(ApiError { status, ..ApiError::from(e) })
    }
}

impl From<ApiError> for TeiFail {
    fn from(e: ApiError) -> Self {
        TeiFail(e)
    }
}

impl TeiFail {
    fn new(status: StatusCode, message: impl Into<String>) -> Self {
        TeiFail(ApiError::new(status, message))
    }

    /// TEI's `Validation`, which it answers 413 whatever the fault (too many inputs, too long a
    /// text, an unknown prompt).
    fn validation(message: impl Into<String>) -> Self {
        Self::new(StatusCode::PAYLOAD_TOO_LARGE, message)
    }
}

impl IntoResponse for TeiFail {
    fn into_response(self) -> Response {
        let e = self.0;
        let error_type = match e.status.as_u16() {
            400 => "Empty",
            401 | 403 => "Unauthorized",
            404 => "NotFound",
            413 | 422 => "Validation",
            429 => "Overloaded",
            503 => "Unhealthy",
            _ => "Backend",
        };
        let mut resp = (e.status, axum::Json(TeiError { error: e.message, error_type })).into_response();
        if let Some(secs) = e.retry_after {
            resp.headers_mut().insert(header::RETRY_AFTER, secs.into());
        }
        resp
    }
}

pub(super) type TeiResult = Result<Response, TeiFail>;

/// The body of a TEI call, or 422 (TEI's answer to a body it cannot read).
async fn tei_parse<T: serde::de::DeserializeOwned + Send + 'static>(body: JsonBody) -> Result<T, TeiFail> {
    body.parse().await.map_err(|e| match e.status {
        StatusCode::BAD_REQUEST => TeiFail::new(StatusCode::UNPROCESSABLE_ENTITY, e.message),
        _ => TeiFail(e),
    })
}

/// TEI's check of a call's texts: none empty (400).
fn tei_texts<'t>(texts: impl IntoIterator<Item = &'t String>) -> Result<(), TeiFail> {
    let mut texts = texts.into_iter().peekable();
    if texts.peek().is_none() || texts.any(String::is_empty) {
        return Err(TeiFail::new(StatusCode::BAD_REQUEST, "`inputs` cannot be empty"));
    }
    Ok(())
}

/// TEI's check of a call's size: at most `--max-client-batch-size` inputs (texts, pairs, id
/// lists; a re-ranker's passages), else 413. Returns the bound.
fn tei_batch(s: &AppState, n: usize) -> Result<usize, TeiFail> {
    let most = s.core.limits().max_client_batch_size;
    if n > most {
        return Err(TeiFail::validation(format!("batch size {n} > maximum allowed batch size {most}")));
    }
    Ok(most)
}

/// `truncation_direction`: the pipelines cut texts at their end (TEI's `Right`).
fn right(direction: &Option<String>) -> Result<(), TeiFail> {
    match direction.as_deref() {
        None | Some("Right" | "right") => Ok(()),
        Some(other) => Err(TeiFail::validation(format!(
            "truncation_direction '{}': text pipelines cut texts at their end (Right)",
            shown(other)
        ))),
    }
}

/// The model a TEI call reaches: the one it names, or the one served model of `task`.
fn tei_model(s: &AppState, model: Option<&str>, task: Option<Task>) -> Result<TextModel, TeiFail> {
    let name = texts::pick(&s.core, model, task)?;
    Ok(TextModel::new(&s.core, &name, task)?)
}

fn yes() -> bool {
    true
}

#[derive(Deserialize, ToSchema)]
#[schema(as = TeiEmbedRequest)]
pub(super) struct TeiEmbedRequest {
    #[serde(deserialize_with = "texts_in")]
    inputs: Texts,
    /// Unit vectors (default); `false` answers the model's own (refused by a pipeline whose
    /// pool step normalizes).
    #[serde(default = "yes")]
    normalize: bool,
    /// `false`: a text over the model's max input length is refused (413) instead of cut.
    #[serde(default)]
    truncate: Option<bool>,
    /// `Right` (the end of a text is cut).
    #[serde(default)]
    truncation_direction: Option<String>,
    /// One of the model's sentence-transformers prompts, put before each text.
    #[serde(default)]
    prompt_name: Option<String>,
    /// Vectors cut to this many dimensions, before normalizing.
    #[serde(default)]
    dimensions: Option<u64>,
    /// Ours: which model, when more than one answers embeddings.
    #[serde(default)]
    model: Option<String>,
}

/// A TEI embedding call's texts, checked, with whom it acts for and the embedder it reaches.
fn tei_embedding(
    s: &AppState,
    acting: Acting,
    inputs: Texts,
    direction: &Option<String>,
    model: Option<&str>,
) -> Result<(Vec<Bytes>, ferrite_core::Caller, TextModel), TeiFail> {
    let texts = inputs.into_vec();
    tei_texts(&texts)?;
    tei_batch(s, texts.len())?;
    right(direction)?;
    let caller = caller_of(acting)?;
    Ok((bytes(texts), caller, tei_model(s, model, Some(Task::Embed))?))
}

/// Embeds `texts` for TEI's `/embed` and `/similarity`: checked, prompted, cut or refused when long.
async fn tei_vectors(s: &AppState, acting: Acting, req: TeiEmbedRequest) -> Result<Vec<Vec<f32>>, TeiFail> {
    let (texts, caller, m) = tei_embedding(s, acting, req.inputs, &req.truncation_direction, req.model.as_deref())?;
    let o = EmbedOptions {
        normalize: req.normalize,
        truncate: req.truncate,
        prompt_name: req.prompt_name,
        dimensions: req.dimensions,
    };
    Ok(m.embed(&s.core, texts, &o, texts::MAX_INPUTS, caller).await?.rows)
}

/// The body of TEI's `/embed_sparse` and `/embed_all` (their requests are alike).
#[derive(Deserialize, ToSchema)]
#[schema(as = TeiEmbedTextsRequest)]
pub(super) struct TeiEmbedTextsRequest {
    #[serde(deserialize_with = "texts_in")]
    inputs: Texts,
    /// `false`: a text over the model's max input length is refused (413) instead of cut.
    #[serde(default)]
    truncate: Option<bool>,
    /// `Right` (the end of a text is cut).
    #[serde(default)]
    truncation_direction: Option<String>,
    /// One of the model's sentence-transformers prompts, put before each text.
    #[serde(default)]
    prompt_name: Option<String>,
    /// Ours: which model, when more than one answers embeddings.
    #[serde(default)]
    model: Option<String>,
}

/// TEI's `/embed_sparse`: a SPLADE model's sparse vectors (424 from another model).
pub(super) async fn embed_sparse(State(s): State<AppState>, acting: Acting, body: JsonBody) -> TeiResult {
    let req: TeiEmbedTextsRequest = tei_parse(body).await?;
    let (texts, caller, m) = tei_embedding(&s, acting, req.inputs, &req.truncation_direction, req.model.as_deref())?;
    let (rows, _) = m.embed_sparse(&s.core, texts, (req.truncate, req.prompt_name), texts::MAX_INPUTS, caller).await?;
    let rows = rows.into_iter().map(|r| r.into_iter().map(|(index, value)| TeiSparseValue { index, value }).collect());
    Ok(axum::Json(TeiEmbedSparseResponse(rows.collect())).into_response())
}

/// TEI's `/embed_all`: each text's token embeddings (424 from a SPLADE model).
pub(super) async fn embed_all(State(s): State<AppState>, acting: Acting, body: JsonBody) -> TeiResult {
    let req: TeiEmbedTextsRequest = tei_parse(body).await?;
    let (texts, caller, m) = tei_embedding(&s, acting, req.inputs, &req.truncation_direction, req.model.as_deref())?;
    let (rows, _) = m.embed_all(&s.core, texts, (req.truncate, req.prompt_name), texts::MAX_INPUTS, caller).await?;
    Ok(axum::Json(TeiEmbedAllResponse(rows)).into_response())
}

/// TEI's health routes (`GET /health`; `/` and `/ping` on its Inference Endpoints and SageMaker
/// images): 200 with no body while the server is ready, 503 `Unhealthy` while it loads or drains.
pub(super) async fn health(State(s): State<AppState>) -> TeiResult {
    if s.core.is_ready() {
        Ok(StatusCode::OK.into_response())
    } else {
        Err(TeiFail::new(StatusCode::SERVICE_UNAVAILABLE, "unhealthy"))
    }
}

/// TEI's default route (`POST /`, SageMaker's `/invocations`): TEI serves one model and routes
/// these to its type's call. Here, the call of the one task the served text models have (of
/// embedders, `/embed_sparse` when they are all SPLADE's); with models of several tasks the call
/// must say which (413).
pub(super) async fn invocations(state: State<AppState>, acting: Acting, body: JsonBody) -> TeiResult {
    let tasks: Vec<Task> = [Task::Embed, Task::Rerank, Task::Classify]
        .into_iter()
        .filter(|&t| !texts::models(&state.core, Some(t)).is_empty())
        .collect();
    let sparse = |name: &String| TextModel::new(&state.core, name, Some(Task::Embed)).is_ok_and(|m| m.sparse());
    match tasks.as_slice() {
        [Task::Embed] if texts::models(&state.core, Some(Task::Embed)).iter().all(sparse) => {
            embed_sparse(state, acting, body).await
        }
        [Task::Embed] => embed(state, acting, body).await,
        [Task::Rerank] => rerank(state, acting, body).await,
        [Task::Classify] => predict(state, acting, body).await,
        [] => Err(Error::NotFound("no served model is a text model".into()).into()),
        several => Err(TeiFail::validation(format!(
            "the served text models have several tasks ({}): POST to /embed, /rerank or /predict",
            several.iter().map(|t| t.as_str()).collect::<Vec<_>>().join(", ")
        ))),
    }
}

pub(super) async fn embed(State(s): State<AppState>, acting: Acting, body: JsonBody) -> TeiResult {
    let req: TeiEmbedRequest = tei_parse(body).await?;
    let vectors = tei_vectors(&s, acting, req).await?;
    Ok(axum::Json(TeiEmbedResponse(vectors)).into_response())
}

#[derive(Deserialize, ToSchema)]
pub(super) struct SimilarityInputs {
    source_sentence: String,
    #[serde(deserialize_with = "at_most::<_, _, Listed>")]
    sentences: Vec<String>,
}

#[derive(Deserialize, ToSchema)]
#[schema(as = TeiSimilarityRequest)]
pub(super) struct TeiSimilarityRequest {
    inputs: SimilarityInputs,
    #[serde(default)]
    truncate: Option<bool>,
    #[serde(default)]
    truncation_direction: Option<String>,
    #[serde(default)]
    prompt_name: Option<String>,
    #[serde(default)]
    model: Option<String>,
}

pub(super) async fn similarity(State(s): State<AppState>, acting: Acting, body: JsonBody) -> TeiResult {
    let req: TeiSimilarityRequest = tei_parse(body).await?;
    let inputs = std::iter::once(req.inputs.source_sentence).chain(req.inputs.sentences).collect();
    let embed = TeiEmbedRequest {
        inputs: Texts::Many(inputs),
        normalize: true,
        truncate: req.truncate,
        truncation_direction: req.truncation_direction,
        prompt_name: req.prompt_name,
        dimensions: None,
        model: req.model,
    };
    let vectors = tei_vectors(&s, acting, embed).await?;
    if vectors.len() < 2 {
        return Err(TeiFail::new(StatusCode::BAD_REQUEST, "`sentences` cannot be empty"));
    }
    let source = &vectors[0];
    let cosines = vectors[1..].iter().map(|v| v.iter().zip(source).map(|(a, b)| a * b).sum()).collect();
    Ok(axum::Json(TeiSimilarityResponse(cosines)).into_response())
}

#[derive(Deserialize, ToSchema)]
#[schema(as = TeiRerankRequest)]
pub(super) struct TeiRerankRequest {
    query: String,
    #[serde(deserialize_with = "at_most::<_, _, Listed>")]
    texts: Vec<String>,
    #[serde(default)]
    truncate: Option<bool>,
    #[serde(default)]
    truncation_direction: Option<String>,
    /// The model's scores as they are, without the sigmoid.
    #[serde(default)]
    raw_scores: bool,
    /// Each passage with its score.
    #[serde(default)]
    return_text: bool,
    #[serde(default)]
    model: Option<String>,
}

/// `(index, score)` of each passage for `query`, highest first, and the tokens they took. The
/// core's error as it is: each API answers it with its own status.
async fn ranked(
    s: &AppState,
    caller: ferrite_core::Caller,
    (model, query, passages): (Option<&str>, &str, &[String]),
    options: (Option<bool>, bool),
    max_inputs: usize,
) -> ferrite_core::Result<(String, Vec<(usize, f32)>, u64)> {
    let m = TextModel::new(&s.core, &texts::pick(&s.core, model, Some(Task::Rerank))?, Some(Task::Rerank))?;
    let (a, scored) = m.rerank(&s.core, query, passages, options, max_inputs, caller).await?;
    Ok((a.model, scored, a.tokens))
}

pub(super) async fn rerank(State(s): State<AppState>, acting: Acting, body: JsonBody) -> TeiResult {
    let req: TeiRerankRequest = tei_parse(body).await?;
    tei_texts(std::iter::once(&req.query).chain(&req.texts))?;
    if req.texts.is_empty() {
        return Err(TeiFail::new(StatusCode::BAD_REQUEST, "`texts` cannot be empty"));
    }
    let most = tei_batch(&s, req.texts.len())?;
    right(&req.truncation_direction)?;
    let caller = caller_of(acting)?;
    let query = (req.model.as_deref(), req.query.as_str(), req.texts.as_slice());
    let (_, scored, _) = ranked(&s, caller, query, (req.truncate, req.raw_scores), most).await?;
    let ranks = scored
        .into_iter()
        .map(|(index, score)| TeiRank { index, score, text: req.return_text.then(|| req.texts[index].clone()) })
        .collect();
    Ok(axum::Json(TeiRerankResponse(ranks)).into_response())
}

/// A text, or a pair of texts.
#[derive(Deserialize, ToSchema)]
#[serde(untagged)]
pub(super) enum Sequence {
    One(String),
    Pair(String, String),
}

/// TEI's `/predict` input: a text or a pair, or a list of either (`["a", "b"]` is one pair); read
/// by `predict_in`.
pub(super) enum PredictInput {
    Single(Sequence),
    Batch(Vec<Sequence>),
}

// Described by hand: two strings fit both readings (the first, a pair, is taken), which a derived
// `oneOf` would refuse.
impl utoipa::PartialSchema for PredictInput {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        use utoipa::openapi::schema::{AnyOfBuilder, ArrayBuilder, Ref};
        let sequence = || Ref::from_schema_name(Sequence::name());
        AnyOfBuilder::new()
            .description(Some("A text or a pair of texts, or a list of either; two strings are one pair"))
            .item(sequence())
            .item(ArrayBuilder::new().items(sequence()))
            .into()
    }
}

impl ToSchema for PredictInput {
    fn schemas(schemas: &mut Vec<(String, utoipa::openapi::RefOr<utoipa::openapi::schema::Schema>)>) {
        schemas.push((Sequence::name().into(), <Sequence as utoipa::PartialSchema>::schema()));
        Sequence::schemas(schemas);
    }
}

/// `PredictInput` as serde's untagged enum would read it (two texts are one pair), without
/// buffering the body's values first, and a list of at most `MAX_LIST`.
fn predict_in<'de, D: Deserializer<'de>>(d: D) -> Result<PredictInput, D::Error> {
    struct V;
    impl<'de> Visitor<'de> for V {
        type Value = PredictInput;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a text or a pair of texts, or a list of either")
        }
        fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<PredictInput, E> {
            Ok(PredictInput::Single(Sequence::One(v.to_string())))
        }
        fn visit_string<E: serde::de::Error>(self, v: String) -> Result<PredictInput, E> {
            Ok(PredictInput::Single(Sequence::One(v)))
        }
        fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<PredictInput, A::Error> {
            let mut entries: Vec<Entry> = capped(seq)?;
            if let [Entry::Text(_), Entry::Text(_)] = entries.as_slice() {
                let (Some(Entry::Text(b)), Some(Entry::Text(a))) = (entries.pop(), entries.pop()) else {
                    unreachable!("two texts")
                };
                return Ok(PredictInput::Single(Sequence::Pair(a, b)));
            }
            let sequences = entries.into_iter().map(|e| match e {
                Entry::Text(t) => Ok(Sequence::One(t)),
                Entry::List(pair) => match <[String; 2]>::try_from(pair) {
                    Ok([a, b]) => Ok(Sequence::Pair(a, b)),
                    Err(_) => Err(serde::de::Error::custom("a pair is a list of two texts")),
                },
            });
            sequences.collect::<Result<_, _>>().map(PredictInput::Batch)
        }
    }
    d.deserialize_any(V)
}

#[derive(Deserialize, ToSchema)]
#[schema(as = TeiPredictRequest)]
pub(super) struct TeiPredictRequest {
    #[serde(deserialize_with = "predict_in")]
    inputs: PredictInput,
    #[serde(default)]
    truncate: Option<bool>,
    #[serde(default)]
    truncation_direction: Option<String>,
    /// The model's scores as they are, without the softmax (sigmoid for one class).
    #[serde(default)]
    raw_scores: bool,
    #[serde(default)]
    model: Option<String>,
}

pub(super) async fn predict(State(s): State<AppState>, acting: Acting, body: JsonBody) -> TeiResult {
    let req: TeiPredictRequest = tei_parse(body).await?;
    let (single, sequences) = match req.inputs {
        PredictInput::Single(q) => (true, vec![q]),
        PredictInput::Batch(v) => (false, v),
    };
    let rows: Vec<(String, Option<String>)> = sequences
        .into_iter()
        .map(|q| match q {
            Sequence::One(a) => (a, None),
            Sequence::Pair(a, b) => (a, Some(b)),
        })
        .collect();
    tei_texts(rows.iter().flat_map(|(a, b)| std::iter::once(a).chain(b)))?;
    let most = tei_batch(&s, rows.len())?;
    right(&req.truncation_direction)?;
    let caller = caller_of(acting)?;
    let m = tei_model(&s, req.model.as_deref(), Some(Task::Classify))?;
    let rows: Vec<_> = rows.into_iter().map(|(a, b)| (Bytes::from(a), b.map(Bytes::from))).collect();
    let classes = m.predict(&s.core, rows, (req.truncate, req.raw_scores), most, caller).await?;
    let mut answers: Vec<Vec<TeiPrediction>> = classes
        .into_iter()
        .map(|row| row.into_iter().map(|(label, score)| TeiPrediction { score, label }).collect())
        .collect();
    let body = match single {
        true => TeiPredictResponse::One(answers.pop().unwrap_or_default()),
        false => TeiPredictResponse::Many(answers),
    };
    Ok(axum::Json(body).into_response())
}

#[derive(Deserialize, ToSchema)]
#[schema(as = TeiTokenizeRequest)]
pub(super) struct TeiTokenizeRequest {
    #[serde(deserialize_with = "texts_in")]
    inputs: Texts,
    #[serde(default = "yes")]
    add_special_tokens: bool,
    #[serde(default)]
    prompt_name: Option<String>,
    #[serde(default)]
    model: Option<String>,
}

pub(super) async fn tokenize(State(s): State<AppState>, acting: Acting, body: JsonBody) -> TeiResult {
    let req: TeiTokenizeRequest = tei_parse(body).await?;
    let texts = req.inputs.into_vec();
    tei_texts(&texts)?;
    tei_batch(&s, texts.len())?;
    let tenant = tenant_of(acting)?;
    let m = tei_model(&s, req.model.as_deref(), None)?;
    let held = m.admit(&s.core, tenant.as_deref())?;
    let tokens = m.tokenize(bytes(texts), req.add_special_tokens, req.prompt_name.as_deref(), held).await?;
    let tokens = tokens
        .into_iter()
        .map(|row| {
            row.into_iter()
                .map(|t| TeiToken { id: t.id, text: t.text, special: t.special, start: t.start, stop: t.stop })
                .collect()
        })
        .collect();
    Ok(axum::Json(TeiTokenizeResponse(tokens)).into_response())
}

/// One list of token ids, or several.
#[derive(Deserialize, ToSchema)]
#[serde(untagged)]
pub(super) enum Ids {
    One(Vec<u32>),
    Many(Vec<Vec<u32>>),
}

/// An entry of `ids`: an id, or a list of them.
enum IdEntry {
    Id(u32),
    List(Vec<u32>),
}

impl<'de> Deserialize<'de> for IdEntry {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<IdEntry, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = IdEntry;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a token id or a list of them")
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<IdEntry, E> {
                u32::try_from(v).map(IdEntry::Id).map_err(|_| E::custom(format!("token id {v} is past u32")))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<IdEntry, A::Error> {
                let mut ids = Vec::new();
                while let Some(id) = seq.next_element()? {
                    ids.push(id);
                }
                Ok(IdEntry::List(ids))
            }
        }
        d.deserialize_any(V)
    }
}

/// `Ids` as serde's untagged enum would read it, without buffering the body's values first, with
/// at most `MAX_LIST` lists (a list of ids is as long as its text).
fn ids_in<'de, D: Deserializer<'de>>(d: D) -> Result<Ids, D::Error> {
    struct V;
    impl<'de> Visitor<'de> for V {
        type Value = Ids;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a list of token ids, or a list of such lists")
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Ids, A::Error> {
            let (mut ids, mut lists) = (Vec::new(), Vec::new());
            while let Some(entry) = seq.next_element()? {
                match entry {
                    IdEntry::Id(id) => ids.push(id),
                    IdEntry::List(_) if lists.len() == MAX_LIST => {
                        return Err(serde::de::Error::custom(format!("more than {MAX_LIST} lists of ids")))
                    }
                    IdEntry::List(list) => lists.push(list),
                }
            }
            match (ids.is_empty(), lists.is_empty()) {
                (_, true) => Ok(Ids::One(ids)),
                (true, false) => Ok(Ids::Many(lists)),
                (false, false) => Err(serde::de::Error::custom("ids: a list of ids, or a list of lists, not both")),
            }
        }
    }
    d.deserialize_seq(V)
}

#[derive(Deserialize, ToSchema)]
#[schema(as = TeiDecodeRequest)]
pub(super) struct TeiDecodeRequest {
    #[serde(deserialize_with = "ids_in")]
    ids: Ids,
    #[serde(default = "yes")]
    skip_special_tokens: bool,
    #[serde(default)]
    model: Option<String>,
}

pub(super) async fn decode(State(s): State<AppState>, acting: Acting, body: JsonBody) -> TeiResult {
    let req: TeiDecodeRequest = tei_parse(body).await?;
    let lists = match req.ids {
        Ids::One(ids) => vec![ids],
        Ids::Many(lists) => lists,
    };
    if lists.is_empty() || lists.iter().any(Vec::is_empty) {
        return Err(TeiFail::new(StatusCode::BAD_REQUEST, "`ids` cannot be empty"));
    }
    tei_batch(&s, lists.len())?;
    let tenant = tenant_of(acting)?;
    let m = tei_model(&s, req.model.as_deref(), None)?;
    let _held = m.admit(&s.core, tenant.as_deref())?;
    let texts = m.decode(&lists, req.skip_special_tokens)?;
    Ok(axum::Json(TeiDecodeResponse(texts)).into_response())
}

#[derive(Deserialize)]
pub(super) struct InfoQuery {
    model: Option<String>,
}

pub(super) async fn info(State(s): State<AppState>, Query(q): Query<InfoQuery>) -> TeiResult {
    let m = tei_model(&s, q.model.as_deref(), None)?;
    let text = m.text.clone().ok_or_else(|| TeiFail::validation(format!("model '{}' has no tokenizer", m.name())))?;
    let classes = |n: usize| {
        let labels = texts::labels(Some(&text), n);
        let id2label: serde_json::Map<_, _> =
            labels.iter().enumerate().map(|(i, l)| (i.to_string(), serde_json::Value::from(l.as_str()))).collect();
        let label2id: serde_json::Map<_, _> =
            labels.iter().enumerate().map(|(i, l)| (l.clone(), serde_json::Value::from(i))).collect();
        serde_json::json!({"id2label": id2label, "label2id": label2id})
    };
    let model_type = match text.task {
        Task::Embed => serde_json::json!({"embedding": {"pooling": text.pooling.as_deref().unwrap_or("mean")}}),
        Task::Rerank => serde_json::json!({"reranker": classes(1)}),
        Task::Classify => serde_json::json!({"classifier": classes(text.labels.len().max(m.width().unwrap_or(0)))}),
    };
    let (per_batch, workers) = s
        .core
        .models()
        .iter()
        .find(|x| x.spec.name == m.name())
        .map_or((1, 1), |x| (x.spec.batch.max_batch_size.max(1), x.spec.instance_count));
    let info = TeiInfo {
        model_id: m.name().to_string(),
        model_sha: None,
        model_dtype: "float32".into(),
        model_type,
        max_concurrent_requests: s.core.limits().max_concurrent_requests,
        max_input_length: text.max_length,
        max_batch_tokens: text.max_length * per_batch,
        max_batch_requests: Some(per_batch),
        max_client_batch_size: s.core.limits().max_client_batch_size,
        auto_truncate: true,
        tokenization_workers: workers,
        version: env!("CARGO_PKG_VERSION").into(),
        sha: None,
        docker_label: None,
    };
    Ok(axum::Json(info).into_response())
}

// ---- Cohere / Jina -------------------------------------------------------------------------

/// Documents Cohere's rerank takes in one call.
pub const RERANK_MAX_DOCUMENTS: usize = 1000;

/// A document: its text, or `{"text": ...}`.
#[derive(Deserialize, ToSchema)]
#[serde(untagged)]
pub(super) enum Document {
    Text(String),
    Object(RerankDocument),
}

#[derive(Deserialize, ToSchema)]
#[schema(as = RerankRequest)]
pub(super) struct CohereRerankRequest {
    /// Optional when one model re-ranks.
    #[serde(default)]
    model: Option<String>,
    query: String,
    #[serde(deserialize_with = "at_most::<_, _, Listed>")]
    documents: Vec<Document>,
    /// The best `top_n` only (default all).
    #[serde(default)]
    top_n: Option<usize>,
    #[serde(default)]
    return_documents: bool,
}

pub(super) async fn cohere_rerank(State(s): State<AppState>, acting: Acting, body: JsonBody) -> Response {
    let answer = async {
        let req: CohereRerankRequest = parse(body).await?;
        let docs: Vec<String> = req
            .documents
            .into_iter()
            .map(|d| match d {
                Document::Text(t) | Document::Object(RerankDocument { text: t }) => t,
            })
            .collect();
        if req.query.is_empty() || docs.is_empty() || docs.iter().any(String::is_empty) {
            return Err(ApiError::bad_request("query and documents must be non-empty texts"));
        }
        if docs.len() > RERANK_MAX_DOCUMENTS {
            return Err(ApiError::bad_request(format!(
                "{} documents; at most {RERANK_MAX_DOCUMENTS} a call",
                docs.len()
            )));
        }
        let caller = caller_of(acting)?;
        let query = (req.model.as_deref(), req.query.as_str(), docs.as_slice());
        let (model, mut scored, tokens) =
            ranked(&s, caller, query, (None, false), RERANK_MAX_DOCUMENTS).await.map_err(invalid_as_400)?;
        scored.truncate(req.top_n.unwrap_or(usize::MAX));
        let results = scored
            .into_iter()
            .map(|(index, relevance_score)| RerankResult {
                index,
                relevance_score,
                document: req.return_documents.then(|| RerankDocument { text: docs[index].clone() }),
            })
            .collect();
        let id = format!("{:016x}", rand_id());
        Ok(axum::Json(RerankResponse { id, model, results, usage: RerankUsage { total_tokens: tokens } })
            .into_response())
    };
    answer.await.unwrap_or_else(openai_error)
}

/// An id for an answer (Cohere's `id`): unique enough to tell answers apart in logs.
fn rand_id() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos()));
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn predict(json: &str) -> Result<Vec<(String, Option<String>)>, serde_json::Error> {
        let req: TeiPredictRequest = serde_json::from_str(&format!(r#"{{"inputs": {json}}}"#))?;
        let sequences = match req.inputs {
            PredictInput::Single(q) => vec![q],
            PredictInput::Batch(v) => v,
        };
        Ok(sequences
            .into_iter()
            .map(|q| match q {
                Sequence::One(a) => (a, None),
                Sequence::Pair(a, b) => (a, Some(b)),
            })
            .collect())
    }

    fn one(a: &str) -> (String, Option<String>) {
        (a.into(), None)
    }

    fn pair(a: &str, b: &str) -> (String, Option<String>) {
        (a.into(), Some(b.into()))
    }

    #[test]
    fn predict_inputs_read_as_the_untagged_enum_read_them() {
        assert_eq!(predict(r#""a""#).unwrap(), [one("a")]);
        // Two texts are one pair; one or three, a list of texts.
        assert_eq!(predict(r#"["a", "b"]"#).unwrap(), [pair("a", "b")]);
        assert_eq!(predict(r#"["a"]"#).unwrap(), [one("a")]);
        assert_eq!(predict(r#"["a", "b", "c"]"#).unwrap(), [one("a"), one("b"), one("c")]);
        assert_eq!(predict(r#"[["a", "b"], "c"]"#).unwrap(), [pair("a", "b"), one("c")]);
        assert!(predict(r#"[["a"]]"#).is_err());
        assert!(predict("7").is_err());
    }

    #[test]
    fn ids_read_as_the_untagged_enum_read_them() {
        let ids =
            |json: &str| serde_json::from_str::<TeiDecodeRequest>(&format!(r#"{{"ids": {json}}}"#)).map(|r| r.ids);
        assert!(matches!(ids("[1, 2]").unwrap(), Ids::One(v) if v == [1, 2]));
        assert!(matches!(ids("[]").unwrap(), Ids::One(v) if v.is_empty()));
        assert!(matches!(ids("[[1], [2, 3]]").unwrap(), Ids::Many(v) if v == [vec![1], vec![2, 3]]));
        assert!(ids("[1, [2]]").is_err());
        assert!(ids("[-1]").is_err());
        assert!(ids("[4294967296]").is_err());
    }

    #[test]
    fn lists_past_the_most_a_call_takes_are_refused_as_they_are_read() {
        let texts = |n: usize| format!(r#"{{"inputs": [{}]}}"#, vec![r#""x""#; n].join(","));
        let req: TeiEmbedRequest = serde_json::from_str(&texts(MAX_LIST)).unwrap();
        assert_eq!(req.inputs.into_vec().len(), MAX_LIST);
        let e = serde_json::from_str::<TeiEmbedRequest>(&texts(MAX_LIST + 1)).err().unwrap();
        assert!(e.to_string().contains("more than 2048 texts a call"), "{e}");
        let one: TeiEmbedRequest = serde_json::from_str(r#"{"inputs": "x"}"#).unwrap();
        assert_eq!(one.inputs.into_vec(), ["x"]);
        let rerank = format!(r#"{{"query": "q", "texts": [{}]}}"#, vec![r#""""#; MAX_LIST + 1].join(","));
        assert!(serde_json::from_str::<TeiRerankRequest>(&rerank).is_err());
        let docs = format!(r#"{{"query": "q", "documents": [{}]}}"#, vec![r#"{"text": "d"}"#; MAX_LIST + 1].join(","));
        assert!(serde_json::from_str::<CohereRerankRequest>(&docs).is_err());
        let lists = format!(r#"{{"ids": [{}]}}"#, vec!["[]"; MAX_LIST + 1].join(","));
        assert!(serde_json::from_str::<TeiDecodeRequest>(&lists).is_err());
    }
}
