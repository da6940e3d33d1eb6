//! What batches cost while serving, kept by the batcher from the batches it runs, as two moving
//! averages (weight 1/8 each):
//! - [`BatchCosts`]: the run time per input element for each range of batch sizes (1, 2, 3-4,
//!   5-8, ... rows), for each size class of rows (a detector's 224x224 images apart from its
//!   640x640 ones). From it follows the merge limit for the sizes actually served: the batcher
//!   never forms a batch that its own measurements say costs more per element than a smaller one
//!   of the same class, and learns each class's curve down from the limit it starts at
//!   ([`Bounds`]: calibration's, scaled to the class's rows), never above it.
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
/// A batch is held for more rows only when one merged run saves at least this share of itself
/// (`BatchCosts::hold`): a held batch leaves its instance idle, and on several instances maybe a
/// core. Under 128 clients on two cores the MLP's batches of about 30, merged, saved a tenth, and
/// holding them cost 8% of its requests; a group of 8 split in two saves 40-80%.
const HOLD_GAIN: f64 = 0.25;
/// One batch in this many is formed at twice the measured limit (at most the one it starts at), so
/// the size that holds the limit down is measured again and a limit lowered by a passing
/// disturbance rises back, a step at a time; and one in this many (half way between) at half the
/// limit, so a smaller size that serves faster is found even when load keeps every batch full (a
/// detector calibrated on smaller images than it is served).
pub const EXPLORE_EVERY: u64 = 32;

/// Which batch size the next batch may reach (see [`EXPLORE_EVERY`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Explore {
    /// The limit the measurements allow.
    No,
    /// Twice that, at most the limit it starts at: the sizes whose cost set the limit.
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

/// Where the merge limit of each size class of rows starts, and its most.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bounds {
    /// The limit calibration chose (or the config's), for rows of `at` input elements.
    pub start: usize,
    /// The row size `start` was measured at; 0: it holds for rows of every size.
    pub at: usize,
    /// The configured most rows a batch may take.
    pub max: usize,
}

impl Bounds {
    /// The limit of rows of `row_elements`: `start` scaled to hold as many input elements a
    /// batch as calibration measured (a batch that size costs about what calibration measured,
    /// whatever its rows' size), at least 1, at most `max`. A variable-size model is calibrated at
    /// one size (sequences of 224, say, where a BERT-style encoder chose 2 rows): its sentences
    /// of 14 tokens get 32, not 2 (held to 2, the text pipeline's encoder ran each worker's few
    /// rows apart, and idled a third of the time at 32 clients); a detector calibrated at 224x224
    /// serves 640x640 images at an eighth of calibration's limit.
    pub fn start(&self, row_elements: usize) -> usize {
        let start = match self.at {
            0 => self.start,
            at => (self.start.saturating_mul(at) / row_elements.max(1)).max(1),
        };
        start.min(self.max).max(1)
    }
}

/// Run time per input element by batch-size bucket, for requests of one size class.
#[derive(Debug, Default, Clone)]
struct Curve {
    /// (moving average of ns per element, runs seen), by bucket.
    buckets: [(f64, u32); BUCKETS],
}

fn bucket(rows: usize) -> usize {
    (usize::BITS - rows.max(1).saturating_sub(1).leading_zeros()) as usize
}

/// Requests are told apart by their rows' size, in half-octaves of input elements per row (a
/// detector's 224x224 and 320x320 images fall in different classes, 320x320 and 320x352 in one):
/// what batch size serves best depends on it (a conv net that gains from batches of small images
/// loses from batches of large ones). At most `2 x usize::BITS` classes exist, so the table is
/// bounded whatever sizes clients send.
fn size_class(row_elements: usize) -> u8 {
    let e = row_elements.max(1);
    let octave = usize::BITS - 1 - e.leading_zeros();
    // The upper half of the octave: at or above 1.5 x 2^octave.
    let upper = octave > 0 && (e >> (octave - 1)) & 1 == 1;
    (2 * octave + upper as u32) as u8
}

