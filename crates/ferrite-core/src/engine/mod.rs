//! The data plane of one model: the resolved spec a model runs with,
//! the backend contract and its ONNX Runtime adapter, the checks a request passes, the queue that
//! forms batches and the batcher whose own threads run them.

pub mod backend;
pub mod batcher;
pub mod classify;
pub mod costs;
pub mod model;
pub mod onnx;
pub mod python;
pub mod queue;
pub mod spec;
pub mod tuning;
