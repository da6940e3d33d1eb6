//! Self-tuning at load: a bounded calibration that measures a model's run time against batch size
//! for each plan of the CPU budget (one instance on every core; one single-threaded instance per
//! core) and picks what serves it fastest. Spinning is measured only when the config asks for it:
//! in-process it looks faster, but in the server its spinning threads take the cores the I/O
//! threads need (README "Self-tuning" has the measurements), which a measurement without the
//! I/O cannot see. What
//! wins on an MLP (merging 64 rows) loses on a conv net (slower per image in batches), so nothing
//! here is a constant: the choice comes from the model's own measurements, and config values
//! always win (a plan that contradicts the config is not tried).
//!
//! The decisions (`choose_merge_limit`, `choose`) are pure functions of measured costs, tested on
//! cost curves; `calibrate` takes the measurements.

use std::{
    collections::HashMap,
    sync::Mutex,
    time::{Duration, Instant},
};

use crate::{
    engine::{
        backend::{BatchInput, Instance},
        model::synthetic_inputs,
        onnx::{OnnxBackend, OnnxOptions},
        spec::ModelSpec,
    },
    Backend, Result,
};

/// A larger batch is kept while its throughput (rows/s) is within this of the best smaller one.
const BATCH_TOLERANCE: f64 = 0.03;
/// The whole calibration of one model stays under about this (plus one run per point).
const BUDGET: Duration = Duration::from_secs(2);

/// One way to spend the CPU budget on a model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Plan {
    pub instances: usize,
    pub threads: usize,
    pub spinning: bool,
}

impl Plan {
    /// How much more throughput this plan must show than the first (plainest) candidate to be
    /// chosen: spinning takes CPU from the I/O threads under load, more instances take memory.
    fn margin(&self) -> f64 {
        if self.spinning {
            0.10
        } else if self.instances > 1 {
            0.05
        } else {
            0.0
        }
    }
}

/// What the calibration chose.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tuned {
    pub plan: Plan,
    /// The largest batch the batcher should merge.
    pub merge_limit: usize,
    /// Input elements a row held where it was measured (all inputs, the batch dim apart), for a
    /// model with variable dims (measured at one size of them); 0 for a fixed-size model.
    pub row_elements: usize,
}

/// The largest measured batch size whose throughput does not fall below the best of the smaller
/// sizes (within `BATCH_TOLERANCE`). `curve` holds (batch size, time of one run), sizes ascending.
/// A model that runs slower per row at batch 2 than at batch 1 gets 1: no merging.
pub fn choose_merge_limit(curve: &[(usize, Duration)]) -> usize {
    let mut best = 0.0f64;
    let mut limit = curve.first().map_or(1, |c| c.0);
    for &(rows, took) in curve {
        let throughput = rows as f64 / took.as_secs_f64().max(1e-9);
        if throughput < best * (1.0 - BATCH_TOLERANCE) {
            break;
        }
        best = best.max(throughput);
        limit = rows;
    }
    limit
}

/// The plan and batch limit with the highest throughput, each plan at its own best batch (its
/// instances running side by side); the row size is the caller's to fill in. `curves` are in
/// order of preference, the plainest first; a later plan must beat the first by its margin.
pub fn choose(curves: &[(Plan, Vec<(usize, Duration)>)]) -> Option<Tuned> {
    let peak = |plan: &Plan, curve: &[(usize, Duration)]| {
        let limit = choose_merge_limit(curve);
        let took = curve.iter().find(|c| c.0 == limit).map_or(Duration::MAX, |c| c.1);
        (limit, (plan.instances * limit) as f64 / took.as_secs_f64().max(1e-9))
    };
    let (first, curve) = curves.iter().find(|(_, c)| !c.is_empty())?;
    let (limit, base) = peak(first, curve);
    let mut best = (Tuned { plan: *first, merge_limit: limit, row_elements: 0 }, base);
    for (plan, curve) in curves.iter().filter(|(_, c)| !c.is_empty()) {
        let (limit, throughput) = peak(plan, curve);
        if throughput > base * (1.0 + plan.margin()) && throughput > best.1 {
            best = (Tuned { plan: *plan, merge_limit: limit, row_elements: 0 }, throughput);
        }
    }
    Some(best.0)
}

/// Results by model content and settings, so a reload of the same file does not measure again.
fn remembered() -> &'static Mutex<HashMap<u64, Option<Tuned>>> {
    static R: std::sync::OnceLock<Mutex<HashMap<u64, Option<Tuned>>>> = std::sync::OnceLock::new();
    R.get_or_init(Default::default)
}

