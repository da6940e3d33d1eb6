//! Refusing at admission a request whose deadline cannot be met (Triton #7512): a moving average
//! of one batch's run time, and the lower bound on a new request's wait that it gives.

use std::{
    sync::atomic::{AtomicU64, Ordering},
    time::Duration,
};

/// A moving average of one batch's run time; zero until the first batch has run.
#[derive(Debug, Default)]
pub struct BatchTime {
    ns: AtomicU64,
}

impl BatchTime {
    /// Folds in one batch's run time (weight 1/8).
    pub fn record(&self, took: Duration) {
        let took = took.as_nanos() as u64;
        let avg = self.ns.load(Ordering::Relaxed);
        self.ns.store(if avg == 0 { took } else { (avg * 7 + took) / 8 }, Ordering::Relaxed);
    }

    /// A lower bound on how long a request queued now waits for its answer: `batches_ahead`
    /// shared among `instances`, plus its own batch. `None` before the first batch has run.
    pub fn wait(&self, batches_ahead: usize, instances: usize) -> Option<Duration> {
        let per_batch = self.ns.load(Ordering::Relaxed);
        if per_batch == 0 {
            return None;
        }
        let rounds = (batches_ahead / instances.max(1)) as u64 + 1;
        Some(Duration::from_nanos(per_batch.saturating_mul(rounds)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_wait_counts_rounds_of_batches_over_the_instances() {
        let t = BatchTime::default();
        assert_eq!(t.wait(10, 2), None, "no estimate before a batch ran");
        t.record(Duration::from_millis(8));
        assert_eq!(t.wait(0, 1), Some(Duration::from_millis(8)));
        assert_eq!(t.wait(4, 2), Some(Duration::from_millis(24)));
        t.record(Duration::from_millis(16));
        assert_eq!(t.wait(0, 1), Some(Duration::from_millis(9)));
    }
}
