//! What batches cost while serving, kept by the batcher from the batches it runs, as two moving
//! averages (weight 1/8 each):
//! - [`BatchCosts`]: the run time per input element for each range of batch sizes (1, 2, 3-4,
//!   5-8, ... rows). From it follows the merge limit: the batcher never forms a batch that its own
//!   measurements say costs more per element than a smaller one. Per element rather than per row,
//!   so requests of different sizes (a detector's variable H/W) can be compared.
//! - [`BatchTime`]: one batch's run time, lock-free, read at admission to refuse a request whose
//!   deadline cannot be met (Triton #7512). It can never lock a model out: only batches of real
//!   traffic feed it (not warm-ups), it goes stale when nothing has run for a while, and the
//!   batcher admits any request with nothing queued ahead of it, so fresh measurements come.
//!
//! Pure: the caller passes every measurement, so the rules are testable on made-up costs.

use std::{
    sync::{
        atomic::{AtomicU64, Ordering},
        OnceLock,
    },
    time::{Duration, Instant},
};

/// A moving average with weight 1/8 for the new sample; the sample itself when there is none yet.
fn average(avg: f64, sample: f64, seen: bool) -> f64 {
    if seen {
        avg + (sample - avg) / 8.0
    } else {
        sample
    }
}

/// Buckets of batch sizes: bucket i holds sizes in (2^(i-1), 2^i], so 1, 2, 3-4, 5-8, ...
const BUCKETS: usize = 16;
/// Runs a bucket needs before its average is trusted.
const MIN_SAMPLES: u32 = 4;
/// A larger batch is allowed while it costs at most this much more per element than the best
/// smaller one; run-time noise under load is larger than at calibration.
const TOLERANCE: f64 = 0.10;
/// One batch in this many is formed ignoring the measured limit, so sizes above it are measured
/// again and a limit lowered by a passing disturbance can rise back; and one in this many (half
/// way between) at half the limit, so a smaller size that serves faster is found even when load
/// keeps every batch full (a detector calibrated on smaller images than it is served).
pub const EXPLORE_EVERY: u64 = 32;

/// Which batch size the next batch may reach (see [`EXPLORE_EVERY`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Explore {
    /// The limit the measurements allow.
    No,
    /// The configured limit, whatever was measured.
    Up,
    /// Half the limit the measurements allow.
    Down,
}

impl Explore {
    /// The batcher's choice for the `n`th batch formed.
    pub fn nth(n: u64) -> Explore {
        match n % EXPLORE_EVERY {
            0 => Explore::Up,
            r if r == EXPLORE_EVERY / 2 => Explore::Down,
            _ => Explore::No,
        }
    }
}

#[derive(Debug, Default, Clone)]
pub struct BatchCosts {
    /// (moving average of ns per element, runs seen), by bucket.
    buckets: [(f64, u32); BUCKETS],
}

fn bucket(rows: usize) -> usize {
    (usize::BITS - rows.max(1).saturating_sub(1).leading_zeros()) as usize
}

impl BatchCosts {
    /// Records one run of `rows` rows holding `elements` input elements that took `took`.
    pub fn record(&mut self, rows: usize, elements: usize, took: Duration) {
        let Some(b) = self.buckets.get_mut(bucket(rows)) else { return };
        let cost = took.as_nanos() as f64 / elements.max(1) as f64;
        b.0 = average(b.0, cost, b.1 > 0);
        b.1 = b.1.saturating_add(1);
    }

    /// The most rows a batch may merge, at most `configured`: below the first measured bucket
    /// that costs more per element than the best smaller one (beyond the tolerance); `configured`
    /// itself, or half the measured limit, when exploring.
    pub fn limit(&self, configured: usize, explore: Explore) -> usize {
        match explore {
            Explore::No => self.measured(configured),
            Explore::Up => configured,
            Explore::Down => (self.measured(configured) / 2).max(1),
        }
    }

