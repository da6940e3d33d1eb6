//! The resolved description a model runs with: its tensors, how the batcher treats it, its
//! queue policies. Built from a model's config by `control::config`; read by the batcher, the
//! front-ends' metadata and config endpoints, and the Python package.

use serde::Deserialize;

use crate::{engine::onnx::OnnxOptions, DataType, Error, Result};

/// Defaults for a batching model whose config does not say otherwise. Chosen by the `bench/`
/// measurements on a 2-core host (see README "Defaults"): merging up to 64 rows with no added
/// delay lets batches form from whatever queued while an instance was busy.
pub const DEFAULT_MAX_BATCH_SIZE: usize = 64;
pub const DEFAULT_MAX_QUEUE_DELAY_US: u64 = 0;
pub const DEFAULT_MAX_QUEUE_SIZE: usize = 1024;
/// Each level holds its own queue; a config cannot ask for an unbounded number of them.
pub const MAX_PRIORITY_LEVELS: u32 = 64;

/// Triton's `timeout_action`: a request past its timeout while queued is either failed at once
/// (`reject`) or kept and run after every request of its level and above that is still in time
/// (`delay`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TimeoutAction {
    #[default]
    Reject,
    Delay,
}

impl TimeoutAction {
    pub fn as_str(self) -> &'static str {
        match self {
            TimeoutAction::Reject => "REJECT",
            TimeoutAction::Delay => "DELAY",
        }
    }
}

/// The queue policy of one priority level.
#[derive(Debug, Clone, PartialEq)]
pub struct QueuePolicy {
    pub max_queue_size: usize,
    /// 0: no timeout unless the request gives one.
    pub default_timeout_us: u64,
    pub allow_timeout_override: bool,
    pub timeout_action: TimeoutAction,
}

impl Default for QueuePolicy {
    fn default() -> Self {
        QueuePolicy {
            max_queue_size: DEFAULT_MAX_QUEUE_SIZE,
            default_timeout_us: 0,
            allow_timeout_override: true,
            timeout_action: TimeoutAction::Reject,
        }
    }
}

impl QueuePolicy {
    /// The timeout a request gets: its own when it may override and it is shorter, else the default.
    pub fn timeout(&self, requested_us: Option<u64>) -> Option<std::time::Duration> {
        let default = self.default_timeout_us;
        let us = match requested_us.filter(|&t| t > 0 && self.allow_timeout_override) {
            Some(t) if default == 0 || t < default => t,
            _ => default,
        };
        (us > 0).then(|| std::time::Duration::from_micros(us))
    }
}

/// A tensor as a model declares it. `dims` exclude the batch dim when the model batches.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorSpec {
    pub name: String,
    pub datatype: DataType,
    pub dims: Vec<i64>,
}

/// How the batcher treats one model.
#[derive(Debug, Clone, PartialEq)]
pub struct BatchPolicy {
    /// 0: requests run one by one, as sent.
    pub max_batch_size: usize,
    /// False: requests run one by one even when the model batches.
    pub dynamic: bool,
    pub preferred_batch_sizes: Vec<usize>,
    /// The most rows the batcher merges into one run (at most `max_batch_size`): lowered by the
    /// calibration for models that run slower per row in larger batches, scaled to each size of
    /// rows (`merge_at`, `costs::Bounds`), and lowered further where the batcher's own
    /// measurements say so. A single request with more rows still runs, alone.
    pub merge_limit: usize,
    /// The input elements a row held where calibration chose `merge_limit` (a variable-size model
    /// is measured at one size); 0: the limit holds for rows of every size.
    pub merge_at: usize,
    pub max_queue_delay_us: u64,
    /// The config left `max_queue_delay_microseconds` unset: a single-instance model's batch may
    /// wait for the callers of the batch before it, when its measured costs say one merged run
    /// serves them sooner (see `BatchCosts::hold`), and the instances share the work (the
    /// batcher's `share`). Set, even to 0, the delay is Triton's: fixed.
    pub gather: bool,
    pub priority_levels: u32,
    pub default_priority_level: u32,
    /// Requests are answered in the order they left the queue (Triton's `preserve_ordering`).
    pub preserve_ordering: bool,
    /// The policy of levels without their own.
    pub queue: QueuePolicy,
    /// One per level, highest priority first.
    pub level_queues: Vec<QueuePolicy>,
}

impl BatchPolicy {
    /// The most rows one merged batch may hold: the configured `max_batch_size` (or the merge
    /// limit, for a model that does not batch).
    pub fn most_rows(&self) -> usize {
        self.max_batch_size.max(self.merge_limit)
    }
}

impl Default for BatchPolicy {
    fn default() -> Self {
        BatchPolicy {
            max_batch_size: 0,
            dynamic: false,
            preferred_batch_sizes: Vec::new(),
            merge_limit: 0,
            merge_at: 0,
            max_queue_delay_us: DEFAULT_MAX_QUEUE_DELAY_US,
            gather: true,
            priority_levels: 1,
            preserve_ordering: false,
            default_priority_level: 1,
            queue: QueuePolicy::default(),
            level_queues: vec![QueuePolicy::default()],
        }
    }
}

