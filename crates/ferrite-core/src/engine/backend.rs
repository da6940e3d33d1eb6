//! The small, synchronous contract every inference engine adapter fulfils.
//!
//! A `Backend` is a loaded model, shareable across threads; an `Instance` is the per-worker state
//! that runs batches (one ONNX Runtime session each). Nothing here is async: instances live on the
//! batcher's own OS threads.

use std::{
    sync::{
        atomic::{AtomicU64, AtomicUsize, Ordering},
        Arc, Mutex,
    },
    task::Wake,
    time::{Duration, Instant},
};

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

    /// What a request will cost, read from what its inputs declare before any work (a
    /// pipeline's: the pixels its images' headers declare, the bytes of text it reads), or an
    /// error when that is over a per-request budget. `None`: every request costs alike. A backend
    /// that tells costs gets one more instance, the batcher's reserve for light work.
    fn cost(&self) -> Option<Cost> {
        None
    }

    /// Whether its instances answer each request of a batch apart (`Instance::run_each`), as a
    /// Python model's `execute` does, rather than with outputs for the whole batch.
    fn answers_each(&self) -> bool {
        false
    }
}

/// A backend's estimate of a request's cost, in its own unit (see `Backend::cost`), and the
/// cost past which a request is heavy.
#[derive(Clone)]
pub struct Cost {
    pub of: std::sync::Arc<CostOf>,
    pub heavy: u64,
}

/// The cost of a request's inputs (validated, in model order), or why it is over budget.
pub type CostOf = dyn Fn(&[Tensor]) -> Result<u64> + Send + Sync;

/// Which request each row of a batch belongs to, and whether its client still waits: a backend
/// that works row by row (a pipeline) stops paying for the rows of a client that has left.
pub struct Live<'a> {
    /// Each request's first row, in batch order; empty: one request, always awaited.
    starts: Vec<usize>,
    /// Whether the client of request `i` (in batch order) still waits.
    awaited: &'a dyn Fn(usize) -> bool,
    ids: Vec<(&'a str, &'a str)>,
    /// Each request's share (`Pending::share`), in batch order; empty: none has one.
    shares: Vec<Option<Arc<str>>>,
    /// The model's submit count and its value when the batch was taken (see `alone`).
    quiet: Option<(&'a AtomicU64, u64)>,
    /// Told when every client of the batch has left (see `on_abandoned`).
    abandon: Option<&'a Abandon>,
}

/// A batch's clients, counted as they leave: each request's reply channel wakes it (on the thread
/// that drops the receiver) when its client goes, and once none waits, the run serving them is
/// stopped by what the backend asked (`Live::on_abandoned`).
pub struct Abandon {
    waiting: AtomicUsize,
    stop: Mutex<Option<Box<dyn FnOnce() + Send>>>,
}

impl Abandon {
    /// A batch of `requests` whose clients all wait.
    pub fn new(requests: usize) -> Abandon {
        Abandon { waiting: AtomicUsize::new(requests), stop: Mutex::new(None) }
    }

    /// One client left (once each).
    pub fn left(&self) {
        if self.waiting.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1)) == Ok(1) {
            let stop = self.stop.lock().unwrap_or_else(|e| e.into_inner()).take();
            if let Some(stop) = stop {
                stop();
            }
        }
    }

    fn on_abandoned(&self, stop: Box<dyn FnOnce() + Send>) {
        let mut slot = self.stop.lock().unwrap_or_else(|e| e.into_inner());
        if self.waiting.load(Ordering::Acquire) == 0 {
            drop(slot);
            stop();
        } else {
            *slot = Some(stop);
        }
    }
}

impl Wake for Abandon {
    fn wake(self: Arc<Self>) {
        self.left();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.left();
    }
}