impl Curve {
    /// The limit, at most `start`: below the first measured bucket that costs more per element
    /// than the best smaller one (beyond [`TOLERANCE`]).
    fn measured(&self, start: usize) -> usize {
        let mut best = f64::INFINITY;
        for (i, &(cost, n)) in self.buckets.iter().enumerate() {
            if n < MIN_SAMPLES {
                continue;
            }
            if cost > best * (1.0 + TOLERANCE) {
                // Bucket i starts just above 2^(i-1) rows: stay at or below that.
                return start.min(1 << (i - 1));
            }
            best = best.min(cost);
        }
        start
    }

    /// The next smaller size to learn, if any: half the smallest size measured (at or below
    /// `limit`), while that smallest size still serves within the tolerance of the best. Batches
    /// start at the limit (calibration's, measured on other sizes than those served, or the
    /// config's) and step down a few batches a step until smaller ones cost clearly more per
    /// element: a conv net served larger than it was calibrated finds its smaller batch within
    /// tens of batches, not by the occasional exploring one; an MLP stops after a step or two.
    fn unlearned(&self, limit: usize) -> Option<usize> {
        let top = bucket(limit).min(BUCKETS - 1);
        let measured = || self.buckets[..=top].iter().enumerate().filter(|(_, b)| b.1 >= MIN_SAMPLES);
        let (smallest, &(cost, _)) = measured().next()?;
        let best = measured().map(|(_, b)| b.0).fold(f64::INFINITY, f64::min);
        (smallest > 0 && cost <= best * (1.0 + TOLERANCE)).then(|| 1 << (smallest - 1))
    }

    /// Run time per element of a batch of `rows`: its bucket's, or where that is not measured
    /// yet, the nearest larger measured bucket's (per element, smaller batches seldom cost less).
    fn per_element(&self, rows: usize) -> Option<f64> {
        self.buckets.get(bucket(rows)..)?.iter().find(|b| b.1 >= MIN_SAMPLES).map(|b| b.0)
    }
}

/// What batches cost, by size class of their rows (see [`size_class`]).
#[derive(Debug, Default, Clone)]
pub struct BatchCosts {
    curves: std::collections::BTreeMap<u8, Curve>,
}

impl BatchCosts {
    /// Records one run of `rows` rows holding `elements` input elements that took `took`.
    pub fn record(&mut self, rows: usize, elements: usize, took: Duration) {
        let class = size_class(elements / rows.max(1));
        let curve = self.curves.entry(class).or_default();
        let Some(b) = curve.buckets.get_mut(bucket(rows)) else { return };
        let cost = took.as_nanos() as f64 / elements.max(1) as f64;
        b.0 = average(b.0, cost, b.1 > 0);
        b.1 = b.1.saturating_add(1);
    }

    /// The most rows a batch of rows of `row_elements` input elements each may merge, at most
    /// `bounds.start` for that size: below the first measured bucket that costs more per element
    /// than the best smaller one (beyond the tolerance).
    pub fn limit(&self, bounds: Bounds, row_elements: usize) -> usize {
        let start = bounds.start(row_elements);
        self.curves.get(&size_class(row_elements)).map_or(start, |c| c.measured(start))
    }

    /// The limit for the next batch formed: as `limit`, but a smaller size not yet measured
    /// first (see `Curve::unlearned`); twice or half the measured limit when exploring. Twice,
    /// not the starting limit: the measurement that holds the limit down is of the sizes just
    /// above it, which no other batch forms; were it never taken again, one disturbed stretch of
    /// runs would hold an MLP to batches of 8 or fewer for good (on one core shared with the I/O
    /// threads it then served 2,500-6,100 requests/s at 128 clients instead of 11,000).
    pub fn batch_limit(&self, bounds: Bounds, row_elements: usize, explore: Explore) -> usize {
        let unseen = Curve::default();
        let curve = self.curves.get(&size_class(row_elements)).unwrap_or(&unseen);
        let start = bounds.start(row_elements);
        let measured = curve.measured(start);
        match explore {
            Explore::No => curve.unlearned(measured).unwrap_or(measured),
            Explore::Up => measured.saturating_mul(2).min(start),
            Explore::Down => (measured / 2).max(1),
        }
    }

