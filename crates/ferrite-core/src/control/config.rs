//! Model configuration: what `config.toml` may say, and the resolved spec a model runs with.

use serde::Deserialize;

pub use crate::engine::spec::{VersionPolicy, WarmupConfig, WarmupInputConfig};
use crate::{
    engine::onnx::OnnxOptions,
    engine::spec::{
        BatchPolicy, LoadRecord, ModelSpec, QueuePolicy, StepRecord, TensorSpec, TimeoutAction, DEFAULT_MAX_BATCH_SIZE,
        DEFAULT_MAX_QUEUE_DELAY_US, DEFAULT_MAX_QUEUE_SIZE, MAX_PRIORITY_LEVELS,
    },
    DataType, Error, Result,
};

/// `models/<name>/config.toml`. Every field is optional.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// `onnxruntime` (the default) or `python` (Triton's Python backend: `<version>/model.py`).
    pub backend: Option<String>,
    /// How a Python model's worker processes run.
    pub python: Option<PythonConfig>,
    /// 0 disables batching; dim 0 of every input and output is then part of `dims`.
    pub max_batch_size: Option<usize>,
    /// Model instances (one backend session and one OS thread each).
    pub instance_count: Option<usize>,
    /// Intra-op threads per instance.
    pub threads: Option<usize>,
    pub dynamic_batching: Option<DynamicBatchingConfig>,
    /// `[cache] enabled = true` puts the response cache in front of this model.
    pub cache: Option<CacheConfig>,
    /// Which versions on disk are served; default `latest = 1`.
    pub version_policy: Option<VersionPolicyConfig>,
    /// A share of unversioned traffic for a candidate version, withdrawn automatically when it
    /// does worse than the stable one.
    pub canary: Option<super::canary::CanaryConfig>,
    /// ONNX Runtime's session settings for this model.
    pub onnxruntime: Option<OnnxRuntimeConfig>,
    /// `false` skips the calibration at load (spinning and the batch limit are then the defaults).
    pub calibrate: Option<bool>,
    /// `false`: when the calibration picks single-threaded instances, no solo instance on every
    /// thread is added beside them for work that arrives alone (one more session in memory).
    pub solo_instance: Option<bool>,
    /// The file in each version directory that holds the model (default `model.onnx`).
    pub default_model_filename: Option<String>,
    #[serde(default)]
    pub input: Vec<TensorConfig>,
    #[serde(default)]
    pub output: Vec<TensorConfig>,
    /// Requests run on every new load before it serves (Triton's `model_warmup`); a load that
    /// fails one is refused.
    #[serde(default)]
    pub warmup: Vec<WarmupConfig>,
    /// What a text pipeline answers (`embed`, `rerank`, `classify`): the routes that reach it.
    pub task: Option<crate::engine::spec::Task>,
    /// A pipeline's steps (native operations and other models' calls) in place of a model file;
    /// its outputs are the `[[output]]` names given, else what the last step writes.
    #[serde(default)]
    pub steps: Vec<crate::pipeline::StepConfig>,
    /// Class labels found elsewhere than in a label file (a Hugging Face `config.json`'s
    /// `id2label`), by output.
    #[serde(skip)]
    pub labels: std::collections::BTreeMap<String, Vec<String>>,
    /// What reading the config found worth saying (settings that have no effect here), logged
    /// when the model loads, not each time the file is read.
    #[serde(skip)]
    pub notes: Vec<String>,
}