/// A larger batch is not measured once one run of it takes more than this: calibration stays
/// bounded for slow models (a BERT-style encoder at 64 rows), whose limit the batcher's own
/// measurements then keep.
const SLOWEST_RUN: Duration = Duration::from_millis(60);
/// A batch size whose first timed run is this far below the best throughput of the smaller ones
/// ends the growth: the curve has turned (measured again in the rounds below, within noise).
const CLEAR_FALL: f64 = 0.25;
/// Rounds over every plan and size: at least this many, and at most `MAX_ROUNDS` within `BUDGET`.
const MIN_ROUNDS: usize = 3;
const MAX_ROUNDS: usize = 50;

/// Synthetic inputs of `rows` rows for `spec`, and the times of the runs timed on them.
struct Batch {
    rows: usize,
    tensors: Vec<crate::Tensor>,
    times: Vec<Duration>,
}

impl Batch {
    fn new(spec: &ModelSpec, rows: usize) -> Batch {
        Batch { rows, tensors: synthetic_inputs(spec, rows), times: Vec::new() }
    }

    fn inputs<'a>(&'a self, spec: &'a ModelSpec) -> Vec<BatchInput<'a>> {
        spec.inputs
            .iter()
            .zip(&self.tensors)
            .map(|(s, t)| BatchInput {
                name: &s.name,
                datatype: s.datatype,
                shape: t.shape.clone(),
                parts: vec![&t.data],
            })
            .collect()
    }
}

/// One run of `batch` on each of `instances` side by side; the slowest one's time (the plan's
/// instances share the CPUs: together they give `instances x rows` per that time). `None` when
/// the model cannot run the synthetic inputs.
fn run_once(instances: &mut [Box<dyn Instance>], spec: &ModelSpec, batch: &Batch) -> Option<Duration> {
    let inputs = batch.inputs(spec);
    let timed = |instance: &mut Box<dyn Instance>| {
        let t = Instant::now();
        instance.run(&inputs).ok().map(|_| t.elapsed())
    };
    if let [one] = instances {
        return timed(one);
    }
    std::thread::scope(|scope| {
        let workers: Vec<_> = instances.iter_mut().map(|i| scope.spawn(|| timed(i))).collect();
        workers.into_iter().map(|w| w.join().ok().flatten()).collect::<Option<Vec<_>>>()
    })
    .and_then(|times| times.into_iter().max())
}

/// A plan under measurement: its instances, opened once and used for every size, as serving
/// uses them; the sizes worth measuring, with their runs' times.
struct Candidate {
    plan: Plan,
    instances: Vec<Box<dyn Instance>>,
    batches: Vec<Batch>,
}

impl Candidate {
    /// Opens the plan's instances and finds the sizes worth measuring: doubling from 1 while the
    /// model batches, up to `max_rows`, until a run is slower than `SLOWEST_RUN` or throughput
    /// falls clearly. Every size runs once untimed first (its first run allocates). `None` when
    /// the model cannot run the synthetic inputs.
    fn open(backend: &OnnxBackend, spec: &ModelSpec, plan: Plan, max_rows: usize) -> Result<Option<Candidate>> {
        let options = OnnxOptions { intra_threads: plan.threads, spinning: plan.spinning, ..spec.onnx.clone() };
        let b = backend.with_options(options)?;
        let mut instances: Vec<Box<dyn Instance>> = (0..plan.instances).map(|_| b.instance()).collect::<Result<_>>()?;
        let mut batches = Vec::new();
        let mut best = 0.0f64;
        let mut rows = 1;
        loop {
            let mut batch = Batch::new(spec, rows);
            let (Some(_), Some(took)) =
                (run_once(&mut instances, spec, &batch), run_once(&mut instances, spec, &batch))
            else {
                break;
            };
            let throughput = rows as f64 / took.as_secs_f64().max(1e-9);
            if throughput < best * (1.0 - CLEAR_FALL) && !batches.is_empty() {
                break;
            }
            best = best.max(throughput);
            batch.times.push(took);
            batches.push(batch);
            if rows >= max_rows || took > SLOWEST_RUN {
                break;
            }
            rows = (rows * 2).min(max_rows);
        }
        Ok((!batches.is_empty()).then_some(Candidate { plan, instances, batches }))
    }

