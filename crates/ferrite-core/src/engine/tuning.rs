//! Self-tuning at load: a bounded calibration that measures a model's run time against batch size
//! and with ONNX Runtime's intra-op spinning on and off, and picks what serves it fastest. What
//! wins on an MLP (spinning, merging 64 rows) loses on a conv net, so nothing here is a constant:
//! the choice comes from the model's own measurements, and config values always win.
//!
//! The decisions (`choose_spinning`, `choose_merge_limit`) are pure functions of measured costs,
//! tested on cost curves; `calibrate` takes the measurements.

use std::{
    collections::HashMap,
    sync::Mutex,
    time::{Duration, Instant},
};

use crate::{
    engine::{
        backend::{BatchInput, Instance},
        model::synthetic_inputs,
        onnx::OnnxBackend,
        spec::ModelSpec,
    },
    Backend, Result,
};

/// Spinning must beat not spinning by this much at batch 1: spinning threads take CPU from the
/// I/O threads under load, so a small in-process gain is not worth it.
const SPIN_GAIN: f64 = 0.10;
/// A larger batch is kept while its throughput (rows/s) is within this of the best smaller one.
const BATCH_TOLERANCE: f64 = 0.03;
/// The whole calibration of one model stays under about this.
const BUDGET: Duration = Duration::from_secs(1);

/// What the calibration chose.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tuned {
    /// `None` when spinning was not free to choose (set in config) or cannot matter (one thread).
    pub spinning: Option<bool>,
    /// The largest batch the batcher should merge; `None` when not measured.
    pub merge_limit: Option<usize>,
}

/// Spinning on only if batch-1 runs are at least `SPIN_GAIN` faster with it.
pub fn choose_spinning(off: Duration, on: Duration) -> bool {
    on.as_secs_f64() < off.as_secs_f64() * (1.0 - SPIN_GAIN)
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

/// Results by model content and settings, so a reload of the same file does not measure again.
fn remembered() -> &'static Mutex<HashMap<u64, Tuned>> {
    static R: std::sync::OnceLock<Mutex<HashMap<u64, Tuned>>> = std::sync::OnceLock::new();
    R.get_or_init(Default::default)
}

/// The median time of one run of `rows` synthetic rows on `instance`, with at least 3 runs and
/// stopping after `budget`. `None` when the model cannot run the synthetic inputs.
fn time_runs(instance: &mut dyn Instance, spec: &ModelSpec, rows: usize, budget: Duration) -> Option<Duration> {
    let tensors = synthetic_inputs(spec, rows);
    let inputs: Vec<BatchInput<'_>> = spec
        .inputs
        .iter()
        .zip(&tensors)
        .map(|(s, t)| BatchInput { name: &s.name, datatype: s.datatype, shape: t.shape.clone(), parts: vec![&t.data] })
        .collect();
    instance.run(&inputs).ok()?; // the first run allocates; not timed
    let start = Instant::now();
    let mut times = Vec::new();
    while times.len() < 3 || (start.elapsed() < budget && times.len() < 50) {
        let t = Instant::now();
        instance.run(&inputs).ok()?;
        times.push(t.elapsed());
    }
    times.sort();
    Some(times[times.len() / 2])
}