/// `[python]`: a Python model's workers (Triton's `parameters` of a `backend: "python"` model).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PythonConfig {
    /// A Python environment's directory (a venv) whose `bin/python3` runs the workers (Triton's
    /// `EXECUTION_ENV_PATH`; `$$TRITON_MODEL_DIRECTORY` is the model's directory). Default: the
    /// server's `--python` interpreter.
    pub env_path: Option<String>,
    /// One `execute` call returns within this or its worker is killed and restarted (60000).
    pub execute_timeout_ms: Option<u64>,
    /// A worker whose resident memory grows past this is killed and restarted (no limit).
    pub memory_limit_mb: Option<u64>,
    /// The config's `parameters`, given to the model in its `model_config`.
    #[serde(default)]
    pub parameters: std::collections::BTreeMap<String, String>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DynamicBatchingConfig {
    #[serde(default = "yes")]
    pub enabled: bool,
    #[serde(default)]
    pub preferred_batch_size: Vec<usize>,
    #[serde(default)]
    pub max_queue_delay_microseconds: Option<u64>,
    /// Requests waiting at once; 0 means the default cap (never unbounded).
    #[serde(default)]
    pub max_queue_size: Option<usize>,
    /// Applied when a request gives no `timeout`; 0 means none.
    #[serde(default)]
    pub default_timeout_microseconds: u64,
    /// Priority levels (1 is highest); 0 or 1 means a single level.
    #[serde(default)]
    pub priority_levels: u32,
    /// Answer a model's requests in the order they were queued (Triton's `preserve_ordering`).
    #[serde(default)]
    pub preserve_ordering: bool,
    /// The level of requests that name none; 0 means the lowest.
    #[serde(default)]
    pub default_priority_level: u32,
    /// May a request's own `timeout` shorten the default one? (Never lengthen it.)
    #[serde(default = "yes")]
    pub allow_timeout_override: bool,
    /// What happens to a request whose timeout ends while it is queued.
    #[serde(default)]
    pub timeout_action: TimeoutAction,
    /// Per-level overrides of the queue policy above, keyed by level (`"1"` is highest).
    #[serde(default)]
    pub priority_queue_policy: std::collections::BTreeMap<String, QueuePolicyConfig>,
}

/// `[dynamic_batching.priority_queue_policy.<level>]`: fields left out keep the model's defaults.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QueuePolicyConfig {
    pub max_queue_size: Option<usize>,
    pub default_timeout_microseconds: Option<u64>,
    pub allow_timeout_override: Option<bool>,
    pub timeout_action: Option<TimeoutAction>,
}

fn yes() -> bool {
    true
}

impl Default for DynamicBatchingConfig {
    fn default() -> Self {
        DynamicBatchingConfig {
            enabled: true,
            preferred_batch_size: Vec::new(),
            max_queue_delay_microseconds: None,
            max_queue_size: None,
            default_timeout_microseconds: 0,
            priority_levels: 0,
            preserve_ordering: false,
            default_priority_level: 0,
            allow_timeout_override: true,
            timeout_action: TimeoutAction::Reject,
            priority_queue_policy: Default::default(),
        }
    }
}

/// `[version_policy]`: exactly one of `latest = n`, `all = true`, `specific = [..]`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VersionPolicyConfig {
    pub latest: Option<usize>,
    pub all: Option<bool>,
    pub specific: Option<Vec<u64>>,
}

impl VersionPolicyConfig {
    pub fn resolve(&self) -> Result<VersionPolicy> {
        match (self.latest, self.all, &self.specific) {
            (Some(0), None, None) => Err(Error::invalid("version_policy latest must be at least 1")),
            (Some(n), None, None) => Ok(VersionPolicy::Latest(n)),
            (None, Some(true), None) => Ok(VersionPolicy::All),
            (None, None, Some(v)) if !v.is_empty() && v.iter().all(|&v| v > 0) => {
                Ok(VersionPolicy::Specific(v.clone()))
            }
            _ => Err(Error::invalid(
                "version_policy takes exactly one of latest = <n>, all = true, specific = [<positive versions>]",
            )),
        }
    }
}

impl VersionPolicy {
    /// The versions to serve among `available` (any order), highest first.
    pub fn select(&self, available: &[u64]) -> Vec<u64> {
        let mut v: Vec<u64> = available.to_vec();
        v.sort_unstable_by(|a, b| b.cmp(a));
        v.dedup();
        match self {
            VersionPolicy::Latest(n) => v.truncate(*n),
            VersionPolicy::All => {}
            VersionPolicy::Specific(wanted) => v.retain(|x| wanted.contains(x)),
        }
        v
    }
}

/// `[onnxruntime]`: ONNX Runtime's session settings, named as the onnxruntime backend's
/// `parameters` are. What is unset is chosen at load: threads from the CPU budget, spinning by
/// the calibration; the rest are ONNX Runtime's defaults.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OnnxRuntimeConfig {
    pub intra_op_thread_count: Option<usize>,
    pub inter_op_thread_count: Option<usize>,
    /// "sequential" (default) or "parallel".
    pub execution_mode: Option<String>,
    /// "disable", "basic", "extended" or "all" (default).
    pub graph_optimization_level: Option<String>,
    pub enable_mem_arena: Option<bool>,
    pub enable_mem_pattern: Option<bool>,
    pub enable_memory_arena_shrinkage: Option<bool>,
    pub spinning: Option<bool>,
    /// Slow runs' threads spin between their operators, not between runs (`--spin-in-run`).
    pub spin_in_run: Option<bool>,
    /// `session.intra_op_thread_affinities`, e.g. "1;2".
    pub intra_op_thread_affinity: Option<String>,
    /// false: each session keeps its own copy of the weights.
    pub share_weights: Option<bool>,
}

