//! KServe V2 / Open Inference Protocol over gRPC (`inference.GRPCInferenceService`), and TEI's
//! gRPC API beside it (`tei`).
//!
//! A thin translation: protobuf messages to core requests and back, and the core's errors mapped
//! once to gRPC codes. Validation, limits and batching are the core's, as for HTTP.

pub mod bound;
pub mod calls;
pub mod convert;
pub mod tei;
mod unpack;

use std::{pin::Pin, sync::Arc, time::Duration};

use ferrite_core::{Core, Error, Model};
use tokio::sync::{mpsc, Semaphore};
use tokio_stream::{Stream, StreamExt};
use tonic::{metadata::MetadataMap, Code, Request, Response, Status, Streaming};
use tonic_types::{ErrorDetails, StatusExt};

use crate::{auth::Acting, budget::HeldFor, telemetry};

pub mod pb {
    tonic::include_proto!("inference");
}

use pb::grpc_inference_service_server::{GrpcInferenceService, GrpcInferenceServiceServer};

/// Requests of one stream that may be in flight at once; past it the stream is not read.
const STREAM_IN_FLIGHT: usize = 256;

#[derive(Debug, Clone)]
pub struct GrpcLimits {
    pub max_decoding_message_size: usize,
    pub max_encoding_message_size: usize,
}

/// Per-call facts from the metadata that every request of the call carries.
#[derive(Debug, Clone)]
struct CallMeta {
    tenant: Option<String>,
    /// Where its work is held (`Acting::share`).
    share: Option<String>,
    canary: ferrite_core::CanaryRoute,
}

#[derive(Clone)]
pub struct Service {
    core: Core,
    /// Triton's system shared-memory regions, shared with the HTTP listener.
    shm: Arc<crate::shm::Regions>,
    stopping: Stopping,
}

/// The inference service, with its message size limits. Requests may come gzip- or
/// deflate-compressed (tritonclient's `compression_algorithm`); a message is decompressed to at
/// most the decoding limit, so a compression bomb costs no more than a plain message.
pub fn service(
    core: Core,
    limits: &GrpcLimits,
    shm: Arc<crate::shm::Regions>,
    stopping: Stopping,
) -> GrpcInferenceServiceServer<Service> {
    use tonic::codec::CompressionEncoding;
    bound::set_largest(limits.max_decoding_message_size);
    GrpcInferenceServiceServer::new(Service { core, shm, stopping })
        .accept_compressed(CompressionEncoding::Gzip)
        .accept_compressed(CompressionEncoding::Deflate)
        .max_decoding_message_size(limits.max_decoding_message_size)
        .max_encoding_message_size(limits.max_encoding_message_size)
}

/// What the listener's streams watch: true once the server takes no more requests.
pub type Stopping = tokio::sync::watch::Receiver<bool>;

/// The messages of a client's stream until the server takes no more requests, then one
/// UNAVAILABLE: a stream a client keeps open neither holds the server's stop up (until its exit
/// timeout) nor ends as if all it sent had been answered. The caller answers what it holds first.
pub(crate) struct UntilStopped<S> {
    inner: S,
    stopped: Pin<Box<dyn std::future::Future<Output = ()> + Send>>,
    done: bool,
}

pub(crate) fn until_stopped<S>(inner: S, mut stopping: Stopping) -> UntilStopped<S> {
    let stopped = Box::pin(async move {
        let _ = stopping.wait_for(|&s| s).await;
    });
    UntilStopped { inner, stopped, done: false }
}

impl<S, M> Stream for UntilStopped<S>
where
    S: Stream<Item = Result<M, Status>> + Unpin,
{
    type Item = Result<M, Status>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<Option<Self::Item>> {
        if self.done {
            return std::task::Poll::Ready(None);
        }
        if self.stopped.as_mut().poll(cx).is_ready() {
            self.done = true;
            let e = Status::unavailable("the server is stopping: this stream takes no more requests");
            return std::task::Poll::Ready(Some(Err(e)));
        }
        Pin::new(&mut self.inner).poll_next(cx)
    }
}