/// The resolved description a model serves with: what metadata and config endpoints report.
#[derive(Debug, Clone)]
pub struct ModelSpec {
    pub name: String,
    pub version: u64,
    pub platform: &'static str,
    pub backend: &'static str,
    pub inputs: Vec<TensorSpec>,
    pub outputs: Vec<TensorSpec>,
    pub batch: BatchPolicy,
    pub instance_count: usize,
    /// The ONNX Runtime session settings every instance runs with.
    pub onnx: OnnxOptions,
    /// Threads of the solo instance beside single-threaded ones (see the batcher); 0: none.
    pub solo_threads: usize,
    /// Class labels of outputs (one per line of their `label_filename`), for classification.
    pub labels: std::collections::BTreeMap<String, Vec<String>>,
    /// Tensors whose shape in the model differs from the clients' (`dims`): the model's shape,
    /// without the batch dim (Triton's `reshape`).
    pub reshape: std::collections::BTreeMap<String, Vec<i64>>,
    /// Inputs a request may leave out.
    pub optional: std::collections::BTreeSet<String>,
    /// The models a pipeline's steps call (empty for a model).
    pub uses: Vec<String>,
    /// Responses are cached (when the process has a cache).
    pub cache: bool,
    /// One cache entry answers every tenant (`[cache] across_tenants = true`): repeated work is
    /// shared, and a tenant can tell by the time (or its hits) what another tenant sent.
    pub cache_across_tenants: bool,
    /// How the model was loaded; the engine reads none of it.
    pub load: LoadRecord,
    /// What the text routes (TEI's, OpenAI's) need of a text pipeline: its task and tokenizer.
    pub text: Option<std::sync::Arc<TextSpec>>,
}

/// What a text pipeline answers, as its config declares it (`task = "..."`); a pipeline that
/// tokenizes and pools is an embedder unless it says otherwise. TEI's routes go by it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Task {
    /// A vector per text (`/embed`, `/v1/embeddings`).
    Embed,
    /// One score per (query, text) pair, a cross-encoder (`/rerank`, `/v1/rerank`).
    Rerank,
    /// A score per class for a text or a pair (`/predict`).
    Classify,
}

impl Task {
    pub fn as_str(self) -> &'static str {
        match self {
            Task::Embed => "embed",
            Task::Rerank => "rerank",
            Task::Classify => "classify",
        }
    }
}

/// A text pipeline as its routes see it: which inputs take the text (and the second text of a
/// pair), which output answers, how long a text may be, and the tokenizer (without its file's
/// truncation and padding) for `/tokenize`, `/decode` and the length checks.
#[derive(Debug, Clone)]
pub struct TextSpec {
    pub task: Task,
    pub input: String,
    pub pair: Option<String>,
    /// The vector (embed) or the scores (rerank: one per row; classify: one per class).
    pub output: String,
    /// The tokens each row took (`token_count`), when the pipeline answers it.
    pub count: Option<String>,
    /// Tokens per text at most, special tokens included (the tokenize step's `max_length`).
    pub max_length: usize,
    pub special_tokens: bool,
    /// How the pool step pools (`mean`, `cls`, `max`), for TEI's `/info`.
    pub pooling: Option<String>,
    /// The pipeline's own vectors are unit vectors (its pool step normalizes).
    pub normalized: bool,
    /// A classifier's labels in the order of its scores.
    pub labels: Vec<String>,
    /// sentence-transformers' prompts (`config_sentence_transformers.json`): name -> prefix.
    pub prompts: std::collections::BTreeMap<String, String>,
    pub default_prompt: Option<String>,
    pub tokenizer: std::sync::Arc<tokenizers::Tokenizer>,
}

/// What a model was loaded from and chose at load, for the control plane and the config
/// endpoints (Triton's `/config`): records, not settings the engine serves with.
#[derive(Debug, Clone, Default)]
pub struct LoadRecord {
    /// The file each version directory holds the model in.
    pub model_filename: String,
    /// The `label_filename` of outputs that name one (as the config states it).
    pub label_files: std::collections::BTreeMap<String, String>,
    /// The warm-up requests the config states (run at each load).
    pub warmup: Vec<WarmupConfig>,
    pub version_policy: VersionPolicy,
    /// What the calibration at load chose, when it ran.
    pub calibrated: Option<String>,
    /// A pipeline's model steps as its config states them (a Triton ensemble's `step`s).
    pub steps: Vec<StepRecord>,
    /// A Python model's `parameters`, as its config states them.
    pub parameters: std::collections::BTreeMap<String, String>,
}

/// One model step of a pipeline: the model it calls and how tensors are named on each side.
#[derive(Debug, Clone, PartialEq)]
pub struct StepRecord {
    pub model: String,
    pub version: Option<u64>,
    /// Model input -> pipeline tensor.
    pub inputs: std::collections::BTreeMap<String, String>,
    /// Model output -> pipeline tensor.
    pub outputs: std::collections::BTreeMap<String, String>,
}