impl OnnxRuntimeConfig {
    /// The session options these settings give, over `base`.
    pub fn apply(&self, mut base: OnnxOptions) -> Result<OnnxOptions> {
        base.intra_threads = self.intra_op_thread_count.unwrap_or(base.intra_threads).max(1);
        base.inter_threads = self.inter_op_thread_count.unwrap_or(base.inter_threads).max(1);
        base.parallel = match self.execution_mode.as_deref() {
            None => base.parallel,
            Some("sequential") => false,
            Some("parallel") => true,
            Some(o) => return Err(Error::invalid(format!("execution_mode '{o}' is not sequential or parallel"))),
        };
        base.optimization_level = match self.graph_optimization_level.as_deref() {
            None => base.optimization_level,
            Some("disable") => 0,
            Some("basic") => 1,
            Some("extended") => 2,
            Some("all") => 3,
            Some(o) => {
                return Err(Error::invalid(format!(
                    "graph_optimization_level '{o}' is not disable, basic, extended or all"
                )))
            }
        };
        base.mem_arena = self.enable_mem_arena.unwrap_or(base.mem_arena);
        base.mem_pattern = self.enable_mem_pattern.unwrap_or(base.mem_pattern);
        base.arena_shrinkage = self.enable_memory_arena_shrinkage.unwrap_or(base.arena_shrinkage);
        base.spinning = self.spinning.unwrap_or(base.spinning);
        base.share_weights = self.share_weights.unwrap_or(base.share_weights);
        if let Some(a) = &self.intra_op_thread_affinity {
            if !a.chars().all(|c| c.is_ascii_digit() || matches!(c, ',' | ';' | '-')) {
                return Err(Error::invalid(format!("intra_op_thread_affinity '{a}' is not like \"1;2\"")));
            }
            base.intra_thread_affinity = Some(a.clone());
        }
        Ok(base)
    }
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CacheConfig {
    #[serde(default)]
    pub enabled: bool,
    /// Entries shared by every tenant (default: each tenant's answers are its own).
    #[serde(default)]
    pub across_tenants: bool,
}

/// An input or output override: `dims` exclude the batch dim when `max_batch_size > 0`; -1 is variable.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TensorConfig {
    pub name: String,
    pub datatype: Option<String>,
    pub dims: Option<Vec<i64>>,
    /// Outputs: a file in the model's directory with one class label per line (classification).
    pub label_filename: Option<String>,
    /// The shape the model takes (inputs) or gives (outputs) for `dims`, as many elements; the
    /// batch dim is not part of either.
    pub reshape: Option<Vec<i64>>,
    /// Inputs: a request may leave it out (it is then not passed to ONNX Runtime).
    #[serde(default)]
    pub optional: bool,
}

impl ModelConfig {
    /// Whether this is a Python model (`backend = "python"`).
    pub fn is_python(&self) -> bool {
        self.backend.as_deref() == Some("python")
    }

    /// The file each version directory holds the model in: `default_model_filename`, else
    /// `model.onnx` (`model.py` for a Python model).
    pub fn model_filename(&self) -> &str {
        match &self.default_model_filename {
            Some(f) => f,
            None if self.is_python() => "model.py",
            None => crate::control::repository::DEFAULT_MODEL_FILENAME,
        }
    }
}

