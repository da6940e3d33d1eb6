//! TEI's gRPC API (`tei.v1`: Info, Embed, Predict, Rerank, Tokenize) over the core's `texts`, as
//! its HTTP routes are: the same checks, limits, tenants and cache. A call names its model in the
//! `model` metadata key, or leaves it to the one served model of its task. A stream's messages
//! are answered one after another, in order.

use std::pin::Pin;

use bytes::Bytes;
use ferrite_core::{
    engine::spec::Task,
    texts::{self, EmbedOptions, TextModel},
    Core, Error,
};
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status, Streaming};

use super::status;
use crate::auth::Acting;

pub mod pb {
    tonic::include_proto!("tei.v1");
}

#[derive(Clone)]
pub struct Tei {
    core: Core,
    stopping: super::Stopping,
}

type Answers<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

/// TEI's five services, for the gRPC server to add.
pub struct Services {
    pub info: pb::info_server::InfoServer<Tei>,
    pub embed: pb::embed_server::EmbedServer<Tei>,
    pub predict: pb::predict_server::PredictServer<Tei>,
    pub rerank: pb::rerank_server::RerankServer<Tei>,
    pub tokenize: pb::tokenize_server::TokenizeServer<Tei>,
}

/// The services, each with the message size limits of the inference service.
pub fn services(core: Core, limits: &super::GrpcLimits, stopping: super::Stopping) -> Services {
    let tei = Tei { core, stopping };
    let (d, e) = (limits.max_decoding_message_size, limits.max_encoding_message_size);
    Services {
        info: pb::info_server::InfoServer::new(tei.clone()).max_decoding_message_size(d).max_encoding_message_size(e),
        embed: pb::embed_server::EmbedServer::new(tei.clone())
            .max_decoding_message_size(d)
            .max_encoding_message_size(e),
        predict: pb::predict_server::PredictServer::new(tei.clone())
            .max_decoding_message_size(d)
            .max_encoding_message_size(e),
        rerank: pb::rerank_server::RerankServer::new(tei.clone())
            .max_decoding_message_size(d)
            .max_encoding_message_size(e),
        tokenize: pb::tokenize_server::TokenizeServer::new(tei)
            .max_decoding_message_size(d)
            .max_encoding_message_size(e),
    }
}

/// What every call reads of its metadata: the model it names and whom it acts for.
struct Call {
    model: Option<String>,
    caller: ferrite_core::Caller,
}

impl Tei {
    fn call<T>(&self, req: &Request<T>) -> Result<Call, Status> {
        let model = req.metadata().get("model").map(|v| v.to_str().unwrap_or_default().to_string());
        let caller =
            Acting::of(req.extensions(), self.core.tenants(), |h| req.metadata().get(h).and_then(|v| v.to_str().ok()))
                .caller()
                .map_err(Status::permission_denied)?;
        Ok(Call { model, caller })
    }

    /// Passages one call may carry (`--max-client-batch-size`).
    fn most(&self) -> usize {
        self.core.limits().max_client_batch_size
    }

    /// TEI's check of a call's size: at most `most()` passages.
    fn batch(&self, n: usize) -> Result<(), Status> {
        if n > self.most() {
            return Err(status(Error::invalid(format!("batch size {n} > maximum allowed batch size {}", self.most()))));
        }
        Ok(())
    }

    fn model(&self, call: &Call, task: Option<Task>) -> Result<TextModel, Status> {
        let name = texts::pick(&self.core, call.model.as_deref(), task).map_err(status)?;
        TextModel::new(&self.core, &name, task).map_err(status)
    }

    async fn embed_one(&self, call: &Call, r: pb::EmbedRequest) -> Result<pb::EmbedResponse, Status> {
        text_given(&r.inputs)?;
        right(r.truncation_direction)?;
        let m = self.model(call, Some(Task::Embed))?;
        // Proto3 cannot leave a bool unset: `truncate: false` is TEI's default here, and cuts.
        let o = EmbedOptions { normalize: r.normalize, truncate: None, prompt_name: r.prompt_name, dimensions: None };
        let a = m.embed(&self.core, vec![Bytes::from(r.inputs)], &o, 1, call.caller.clone()).await.map_err(status)?;
        let embeddings = a.rows.into_iter().next().unwrap_or_default();
        Ok(pb::EmbedResponse { embeddings, metadata: Some(metadata(a.tokens)) })
    }