impl ModelSpec {
    /// Whether dim 0 of every input and output is the batch dim (`max_batch_size > 0`).
    pub fn batched(&self) -> bool {
        self.batch.max_batch_size > 0
    }

    /// Whether this is a pipeline (its BYTES inputs are encoded images or texts, checked by its steps).
    pub fn is_pipeline(&self) -> bool {
        self.platform == "ensemble"
    }

    /// The settings chosen for this model that Triton's config shows as `parameters` (the
    /// onnxruntime backend's names), for the config endpoints of every front-end.
    pub fn parameters(&self) -> Vec<(String, String)> {
        if self.backend == "python" {
            return self.load.parameters.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        }
        let o = &self.onnx;
        let mut p = vec![
            ("threads", o.intra_threads.to_string()),
            ("intra_op_thread_count", o.intra_threads.to_string()),
            ("inter_op_thread_count", o.inter_threads.to_string()),
            ("execution_mode", if o.parallel { "parallel" } else { "sequential" }.to_string()),
            ("graph_optimization_level", o.optimization_level.to_string()),
            ("enable_mem_arena", o.mem_arena.to_string()),
            ("enable_mem_pattern", o.mem_pattern.to_string()),
            ("memory.enable_memory_arena_shrinkage", o.arena_shrinkage.to_string()),
            ("spinning", o.spinning.to_string()),
            ("spin_in_run", o.spin_in_run.to_string()),
            ("share_weights", o.share_weights.to_string()),
            ("batch_merge_limit", self.batch.merge_limit.to_string()),
        ];
        if self.batch.merge_at > 0 {
            p.push(("batch_merge_limit_row_elements", self.batch.merge_at.to_string()));
        }
        if let Some(a) = &o.intra_thread_affinity {
            p.push(("intra_op_thread_affinity", a.clone()));
        }
        if let Some(c) = &self.load.calibrated {
            p.push(("calibrated", c.clone()));
        }
        if self.solo_threads > 0 {
            p.push(("solo_instance_threads", self.solo_threads.to_string()));
        }
        p.into_iter().map(|(k, v)| (k.to_string(), v)).collect()
    }

    /// `t`'s shape as clients see it: with a leading -1 for the batch dim when the model batches.
    pub fn wire_shape(&self, t: &TensorSpec) -> Vec<i64> {
        self.batched().then_some(-1).into_iter().chain(t.dims.iter().copied()).collect()
    }
}

/// `shape` (with its batch dim first when `batched`) as `to` (without it): the same elements, a
/// variable dim of `to` (at most one) taking what the others leave.
pub(crate) fn reshaped(shape: &[usize], batched: bool, to: &[i64]) -> Result<Vec<usize>> {
    let (rows, row) = if batched { (Some(shape[0]), &shape[1..]) } else { (None, shape) };
    let elements: usize = row.iter().product();
    let known: usize = to.iter().filter(|&&d| d >= 0).map(|&d| d as usize).product();
    let fill = match known {
        0 => 0,
        k if elements.is_multiple_of(k) => elements / k,
        _ => usize::MAX,
    };
    let out: Vec<usize> = rows.into_iter().chain(to.iter().map(|&d| if d < 0 { fill } else { d as usize })).collect();
    let count: usize = out.iter().skip(usize::from(batched)).product();
    if fill == usize::MAX || count != elements {
        return Err(Error::invalid(format!("shape {row:?} cannot be reshaped to {to:?}")));
    }
    Ok(out)
}
// The load records a spec carries for its model's warm-ups and Triton's `/config` (read from
// `config.toml` or `config.pbtxt` by `control::config`, which re-exports them).

/// Which of the versions on disk a model serves (Triton's `version_policy`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VersionPolicy {
    Latest(usize),
    All,
    Specific(Vec<u64>),
}

impl Default for VersionPolicy {
    fn default() -> Self {
        VersionPolicy::Latest(1)
    }
}

/// `[[warmup]]`: one warm-up request; its inputs each of zeros, random values or a file's bytes.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct WarmupConfig {
    pub name: String,
    /// Rows of the request (each a copy of the inputs below); 0 means 1.
    #[serde(default)]
    pub batch_size: usize,
    /// Times the request is run; 0 means once.
    #[serde(default)]
    pub count: usize,
    pub inputs: std::collections::BTreeMap<String, WarmupInputConfig>,
}

/// One input of a warm-up request: `dims` without the batch dim, and exactly one data source.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct WarmupInputConfig {
    pub datatype: String,
    pub dims: Vec<i64>,
    #[serde(default)]
    pub zero_data: bool,
    #[serde(default)]
    pub random_data: bool,
    /// A file of the model's `warmup/` directory: the row's raw bytes, row-major (BYTES: each
    /// element a 4-byte little-endian length, then its bytes).
    pub input_data_file: Option<String>,
}