/// Requires a bearer token with the call's scope on every gRPC call (when auth is on):
/// repository calls need `admin`, `grpc.health.v1` nothing when health is left open, everything
/// else `infer`. A layer over the whole server, so it sees each call's method path.
#[derive(Clone)]
pub struct AuthLayer {
    pub auth: Option<Arc<crate::auth::Auth>>,
}

impl<S> tower_layer::Layer<S> for AuthLayer {
    type Service = AuthService<S>;
    fn layer(&self, inner: S) -> AuthService<S> {
        AuthService { inner, auth: self.auth.clone() }
    }
}

#[derive(Clone)]
pub struct AuthService<S> {
    inner: S,
    auth: Option<Arc<crate::auth::Auth>>,
}

impl<S, B, R> tower_service::Service<http::Request<B>> for AuthService<S>
where
    S: tower_service::Service<http::Request<B>, Response = http::Response<R>>,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    R: Default + Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn std::future::Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut std::task::Context<'_>) -> std::task::Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        use crate::auth::{Denied, Scope};
        if let Some(auth) = &self.auth {
            let path = req.uri().path();
            let scope = if path.starts_with("/grpc.health.v1.Health/") && auth.allow_health {
                None
            } else if path.starts_with("/inference.GRPCInferenceService/Repository") {
                Some(Scope::Admin)
            } else if path == "/inference.GRPCInferenceService/ModelStatistics" {
                Some(Scope::Metrics)
            } else {
                Some(Scope::Infer)
            };
            if let Some(scope) = scope {
                let header = req.headers().get("authorization").and_then(|v| v.to_str().ok());
                let refused = match auth.check(header, scope) {
                    Ok(principal) => {
                        let mut req = req;
                        req.extensions_mut().insert(principal);
                        return Box::pin(self.inner.call(req));
                    }
                    Err(Denied::Unauthenticated) => Some(Status::unauthenticated("a valid bearer token is required")),
                    Err(Denied::Forbidden) => {
                        Some(Status::permission_denied("the token lacks the scope this call needs"))
                    }
                };
                if let Some(status) = refused {
                    return Box::pin(std::future::ready(Ok(status.into_http())));
                }
            }
        }
        Box::pin(self.inner.call(req))
    }
}

/// The one mapping from core errors to gRPC status codes. Refusals that ask the client to come
/// back carry the hint as HTTP's `Retry-After` does: Google's `RetryInfo` in the status details
/// (read by gRPC retry policies and client libraries), and a `retry-after` metadata value (s).
pub fn status(e: Error) -> Status {
    match &e {
        Error::InvalidInput(m) => Status::invalid_argument(m),
        Error::NotFound(m) => Status::not_found(m),
        Error::Unavailable { message, retry_after: Some(after) } => retry(Code::Unavailable, message, *after),
        Error::Overloaded { message, retry_after: Some(after) } => retry(Code::ResourceExhausted, message, *after),
        Error::Unavailable { message, .. } => Status::unavailable(message),
        Error::Overloaded { message, .. } => Status::resource_exhausted(message),
        Error::TooLarge(m) => Status::resource_exhausted(m),
        Error::DeadlineExceeded(m) => Status::deadline_exceeded(m),
        Error::Unsupported(m) => Status::unimplemented(m),
        Error::Internal(m) => Status::internal(m),
    }
}

/// UNAVAILABLE, to be retried in a second: a refusal for want of room (bytes in flight, places to
/// decompress) that frees as other calls end.
pub(crate) fn unavailable(message: &str) -> Status {
    status(Error::unavailable(message, Some(std::time::Duration::from_secs(1))))
}

fn retry(code: Code, message: &str, after: std::time::Duration) -> Status {
    let mut metadata = MetadataMap::new();
    metadata.insert("retry-after", after.as_secs().max(1).into());
    Status::with_error_details_and_metadata(code, message, ErrorDetails::with_retry_info(Some(after)), metadata)
}