    async fn embed_sparse_one(
        &self,
        call: &Call,
        r: pb::EmbedSparseRequest,
    ) -> Result<pb::EmbedSparseResponse, Status> {
        text_given(&r.inputs)?;
        right(r.truncation_direction)?;
        let m = self.model(call, Some(Task::Embed))?;
        let texts = vec![Bytes::from(r.inputs)];
        let (rows, tokens) =
            m.embed_sparse(&self.core, texts, (None, r.prompt_name), 1, call.caller.clone()).await.map_err(status)?;
        let sparse_embeddings = rows
            .into_iter()
            .next()
            .unwrap_or_default()
            .into_iter()
            .map(|(index, value)| pb::SparseValue { index, value })
            .collect();
        Ok(pb::EmbedSparseResponse { sparse_embeddings, metadata: Some(metadata(tokens)) })
    }

    async fn embed_all_one(&self, call: &Call, r: pb::EmbedAllRequest) -> Result<pb::EmbedAllResponse, Status> {
        text_given(&r.inputs)?;
        right(r.truncation_direction)?;
        let m = self.model(call, Some(Task::Embed))?;
        let texts = vec![Bytes::from(r.inputs)];
        let (rows, tokens) =
            m.embed_all(&self.core, texts, (None, r.prompt_name), 1, call.caller.clone()).await.map_err(status)?;
        let token_embeddings = rows
            .into_iter()
            .next()
            .unwrap_or_default()
            .into_iter()
            .map(|embeddings| pb::TokenEmbedding { embeddings })
            .collect();
        Ok(pb::EmbedAllResponse { token_embeddings, metadata: Some(metadata(tokens)) })
    }

    async fn predict_one(&self, call: &Call, row: texts::Row, raw: bool) -> Result<pb::PredictResponse, Status> {
        let m = self.model(call, Some(Task::Classify))?;
        let classes = m.predict(&self.core, vec![row], (None, raw), 1, call.caller.clone()).await.map_err(status)?;
        let predictions = classes
            .into_iter()
            .next()
            .unwrap_or_default()
            .into_iter()
            .map(|(label, score)| pb::Prediction { score, label })
            .collect();
        Ok(pb::PredictResponse { predictions, metadata: None })
    }

    async fn rerank_all(
        &self,
        call: &Call,
        query: &str,
        texts: Vec<String>,
        (raw, return_text): (bool, bool),
    ) -> Result<pb::RerankResponse, Status> {
        text_given(query)?;
        texts.iter().try_for_each(|t| text_given(t))?;
        if texts.is_empty() {
            return Err(Status::invalid_argument("`texts` cannot be empty"));
        }
        let m = self.model(call, Some(Task::Rerank))?;
        let (a, scored) =
            m.rerank(&self.core, query, &texts, (None, raw), self.most(), call.caller.clone()).await.map_err(status)?;
        let ranks = scored
            .into_iter()
            .map(|(i, score)| pb::Rank { index: i as u32, text: return_text.then(|| texts[i].clone()), score })
            .collect();
        Ok(pb::RerankResponse { ranks, metadata: Some(metadata(a.tokens)) })
    }

    async fn tokenize_one(&self, call: &Call, r: pb::EncodeRequest) -> Result<pb::EncodeResponse, Status> {
        text_given(&r.inputs)?;
        let m = self.model(call, None)?;
        let held = m.admit(&self.core, call.caller.tenant.as_deref()).map_err(status)?;
        let rows = m
            .tokenize(vec![Bytes::from(r.inputs)], r.add_special_tokens, r.prompt_name.as_deref(), held)
            .await
            .map_err(status)?;
        let tokens = rows
            .into_iter()
            .flatten()
            .map(|t| pb::SimpleToken {
                id: t.id,
                text: t.text,
                special: t.special,
                start: t.start.map(|s| s as u32),
                stop: t.stop.map(|s| s as u32),
            })
            .collect();
        Ok(pb::EncodeResponse { tokens })
    }