    fn measured(&self, configured: usize) -> usize {
        let mut best = f64::INFINITY;
        for (i, &(cost, n)) in self.buckets.iter().enumerate() {
            if n < MIN_SAMPLES {
                continue;
            }
            if cost > best * (1.0 + TOLERANCE) {
                // Bucket i starts just above 2^(i-1) rows: stay at or below that.
                return configured.min(1 << (i - 1));
            }
            best = best.min(cost);
        }
        configured
    }
}

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
        let avg = self.ns.load(Ordering::Relaxed);
        self.ns.store(average(avg as f64, took.as_nanos() as f64, avg > 0) as u64, Ordering::Relaxed);
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

    fn us(v: f64) -> Duration {
        Duration::from_secs_f64(v / 1e6)
    }

    #[test]
    fn buckets_are_powers_of_two() {
        let got: Vec<usize> = [1, 2, 3, 4, 5, 8, 9, 64, 65].iter().map(|&r| bucket(r)).collect();
        assert_eq!(got, vec![0, 1, 2, 2, 3, 3, 4, 6, 7]);
    }

    #[test]
    fn nothing_measured_leaves_the_configured_limit() {
        assert_eq!(BatchCosts::default().limit(64, Explore::No), 64);
    }

    #[test]
    fn a_conv_net_slower_per_image_in_pairs_is_held_to_single_runs() {
        let mut c = BatchCosts::default();
        for _ in 0..8 {
            c.record(1, 150_528, us(17_000.0));
            c.record(2, 301_056, us(42_000.0));
        }
        assert_eq!(c.limit(64, Explore::No), 1);
    }

    #[test]
    fn an_mlp_cheaper_per_row_in_batches_keeps_merging() {
        let mut c = BatchCosts::default();
        for rows in [1usize, 2, 4, 8, 16, 32, 64] {
            for _ in 0..8 {
                c.record(rows, rows * 512, us(400.0 + 20.0 * rows as f64));
            }
        }
        assert_eq!(c.limit(64, Explore::No), 64);
    }

    #[test]
    fn costs_per_element_compare_requests_of_different_sizes() {
        // A detector: 640x640 images cost 4x a 320x320 one, per element the same: no penalty.
        let mut c = BatchCosts::default();
        for _ in 0..8 {
            c.record(1, 3 * 320 * 320, us(25_000.0));
            c.record(2, 2 * 3 * 640 * 640, us(200_000.0));
        }
        assert_eq!(c.limit(8, Explore::No), 8);
    }

    #[test]
    fn the_limit_is_explored_again_now_and_then() {
        let mut c = BatchCosts::default();
        for _ in 0..8 {
            c.record(1, 1, us(10.0));
            c.record(4, 4, us(80.0));
        }
        assert_eq!(c.limit(16, Explore::No), 2);
        assert_eq!(c.limit(16, Explore::Up), 16);
        assert_eq!(c.limit(16, Explore::Down), 1);
        assert_eq!([0, 1, 16, 32].map(Explore::nth), [Explore::Up, Explore::No, Explore::Down, Explore::Up]);
    }

    #[test]
    fn a_detector_served_larger_than_calibrated_finds_its_smaller_batch_by_exploring_down() {
        // Calibrated at 224x224 to a limit of 8; at 320x320 a batch of 8 costs 20% more per image
        // than one of 4, and the load keeps every batch at 8 rows: only the batches formed at half
        // the limit measure 4.
        let per_image = 3 * 320 * 320;
        let mut c = BatchCosts::default();
        for _ in 0..8 {
            c.record(8, 8 * per_image, us(8.0 * 11_500.0));
        }
        assert_eq!(c.limit(8, Explore::No), 8, "nothing smaller measured yet");
        assert_eq!(c.limit(8, Explore::Down), 4);
        for _ in 0..MIN_SAMPLES {
            c.record(4, 4 * per_image, us(4.0 * 9_500.0));
        }
        assert_eq!(c.limit(8, Explore::No), 4);
        // An MLP whose batches of 64 stay cheapest loses nothing but the explored batch.
        let mut m = BatchCosts::default();
        for _ in 0..8 {
            m.record(64, 64 * 512, us(5_000.0));
            m.record(32, 32 * 512, us(2_600.0));
        }
        assert_eq!(m.limit(64, Explore::No), 64);
    }

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
