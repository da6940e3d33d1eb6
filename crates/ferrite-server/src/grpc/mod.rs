//! KServe V2 / Open Inference Protocol over gRPC (`inference.GRPCInferenceService`).
//!
//! A thin translation: protobuf messages to core requests and back, and the core's errors mapped
//! once to gRPC codes. Validation, limits and batching are the core's, as for HTTP.

pub mod convert;

use std::{pin::Pin, sync::Arc, time::Duration};

use ferrite_core::{Core, Error, Model};
use tokio::sync::{mpsc, Semaphore};
use tokio_stream::{wrappers::ReceiverStream, Stream};
use tonic::{metadata::MetadataMap, Request, Response, Status, Streaming};

use crate::telemetry;

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

#[derive(Clone)]
pub struct Service {
    core: Core,
}

/// The inference service, with its message size limits.
pub fn service(core: Core, limits: &GrpcLimits) -> GrpcInferenceServiceServer<Service> {
    GrpcInferenceServiceServer::new(Service { core })
        .max_decoding_message_size(limits.max_decoding_message_size)
        .max_encoding_message_size(limits.max_encoding_message_size)
}

/// Checks the `authorization` metadata of every call against `scope` (when auth is on).
pub fn interceptor(
    auth: Option<Arc<crate::auth::Auth>>,
    scope: crate::auth::Scope,
) -> impl FnMut(Request<()>) -> Result<Request<()>, Status> + Clone {
    move |req: Request<()>| {
        let Some(auth) = &auth else { return Ok(req) };
        let header = req.metadata().get("authorization").and_then(|v| v.to_str().ok());
        match auth.check(header, scope) {
            Ok(()) => Ok(req),
            Err(crate::auth::Denied::Unauthenticated) => {
                Err(Status::unauthenticated("a valid bearer token is required"))
            }
            Err(crate::auth::Denied::Forbidden) => {
                Err(Status::permission_denied("the token lacks the scope this call needs"))
            }
        }
    }
}

/// The one mapping from core errors to gRPC status codes.
pub fn status(e: Error) -> Status {
    match &e {
        Error::InvalidInput(m) => Status::invalid_argument(m),
        Error::NotFound(m) => Status::not_found(m),
        Error::Unavailable { message, .. } => Status::unavailable(message),
        Error::Overloaded { message, .. } => Status::resource_exhausted(message),
        Error::DeadlineExceeded(m) => Status::deadline_exceeded(m),
        Error::Unsupported(m) => Status::unimplemented(m),
        Error::Internal(m) => Status::internal(m),
    }
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
    fn model(&self, name: &str, version: &str) -> Result<&Arc<Model>, Status> {
        self.core.model(name, Some(version)).map_err(status)
    }

    /// The tenant a call names in its `--tenant-header` metadata, when tenants are configured.
    fn tenant(&self, metadata: &tonic::metadata::MetadataMap) -> Option<String> {
        let key = &self.core.tenants()?.header;
        metadata.get(key.as_str()).and_then(|v| v.to_str().ok()).map(str::to_string)
    }

    /// One inference, shared by the unary and streaming calls.
    async fn infer(
        &self,
        req: pb::ModelInferRequest,
        deadline_us: Option<u64>,
        tenant: Option<String>,
    ) -> Result<pb::ModelInferResponse, Error> {
        let final_flag = convert::wants_final_response(&req);
        let mut core_req = convert::to_core(req, self.core.limits().max_elements)?;
        core_req.tenant = tenant;
        if let Some(d) = deadline_us {
            core_req.timeout_us = Some(core_req.timeout_us.filter(|&t| t > 0 && t < d).unwrap_or(d));
        }
        let resp = self.core.infer(core_req).await?;
        Ok(convert::from_core(resp, final_flag))
    }
}

