//! Refusing at admission a request whose deadline cannot be met (Triton #7512): a moving average
//! of one batch's run time, and the lower bound on a new request's wait that it gives. The estimate
//! can never lock a model out: only batches of real traffic feed it (not warm-ups), it goes stale
//! when nothing has run for a while, and the batcher admits any request with nothing queued ahead
//! of it, so fresh measurements always come.

use std::{
    sync::{
        atomic::{AtomicU64, Ordering},
        OnceLock,
    },
    time::{Duration, Instant},
};

/// An estimate older than this is not used: the model may have changed pace since (a few large
/// batches, then small ones).
pub const STALE_AFTER: Duration = Duration::from_secs(2);

fn since_start(now: Instant) -> u64 {
    static START: OnceLock<Instant> = OnceLock::new();
    now.saturating_duration_since(*START.get_or_init(Instant::now)).as_nanos() as u64
}

/// A moving average of one batch's run time; zero until the first batch has run.
#[derive(Debug, Default)]
pub struct BatchTime {
    ns: AtomicU64,
    /// When the last batch was recorded (ns since the process's first estimate).
    at: AtomicU64,
}

impl BatchTime {
    /// Folds in one batch's run time (weight 1/8).
    pub fn record(&self, took: Duration) {
        self.record_at(took, Instant::now());
    }

    fn record_at(&self, took: Duration, now: Instant) {
        let took = took.as_nanos() as u64;
        let avg = self.ns.load(Ordering::Relaxed);
        self.ns.store(if avg == 0 { took } else { (avg * 7 + took) / 8 }, Ordering::Relaxed);
        self.at.store(since_start(now), Ordering::Relaxed);
    }

    /// A lower bound on how long a request queued now waits for its answer: `batches_ahead`
    /// shared among `instances`, plus its own batch. `None` before the first batch has run, and
    /// when no batch has run for `STALE_AFTER`.
    pub fn wait(&self, batches_ahead: usize, instances: usize) -> Option<Duration> {
        self.wait_at(batches_ahead, instances, Instant::now())
    }

    fn wait_at(&self, batches_ahead: usize, instances: usize, now: Instant) -> Option<Duration> {
        let per_batch = self.ns.load(Ordering::Relaxed);
        let age = since_start(now).saturating_sub(self.at.load(Ordering::Relaxed));
        if per_batch == 0 || age > STALE_AFTER.as_nanos() as u64 {
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

    #[test]
    fn an_estimate_nothing_has_refreshed_goes_stale() {
        let t = BatchTime::default();
        let now = Instant::now();
        t.record_at(Duration::from_millis(65), now);
        assert!(t.wait_at(0, 1, now + Duration::from_millis(100)).is_some());
        assert_eq!(t.wait_at(0, 1, now + STALE_AFTER + Duration::from_millis(1)), None);
    }
}