    /// How long a batch of `rows` rows (of `row_elements` input elements each) is worth holding
    /// for `target` rows in all: the time one merged run saves over running these rows now and the
    /// rest after them, at most one run of these rows (by then the rest would have come during
    /// it). `None` when merging saves under [`HOLD_GAIN`] of the merged run, or the merged size is
    /// not measured. Clients that wait for each answer before they send again come back in groups:
    /// under 8 of perf_analyzer's, an MLP whose batches of 1 to 8 cost alike ran batches of 4
    /// alternating with the other 4, which arrived while it ran.
    pub fn hold(&self, row_elements: usize, rows: usize, target: usize) -> Option<Duration> {
        if rows == 0 || target <= rows {
            return None;
        }
        let curve = self.curves.get(&size_class(row_elements))?;
        let &(merged, runs) = curve.buckets.get(bucket(target))?;
        if runs < MIN_SAMPLES {
            return None;
        }
        let run = |rows: usize, per_element: f64| (rows * row_elements) as f64 * per_element;
        let now = run(rows, curve.per_element(rows)?);
        let rest = run(target - rows, curve.per_element(target - rows)?);
        let merged = run(target, merged);
        let saved = now + rest - merged;
        (saved > merged * HOLD_GAIN).then(|| Duration::from_nanos(saved.min(now) as u64))
    }
}