impl ModelSpec {
    /// Resolves `config` against the tensors the model file declares (`io_*`: full shapes, -1 variable).
    pub fn resolve(
        name: &str,
        version: u64,
        config: &ModelConfig,
        io_inputs: &[TensorSpec],
        io_outputs: &[TensorSpec],
        default_threads: usize,
    ) -> Result<ModelSpec> {
        match config.backend.as_deref() {
            None | Some("onnxruntime") | Some("python") => {}
            Some(other) => return Err(Error::Unsupported(format!("backend '{other}' is not available"))),
        }
        let all_io = || io_inputs.iter().chain(io_outputs);
        let batchable = all_io().all(|t| t.dims.first() == Some(&-1));
        let max_batch_size = match config.max_batch_size {
            Some(n) if n > 0 && !batchable => {
                return Err(Error::invalid(format!(
                    "max_batch_size = {n}, but not every input and output of the model has a variable dim 0"
                )))
            }
            Some(n) => n,
            None if batchable => DEFAULT_MAX_BATCH_SIZE,
            None => 0,
        };
        let strip = |t: &TensorSpec| TensorSpec {
            name: t.name.clone(),
            datatype: t.datatype,
            dims: if max_batch_size > 0 { t.dims[1..].to_vec() } else { t.dims.clone() },
        };
        let mut reshape = Default::default();
        let inputs = apply_overrides("input", io_inputs.iter().map(strip).collect(), &config.input, &mut reshape)?;
        let outputs = apply_overrides("output", io_outputs.iter().map(strip).collect(), &config.output, &mut reshape)?;
        if let Some(o) = config.output.iter().find(|o| o.optional) {
            return Err(Error::invalid(format!("config output '{}': only inputs can be optional", o.name)));
        }

        let db = config.dynamic_batching.clone();
        let mut batch = BatchPolicy {
            max_batch_size,
            merge_limit: max_batch_size,
            dynamic: max_batch_size > 0,
            ..BatchPolicy::default()
        };
        if let Some(db) = db {
            batch.dynamic = db.enabled && max_batch_size > 0;
            batch.preferred_batch_sizes = db.preferred_batch_size.clone();
            batch.max_queue_delay_us = db.max_queue_delay_microseconds.unwrap_or(DEFAULT_MAX_QUEUE_DELAY_US);
            batch.gather = db.max_queue_delay_microseconds.is_none();
            batch.queue = QueuePolicy {
                max_queue_size: db.max_queue_size.filter(|&n| n > 0).unwrap_or(DEFAULT_MAX_QUEUE_SIZE),
                default_timeout_us: db.default_timeout_microseconds,
                allow_timeout_override: db.allow_timeout_override,
                timeout_action: db.timeout_action,
            };
            batch.preserve_ordering = db.preserve_ordering;
            batch.priority_levels = db.priority_levels.max(1);
            if batch.priority_levels > MAX_PRIORITY_LEVELS {
                return Err(Error::invalid(format!("priority_levels must be at most {MAX_PRIORITY_LEVELS}")));
            }
            batch.level_queues = vec![batch.queue.clone(); batch.priority_levels as usize];
            for (key, o) in &db.priority_queue_policy {
                let level =
                    key.parse::<u32>().ok().filter(|l| (1..=batch.priority_levels).contains(l)).ok_or_else(|| {
                        Error::invalid(format!("priority_queue_policy '{key}' is not a level in 1..=priority_levels"))
                    })?;
                let q = &mut batch.level_queues[level as usize - 1];
                q.max_queue_size = o.max_queue_size.filter(|&n| n > 0).unwrap_or(q.max_queue_size);
                q.default_timeout_us = o.default_timeout_microseconds.unwrap_or(q.default_timeout_us);
                q.allow_timeout_override = o.allow_timeout_override.unwrap_or(q.allow_timeout_override);
                q.timeout_action = o.timeout_action.unwrap_or(q.timeout_action);
            }
            batch.default_priority_level = match db.default_priority_level {
                0 => batch.priority_levels,
                n if n <= batch.priority_levels => n,
                n => return Err(Error::invalid(format!("default_priority_level {n} exceeds priority_levels"))),
            };
            if let Some(&p) = batch.preferred_batch_sizes.iter().find(|&&p| p == 0 || p > max_batch_size) {
                return Err(Error::invalid(format!("preferred_batch_size {p} must be in 1..=max_batch_size")));
            }
        }
        let instance_count = config.instance_count.unwrap_or(1);
        if instance_count == 0 {
            return Err(Error::invalid("instance_count must be at least 1"));
        }
        Ok(ModelSpec {
            name: name.to_string(),
            version,
            platform: "onnxruntime_onnx",
            backend: "onnxruntime",
            inputs,
            outputs,
            batch,
            instance_count,
            onnx: OnnxOptions { intra_threads: config.threads.unwrap_or(default_threads).max(1), ..Default::default() },
            solo_threads: 0,
            labels: Default::default(),
            reshape,
            optional: config.input.iter().filter(|i| i.optional).map(|i| i.name.clone()).collect(),
            uses: Vec::new(),
            cache: config.cache.as_ref().is_some_and(|c| c.enabled),
            cache_across_tenants: config.cache.as_ref().is_some_and(|c| c.across_tenants),
            load: LoadRecord {
                model_filename: config.model_filename().to_string(),
                label_files: config
                    .output
                    .iter()
                    .filter_map(|o| Some((o.name.clone(), o.label_filename.clone()?)))
                    .collect(),
                warmup: config.warmup.clone(),
                version_policy: config
                    .version_policy
                    .as_ref()
                    .map(VersionPolicyConfig::resolve)
                    .transpose()?
                    .unwrap_or_default(),
                calibrated: None,
                steps: config
                    .steps
                    .iter()
                    .filter_map(|s| match s {
                        crate::pipeline::StepConfig::Model(m) => Some(StepRecord {
                            // A step of its own file runs as `<pipeline>/<file>`.
                            model: match &m.file {
                                Some(f) if m.model.is_empty() => format!("{name}/{f}"),
                                _ => m.model.clone(),
                            },
                            version: m.version,
                            inputs: m.inputs.clone(),
                            outputs: m.outputs.clone(),
                        }),
                        _ => None,
                    })
                    .collect(),
                parameters: Default::default(),
            },
            text: None,
        })
    }
}