    /// One more run of every size.
    fn round(&mut self, spec: &ModelSpec) {
        for batch in &mut self.batches {
            if let Some(t) = run_once(&mut self.instances, spec, batch) {
                batch.times.push(t);
            }
        }
    }

    /// (batch size, median run time), sizes ascending.
    fn curve(&self) -> Vec<(usize, Duration)> {
        self.batches.iter().map(|b| (b.rows, median(&b.times))).collect()
    }
}

fn median(times: &[Duration]) -> Duration {
    let mut t = times.to_vec();
    t.sort();
    t[t.len() / 2]
}

/// The candidate plans for `spec` within a budget of `cpus`, plainest first; `fixed_*` are what
/// the config decided (a plan that contradicts it is not a candidate).
pub fn plans(
    cpus: usize,
    fixed_instances: Option<usize>,
    fixed_threads: Option<usize>,
    fixed_spinning: Option<bool>,
) -> Vec<Plan> {
    let cpus = cpus.max(1);
    let mut plans = vec![
        Plan { instances: 1, threads: cpus, spinning: false },
        Plan { instances: cpus, threads: 1, spinning: false },
    ];
    if fixed_spinning == Some(true) {
        plans.push(Plan { instances: 1, threads: cpus, spinning: true });
    }
    plans.dedup();
    plans.retain(|p| {
        fixed_instances.is_none_or(|n| n == p.instances)
            && fixed_threads.is_none_or(|t| t == p.threads)
            && fixed_spinning.is_none_or(|s| s == p.spinning)
            && !(p.spinning && p.threads == 1)
    });
    if plans.is_empty() {
        // The config fixed everything but, perhaps, the batch limit: measure what it says.
        plans.push(Plan {
            instances: fixed_instances.unwrap_or(1),
            threads: fixed_threads.unwrap_or((cpus / fixed_instances.unwrap_or(1)).max(1)),
            spinning: fixed_spinning.unwrap_or(false),
        });
    }
    plans
}

/// Sizes tried for variable dims other than the batch dim (a detector's H and W, a sequence
/// length): real inputs' sizes are unknown at load. Multiples of 32, as strided conv nets need,
/// largest first: a conv net measured on small images gains from batches that it loses at the
/// sizes served (a detector calibrated at 64x64 merged 32 images where at 320x320 one at a time
/// is fastest). The CPU plan that wins at one size wins at the others (the models stay
/// compute-bound); the batch limit found here is only a start, which the batcher's own
/// measurements then lower where the served sizes need it.
const VARIABLE_DIM_SIZES: [i64; 3] = [224, 128, 64];

/// `spec` with its variable dims (but the batch dim) at the first size of `VARIABLE_DIM_SIZES`
/// the model runs, or as it is when it has none; `None` when it runs none of them.
fn concrete(backend: &OnnxBackend, spec: &ModelSpec) -> Option<ModelSpec> {
    if spec.inputs.iter().all(|t| t.dims.iter().all(|&d| d >= 0)) {
        return Some(spec.clone());
    }
    VARIABLE_DIM_SIZES.iter().find_map(|&size| {
        let mut s = spec.clone();
        for d in s.inputs.iter_mut().flat_map(|t| t.dims.iter_mut()).filter(|d| **d < 0) {
            *d = size;
        }
        let mut one = [backend.instance().ok()?];
        run_once(&mut one, &s, &Batch::new(&s, 1)).map(|_| s)
    })
}

/// Asked to (`--spin-in-run`), a model whose run of one row takes at least this on several threads
/// lets them spin within its runs (`OnnxOptions::spin_in_run`): its operators hand work to the
/// other threads hundreds of times a run, and each hand-off to a sleeping thread costs a wake-up.
/// Below it (an MLP's run is one or two operators) the spinning costs more than it saves: an MLP
/// spinning within runs served a quarter of its requests at 32 clients. Measured side by side in
/// bench/results/together-spin-in-run*.md.
pub const SPIN_IN_RUN_FROM: Duration = Duration::from_millis(2);

/// Whether a model run on `threads` threads whose one-row run takes `one_row` spins within runs.
pub fn spins_in_run(threads: usize, one_row: Duration) -> bool {
    threads > 1 && one_row >= SPIN_IN_RUN_FROM
}