/// Measures `backend` (opened with `spec.onnx`) and returns what serves it best. `spin_free`:
/// spinning may be chosen; `merge_free`: the batch limit may be. `content` identifies the model
/// file's bytes. Models with variable dims other than the batch dim are not calibrated (their
/// real inputs' sizes are unknown at load).
pub fn calibrate(
    backend: &OnnxBackend,
    spec: &ModelSpec,
    content: u64,
    spin_free: bool,
    merge_free: bool,
) -> Result<Tuned> {
    let spin_free = spin_free && spec.onnx.intra_threads > 1;
    let merge_free = merge_free && spec.batch.dynamic && spec.batch.max_batch_size > 1;
    let none = Tuned { spinning: None, merge_limit: None };
    if (!spin_free && !merge_free) || spec.inputs.iter().any(|t| t.dims.iter().any(|&d| d < 0)) {
        return Ok(none);
    }
    let key = xxhash_rust::xxh3::xxh3_64(format!("{content}{:?}{spin_free}{merge_free}", spec.onnx).as_bytes());
    if let Some(t) = remembered().lock().unwrap_or_else(|e| e.into_inner()).get(&key) {
        return Ok(*t);
    }
    let started = Instant::now();
    let mut instance = backend.instance()?;
    let Some(plain) = time_runs(instance.as_mut(), spec, 1, BUDGET / 8) else { return Ok(none) };
    let mut spinning = None;
    if spin_free {
        let mut options = spec.onnx.clone();
        options.spinning = !options.spinning;
        let other = backend.with_options(options)?;
        let mut other_instance = other.instance()?;
        if let Some(t) = time_runs(other_instance.as_mut(), spec, 1, BUDGET / 8) {
            let (off, on) = if spec.onnx.spinning { (t, plain) } else { (plain, t) };
            let spin = choose_spinning(off, on);
            if spin != spec.onnx.spinning {
                instance = other_instance;
            }
            spinning = Some(spin);
        }
    }
    let mut merge_limit = None;
    if merge_free {
        let mut curve = vec![(1, plain)];
        let mut rows = 2;
        while rows <= spec.batch.max_batch_size && started.elapsed() < BUDGET {
            let Some(t) = time_runs(instance.as_mut(), spec, rows, BUDGET / 16) else { break };
            curve.push((rows, t));
            // Past the point where throughput falls, larger sizes are not worth measuring.
            if choose_merge_limit(&curve) < rows {
                break;
            }
            rows *= 2;
        }
        let limit = choose_merge_limit(&curve);
        // Sizes past the last one measured stay allowed only if the curve was still rising there.
        let last = curve.last().map_or(1, |c| c.0);
        merge_limit =
            Some(if limit == last && rows > spec.batch.max_batch_size { spec.batch.max_batch_size } else { limit });
        tracing::debug!(model = %spec.name, curve = ?curve, "calibration curve");
    }
    let tuned = Tuned { spinning, merge_limit };
    remembered().lock().unwrap_or_else(|e| e.into_inner()).insert(key, tuned);
    Ok(tuned)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(v: f64) -> Duration {
        Duration::from_secs_f64(v / 1000.0)
    }

    #[test]
    fn an_mlp_like_curve_merges_up_to_the_largest_batch() {
        // Overhead-bound: a run costs little more at 64 rows than at 1.
        let curve: Vec<(usize, Duration)> =
            [1, 2, 4, 8, 16, 32, 64].iter().map(|&b| (b, ms(0.4 + 0.02 * b as f64))).collect();
        assert_eq!(choose_merge_limit(&curve), 64);
    }

    #[test]
    fn a_conv_net_that_is_slower_per_image_in_batches_does_not_merge() {
        // PP-OCR-like: 17 ms per image alone, 21 ms per image at batch 2 and worse after.
        let curve = [(1, ms(17.0)), (2, ms(42.0)), (4, ms(90.0))];
        assert_eq!(choose_merge_limit(&curve), 1);
    }

    #[test]
    fn the_limit_stops_where_throughput_falls() {
        // Gains to 8, then per-row cost rises (cache spill).
        let curve = [(1, ms(1.0)), (2, ms(1.5)), (4, ms(2.5)), (8, ms(4.5)), (16, ms(12.0))];
        assert_eq!(choose_merge_limit(&curve), 8);
        // A flat stretch within the tolerance keeps growing.
        let flat = [(1, ms(1.0)), (2, ms(2.02)), (4, ms(4.05))];
        assert_eq!(choose_merge_limit(&flat), 4);
    }

    #[test]
    fn spinning_must_win_clearly() {
        assert!(choose_spinning(ms(20.0), ms(15.0)), "a conv net gains 25%");
        assert!(!choose_spinning(ms(0.50), ms(0.48)), "a 4% gain is not worth the CPU");
        assert!(!choose_spinning(ms(10.0), ms(12.0)));
    }
}