    fn decode_one(&self, call: &Call, r: pb::DecodeRequest) -> Result<pb::DecodeResponse, Status> {
        if r.ids.is_empty() {
            return Err(Status::invalid_argument("`ids` cannot be empty"));
        }
        let m = self.model(call, None)?;
        let _held = m.admit(&self.core, call.caller.tenant.as_deref()).map_err(status)?;
        let text = m.decode(&[r.ids], r.skip_special_tokens).map_err(status)?.pop().unwrap_or_default();
        Ok(pb::DecodeResponse { text })
    }
}

fn text_given(t: &str) -> Result<(), Status> {
    if t.is_empty() {
        return Err(Status::invalid_argument("`inputs` cannot be empty"));
    }
    Ok(())
}

fn right(direction: i32) -> Result<(), Status> {
    match pb::TruncationDirection::try_from(direction) {
        Ok(pb::TruncationDirection::Right) => Ok(()),
        _ => Err(status(Error::invalid("truncation_direction: text pipelines cut texts at their end (RIGHT)"))),
    }
}

fn metadata(tokens: u64) -> pb::Metadata {
    pb::Metadata { compute_tokens: tokens.min(u32::MAX as u64) as u32, ..Default::default() }
}

fn pair(inputs: Vec<String>) -> Result<texts::Row, Status> {
    match <[String; 2]>::try_from(inputs) {
        Ok([a, b]) => {
            text_given(&a)?;
            text_given(&b)?;
            Ok((Bytes::from(a), Some(Bytes::from(b))))
        }
        Err(v) => Err(Status::invalid_argument(format!("`inputs` must be a pair of texts, not {}", v.len()))),
    }
}

/// Each message of `incoming` answered by `answer`, in order; the stream ends at the first error,
/// and with UNAVAILABLE once the server takes no more requests (after the answer in hand).
fn each<M, T, F, Fut>(tei: Tei, incoming: Streaming<M>, answer: F) -> Answers<T>
where
    M: Send + 'static,
    T: Send + 'static,
    F: Fn(Tei, M) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = Result<T, Status>> + Send + 'static,
{
    let incoming = super::until_stopped(incoming, tei.stopping.clone());
    Box::pin(incoming.then(move |m| {
        let tei = tei.clone();
        let answer = &answer;
        let fut = m.map(|m| answer(tei, m));
        async move {
            match fut {
                Ok(f) => f.await,
                Err(e) => Err(e),
            }
        }
    }))
}

#[tonic::async_trait]
impl pb::info_server::Info for Tei {
    async fn info(&self, req: Request<pb::InfoRequest>) -> Result<Response<pb::InfoResponse>, Status> {
        let call = self.call(&req)?;
        let m = self.model(&call, None)?;
        let text = m.text.clone().ok_or_else(|| Status::invalid_argument("the model has no tokenizer"))?;
        let model_type = match text.task {
            Task::Embed => pb::ModelType::Embedding,
            Task::Rerank => pb::ModelType::Reranker,
            Task::Classify => pb::ModelType::Classifier,
        };
        let spec = self.core.models().into_iter().find(|x| x.spec.name == m.name()).map(|x| x.spec.clone());
        let (per_batch, workers) = spec.map_or((1, 1), |s| (s.batch.max_batch_size.max(1), s.instance_count));
        Ok(Response::new(pb::InfoResponse {
            version: env!("CARGO_PKG_VERSION").into(),
            sha: None,
            docker_label: None,
            model_id: m.name().to_string(),
            model_sha: None,
            model_dtype: "float32".into(),
            model_type: model_type as i32,
            max_concurrent_requests: self.core.limits().max_concurrent_requests.min(u32::MAX as usize) as u32,
            max_input_length: text.max_length as u32,
            max_batch_tokens: (text.max_length * per_batch) as u32,
            max_batch_requests: Some(per_batch as u32),
            max_client_batch_size: self.most() as u32,
            tokenization_workers: workers as u32,
        }))
    }
}