/// The time of one run of one row on `backend`'s settings, at the sizes calibration uses for
/// variable dims: the fastest of up to five runs (after an untimed one, within about a second), so
/// that a busy moment at load (another model or process starting) does not pass for a slow model
/// (an MLP timed once beside another server's start took over 2 ms). `None` when the model cannot
/// run the synthetic inputs.
pub fn one_row_time(backend: &OnnxBackend, spec: &ModelSpec) -> Option<Duration> {
    let spec = concrete(backend, spec)?;
    let mut one = [backend.instance().ok()?];
    let batch = Batch::new(&spec, 1);
    run_once(&mut one, &spec, &batch)?;
    let started = Instant::now();
    let mut fastest = run_once(&mut one, &spec, &batch)?;
    for _ in 0..4 {
        if fastest < SPIN_IN_RUN_FROM || started.elapsed() > Duration::from_secs(1) {
            break;
        }
        fastest = fastest.min(run_once(&mut one, &spec, &batch)?);
    }
    Some(fastest)
}

/// Measures `backend` under each of `plans` and returns the best, or `None` when the model cannot
/// be calibrated (it refuses synthetic inputs). `content` identifies the model file's bytes.
pub fn calibrate(backend: &OnnxBackend, spec: &ModelSpec, content: u64, plans: &[Plan]) -> Result<Option<Tuned>> {
    let Some(concrete) = concrete(backend, spec) else { return Ok(None) };
    let row_elements = match concrete.inputs == spec.inputs {
        true => 0,
        false => concrete.inputs.iter().map(|t| t.dims.iter().map(|&d| d as usize).product::<usize>()).sum(),
    };
    let spec = &concrete;
    let key = xxhash_rust::xxh3::xxh3_64(format!("{content}{:?}{plans:?}{:?}", spec.onnx, spec.batch).as_bytes());
    if let Some(t) = remembered().lock().unwrap_or_else(|e| e.into_inner()).get(&key) {
        return Ok(*t);
    }
    let started = Instant::now();
    let mergeable = spec.batch.dynamic && spec.batch.max_batch_size > 1;
    let max_rows = if mergeable { spec.batch.max_batch_size } else { 1 };
    let mut candidates = Vec::new();
    for plan in plans {
        candidates.extend(Candidate::open(backend, spec, *plan, max_rows)?);
    }
    // Rounds over every plan and size in turn, so that what slows the machine for a while (another
    // process, the clock) slows every point alike instead of bending one point of the curve: the
    // sizes measured one after the other gave batch limits from 16 to 64 for the same MLP on one
    // core, from one start to the next.
    let rounds_start = Instant::now();
    let mut rounds = 1;
    while rounds < MIN_ROUNDS || (rounds < MAX_ROUNDS && started.elapsed() < BUDGET) {
        for c in &mut candidates {
            c.round(spec);
        }
        rounds += 1;
    }
    let curves: Vec<(Plan, Vec<(usize, Duration)>)> = candidates
        .iter()
        .map(|c| {
            let curve = c.curve();
            tracing::debug!(model = %spec.name, plan = ?c.plan, ?curve, "calibration curve");
            (c.plan, curve)
        })
        .collect();
    tracing::debug!(model = %spec.name, rounds, rounds_ms = rounds_start.elapsed().as_millis() as u64, "calibration rounds");
    let tuned = choose(&curves).map(|t| Tuned { row_elements, ..t });
    tracing::debug!(model = %spec.name, took_ms = started.elapsed().as_millis() as u64, ?tuned, "calibrated");
    remembered().lock().unwrap_or_else(|e| e.into_inner()).insert(key, tuned);
    Ok(tuned)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(v: f64) -> Duration {
        Duration::from_secs_f64(v / 1000.0)
    }

    fn curve(f: impl Fn(f64) -> f64, sizes: &[usize]) -> Vec<(usize, Duration)> {
        sizes.iter().map(|&b| (b, ms(f(b as f64)))).collect()
    }

    const ONE_BY_TWO: Plan = Plan { instances: 1, threads: 2, spinning: false };
    const TWO_BY_ONE: Plan = Plan { instances: 2, threads: 1, spinning: false };
    const SPINNING: Plan = Plan { instances: 1, threads: 2, spinning: true };

    #[test]
    fn an_mlp_like_curve_merges_up_to_the_largest_batch() {
        // Overhead-bound: a run costs little more at 64 rows than at 1.
        let c = curve(|b| 0.4 + 0.02 * b, &[1, 2, 4, 8, 16, 32, 64]);
        assert_eq!(choose_merge_limit(&c), 64);
    }

    #[test]
    fn a_conv_net_that_is_slower_per_image_in_batches_does_not_merge() {
        // PP-OCR-like: 17 ms per image alone, 21 ms per image at batch 2 and worse after.
        assert_eq!(choose_merge_limit(&[(1, ms(17.0)), (2, ms(42.0)), (4, ms(90.0))]), 1);
    }

    #[test]
    fn the_limit_stops_where_throughput_falls() {
        let c = [(1, ms(1.0)), (2, ms(1.5)), (4, ms(2.5)), (8, ms(4.5)), (16, ms(12.0))];
        assert_eq!(choose_merge_limit(&c), 8);
        // A flat stretch within the tolerance keeps growing.
        assert_eq!(choose_merge_limit(&[(1, ms(1.0)), (2, ms(2.02)), (4, ms(4.05))]), 4);
    }

    #[test]
    fn a_conv_net_gets_an_instance_per_core_when_that_is_faster() {
        // As measured on the ResNet-style model: 1 x 2 threads 7.6 ms per image, 2 x 1 thread
        // 12.6 ms each side by side (158/s), batches no better.
        let curves = vec![
            (ONE_BY_TWO, vec![(1, ms(7.6)), (2, ms(16.0))]),
            (TWO_BY_ONE, vec![(1, ms(12.6)), (2, ms(27.0))]),
            (SPINNING, vec![(1, ms(6.8)), (2, ms(14.0))]),
        ];
        assert_eq!(choose(&curves), Some(Tuned { plan: TWO_BY_ONE, merge_limit: 1, row_elements: 0 }));
    }

    #[test]
    fn spinning_and_more_instances_must_win_clearly() {
        // Spinning 8% faster: not worth the CPU it takes from the I/O threads.
        let curves = vec![(ONE_BY_TWO, vec![(1, ms(10.0))]), (SPINNING, vec![(1, ms(9.2))])];
        assert_eq!(choose(&curves).unwrap().plan, ONE_BY_TWO);
        // Spinning 25% faster: taken.
        let curves = vec![(ONE_BY_TWO, vec![(1, ms(10.0))]), (SPINNING, vec![(1, ms(7.5))])];
        assert_eq!(choose(&curves).unwrap().plan, SPINNING);
        // Two instances 3% ahead: not worth the memory.
        let curves = vec![(ONE_BY_TWO, vec![(1, ms(10.0))]), (TWO_BY_ONE, vec![(1, ms(19.4))])];
        assert_eq!(choose(&curves).unwrap().plan, ONE_BY_TWO);
    }

    #[test]
    fn an_mlp_keeps_batching_on_the_plan_with_the_best_peak() {
        let curves = vec![
            (ONE_BY_TWO, curve(|b| 0.45 + 0.07 * b, &[1, 2, 4, 8, 16, 32, 64])),
            (TWO_BY_ONE, curve(|b| 0.9 + 0.12 * b, &[1, 2, 4, 8, 16, 32, 64])),
        ];
        // 1 x 2 peaks at 64 / 4.93 ms = 13.0k rows/s; 2 x 1 at 128 / 8.58 ms = 14.9k: 15% more.
        assert_eq!(choose(&curves), Some(Tuned { plan: TWO_BY_ONE, merge_limit: 64, row_elements: 0 }));
    }

    #[test]
    fn only_slow_runs_on_several_threads_spin_within_runs() {
        // BERT-style encoder (24 ms) and a detector (8 ms) on two threads: yes.
        assert!(spins_in_run(2, ms(24.0)));
        assert!(spins_in_run(2, ms(8.0)));
        // An MLP (0.3 ms) on two threads, or anything on one thread: no.
        assert!(!spins_in_run(2, ms(0.3)));
        assert!(!spins_in_run(1, ms(24.0)));
        assert!(spins_in_run(2, SPIN_IN_RUN_FROM));
    }

    #[test]
    fn plans_honour_what_the_config_fixed() {
        // Spinning is tried only when asked for (it cannot be judged without the I/O threads).
        assert_eq!(plans(2, None, None, None), vec![ONE_BY_TWO, TWO_BY_ONE]);
        assert_eq!(plans(2, None, None, Some(true)), vec![SPINNING]);
        assert_eq!(plans(2, Some(2), None, None), vec![TWO_BY_ONE]);
        assert_eq!(plans(2, None, None, Some(false)), vec![ONE_BY_TWO, TWO_BY_ONE]);
        assert_eq!(plans(1, None, None, None), vec![Plan { instances: 1, threads: 1, spinning: false }]);
        assert_eq!(plans(2, Some(3), Some(1), None), vec![Plan { instances: 3, threads: 1, spinning: false }]);
    }
}