/// The client's deadline (`grpc-timeout`: digits and a unit of H, M, S, m, u or n) in microseconds,
/// less a 2 ms margin.
pub fn grpc_timeout_us(metadata: &MetadataMap) -> Option<u64> {
    let v = metadata.get("grpc-timeout")?.to_str().ok()?;
    let (digits, unit) = v.split_at(v.len().checked_sub(1)?);
    let n: u64 = digits.parse().ok()?;
    let us = match unit {
        "H" => n.saturating_mul(3_600_000_000),
        "M" => n.saturating_mul(60_000_000),
        "S" => n.saturating_mul(1_000_000),
        "m" => n.saturating_mul(1_000),
        "u" => n,
        "n" => n.div_ceil(1_000),
        _ => return None,
    };
    // Answer a little before tonic's own timer (which replies CANCELLED) so the client gets our
    // DEADLINE_EXCEEDED; the request is dropped from the queue either way.
    Some(us.saturating_sub(2_000).max(1))
}

impl Service {
    fn model(&self, name: &str, version: &str) -> Result<Arc<Model>, Status> {
        self.core.model(name, Some(version)).map_err(status)
    }

    /// What a call's metadata says about its requests: the tenant (its token's, or its
    /// `--tenant-header` key where tenants are configured and the token allows) and the
    /// `x-ferrite-canary` routing.
    fn call_meta(&self, metadata: &MetadataMap, extensions: &http::Extensions) -> Result<CallMeta, Status> {
        let Acting { tenant, share } =
            Acting::of(extensions, self.core.tenants(), |h| metadata.get(h).and_then(|v| v.to_str().ok()));
        let tenant = tenant.map_err(Status::permission_denied)?;
        let canary = match metadata.get(crate::CANARY_HEADER).map(|v| v.to_str().unwrap_or("?")) {
            None => ferrite_core::CanaryRoute::Auto,
            Some(v) => ferrite_core::CanaryRoute::parse(v).ok_or_else(|| {
                Status::invalid_argument(format!("{}: expected always, never or auto", crate::CANARY_HEADER))
            })?,
        };
        Ok(CallMeta { tenant, share, canary })
    }

    /// The tenant a shared-memory call acts for (as its inferences would).
    fn shm_tenant<T>(&self, r: &Request<T>) -> Result<Option<String>, Status> {
        Ok(self.call_meta(r.metadata(), r.extensions())?.tenant)
    }

    /// One inference, shared by the unary and streaming calls.
    async fn infer(
        &self,
        req: pb::ModelInferRequest,
        deadline_us: Option<u64>,
        meta: CallMeta,
        hold: impl FnOnce(usize) -> Result<(), Error> + Send,
    ) -> Result<pb::ModelInferResponse, Error> {
        let final_flag = convert::wants_final_response(&req);
        let shared = convert::shared_outputs(&req)?;
        let shm = crate::shm::Access::new(self.shm.clone(), meta.tenant.clone(), meta.share.clone());
        let max = self.core.limits().max_elements;
        let in_shm = convert::shared_input_bytes(&req);
        // A large request's inputs are checked against the model before their contents are
        // converted or read from shared memory, as a large HTTP body's are before it is decoded.
        if convert::input_bytes(&req).saturating_add(in_shm) > crate::http::OFFLOAD_BYTES as u64 {
            let version = Some(req.model_version.as_str()).filter(|v| !v.is_empty());
            convert::check_headers(&req, max, |input, datatype, shape| {
                self.core.check_input(&req.model_name, version, input, datatype, shape)
            })?;
        }
        // Inputs read from shared memory may be as large as bodies: large reads off the I/O threads.
        let large = in_shm > crate::http::OFFLOAD_BYTES as u64;
        let (core_req, shm) =
            crate::http::off_io(large, meta.share.as_deref(), move || (convert::to_core(req, max, Some(&shm)), shm))
                .await?;
        let mut core_req = core_req?;
        // What the message decoded to is held until answered, as its bytes are (`hold`: bytes in
        // all, never less than its message's; those read from shared memory are held already).
        hold(core_req.held_len().saturating_sub(shm.bytes_read()))?;
        core_req.tenant = meta.tenant.clone();
        core_req.share = meta.share.clone();
        core_req.canary = meta.canary;
        if let Some(d) = deadline_us {
            core_req.timeout_us = Some(core_req.timeout_us.filter(|&t| t > 0 && t < d).unwrap_or(d));
        }
        let resp = self.core.infer(core_req).await?;
        // Outputs written to shared memory may be as large as inputs read from it: off the I/O
        // threads too, as HTTP does.
        let written = resp.outputs.iter().filter(|t| shared.iter().any(|(name, _)| t.name == *name));
        let large = written.map(|t| t.data.wire_len()).sum::<usize>() > crate::http::OFFLOAD_BYTES;
        crate::http::off_io(large, meta.share.as_deref(), move || {
            for (name, place) in &shared {
                if let Some(t) = resp.outputs.iter().find(|t| t.name == *name) {
                    shm.write(t, place)?;
                }
            }
            Ok(convert::from_core(resp, final_flag, &shared))
        })
        .await?
    }
}