/// Config entries may narrow a variable dim or restate a tensor; they may not contradict the
/// model. An entry with `reshape` states the model's shape there and the clients' in `dims`; those
/// go in `reshapes`.
fn apply_overrides(
    kind: &str,
    mut specs: Vec<TensorSpec>,
    overrides: &[TensorConfig],
    reshapes: &mut std::collections::BTreeMap<String, Vec<i64>>,
) -> Result<Vec<TensorSpec>> {
    for o in overrides {
        let spec = specs
            .iter_mut()
            .find(|s| s.name == o.name)
            .ok_or_else(|| Error::invalid(format!("config {kind} '{}' is not in the model", o.name)))?;
        if let Some(dt) = &o.datatype {
            let dt = DataType::parse(dt).ok_or_else(|| Error::invalid(format!("unknown datatype '{dt}'")))?;
            if dt != spec.datatype {
                return Err(Error::invalid(format!(
                    "config {kind} '{}' says {dt}, the model says {}",
                    o.name, spec.datatype
                )));
            }
        }
        let narrow = |what: &str, dims: &[i64], model: &[i64]| {
            let fits =
                dims.len() == model.len() && dims.iter().zip(model).all(|(&c, &m)| c >= -1 && (m == -1 || c == m));
            if fits {
                Ok(())
            } else {
                Err(Error::invalid(format!(
                    "config {kind} '{}' {what} {dims:?} do not fit the model's {model:?}",
                    o.name
                )))
            }
        };
        match (&o.reshape, &o.dims) {
            (Some(reshape), Some(dims)) => {
                narrow("reshape", reshape, &spec.dims)?;
                let known = |d: &[i64]| d.iter().all(|&x| x >= 0).then(|| d.iter().product::<i64>());
                let variable = |d: &[i64]| d.iter().filter(|&&x| x < 0).count();
                let counts_differ = matches!((known(dims), known(reshape)), (Some(a), Some(b)) if a != b);
                if counts_differ || dims.iter().any(|&d| d < -1) || variable(reshape) > 1 {
                    return Err(Error::invalid(format!(
                        "config {kind} '{}': dims {dims:?} cannot be reshaped to {reshape:?} (the same number of \
                         elements, at most one variable dim in reshape)",
                        o.name
                    )));
                }
                reshapes.insert(o.name.clone(), reshape.clone());
                spec.dims = dims.clone();
            }
            (Some(_), None) => {
                return Err(Error::invalid(format!("config {kind} '{}' has a reshape but no dims", o.name)))
            }
            (None, Some(dims)) => {
                narrow("dims", dims, &spec.dims)?;
                spec.dims = dims.clone();
            }
            (None, None) => {}
        }
    }
    Ok(specs)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(name: &str, dt: DataType, dims: &[i64]) -> TensorSpec {
        TensorSpec { name: name.into(), datatype: dt, dims: dims.to_vec() }
    }

    #[test]
    fn symbolic_dim0_means_batching_by_default() {
        let s = ModelSpec::resolve(
            "m",
            1,
            &ModelConfig::default(),
            &[spec("x", DataType::Fp32, &[-1, 4])],
            &[spec("y", DataType::Fp32, &[-1, 2])],
            1,
        )
        .unwrap();
        assert_eq!(s.batch.max_batch_size, DEFAULT_MAX_BATCH_SIZE);
        assert!(s.batch.dynamic);
        assert_eq!(s.inputs[0].dims, vec![4]);
    }

    #[test]
    fn fixed_dim0_means_no_batching() {
        let s = ModelSpec::resolve(
            "m",
            1,
            &ModelConfig::default(),
            &[spec("x", DataType::Fp32, &[2, 4])],
            &[spec("y", DataType::Fp32, &[2, 2])],
            1,
        )
        .unwrap();
        assert_eq!(s.batch.max_batch_size, 0);
        assert_eq!(s.inputs[0].dims, vec![2, 4]);
        let cfg = ModelConfig { max_batch_size: Some(8), ..Default::default() };
        assert!(ModelSpec::resolve("m", 1, &cfg, &[spec("x", DataType::Fp32, &[2, 4])], &[], 1).is_err());
    }

    #[test]
    fn version_policies_select_from_what_is_on_disk() {
        let on_disk = [3, 1, 7, 5];
        assert_eq!(VersionPolicy::default().select(&on_disk), vec![7]);
        assert_eq!(VersionPolicy::Latest(2).select(&on_disk), vec![7, 5]);
        assert_eq!(VersionPolicy::All.select(&on_disk), vec![7, 5, 3, 1]);
        assert_eq!(VersionPolicy::Specific(vec![1, 4, 5]).select(&on_disk), vec![5, 1]);
        let parse = |t: &str| toml::from_str::<ModelConfig>(t).unwrap().version_policy.unwrap().resolve();
        assert_eq!(parse("[version_policy]\nspecific = [2, 3]").unwrap(), VersionPolicy::Specific(vec![2, 3]));
        assert_eq!(parse("[version_policy]\nall = true").unwrap(), VersionPolicy::All);
        assert!(parse("[version_policy]\nlatest = 2\nall = true").is_err());
        assert!(parse("[version_policy]\nlatest = 0").is_err());
        assert!(parse("[version_policy]\nspecific = []").is_err());
    }

    #[test]
    fn toml_config_and_overrides() {
        let cfg: ModelConfig = toml::from_str(
            r#"
            max_batch_size = 8
            instance_count = 2
            [dynamic_batching]
            preferred_batch_size = [4, 8]
            max_queue_delay_microseconds = 100
            [[input]]
            name = "x"
            dims = [4]
            "#,
        )
        .unwrap();
        let io = [spec("x", DataType::Fp32, &[-1, -1])];
        let s = ModelSpec::resolve("m", 3, &cfg, &io, &[spec("y", DataType::Fp32, &[-1])], 1).unwrap();
        assert_eq!(s.inputs[0].dims, vec![4]);
        assert_eq!(s.batch.preferred_batch_sizes, vec![4, 8]);
        assert_eq!(s.batch.max_queue_delay_us, 100);
        assert!(!s.batch.gather, "a delay the config sets is kept as it is");
        assert_eq!(s.instance_count, 2);
        let unset = ModelSpec::resolve("m", 3, &toml::from_str("max_batch_size = 8").unwrap(), &io, &[], 1).unwrap();
        assert!(unset.batch.gather && unset.batch.max_queue_delay_us == 0);
        let zero = "max_batch_size = 8\n[dynamic_batching]\nmax_queue_delay_microseconds = 0";
        assert!(!ModelSpec::resolve("m", 3, &toml::from_str(zero).unwrap(), &io, &[], 1).unwrap().batch.gather);

        let bad: ModelConfig = toml::from_str("[[input]]\nname = \"x\"\ndatatype = \"INT8\"").unwrap();
        assert!(ModelSpec::resolve("m", 1, &bad, &io, &[], 1).is_err());
        assert!(toml::from_str::<ModelConfig>("max_batch = 3").is_err());
    }

    #[test]
    fn reshape_keeps_the_element_count_and_fits_the_model() {
        let io = [spec("x", DataType::Fp32, &[-1, 4])];
        let resolve = |t: &str| ModelSpec::resolve("m", 1, &toml::from_str(t).unwrap(), &io, &[], 1);
        let s = resolve("[[input]]\nname = \"x\"\ndims = [2, 2]\nreshape = [4]").unwrap();
        assert_eq!((s.inputs[0].dims.clone(), s.reshape["x"].clone()), (vec![2, 2], vec![4]));
        assert!(resolve("[[input]]\nname = \"x\"\ndims = [3]\nreshape = [4]").is_err());
        assert!(resolve("[[input]]\nname = \"x\"\ndims = [4]\nreshape = [5]").is_err());
        assert!(resolve("[[input]]\nname = \"x\"\nreshape = [4]").is_err());
    }
}
