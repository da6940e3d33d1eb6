//! Ferrite's engine. Nothing here knows HTTP, gRPC or Python: the front-ends translate their
//! wire types into [`InferRequest`] (with the shared pieces in [`wire`]), call [`Core::infer`],
//! and map [`Error`] once each.
//!
//! The map, as layers: each module imports only those in the rows above it (and `error`, `data`
//! and `wire`, the ground floor), never one below; `tests/layers.rs` fails on any import cycle.
//!
//! | layer | module | what it is |
//! |---|---|---|
//! | ground | [`error`] | the one error enum every front-end maps |
//! | ground | [`data`] | datatypes (each element type's conversions once, in [`Element`], reached from a [`DataType`] by [`dispatch!`]), tensors, the request and response types the front-ends hand the core |
//! | ground | [`wire`] | what every front-end shares about the V2 protocol: request parameters, header checks, `Retry-After` |
//! | ground | [`crash`] | crash reports: what a worker runs, written out by a fatal-signal handler |
//! | ground | [`telemetry`] | Prometheus metrics and Triton-shaped statistics |
//! | admission | [`admission`] | request and concurrency limits, per-tenant limits |
//! | cache | [`cache`] | the response cache: keys, the in-process tier, and the trait a shared tier (Redis) implements |
//! | engine | [`engine`] | one model's data plane: spec, backend trait and ONNX Runtime adapter, queue, batcher, its measured costs and deadline estimate |
//! | pipeline | [`pipeline`] | native pre- and post-processing steps and calls to other models, served as a model (it finds those through its `Models` trait) |
//! | control | [`control`] | the control plane: repository, configs (`config.toml` and Triton's `config.pbtxt`), the registry swapped on every change, lifecycle, canary |
//! | core | [`core`] | [`Core`], one per process: the path of a request (routing once to a [`Route`], admission, the model, the canary's record) and the control plane's operations |
//! | services | [`texts`] | text models as OpenAI's, TEI's and Cohere's APIs call them (embed, rerank, classify, tokenize), over `Core` |
//!
//! A change to batching touches `engine` alone; the control plane builds models, never the reverse.

pub mod admission;
pub mod cache;
pub mod control;
pub mod core;
pub mod crash;
pub mod data;
pub mod engine;
pub mod error;
pub mod pipeline;
pub mod telemetry;
pub mod texts;
pub mod wire;

pub use crate::core::{Core, ModelControl, Route, Startup};
pub use admission::Limits;
pub use control::{IndexEntry, LoadOptions, Registry, Repository};
pub use data::{
    dtype::{DataType, Element, Number},
    request::{Caller, CanaryRoute, InferRequest, InferResponse},
    tensor::{Tensor, TensorData},
};
pub use engine::{backend::Backend, model::Model};
pub use error::{Error, Result};
/// For [`dispatch!`]'s half-precision types.
pub use half;
