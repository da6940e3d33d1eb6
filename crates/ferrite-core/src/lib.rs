//! Ferrite's engine. Nothing here knows HTTP, gRPC or Python: the front-ends translate their
//! wire types into [`InferRequest`] (with the shared pieces in [`wire`]), call [`Core::infer`],
//! and map [`Error`] once each.
//!
//! The map, in the order a request meets the parts:
//!
//! | module | what it is |
//! |---|---|
//! | [`core`] | [`Core`], one per process: the path of a request (admission, routing, the model, the canary's record) |
//! | [`wire`] | what every front-end shares about the V2 protocol: request parameters, batch-dim shapes |
//! | [`admission`] | request and concurrency limits, per-tenant limits, refusing deadlines that cannot be met |
//! | [`cache`] | the response cache: keys, the in-process tier, and the trait a shared tier (Redis) implements |
//! | [`engine`] | one model's data plane: tensors, spec, backend trait and ONNX Runtime adapter, queue, batcher |
//! | [`control`] | the control plane: repository, configs (`config.toml` and Triton's `config.pbtxt`), the registry swapped on every change, lifecycle, canary |
//! | [`telemetry`] | Prometheus metrics and Triton-shaped statistics |
//! | [`pipeline`] | pipelines: native pre- and post-processing steps and calls to other models, served as a model |
//! | [`error`] | the one error enum every front-end maps |
//! | [`crash`] | crash reports: what a worker runs, written out by a fatal-signal handler |
//!
//! Layers depend one way: `engine` knows nothing of `control` but the version policy and warm-ups
//! it reports; `control` builds `engine` models; `core` ties them together. A change to batching touches
//! `engine` (and `admission` for its estimates) alone.

pub mod admission;
pub mod cache;
pub mod control;
pub mod core;
pub mod crash;
pub mod engine;
pub mod error;
pub mod pipeline;
pub mod telemetry;
pub mod wire;

pub use crate::core::{Core, ModelControl, Startup};
pub use admission::Limits;
pub use control::{canary::CanaryRoute, IndexEntry, LoadOptions, Registry, Repository};
pub use engine::{
    backend::Backend,
    dtype::DataType,
    model::{InferRequest, InferResponse, Model},
    tensor::{Tensor, TensorData},
};
pub use error::{Error, Result};
