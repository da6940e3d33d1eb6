//! What the engine reports about itself: Prometheus metrics for the process, and per-model
//! statistics in the shape of Triton's statistics extension.

pub mod metrics;
pub mod stats;