#[tonic::async_trait]
impl pb::embed_server::Embed for Tei {
    async fn embed(&self, req: Request<pb::EmbedRequest>) -> Result<Response<pb::EmbedResponse>, Status> {
        let call = self.call(&req)?;
        self.embed_one(&call, req.into_inner()).await.map(Response::new)
    }

    type EmbedStreamStream = Answers<pb::EmbedResponse>;
    async fn embed_stream(
        &self,
        req: Request<Streaming<pb::EmbedRequest>>,
    ) -> Result<Response<Self::EmbedStreamStream>, Status> {
        let call = std::sync::Arc::new(self.call(&req)?);
        Ok(Response::new(each(self.clone(), req.into_inner(), move |tei, m| {
            let call = call.clone();
            async move { tei.embed_one(&call, m).await }
        })))
    }

    async fn embed_sparse(
        &self,
        req: Request<pb::EmbedSparseRequest>,
    ) -> Result<Response<pb::EmbedSparseResponse>, Status> {
        let call = self.call(&req)?;
        self.embed_sparse_one(&call, req.into_inner()).await.map(Response::new)
    }

    type EmbedSparseStreamStream = Answers<pb::EmbedSparseResponse>;
    async fn embed_sparse_stream(
        &self,
        req: Request<Streaming<pb::EmbedSparseRequest>>,
    ) -> Result<Response<Self::EmbedSparseStreamStream>, Status> {
        let call = std::sync::Arc::new(self.call(&req)?);
        Ok(Response::new(each(self.clone(), req.into_inner(), move |tei, m| {
            let call = call.clone();
            async move { tei.embed_sparse_one(&call, m).await }
        })))
    }

    async fn embed_all(&self, req: Request<pb::EmbedAllRequest>) -> Result<Response<pb::EmbedAllResponse>, Status> {
        let call = self.call(&req)?;
        self.embed_all_one(&call, req.into_inner()).await.map(Response::new)
    }

    type EmbedAllStreamStream = Answers<pb::EmbedAllResponse>;
    async fn embed_all_stream(
        &self,
        req: Request<Streaming<pb::EmbedAllRequest>>,
    ) -> Result<Response<Self::EmbedAllStreamStream>, Status> {
        let call = std::sync::Arc::new(self.call(&req)?);
        Ok(Response::new(each(self.clone(), req.into_inner(), move |tei, m| {
            let call = call.clone();
            async move { tei.embed_all_one(&call, m).await }
        })))
    }
}

#[tonic::async_trait]
impl pb::predict_server::Predict for Tei {
    async fn predict(&self, req: Request<pb::PredictRequest>) -> Result<Response<pb::PredictResponse>, Status> {
        let call = self.call(&req)?;
        let r = req.into_inner();
        text_given(&r.inputs)?;
        right(r.truncation_direction)?;
        self.predict_one(&call, (Bytes::from(r.inputs), None), r.raw_scores).await.map(Response::new)
    }

    async fn predict_pair(
        &self,
        req: Request<pb::PredictPairRequest>,
    ) -> Result<Response<pb::PredictResponse>, Status> {
        let call = self.call(&req)?;
        let r = req.into_inner();
        right(r.truncation_direction)?;
        self.predict_one(&call, pair(r.inputs)?, r.raw_scores).await.map(Response::new)
    }

    type PredictStreamStream = Answers<pb::PredictResponse>;
    async fn predict_stream(
        &self,
        req: Request<Streaming<pb::PredictRequest>>,
    ) -> Result<Response<Self::PredictStreamStream>, Status> {
        let call = std::sync::Arc::new(self.call(&req)?);
        Ok(Response::new(each(self.clone(), req.into_inner(), move |tei, r| {
            let call = call.clone();
            async move {
                text_given(&r.inputs)?;
                right(r.truncation_direction)?;
                tei.predict_one(&call, (Bytes::from(r.inputs), None), r.raw_scores).await
            }
        })))
    }