/// The calling thread's CPU time so far (user and system), for a run's cost undisturbed by other
/// threads on its core; zero where the clock cannot be read.
pub fn thread_cpu_time() -> Duration {
    let mut t = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `t` is a valid timespec for the call to write.
    if unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) } != 0 {
        return Duration::ZERO;
    }
    Duration::new(t.tv_sec.max(0) as u64, t.tv_nsec.clamp(0, 999_999_999) as u32)
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

    /// The moving average itself (zero before the first batch).
    pub fn recent(&self) -> Duration {
        Duration::from_nanos(self.ns.load(Ordering::Relaxed))
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

    /// Bounds that start at the most rows allowed, for rows of any size.
    fn fixed(max: usize) -> Bounds {
        Bounds { start: max, at: 0, max }
    }

    fn us(v: f64) -> Duration {
        Duration::from_secs_f64(v / 1e6)
    }

    #[test]
    fn buckets_are_powers_of_two() {
        let got: Vec<usize> = [1, 2, 3, 4, 5, 8, 9, 64, 65].iter().map(|&r| bucket(r)).collect();
        assert_eq!(got, vec![0, 1, 2, 2, 3, 3, 4, 6, 7]);
    }

    #[test]
    fn size_classes_are_half_octaves_of_a_row() {
        let got: Vec<u8> = [1, 2, 3, 4, 5, 6, 7, 8, 12].iter().map(|&e| size_class(e)).collect();
        assert_eq!(got, vec![0, 2, 3, 4, 4, 5, 5, 6, 7]);
        let image = |side: usize| size_class(3 * side * side);
        assert_ne!(image(224), image(320));
        assert_eq!(image(320), size_class(3 * 320 * 352));
        assert!(size_class(usize::MAX) < 2 * usize::BITS as u8);
    }

    #[test]
    fn nothing_measured_leaves_the_configured_limit() {
        let c = BatchCosts::default();
        assert_eq!(c.limit(fixed(64), 512), 64);
        assert_eq!(c.batch_limit(fixed(64), 512, Explore::No), 64);
    }

    /// Records `MIN_SAMPLES` runs of each size in `sizes`, each taking `took(rows)` microseconds.
    fn learn(c: &mut BatchCosts, row_elements: usize, sizes: &[usize], took: impl Fn(f64) -> f64) {
        for &rows in sizes {
            for _ in 0..MIN_SAMPLES {
                c.record(rows, rows * row_elements, us(took(rows as f64)));
            }
        }
    }

    /// The batch limits a size class steps through under full load, learning each, and the
    /// limit it ends with.
    fn steps(configured: usize, row_elements: usize, took: impl Fn(f64) -> f64) -> (Vec<usize>, usize) {
        let mut c = BatchCosts::default();
        let mut steps = Vec::new();
        for _ in 0..10 {
            let next = c.batch_limit(fixed(configured), row_elements, Explore::No);
            steps.push(next);
            learn(&mut c, row_elements, &[next], &took);
        }
        (steps, c.limit(fixed(configured), row_elements))
    }

    #[test]
    fn a_size_steps_down_from_its_limit_while_smaller_batches_serve_as_well() {
        // A conv net at 320x320: per image, batches up to 4 cost what one does, 8 and 16 more.
        let detector = |rows: f64| rows * if rows <= 4.0 { 9_500.0 } else { 11_400.0 };
        assert_eq!(steps(16, 3 * 320 * 320, detector), (vec![16, 8, 4, 2, 1, 4, 4, 4, 4, 4], 4));
        // An MLP: each halving costs more per row; it stops once that passes the tolerance.
        let mlp = |rows: f64| 400.0 + 80.0 * rows;
        assert_eq!(steps(64, 512, mlp), (vec![64, 32, 16, 64, 64, 64, 64, 64, 64, 64], 64));
    }

    fn ms(d: Option<Duration>) -> Option<f64> {
        d.map(|d| (d.as_secs_f64() * 1e6).round() / 1e3)
    }

    #[test]
    fn a_batch_is_held_for_the_rest_where_one_merged_run_serves_them_sooner() {
        // An MLP whose batches of 1 to 8 cost about the same (its weights' reads, not its rows).
        let mut c = BatchCosts::default();
        learn(&mut c, 512, &[1, 2, 4, 8], |rows| 800.0 + 20.0 * rows);
        // 4 queued, 4 coming: now 0.88 ms, the rest 0.88 ms after, merged 0.96 ms: 0.8 ms saved.
        assert_eq!(ms(c.hold(512, 4, 8)), Some(0.8));
        // 1 queued, 7 coming (a batch of 7 costs per row what one of 8 does): 0.82 + 0.84 - 0.96.
        assert_eq!(ms(c.hold(512, 1, 8)), Some(0.7));
        // Nothing to wait for, or nothing queued to hold.
        assert_eq!(c.hold(512, 8, 8), None);
        assert_eq!(c.hold(512, 0, 8), None);
    }

    #[test]
    fn a_conv_net_costing_the_same_per_image_or_more_in_batches_is_never_held() {
        let mut c = BatchCosts::default();
        learn(&mut c, 3 * 224 * 224, &[1, 2, 4, 8], |rows| 5_000.0 * rows);
        assert_eq!(c.hold(3 * 224 * 224, 4, 8), None);
        assert_eq!(c.hold(3 * 224 * 224, 1, 8), None);
        let detector = |rows: f64| rows * if rows <= 4.0 { 9_500.0 } else { 11_400.0 };
        learn(&mut c, 3 * 320 * 320, &[1, 2, 4, 8], detector);
        assert_eq!(c.hold(3 * 320 * 320, 4, 8), None);
        // A saving under a quarter of the merged run does not pay for an idle instance.
        learn(&mut c, 100, &[4, 8], |rows| if rows == 4.0 { 1_000.0 } else { 1_700.0 });
        assert_eq!(c.hold(100, 4, 8), None);
        learn(&mut c, 200, &[4, 8], |rows| if rows == 4.0 { 1_000.0 } else { 1_500.0 });
        assert_eq!(ms(c.hold(200, 4, 8)), Some(0.5));
    }

    #[test]
    fn a_hold_needs_the_merged_size_measured_and_lasts_at_most_a_run_of_what_is_queued() {
        let mut c = BatchCosts::default();
        learn(&mut c, 512, &[1, 2, 4], |rows| 800.0 + 20.0 * rows);
        assert_eq!(c.hold(512, 4, 8), None);
        // 4 queued (their size unmeasured: costed per row as 5-8, 0.5 ms), 1 coming (a batch of 1:
        // 1 ms): merging saves 0.875 ms, but a hold longer than running the 4 gains nothing.
        let mut c = BatchCosts::default();
        learn(&mut c, 512, &[1, 8], |_| 1_000.0);
        assert_eq!(ms(c.hold(512, 4, 5)), Some(0.5));
    }

    #[test]
    fn a_conv_net_slower_per_image_in_pairs_is_held_to_single_runs() {
        let mut c = BatchCosts::default();
        learn(&mut c, 150_528, &[1, 2], |rows| if rows == 1.0 { 17_000.0 } else { 42_000.0 });
        assert_eq!(c.limit(fixed(64), 150_528), 1);
        assert_eq!(c.batch_limit(fixed(64), 150_528, Explore::No), 1);
    }

    #[test]
    fn an_mlp_cheaper_per_row_in_batches_keeps_merging() {
        let mut c = BatchCosts::default();
        learn(&mut c, 512, &[1, 2, 4, 8, 16, 32, 64], |rows| 400.0 + 20.0 * rows);
        assert_eq!(c.limit(fixed(64), 512), 64);
        assert_eq!(c.batch_limit(fixed(64), 512, Explore::No), 64);
    }

    #[test]
    fn a_detector_whose_best_batch_depends_on_its_size_gets_a_limit_per_size() {
        // Calibrated at 224x224 to a limit of 16: small images gain from batches up to 16; at
        // 320x320 batches of 4 cost the same per image as one, 8 cost 20% more.
        let (small, large) = (3 * 224 * 224, 3 * 320 * 320);
        let mut c = BatchCosts::default();
        learn(&mut c, small, &[1, 2, 4, 8, 16], |rows| 4_000.0 + 3_000.0 * rows);
        learn(&mut c, large, &[1, 2, 4, 8, 16], |rows| if rows <= 4.0 { 9_500.0 * rows } else { 11_400.0 * rows });
        assert_eq!(c.limit(fixed(16), small), 16);
        assert_eq!(c.limit(fixed(16), large), 4);
        assert_eq!(c.batch_limit(fixed(16), large, Explore::No), 4);
        // Requests of another size in between change neither.
        learn(&mut c, 3 * 640 * 640, &[1, 2], |rows| 40_000.0 * rows * rows);
        assert_eq!(
            (c.limit(fixed(16), small), c.limit(fixed(16), large), c.limit(fixed(16), 3 * 640 * 640)),
            (16, 4, 1)
        );
    }

    #[test]
    fn a_limit_starts_where_calibration_measured_as_many_elements_a_batch() {
        // Calibrated at sequences of 224 (two inputs: 448 elements a row) to 2 rows.
        let b = Bounds { start: 2, at: 448, max: 64 };
        assert_eq!([448, 28, 896, 1, 100_000].map(|e| b.start(e)), [2, 32, 1, 64, 1]);
        assert_eq!(BatchCosts::default().limit(b, 28), 32);
        // Nor does exploring go past it.
        assert_eq!(BatchCosts::default().batch_limit(b, 28, Explore::Up), 32);
        assert_eq!(BatchCosts::default().batch_limit(b, 896, Explore::Up), 1);
        // Not calibrated at one size: the start holds for every size.
        assert_eq!(Bounds { start: 16, at: 0, max: 64 }.start(28), 16);
    }

    #[test]
    fn the_limit_is_explored_again_now_and_then() {
        let mut c = BatchCosts::default();
        learn(&mut c, 1, &[1, 2, 4], |rows| if rows <= 2.0 { 10.0 * rows } else { 20.0 * rows });
        assert_eq!(c.limit(fixed(16), 1), 2);
        assert_eq!(c.batch_limit(fixed(16), 1, Explore::No), 2);
        assert_eq!(c.batch_limit(fixed(16), 1, Explore::Up), 4);
        assert_eq!(c.batch_limit(fixed(16), 1, Explore::Down), 1);
        assert_eq!(BatchCosts::default().batch_limit(fixed(16), 1, Explore::Up), 16);
        assert_eq!([0, 1, 16, 32].map(Explore::nth), [Explore::Up, Explore::No, Explore::Down, Explore::Up]);
    }

    #[test]
    fn a_limit_that_serves_worse_than_a_smaller_one_comes_down() {
        // The curve was learned while 8 images cost per image what 4 do; then batches of 8 grew
        // 20% dearer (another process took the cache) while load keeps every batch at 8.
        let per_image = 3 * 320 * 320;
        let mut c = BatchCosts::default();
        learn(&mut c, per_image, &[1, 2, 4, 8], |rows| 9_500.0 * rows);
        for _ in 0..4 {
            c.record(8, 8 * per_image, us(8.0 * 11_500.0));
        }
        assert_eq!(c.limit(fixed(8), per_image), 8, "the moving average is still within the tolerance");
        assert_eq!(c.batch_limit(fixed(8), per_image, Explore::Down), 4);
        for _ in 0..4 {
            c.record(8, 8 * per_image, us(8.0 * 11_500.0));
        }
        assert_eq!(c.limit(fixed(8), per_image), 4);
        // An MLP whose batches of 64 stay cheapest keeps them.
        let mut m = BatchCosts::default();
        learn(&mut m, 512, &[1, 2, 4, 8, 16, 32, 64], |rows| 100.0 + 78.0 * rows);
        assert_eq!(m.limit(fixed(64), 512), 64);
    }

    #[test]
    fn a_limit_held_down_by_sizes_no_batch_forms_rises_back() {
        // An MLP whose batches of 9-16 rows once measured dear (runs stretched by threads that
        // shared their core) is held to 8; under full load only the exploring batches form
        // other sizes. They re-measure 16, then 32, then 64, and the limit climbs back.
        let mlp = |rows: f64| 400.0 + 60.0 * rows;
        let mut c = BatchCosts::default();
        learn(&mut c, 512, &[1, 2, 4, 8, 32, 64], mlp);
        learn(&mut c, 512, &[16], |rows| 3.0 * mlp(rows));
        assert_eq!(c.limit(fixed(64), 512), 8);
        let mut formed = Vec::new();
        for n in 1..=2_000 {
            let rows = c.batch_limit(fixed(64), 512, Explore::nth(n));
            formed.push(rows);
            c.record(rows, rows * 512, us(mlp(rows as f64)));
        }
        assert_eq!(c.limit(fixed(64), 512), 64);
        assert!(formed[1_000..].iter().filter(|&&r| r == 64).count() > 900, "batches of 64 again");
    }

    #[test]
    fn a_threads_cpu_time_counts_its_own_work() {
        // Busy until `cpu` of this thread's CPU time has passed, or 5 s of wall time (a clock that
        // does not move fails the test instead of hanging it).
        let busy = |cpu: Duration| {
            let (from, wall) = (thread_cpu_time(), Instant::now());
            let mut x = 0u64;
            while thread_cpu_time() < from + cpu && wall.elapsed() < Duration::from_secs(5) {
                x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
            }
        };
        let before = thread_cpu_time();
        busy(Duration::from_millis(2));
        assert!(thread_cpu_time() >= before + Duration::from_millis(2));
        // Another thread's work is not this one's.
        let mine = thread_cpu_time();
        std::thread::spawn(move || busy(Duration::from_millis(20))).join().unwrap();
        assert!(thread_cpu_time() < mine + Duration::from_millis(20));
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