type InferStream = Pin<Box<dyn Stream<Item = Result<pb::ModelStreamInferResponse, Status>> + Send>>;

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
            version: env!("CARGO_PKG_VERSION").into(),
            extensions: ["model_configuration", "statistics", "binary_tensor_data"].map(String::from).to_vec(),
        }))
    }

    async fn model_metadata(
        &self,
        r: Request<pb::ModelMetadataRequest>,
    ) -> Result<Response<pb::ModelMetadataResponse>, Status> {
        let r = r.into_inner();
        Ok(Response::new(convert::metadata(self.model(&r.name, &r.version)?)))
    }

    async fn model_infer(&self, r: Request<pb::ModelInferRequest>) -> Result<Response<pb::ModelInferResponse>, Status> {
        use tracing::Instrument;
        let deadline = grpc_timeout_us(r.metadata());
        let parent = telemetry::extract(&telemetry::Metadata(r.metadata()));
        let tenant = self.tenant(r.metadata());
        let req = r.into_inner();
        let span = telemetry::request_span("grpc", &req.model_name, parent);
        // If the client cancels, this future is dropped and the queued request is skipped.
        self.infer(req, deadline, tenant).instrument(span).await.map(Response::new).map_err(status)
    }

    type ModelStreamInferStream = InferStream;

    async fn model_stream_infer(
        &self,
        r: Request<Streaming<pb::ModelInferRequest>>,
    ) -> Result<Response<InferStream>, Status> {
        let parent = telemetry::extract(&telemetry::Metadata(r.metadata()));
        let tenant = self.tenant(r.metadata());
        let mut incoming = r.into_inner();
        let (tx, rx) = mpsc::channel(STREAM_IN_FLIGHT);
        let permits = Arc::new(Semaphore::new(STREAM_IN_FLIGHT));
        let svc = self.clone();
        tokio::spawn(async move {
            loop {
                let Ok(permit) = permits.clone().acquire_owned().await else { break };
                let msg = match incoming.message().await {
                    Ok(Some(m)) => m,
                    Ok(None) => break,
                    Err(e) => {
                        let _ = tx.send(Err(e)).await;
                        break;
                    }
                };
                let (tx, svc, tenant) = (tx.clone(), svc.clone(), tenant.clone());
                let span = telemetry::request_span("grpc-stream", &msg.model_name, parent.clone());
                tokio::spawn(tracing::Instrument::instrument(
                    async move {
                        let (id, model_name) = (msg.id.clone(), msg.model_name.clone());
                        // One bad request answers with an error message; the stream goes on.
                        let out = tokio::select! {
                            r = svc.infer(msg, None, tenant) => match r {
                                Ok(resp) => pb::ModelStreamInferResponse { error_message: String::new(), infer_response: Some(resp) },
                                Err(e) => pb::ModelStreamInferResponse {
                                    error_message: e.to_string(),
                                    infer_response: Some(pb::ModelInferResponse { id, model_name, ..Default::default() }),
                                },
                            },
                            // The client went away: dropping the request frees its queue slot.
                            _ = tx.closed() => return,
                        };
                        let _ = tx.send(Ok(out)).await;
                        drop(permit);
                    },
                    span,
                ));
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn model_config(
        &self,
        r: Request<pb::ModelConfigRequest>,
    ) -> Result<Response<pb::ModelConfigResponse>, Status> {
        let r = r.into_inner();
        let config = convert::config(self.model(&r.name, &r.version)?);
        Ok(Response::new(pb::ModelConfigResponse { config: Some(config) }))
    }

    async fn model_statistics(
        &self,
        r: Request<pb::ModelStatisticsRequest>,
    ) -> Result<Response<pb::ModelStatisticsResponse>, Status> {
        let r = r.into_inner();
        let models: Vec<&Arc<Model>> =
            if r.name.is_empty() { self.core.models().collect() } else { vec![self.model(&r.name, &r.version)?] };
        let model_stats =
            models.into_iter().map(|m| convert::statistics(&m.stats.snapshot(&m.spec.name, m.spec.version))).collect();
        Ok(Response::new(pb::ModelStatisticsResponse { model_stats }))
    }
}

/// How often HTTP/2 pings keep idle gRPC connections honest.
pub const KEEPALIVE: Duration = Duration::from_secs(60);