    type PredictPairStreamStream = Answers<pb::PredictResponse>;
    async fn predict_pair_stream(
        &self,
        req: Request<Streaming<pb::PredictPairRequest>>,
    ) -> Result<Response<Self::PredictPairStreamStream>, Status> {
        let call = std::sync::Arc::new(self.call(&req)?);
        Ok(Response::new(each(self.clone(), req.into_inner(), move |tei, r| {
            let call = call.clone();
            async move {
                right(r.truncation_direction)?;
                tei.predict_one(&call, pair(r.inputs)?, r.raw_scores).await
            }
        })))
    }
}

#[tonic::async_trait]
impl pb::rerank_server::Rerank for Tei {
    async fn rerank(&self, req: Request<pb::RerankRequest>) -> Result<Response<pb::RerankResponse>, Status> {
        let call = self.call(&req)?;
        let r = req.into_inner();
        right(r.truncation_direction)?;
        self.batch(r.texts.len())?;
        self.rerank_all(&call, &r.query, r.texts, (r.raw_scores, r.return_text)).await.map(Response::new)
    }

    /// The stream's (query, text) messages make one call: the first message's query and flags.
    async fn rerank_stream(
        &self,
        req: Request<Streaming<pb::RerankStreamRequest>>,
    ) -> Result<Response<pb::RerankResponse>, Status> {
        let call = self.call(&req)?;
        // A stream still coming when the server stops gets UNAVAILABLE, not a ranking of part of it.
        let mut incoming = super::until_stopped(req.into_inner(), self.stopping.clone());
        let mut first: Option<pb::RerankStreamRequest> = None;
        let mut texts = Vec::new();
        while let Some(m) = incoming.next().await {
            let m = m?;
            right(m.truncation_direction)?;
            self.batch(texts.len() + 1)?;
            texts.push(m.text.clone());
            first.get_or_insert(m);
        }
        let first = first.ok_or_else(|| Status::invalid_argument("the stream carried no message"))?;
        self.rerank_all(&call, &first.query, texts, (first.raw_scores, first.return_text)).await.map(Response::new)
    }
}

#[tonic::async_trait]
impl pb::tokenize_server::Tokenize for Tei {
    async fn tokenize(&self, req: Request<pb::EncodeRequest>) -> Result<Response<pb::EncodeResponse>, Status> {
        let call = self.call(&req)?;
        self.tokenize_one(&call, req.into_inner()).await.map(Response::new)
    }

    type TokenizeStreamStream = Answers<pb::EncodeResponse>;
    async fn tokenize_stream(
        &self,
        req: Request<Streaming<pb::EncodeRequest>>,
    ) -> Result<Response<Self::TokenizeStreamStream>, Status> {
        let call = std::sync::Arc::new(self.call(&req)?);
        Ok(Response::new(each(self.clone(), req.into_inner(), move |tei, r| {
            let call = call.clone();
            async move { tei.tokenize_one(&call, r).await }
        })))
    }

    async fn decode(&self, req: Request<pb::DecodeRequest>) -> Result<Response<pb::DecodeResponse>, Status> {
        let call = self.call(&req)?;
        self.decode_one(&call, req.into_inner()).map(Response::new)
    }

    type DecodeStreamStream = Answers<pb::DecodeResponse>;
    async fn decode_stream(
        &self,
        req: Request<Streaming<pb::DecodeRequest>>,
    ) -> Result<Response<Self::DecodeStreamStream>, Status> {
        let call = std::sync::Arc::new(self.call(&req)?);
        Ok(Response::new(each(self.clone(), req.into_inner(), move |tei, r| {
            let call = call.clone();
            async move { tei.decode_one(&call, r) }
        })))
    }
}
