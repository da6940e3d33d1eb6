//! What the engine reports about itself: Prometheus metrics for the process, and per-model
//! statistics in the shape of Triton's statistics extension, and the replica count its load calls
//! for; and the warnings requests cause, kept to a line a second.

pub mod metrics;
pub mod quiet;
pub mod scale;
pub mod stats;