type InferStream = Pin<Box<dyn Stream<Item = Result<pb::ModelStreamInferResponse, Status>> + Send>>;

/// A stream's answer, with what it holds of the bytes in flight.
type Answer = (Result<pb::ModelStreamInferResponse, Status>, Option<crate::budget::Reserved>);

/// Hands `answer` on to the stream's client (counted as waiting on it until taken).
async fn send(tx: &mpsc::Sender<Answer>, answers: &Option<calls::StreamAnswers>, answer: Answer) {
    if let Some(a) = answers {
        a.made();
    }
    if tx.send(answer).await.is_err() {
        if let Some(a) = answers {
            a.taken(1);
        }
    }
}

/// A stream's answers as its connection asks for them, each handed on with what it holds of the
/// bytes in flight, kept until its bytes have been written (see `calls::StreamAnswers`).
struct Answers {
    rx: mpsc::Receiver<Answer>,
    answers: Option<calls::StreamAnswers>,
}

impl Stream for Answers {
    type Item = Result<pb::ModelStreamInferResponse, Status>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<Option<Self::Item>> {
        let this = &mut *self;
        this.rx.poll_recv(cx).map(|next| {
            next.map(|(answer, held)| {
                if let Some(a) = &this.answers {
                    a.handed(held);
                }
                answer
            })
        })
    }
}

#[tonic::async_trait]
impl GrpcInferenceService for Service {
    async fn server_live(&self, _: Request<pb::ServerLiveRequest>) -> Result<Response<pb::ServerLiveResponse>, Status> {
        Ok(Response::new(pb::ServerLiveResponse { live: true }))
    }

    async fn server_ready(
        &self,
        _: Request<pb::ServerReadyRequest>,
    ) -> Result<Response<pb::ServerReadyResponse>, Status> {
        Ok(Response::new(pb::ServerReadyResponse { ready: self.core.is_ready() }))
    }

    async fn model_ready(&self, r: Request<pb::ModelReadyRequest>) -> Result<Response<pb::ModelReadyResponse>, Status> {
        let r = r.into_inner();
        let ready = self.core.is_ready() && self.core.model(&r.name, Some(&r.version)).is_ok();
        Ok(Response::new(pb::ModelReadyResponse { ready }))
    }

    async fn server_metadata(
        &self,
        _: Request<pb::ServerMetadataRequest>,
    ) -> Result<Response<pb::ServerMetadataResponse>, Status> {
        Ok(Response::new(pb::ServerMetadataResponse {
            name: "ferrite".into(),
            version: ferrite_core::wire::VERSION.into(),
            extensions: self.shm.extensions(),
            onnxruntime_version: ferrite_core::engine::onnx::runtime_version().unwrap_or_default().into(),
        }))
    }

