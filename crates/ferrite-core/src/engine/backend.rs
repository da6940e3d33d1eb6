//! The small, synchronous contract every inference engine adapter fulfils.
//!
//! A `Backend` is a loaded model, shareable across threads; an `Instance` is the per-worker state
//! that runs batches (one ONNX Runtime session each). Nothing here is async: instances live on the
//! batcher's own OS threads.

use std::time::Duration;

use crate::{engine::spec::TensorSpec, DataType, Result, Tensor, TensorData};

/// One model input for one run: the concatenation along dim 0 of `parts` (one per request), with
/// `shape` the shape of the whole. A single part is the common case and is not copied twice.
#[derive(Debug)]
pub struct BatchInput<'a> {
    pub name: &'a str,
    pub datatype: DataType,
    pub shape: Vec<usize>,
    pub parts: Vec<&'a TensorData>,
}

pub trait Backend: Send + Sync {
    /// Inputs as the model file declares them (full shapes, -1 for variable dims), in model order.
    fn inputs(&self) -> &[TensorSpec];
    /// Outputs likewise; `Instance::run` returns them in this order.
    fn outputs(&self) -> &[TensorSpec];
    /// A new per-worker runner.
    fn instance(&self) -> Result<Box<dyn Instance>>;
}

pub trait Instance: Send {
    /// Runs one batch; `inputs` are in the order of `Backend::inputs`. Returns every output.
    fn run(&mut self, inputs: &[BatchInput<'_>]) -> Result<Vec<Tensor>>;

    /// How long the last `run` spent writing its inputs into the engine's own buffers (Triton's
    /// `compute_input`); the rest of the run counts as inference.
    fn input_time(&self) -> Duration {
        Duration::ZERO
    }

    /// After a failed `run`: the rows of the batch that failed on their own, each with its error,
    /// where the backend can tell (a pipeline's per-row steps). The batcher then fails the
    /// requests those rows belong to and runs the others again. Empty: the batch failed as a whole.
    fn failed_rows(&mut self) -> Vec<(usize, crate::Error)> {
        Vec::new()
    }
}