impl<'a> Live<'a> {
    /// A batch of one request whose caller always waits (warm-ups, calibration, tests).
    pub fn everyone() -> Live<'static> {
        Live { starts: Vec::new(), awaited: &|_| true, ids: Vec::new(), shares: Vec::new(), quiet: None, abandon: None }
    }

    /// Requests of `rows` rows each, in batch order; `awaited(i)` tells whether request i's
    /// client still waits.
    pub fn new(rows: impl IntoIterator<Item = usize>, awaited: &'a dyn Fn(usize) -> bool) -> Live<'a> {
        let mut next = 0;
        let starts = rows
            .into_iter()
            .map(|n| {
                let first = next;
                next += n;
                first
            })
            .collect();
        Live { starts, awaited, ids: Vec::new(), shares: Vec::new(), quiet: None, abandon: None }
    }

    /// The index of the request row `row` belongs to.
    pub fn request_of(&self, row: usize) -> usize {
        self.starts.partition_point(|&first| first <= row).saturating_sub(1)
    }

    /// The requests' ids and parameters (in batch order), given to a backend that shows them to
    /// its code.
    pub fn with_ids(mut self, ids: Vec<(&'a str, &'a str)>) -> Live<'a> {
        self.ids = ids;
        self
    }

    /// The requests' shares (in batch order), for a backend whose work goes on through other
    /// models' queues (a pipeline's model steps), where the requests take their turns as theirs.
    pub fn with_shares(mut self, shares: Vec<Option<Arc<str>>>) -> Live<'a> {
        self.shares = shares;
        self
    }

    /// The share of the request row `row` belongs to.
    pub fn share(&self, row: usize) -> Option<&Arc<str>> {
        self.shares.get(self.request_of(row)).and_then(Option::as_ref)
    }

    /// The batch is a lone request that left its model's queue empty; `submitted` is the model's
    /// submit count, `seen` its value then.
    pub fn with_quiet(mut self, submitted: &'a AtomicU64, seen: u64) -> Live<'a> {
        self.quiet = Some((submitted, seen));
        self
    }

    /// The batch's clients, counted as they leave (none for a batch with no client to leave).
    pub fn with_abandon(mut self, abandon: &'a Abandon) -> Live<'a> {
        self.abandon = Some(abandon);
        self
    }

    /// Whether the batch's clients can all leave while it runs (see `on_abandoned`).
    pub fn abandonable(&self) -> bool {
        self.abandon.is_some()
    }

    /// Has `stop` called once every client of the batch has left, at once if all have (from
    /// the thread that sees the last one go): a backend that can end a run part-way (ONNX
    /// Runtime's terminate flag) stops paying for a batch nobody awaits. Never called for a
    /// batch that is not `abandonable`.
    pub fn on_abandoned(&self, stop: impl FnOnce() + Send + 'static) {
        if let Some(abandon) = self.abandon {
            abandon.on_abandoned(Box::new(stop));
        }
    }

    /// Whether this batch's caller is alone: a lone request taken from a queue it left empty, and
    /// no request has come for the model since. A backend waiting on another process may then
    /// poll for the answer rather than sleep: no one else needs the core, and a wake-up costs as
    /// much as a quick model's whole run.
    pub fn alone(&self) -> bool {
        self.quiet.is_some_and(|(submitted, seen)| submitted.load(Ordering::Acquire) == seen)
    }

    /// Request `i`'s id ("" when it has none).
    pub fn id(&self, i: usize) -> &str {
        self.ids.get(i).map_or("", |r| r.0)
    }

    /// Request `i`'s parameters as a JSON object ("{}" when it has none).
    pub fn parameters(&self, i: usize) -> &str {
        self.ids.get(i).map_or("{}", |r| r.1)
    }

    /// Whether the client of request `i` (in batch order) still waits.
    pub fn request_awaited(&self, i: usize) -> bool {
        self.starts.is_empty() || (self.awaited)(i)
    }

    /// Whether the client of row `row` still waits for it.
    pub fn awaited(&self, row: usize) -> bool {
        self.starts.is_empty() || (self.awaited)(self.request_of(row))
    }
}

pub trait Instance: Send {
    /// Runs one batch; `inputs` are in the order of `Backend::inputs`. Returns every output.
    fn run(&mut self, inputs: &[BatchInput<'_>]) -> Result<Vec<Tensor>>;

    /// As `run`, told which rows are still awaited; a backend that can stop part-way (a
    /// pipeline, between steps and rows) skips the rest of a row whose client left. Its outputs for
    /// such rows are of the right shape but carry no meaning.
    fn run_live(&mut self, inputs: &[BatchInput<'_>], live: &Live<'_>) -> Result<Vec<Tensor>> {
        let _ = live;
        self.run(inputs)
    }

    /// For a backend that `answers_each`: runs the batch and gives each request (in batch order)
    /// its outputs, any of those `Backend::outputs` names, or an error of its own. An `Err` is a
    /// failed run, as `run`'s: its requests are run again apart (in halves), so that one
    /// client's request cannot fail another's.
    fn run_each(&mut self, inputs: &[BatchInput<'_>], live: &Live<'_>) -> Result<Vec<Result<Vec<Tensor>>>> {
        let _ = (inputs, live);
        Err(crate::Error::internal("this backend answers batches as a whole"))
    }

    /// Asks that what the next run grows the engine's memory by be given back right after it
    /// (`give_back_due` says so): it is larger than the model's batches usually are (one
    /// exploring the limit), and an arena left grown to it would hold that memory.
    fn shrink_after_next(&mut self) {}

    /// When this instance should give back engine memory that a burst grew and no run has needed
    /// since, or that `shrink_after_next` asked for (by `give_back`); `None`: it holds none worth
    /// that.
    fn give_back_due(&self) -> Option<Instant> {
        None
    }

    /// Gives back what `give_back_due` named; called between batches, never beside a run.
    fn give_back(&mut self) {}

    /// How long the last `run` spent writing its inputs into the engine's own buffers (Triton's
    /// `compute_input`); the rest of the run counts as inference.
    fn input_time(&self) -> Duration {
        Duration::ZERO
    }

    /// Whether a run does all its work on the calling thread (a one-thread ONNX Runtime session):
    /// its cost is then that thread's CPU time, which threads sharing its core (the server's I/O,
    /// on a one-core host) do not stretch as they stretch its wall time.
    fn runs_on_caller(&self) -> bool {
        false
    }

    /// After a `run`: the rows of the batch that failed on their own, each with its error, where
    /// the backend can tell (a pipeline's per-row steps). The batcher fails the requests those
    /// rows belong to; after a run that succeeded it answers the others from it (their rows went
    /// on without the failed ones; the failed rows' outputs are filler), after a failed run it
    /// runs them again. Empty: no row failed on its own.
    fn failed_rows(&mut self) -> Vec<(usize, crate::Error)> {
        Vec::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_caller_is_alone_until_another_request_comes() {
        let submitted = AtomicU64::new(7);
        let awaited = |_: usize| true;
        assert!(!Live::new([1], &awaited).alone(), "a batch taken with others waiting is never alone");
        let live = Live::new([1], &awaited).with_quiet(&submitted, 7);
        assert!(live.alone());
        submitted.fetch_add(1, Ordering::Release);
        assert!(!live.alone());
        assert!(!Live::everyone().alone());
    }
}