    async fn model_metadata(
        &self,
        r: Request<pb::ModelMetadataRequest>,
    ) -> Result<Response<pb::ModelMetadataResponse>, Status> {
        let r = r.into_inner();
        let m = self.model(&r.name, &r.version)?;
        Ok(Response::new(convert::metadata(&m, &self.core.versions(&r.name))))
    }

    async fn model_infer(&self, r: Request<pb::ModelInferRequest>) -> Result<Response<pb::ModelInferResponse>, Status> {
        use tracing::Instrument;
        let deadline = grpc_timeout_us(r.metadata());
        let parent = telemetry::extract(&telemetry::Metadata(r.metadata()));
        let meta = self.call_meta(r.metadata(), r.extensions())?;
        let charge = r.extensions().get::<calls::AnswerCharge>().cloned();
        // A large message was read by the call's body into a pooled buffer (`calls`); tonic decoded
        // an empty one in its place. It is checked as tonic's are (`bound`), and decoded off the
        // I/O threads as large HTTP bodies are.
        let req = match r.extensions().get::<calls::Captured>().and_then(calls::Captured::take) {
            Some(bytes) => crate::http::off_io(true, meta.share.as_deref(), move || {
                bound::check::<pb::ModelInferRequest>(&bytes)?;
                prost::Message::decode(bytes).map_err(|e| Status::internal(e.to_string()))
            })
            .await
            .map_err(status)??,
            None => r.into_inner(),
        };
        let span = telemetry::request_span("grpc", &req.model_name, parent);
        // If the client cancels, this future is dropped and the queued request is skipped.
        let hold = |bytes| charge.as_ref().map_or(Ok(()), |c| c.decoded(bytes));
        let resp = self.infer(req, deadline, meta, hold).instrument(span).await.map_err(status)?;
        if let Some(charge) = charge {
            charge.add(prost::Message::encoded_len(&resp))?;
        }
        Ok(Response::new(resp))
    }

    type ModelStreamInferStream = InferStream;

    async fn model_stream_infer(
        &self,
        r: Request<Streaming<pb::ModelInferRequest>>,
    ) -> Result<Response<InferStream>, Status> {
        let parent = telemetry::extract(&telemetry::Metadata(r.metadata()));
        let meta = self.call_meta(r.metadata(), r.extensions())?;
        let answers = r.extensions().get::<calls::StreamAnswers>().cloned();
        let mut incoming = until_stopped(r.into_inner(), self.stopping.clone());
        // Each answer with what it holds of the bytes in flight, given back once written (`Kept`).
        let (tx, rx) = mpsc::channel::<Answer>(STREAM_IN_FLIGHT);
        let permits = Arc::new(Semaphore::new(STREAM_IN_FLIGHT));
        let svc = self.clone();
        let taking = answers.clone();
        tokio::spawn(async move {
            loop {
                let Ok(permit) = permits.clone().acquire_owned().await else { break };
                let msg = match incoming.next().await {
                    Some(Ok(m)) => m,
                    None => break,
                    Some(Err(e)) => {
                        // An error ends the stream: the requests in flight are answered first.
                        drop(permit);
                        let _ = permits.acquire_many(STREAM_IN_FLIGHT as u32).await;
                        send(&tx, &answers, (Err(e), None)).await;
                        break;
                    }
                };
                let (tx, svc, meta, answers) = (tx.clone(), svc.clone(), meta.clone(), answers.clone());
                // What the message's bytes hold, held until it is answered.
                let mut request = answers.as_ref().map(|a| a.next_message());
                let span = telemetry::request_span("grpc-stream", &msg.model_name, parent.clone());
                tokio::spawn(tracing::Instrument::instrument(
                    async move {
                        let (id, model_name) = (msg.id.clone(), msg.model_name.clone());
                        // One bad request answers with an error message; the stream goes on.
                        let failed = |error_message: String| pb::ModelStreamInferResponse {
                            error_message,
                            infer_response: Some(pb::ModelInferResponse { id, model_name, ..Default::default() }),
                        };
                        // What it decodes to is held with its bytes.
                        let hold = |bytes| request.as_mut().map_or(Ok(()), |r| r.hold(bytes, HeldFor::Request));
                        let out = tokio::select! {
                            r = svc.infer(msg, None, meta, hold) => {
                                r.map_err(|e| e.to_string())
                            }
                            // The client went away: dropping the request frees its queue slot.
                            _ = tx.closed() => return,
                        };
                        let held = match (&out, &answers, request) {
                            (Ok(resp), Some(answers), Some(request)) => {
                                answers.hold(request, prost::Message::encoded_len(resp)).map(Some)
                            }
                            _ => Ok(None),
                        };
                        let (out, held) = match (out, held) {
                            (Ok(resp), Ok(held)) => (
                                pb::ModelStreamInferResponse {
                                    error_message: String::new(),
                                    infer_response: Some(resp),
                                },
                                held,
                            ),
                            (Err(e), _) | (Ok(_), Err(e)) => (failed(e), None),
                        };
                        send(&tx, &answers, (Ok(out), held)).await;
                        drop(permit);
                    },
                    span,
                ));
            }
        });
        Ok(Response::new(Box::pin(Answers { rx, answers: taking })))
    }

    async fn model_config(
        &self,
        r: Request<pb::ModelConfigRequest>,
    ) -> Result<Response<pb::ModelConfigResponse>, Status> {
        let r = r.into_inner();
        let config = ferrite_core::control::triton::resolved(&self.model(&r.name, &r.version)?.spec);
        Ok(Response::new(pb::ModelConfigResponse { config: Some(config) }))
    }

    async fn model_statistics(
        &self,
        r: Request<pb::ModelStatisticsRequest>,
    ) -> Result<Response<pb::ModelStatisticsResponse>, Status> {
        let r = r.into_inner();
        let models: Vec<Arc<Model>> =
            if r.name.is_empty() { self.core.models() } else { vec![self.model(&r.name, &r.version)?] };
        let model_stats =
            models.into_iter().map(|m| convert::statistics(&m.stats.snapshot(&m.spec.name, m.spec.version))).collect();
        Ok(Response::new(pb::ModelStatisticsResponse { model_stats }))
    }

    async fn repository_index(
        &self,
        r: Request<pb::RepositoryIndexRequest>,
    ) -> Result<Response<pb::RepositoryIndexResponse>, Status> {
        let ready_only = r.into_inner().ready;
        let models = self
            .core
            .index()
            .into_iter()
            .filter(|e| !ready_only || e.state == ferrite_core::control::registry::State::Ready)
            .map(|e| pb::repository_index_response::ModelIndex {
                name: e.name,
                version: e.version.map(|v| v.to_string()).unwrap_or_default(),
                state: e.state.as_str().into(),
                reason: e.reason,
            })
            .collect();
        Ok(Response::new(pb::RepositoryIndexResponse { models }))
    }

    async fn repository_model_load(
        &self,
        r: Request<pb::RepositoryModelLoadRequest>,
    ) -> Result<Response<pb::RepositoryModelLoadResponse>, Status> {
        let r = r.into_inner();
        let core = self.core.clone();
        run_blocking(move || core.load_model(&r.model_name, r.parameters.keys().map(String::as_str))).await?;
        Ok(Response::new(pb::RepositoryModelLoadResponse {}))
    }

    async fn repository_model_unload(
        &self,
        r: Request<pb::RepositoryModelUnloadRequest>,
    ) -> Result<Response<pb::RepositoryModelUnloadResponse>, Status> {
        let r = r.into_inner();
        let core = self.core.clone();
        run_blocking(move || core.unload_model(&r.model_name, r.parameters.keys().map(String::as_str))).await?;
        Ok(Response::new(pb::RepositoryModelUnloadResponse {}))
    }

    async fn system_shared_memory_status(
        &self,
        r: Request<pb::SystemSharedMemoryStatusRequest>,
    ) -> Result<Response<pb::SystemSharedMemoryStatusResponse>, Status> {
        let tenant = self.shm_tenant(&r)?;
        let regions = self.shm.status(tenant.as_deref(), &r.get_ref().name).map_err(status)?;
        let regions = regions
            .iter()
            .map(|g| {
                let region = pb::system_shared_memory_status_response::RegionStatus {
                    name: g.name.clone(),
                    key: g.key.clone(),
                    offset: g.offset,
                    byte_size: g.byte_size,
                };
                (g.name.clone(), region)
            })
            .collect();
        Ok(Response::new(pb::SystemSharedMemoryStatusResponse { regions }))
    }

    async fn system_shared_memory_register(
        &self,
        r: Request<pb::SystemSharedMemoryRegisterRequest>,
    ) -> Result<Response<pb::SystemSharedMemoryRegisterResponse>, Status> {
        let CallMeta { tenant, share, .. } = self.call_meta(r.metadata(), r.extensions())?;
        let g = r.into_inner();
        self.shm
            .register(tenant.as_deref(), share.as_deref(), &g.name, &g.key, g.offset, g.byte_size)
            .map_err(status)?;
        Ok(Response::new(pb::SystemSharedMemoryRegisterResponse {}))
    }

    async fn system_shared_memory_unregister(
        &self,
        r: Request<pb::SystemSharedMemoryUnregisterRequest>,
    ) -> Result<Response<pb::SystemSharedMemoryUnregisterResponse>, Status> {
        let tenant = self.shm_tenant(&r)?;
        self.shm.unregister(tenant.as_deref(), &r.get_ref().name);
        Ok(Response::new(pb::SystemSharedMemoryUnregisterResponse {}))
    }

    async fn cuda_shared_memory_status(
        &self,
        r: Request<pb::CudaSharedMemoryStatusRequest>,
    ) -> Result<Response<pb::CudaSharedMemoryStatusResponse>, Status> {
        let name = &r.get_ref().name;
        if !name.is_empty() {
            return Err(Status::not_found(format!("no CUDA shared memory region '{name}'")));
        }
        Ok(Response::new(pb::CudaSharedMemoryStatusResponse::default()))
    }

    async fn cuda_shared_memory_register(
        &self,
        _: Request<pb::CudaSharedMemoryRegisterRequest>,
    ) -> Result<Response<pb::CudaSharedMemoryRegisterResponse>, Status> {
        Err(Status::unimplemented("CUDA shared memory: this server has no GPU"))
    }

    async fn cuda_shared_memory_unregister(
        &self,
        _: Request<pb::CudaSharedMemoryUnregisterRequest>,
    ) -> Result<Response<pb::CudaSharedMemoryUnregisterResponse>, Status> {
        Ok(Response::new(pb::CudaSharedMemoryUnregisterResponse {}))
    }
}

/// Loads block while models load; off the async threads.
async fn run_blocking(f: impl FnOnce() -> Result<(), Error> + Send + 'static) -> Result<(), Status> {
    tokio::task::spawn_blocking(f).await.map_err(|e| Status::internal(e.to_string()))?.map_err(status)
}

/// How often HTTP/2 pings keep idle gRPC connections honest.
pub const KEEPALIVE: Duration = Duration::from_secs(60);

/// The largest HTTP/2 frame the gRPC listener accepts (HTTP/2's default is 16 KiB). A 1.2 MB image
/// then comes in 10 DATA frames instead of 75, its system calls about 165 → 40 a request; below the
/// 1 MiB mmap threshold, so a frame's buffer is reused heap. The flow-control windows, which bound
/// what a connection may send ahead, stay at their defaults.
pub const MAX_FRAME: u32 = 128 << 10;
