//! The model repository on disk: `<root>/<name>/config.toml` and `<root>/<name>/<version>/model.onnx`.

use std::{
    path::{Path, PathBuf},
    sync::Arc,
};

use crate::{
    cache::ResponseCache,
    control::config::ModelConfig,
    engine::spec::{ModelSpec, Task, TensorSpec},
    engine::{
        onnx::{OnnxBackend, OnnxOptions},
        tuning,
    },
    Backend, Error, Model, Result,
};

/// The model file of a version directory unless the config names another.
pub const DEFAULT_MODEL_FILENAME: &str = "model.onnx";

/// How models are loaded when their config does not say.
#[derive(Debug, Clone)]
pub struct LoadOptions {
    /// Intra-op threads a model's instances share (the CPU budget): each of N instances gets
    /// threads / N, unless its config says otherwise.
    pub threads: usize,
    pub spinning: bool,
    /// Let slow models' threads spin within runs (see `tuning::spins_in_run`), where a model's
    /// config does not say.
    pub spin_in_run: bool,
    /// Calibrate spinning and the batch limit at load where a model's config leaves them open.
    pub calibrate: bool,
    /// The process's response cache, used by models whose config enables it.
    pub cache: Option<Arc<ResponseCache>>,
    /// The interpreter Python models' workers run under (unless a model names its own environment).
    pub python: PathBuf,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions {
            threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
            spinning: false,
            spin_in_run: false,
            calibrate: false,
            cache: None,
            python: PathBuf::from("python3"),
        }
    }
}

/// A model name is an identifier: letters, digits, `_`, `-`, `.`; it starts with a letter or digit.
pub fn is_model_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphanumeric())
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))
        && !name.contains("..")
}

/// A model repository on disk. Every path it reads is resolved and checked to stay under the
/// root, so a symlink cannot lead a load outside it.
#[derive(Debug, Clone)]
pub struct Repository {
    root: PathBuf,
    /// When the root is itself a Hugging Face directory (what TEI's `--model-id` names), the
    /// name of the one model it holds: the directory's own name.
    lone: Option<String>,
    pub options: LoadOptions,
}

/// One version directory holding a `model.onnx`.
#[derive(Debug, Clone)]
pub struct OnDisk {
    pub version: u64,
    pub onnx: PathBuf,
    /// Changes when the file is replaced or rewritten (length, modification time, inode).
    pub fingerprint: u64,
}

/// Rows per pipeline batch when its config does not say (see `load_pipeline`).
pub const PIPELINE_MAX_BATCH_SIZE: usize = 32;

impl Repository {
    pub fn open(root: &Path, options: LoadOptions) -> Result<Repository> {
        let root = root
            .canonicalize()
            .map_err(|e| Error::invalid(format!("cannot read model repository {}: {e}", root.display())))?;
        if !root.is_dir() {
            return Err(Error::invalid(format!("model repository {} is not a directory", root.display())));
        }
        let lone = match root.file_name().and_then(|n| n.to_str()) {
            Some(name) if super::hugging_face::is_layout(&root) => {
                if !is_model_name(name) {
                    return Err(Error::invalid(format!(
                        "model repository {} is a Hugging Face directory served as one model named after it, and \
                         '{name}' is not a valid model name (letters, digits, _, - and .)",
                        root.display()
                    )));
                }
                Some(name.to_string())
            }
            _ => None,
        };
        Ok(Repository { root, lone, options })
    }

    /// `path` resolved, if it exists and stays under the root.
    fn inside(&self, path: &Path) -> Result<Option<PathBuf>> {
        match path.canonicalize() {
            Ok(real) if real.starts_with(&self.root) => Ok(Some(real)),
            Ok(_) => Err(Error::invalid(format!("{} leads outside the model repository", path.display()))),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(Error::invalid(format!("cannot read {}: {e}", path.display()))),
        }
    }

    /// The names of the model directories, sorted (hidden ones left out; invalid ones kept, so
    /// they are reported); a Hugging Face directory's own name when the root is one.
    pub fn names(&self) -> Vec<String> {
        if let Some(name) = &self.lone {
            return vec![name.clone()];
        }
        let Ok(entries) = std::fs::read_dir(&self.root) else { return Vec::new() };
        let mut names: Vec<String> = entries
            .filter_map(|e| e.ok())
            .filter(|e| e.path().is_dir())
            .filter_map(|e| e.file_name().to_str().map(str::to_string))
            .filter(|n| !n.starts_with('.'))
            .collect();
        names.sort();
        names
    }

    fn model_dir(&self, name: &str) -> Result<PathBuf> {
        if !is_model_name(name) {
            return Err(Error::invalid(format!("'{name}' is not a valid model name")));
        }
        let dir = match &self.lone {
            Some(lone) if lone == name => Some(self.root.clone()),
            Some(_) => None,
            None => self.inside(&self.root.join(name))?,
        };
        match dir {
            Some(dir) if dir.is_dir() => Ok(dir),
            _ => Err(Error::NotFound(format!("no model '{name}' in the repository"))),
        }
    }

    /// The model's config file: Ferrite's `config.toml` or Triton's `config.pbtxt` (an empty
    /// `config.toml` when it has neither). Both in one directory is an error naming both.
    pub fn config_file(&self, name: &str) -> Result<ConfigFile> {
        let dir = self.model_dir(name)?;
        let read = |file: &str| -> Result<Option<String>> {
            let path = dir.join(file);
            match self.inside(&path)? {
                None => Ok(None),
                Some(p) => std::fs::read_to_string(&p)
                    .map(Some)
                    .map_err(|e| Error::invalid(format!("cannot read {}: {e}", path.display()))),
            }
        };
        match (read("config.toml")?, read("config.pbtxt")?) {
            (Some(_), Some(_)) => {
                Err(Error::invalid("the model's directory holds both config.toml and config.pbtxt; keep one of them"))
            }
            (None, Some(text)) => Ok(ConfigFile { format: ConfigFormat::Pbtxt, text }),
            (toml, None) => Ok(ConfigFile { format: ConfigFormat::Toml, text: toml.unwrap_or_default() }),
        }
    }

    /// The config a model serves with: `file`'s, and for a Hugging Face directory whose config
    /// has no steps of its own, the text pipeline its files describe (`hugging_face`).
    pub fn config(&self, name: &str, file: &ConfigFile) -> Result<ModelConfig> {
        let config = file.parse(name)?;
        let dir = self.model_dir(name)?;
        if !config.steps.is_empty() || !super::hugging_face::is_layout(&dir) {
            return Ok(config);
        }
        super::hugging_face::pipeline(&dir, config)
    }

    /// The model's version directories that hold its model file (`filename`, normally
    /// `model.onnx`), highest first.
    pub fn versions(&self, name: &str, filename: &str) -> Result<Vec<OnDisk>> {
        if Path::new(filename).components().count() != 1 || filename.starts_with('.') {
            return Err(Error::invalid(format!("default_model_filename '{filename}' must be a file name")));
        }
        use std::os::unix::fs::MetadataExt;
        let dir = self.model_dir(name)?;
        let entries =
            std::fs::read_dir(&dir).map_err(|e| Error::invalid(format!("cannot read {}: {e}", dir.display())))?;
        let mut found = Vec::new();
        for e in entries.filter_map(|e| e.ok()) {
            let Some(version) = e.file_name().to_str().and_then(|n| n.parse::<u64>().ok()).filter(|&v| v > 0) else {
                continue;
            };
            let Some(onnx) = self.inside(&e.path().join(filename))? else { continue };
            let Ok(meta) = std::fs::metadata(&onnx) else { continue };
            if !meta.is_file() {
                continue;
            }
            let stamp = (meta.len(), meta.mtime(), meta.mtime_nsec(), meta.ino());
            let fingerprint = xxhash_rust::xxh3::xxh3_64(format!("{stamp:?}").as_bytes());
            found.push(OnDisk { version, onnx, fingerprint });
        }
        found.sort_by_key(|d| std::cmp::Reverse(d.version));
        Ok(found)
    }

    /// A pipeline's versions: its positive-integer directories (Triton's ensembles have an empty
    /// `1/`), else version 1. The fingerprint follows the files of its directory (tokenizer,
    /// labels), whose `onnx` path it carries.
    pub fn pipeline_versions(&self, name: &str) -> Result<Vec<OnDisk>> {
        use std::os::unix::fs::MetadataExt;
        let dir = self.model_dir(name)?;
        let entries =
            std::fs::read_dir(&dir).map_err(|e| Error::invalid(format!("cannot read {}: {e}", dir.display())))?;
        let mut versions = Vec::new();
        let mut stamps = Vec::new();
        for e in entries.filter_map(|e| e.ok()) {
            let name = e.file_name().to_string_lossy().to_string();
            match name.parse::<u64>() {
                Ok(v) if v > 0 => versions.push(v),
                _ => {
                    // Its files, and those of its other directories (a Hugging Face directory's
                    // `onnx/`, `1_Pooling/`).
                    let inner = std::fs::read_dir(e.path()).into_iter().flatten().flatten();
                    let files = std::iter::once((name.clone(), e.path()))
                        .chain(inner.map(|f| (format!("{name}/{}", f.file_name().to_string_lossy()), f.path())));
                    for (name, path) in files {
                        if let Some(m) = std::fs::metadata(path).ok().filter(|m| m.is_file()) {
                            stamps.push((name, m.len(), m.mtime(), m.mtime_nsec(), m.ino()));
                        }
                    }
                }
            }
        }
        stamps.sort();
        let fingerprint = xxhash_rust::xxh3::xxh3_64(format!("{stamps:?}").as_bytes());
        if versions.is_empty() {
            versions.push(1);
        }
        versions.sort_by_key(|&v| std::cmp::Reverse(v));
        Ok(versions.into_iter().map(|version| OnDisk { version, onnx: dir.clone(), fingerprint }).collect())
    }

    /// Builds the pipeline `name` (version `version`) from `config.steps`; `models` is what serves
    /// beside it (its model steps' models), `registry` where its steps find them at run time.
    pub fn load_pipeline(
        &self,
        name: &str,
        version: u64,
        config: &ModelConfig,
        fingerprint: u64,
        models: &crate::Registry,
        registry: Arc<arc_swap::ArcSwap<crate::Registry>>,
    ) -> Result<Model> {
        let dir = self.model_dir(name)?;
        // Its tensors follow from its steps; the config names its outputs, and what it states of
        // a tensor's type (as Triton's ensembles do) must agree.
        let labelled_input = config.input.iter().find(|t| t.label_filename.is_some());
        if let Some(t) =
            labelled_input.or(config.input.iter().chain(&config.output).find(|t| t.reshape.is_some() || t.optional))
        {
            return Err(Error::invalid(format!(
                "'{}': a pipeline's tensors take a name, datatype and dims only (and outputs a label_filename)",
                t.name
            )));
        }
        let names = |ts: &[crate::control::config::TensorConfig]| ts.iter().map(|t| t.name.clone()).collect::<Vec<_>>();
        let (inputs, outputs) = (names(&config.input), names(&config.output));
        // Its own models (`file` steps: a Hugging Face directory's ONNX file), loaded with its
        // config's ONNX Runtime settings and batches no larger than its own; they serve only it.
        let mut own = std::collections::BTreeMap::new();
        for step in &config.steps {
            let crate::pipeline::StepConfig::Model(m) = step else { continue };
            let Some(file) = &m.file else { continue };
            let path = crate::pipeline::model_file(&dir, file, "model file")?;
            let path = self.inside(&path)?.ok_or_else(|| Error::invalid(format!("no model file '{file}'")))?;
            let settings = ModelConfig {
                max_batch_size: config.max_batch_size.filter(|&n| n > 0),
                threads: config.threads,
                onnxruntime: config.onnxruntime.clone(),
                calibrate: config.calibrate,
                solo_instance: config.solo_instance,
                ..Default::default()
            };
            let own_name = if m.model.is_empty() { format!("{name}/{file}") } else { m.model.clone() };
            let model = load_version(&path, &own_name, version, &settings, &self.options)
                .map_err(|e| Error::invalid(format!("model file '{file}': {e}")))?;
            own.insert(file.clone(), Arc::new(model));
        }
        let pipeline =
            crate::pipeline::Pipeline::build(name, &dir, &config.steps, &inputs, &outputs, models, registry as _, own)?;
        for (what, stated, derived) in
            [("input", &config.input, pipeline.inputs()), ("output", &config.output, pipeline.outputs())]
        {
            for t in stated {
                let Some(d) = derived.iter().find(|d| d.name == t.name) else {
                    let names: Vec<&str> = derived.iter().map(|d| d.name.as_str()).collect();
                    return Err(Error::invalid(format!("{what} '{}' is not one of the pipeline's: {names:?}", t.name)));
                };
                let datatype = t.datatype.as_deref().map(|s| {
                    crate::DataType::parse(s).ok_or_else(|| Error::invalid(format!("unknown datatype '{s}'")))
                });
                let wrong_type = datatype.transpose()?.is_some_and(|dt| dt != d.datatype);
                let wrong_dims = t.dims.as_ref().is_some_and(|dims| {
                    dims.len() != d.dims.len() || dims.iter().zip(&d.dims).any(|(&s, &g)| s >= 0 && g >= 0 && s != g)
                });
                if wrong_type || wrong_dims {
                    return Err(Error::invalid(format!(
                        "{what} '{}': the config says {:?} {:?}, the steps make {} {:?}",
                        t.name, t.datatype, t.dims, d.datatype, d.dims
                    )));
                }
            }
        }
        // Its workers run the native steps and wait for its model steps: twice as many as the CPU
        // budget has threads, so some prepare batches while others wait; batches of 32 rows (the
        // pipelines benchmark's choice: bench/results/pipelines.md).
        let workers = config.instance_count.unwrap_or(2 * self.options.threads).max(1);
        let mut spec = pipeline_spec(name, version, config, &pipeline, workers)?;
        spec.labels = labels(&dir, config)?;
        spec.labels.extend(config.labels.clone());
        spec.load.label_files =
            config.output.iter().filter_map(|o| Some((o.name.clone(), o.label_filename.clone()?))).collect();
        spec.text = pipeline.text_spec(&dir, config.task, &spec.labels)?.map(Arc::new);
        // Cached answers follow the pipeline's files and config and the models it calls.
        let mut content = fingerprint;
        for m in &spec.uses {
            if let Ok(model) = models.model(m, None) {
                content = xxhash_rust::xxh3::xxh3_64(&[content.to_le_bytes(), model.content.to_le_bytes()].concat());
            }
        }
        // A text embedder answers its token embeddings too: its steps before the pool step (the
        // same built steps and models, nothing loaded again), by two workers of their own, so
        // that its pooled answers keep their fixed shape and stack across requests.
        let pooled = pipeline.pooled().filter(|_| spec.text.as_ref().is_some_and(|t| t.task == Task::Embed));
        let token_embeddings = match pooled {
            Some((at, hidden)) => {
                let label = format!("{name}/embed_all");
                let built = pipeline
                    .prefix(&label, at, &[hidden.to_string(), "token_count".to_string()])
                    .and_then(|p| Model::start(pipeline_spec(&label, version, config, &p, 2)?, &p, None));
                match built {
                    Ok(m) => Some(Arc::new(m)),
                    Err(e) => {
                        tracing::warn!(model = name, "its token embeddings (/embed_all) are not served: {e}");
                        None
                    }
                }
            }
            None => None,
        };
        let cache = self.options.cache.clone().filter(|_| spec.cache);
        let mut model = Model::start(spec, &pipeline, None)?;
        model.cache = cache;
        model.content = content;
        model.fingerprint = fingerprint;
        model.token_embeddings = token_embeddings;
        Ok(model)
    }

    /// Loads one version with `config`, as `name`, and starts its batcher.
    /// `models`: where a Python model's BLS calls find the other models.
    pub fn load_version(
        &self,
        name: &str,
        disk: &OnDisk,
        config: &ModelConfig,
        fingerprint: u64,
        models: Option<std::sync::Weak<dyn crate::engine::model::Models>>,
    ) -> Result<Model> {
        let mut model = if config.is_python() {
            load_python(&disk.onnx, name, disk.version, config, &self.options, models)?
        } else {
            load_version(&disk.onnx, name, disk.version, config, &self.options)?
        };
        model.fingerprint = fingerprint;
        Ok(model)
    }
}

/// The spec of `pipeline`, named `name`, run by `workers` instances in batches of the config's
/// `max_batch_size` (`PIPELINE_MAX_BATCH_SIZE` by default).
fn pipeline_spec(
    name: &str,
    version: u64,
    config: &ModelConfig,
    pipeline: &crate::pipeline::Pipeline,
    workers: usize,
) -> Result<ModelSpec> {
    let batched =
        |t: &TensorSpec| TensorSpec { dims: std::iter::once(-1).chain(t.dims.iter().copied()).collect(), ..t.clone() };
    let inputs: Vec<_> = pipeline.inputs().iter().map(batched).collect();
    let outputs: Vec<_> = pipeline.outputs().iter().map(batched).collect();
    let mut plain = config.clone();
    plain.input.clear();
    plain.output.clear();
    plain.instance_count = Some(workers);
    plain.max_batch_size = Some(config.max_batch_size.unwrap_or(PIPELINE_MAX_BATCH_SIZE));
    let mut spec = ModelSpec::resolve(name, version, &plain, &inputs, &outputs, 1)?;
    spec.platform = "ensemble";
    spec.backend = "ferrite";
    spec.uses = pipeline.uses.clone();
    Ok(spec)
}

/// The format of a model's config file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConfigFormat {
    /// Ferrite's `config.toml`.
    Toml,
    /// Triton's `config.pbtxt`.
    Pbtxt,
}

/// A model's config file as read.
#[derive(Debug, Clone)]
pub struct ConfigFile {
    pub format: ConfigFormat,
    pub text: String,
}

impl ConfigFile {
    /// The config of the model in directory `name`.
    pub fn parse(&self, name: &str) -> Result<ModelConfig> {
        match self.format {
            ConfigFormat::Toml => parse_config(&self.text),
            ConfigFormat::Pbtxt => {
                let config = crate::control::triton::to_config(&crate::control::triton::parse(&self.text)?, name)?;
                check_config(&config)?;
                Ok(config)
            }
        }
    }
}

/// Parses a `config.toml`; "" is the empty config.
pub fn parse_config(text: &str) -> Result<ModelConfig> {
    let config: ModelConfig = toml::from_str(text).map_err(|e| config_error(text, &e))?;
    check_config(&config)?;
    Ok(config)
}

/// A config error in one line: the line of the bad value, and for a step, which step it is.
fn config_error(text: &str, e: &toml::de::Error) -> Error {
    let line = |at: usize| text[..at.min(text.len())].matches('\n').count() + 1;
    let message = e.message().replace('\n', " ");
    // Steps are read whole by their `op`, so a bad value inside one is read again on its own,
    // for its line and the step's name.
    #[derive(serde::Deserialize)]
    struct Steps {
        #[serde(default)]
        steps: Vec<toml::Spanned<toml::Table>>,
    }
    let steps = toml::from_str::<Steps>(text).map(|s| s.steps).unwrap_or_default();
    // A step's body: after its `[[steps]]` header, up to the next table header.
    let body = |from: usize| {
        let rest = &text[from.min(text.len())..];
        let header = |l: &str| {
            let l = l.trim_start();
            l.starts_with('[') && l.trim_start_matches('[').starts_with(|c: char| c.is_ascii_alphabetic() || c == '_')
        };
        let end = rest.split_inclusive('\n').take_while(|l| !header(l)).map(str::len).sum::<usize>();
        from..from + end
    };
    for (i, step) in steps.iter().enumerate() {
        let span = body(step.span().end);
        let Some(e) = text.get(span.clone()).and_then(|t| toml::from_str::<crate::pipeline::StepConfig>(t).err())
        else {
            continue;
        };
        let table = step.get_ref();
        let op = table.get("op").and_then(|v| v.as_str()).unwrap_or("no op");
        let name = table.get("name").and_then(|v| v.as_str()).map(|n| format!("'{n}' ")).unwrap_or_default();
        // An error inside a step comes without a position (the step is read through its `op`):
        // the line is the one holding the value the message names (`unknown field `x``), else
        // the step's header.
        let named = e.message().split('`').nth(1).filter(|t| !t.is_empty());
        let at = e
            .span()
            .map(|s| span.start + s.start)
            .or_else(|| named.and_then(|t| text[span.clone()].find(t)).map(|i| span.start + i))
            .unwrap_or(step.span().start);
        return Error::invalid(format!(
            "config.toml line {}: step {} {name}({op}): {}",
            line(at),
            i + 1,
            e.message().replace('\n', " ")
        ));
    }
    match e.span() {
        Some(s) => Error::invalid(format!("config.toml line {}: {message}", line(s.start))),
        None => Error::invalid(format!("config.toml: {message}")),
    }
}

/// The most instances, or threads of one instance, a config may ask for: four per thread of the
/// CPU budget, and at least 16. Past it a typo (`count: 1000000`) would start threads until the
/// host gives out, before anything could fail.
pub fn most_threads() -> usize {
    (4 * std::thread::available_parallelism().map_or(1, |n| n.get())).max(16)
}

/// Warm-up requests a config may state, and times each may run.
const MAX_WARMUPS: usize = 64;
const MAX_WARMUP_COUNT: usize = 100;

fn check_config(config: &ModelConfig) -> Result<()> {
    let most = most_threads();
    let ort = config.onnxruntime.as_ref();
    for (what, n) in [
        ("instance_count (instance_group count)", config.instance_count),
        ("threads", config.threads),
        ("intra_op_thread_count", ort.and_then(|o| o.intra_op_thread_count)),
        ("inter_op_thread_count", ort.and_then(|o| o.inter_op_thread_count)),
    ] {
        if let Some(n) = n.filter(|&n| n > most) {
            return Err(Error::invalid(format!(
                "{what} is {n}, more than {most} (four per CPU thread of this host, at least 16)"
            )));
        }
    }
    if config.warmup.len() > MAX_WARMUPS {
        return Err(Error::invalid(format!("{} warm-ups, more than {MAX_WARMUPS}", config.warmup.len())));
    }
    if let Some(w) = config.warmup.iter().find(|w| w.count > MAX_WARMUP_COUNT) {
        return Err(Error::invalid(format!("warm-up '{}': count {} is more than {MAX_WARMUP_COUNT}", w.name, w.count)));
    }
    if let Some(c) = &config.canary {
        c.check()?;
    }
    if let Some(p) = &config.version_policy {
        p.resolve()?;
    }
    Ok(())
}

/// Loads a model directory (its highest version) or a single `.onnx` file (as version 1), with
/// the `Some` fields of `overrides` and `max_queue_delay_us` replacing what its config says.
pub fn load_with(
    path: &Path,
    name: &str,
    options: &LoadOptions,
    overrides: &ModelConfig,
    max_queue_delay_us: Option<u64>,
) -> Result<Model> {
    if !is_model_name(name) {
        return Err(Error::invalid(format!("'{name}' is not a valid model name")));
    }
    let (mut config, version, onnx) = if path.is_dir() {
        let parent = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
        let repo = Repository::open(parent, options.clone())?;
        let dir_name = path.file_name().and_then(|n| n.to_str()).unwrap_or_default();
        let config = repo.config_file(dir_name)?.parse(dir_name)?;
        let filename = config.model_filename();
        let latest =
            repo.versions(dir_name, filename)?.into_iter().next().ok_or_else(|| {
                Error::invalid(format!("no version directory (a positive integer) holds a {filename}"))
            })?;
        (config, latest.version, latest.onnx)
    } else {
        (ModelConfig::default(), 1, path.to_path_buf())
    };
    config.max_batch_size = overrides.max_batch_size.or(config.max_batch_size);
    config.instance_count = overrides.instance_count.or(config.instance_count);
    config.threads = overrides.threads.or(config.threads);
    if let Some(delay) = max_queue_delay_us {
        let db = config.dynamic_batching.get_or_insert_with(Default::default);
        db.max_queue_delay_microseconds = Some(delay);
    }
    if config.is_python() {
        return load_python(&onnx, name, version, &config, options, None);
    }
    load_version(&onnx, name, version, &config, options)
}

/// Loads a Python model (`model_py`, Triton's `model.py`) and starts its workers: its tensors
/// are the config's (after the model's `auto_complete_config`, when it has one).
fn load_python(
    model_py: &Path,
    name: &str,
    version: u64,
    config: &ModelConfig,
    options: &LoadOptions,
    models: Option<std::sync::Weak<dyn crate::engine::model::Models>>,
) -> Result<Model> {
    use crate::engine::python::{PythonBackend, PythonOptions};
    let py = config.python.clone().unwrap_or_default();
    let model_dir = model_py.parent().and_then(Path::parent).unwrap_or(Path::new("."));
    let mut python = PythonOptions { interpreter: options.python.clone(), ..Default::default() };
    if let Some(env) = &py.env_path {
        let env = env.replace("$$TRITON_MODEL_DIRECTORY", &model_dir.display().to_string());
        if env.ends_with(".tar.gz") || env.ends_with(".tgz") {
            return Err(Error::Unsupported(format!(
                "EXECUTION_ENV_PATH '{env}': packed environments are not unpacked; give the directory of an \
                 environment (a venv or an unpacked conda-pack) instead"
            )));
        }
        let interpreter = Path::new(&env).join("bin").join("python3");
        if !interpreter.is_file() {
            return Err(Error::invalid(format!("EXECUTION_ENV_PATH '{env}' has no bin/python3")));
        }
        python.interpreter = interpreter;
    }
    if let Some(ms) = py.execute_timeout_ms {
        python.execute_timeout = std::time::Duration::from_millis(ms.max(1));
    }
    python.memory_limit = py.memory_limit_mb.map(|mb| mb << 20);
    // Read once: for its class's auto_complete_config, and for the hash cached answers follow.
    let source =
        std::fs::read(model_py).map_err(|e| Error::invalid(format!("cannot read {}: {e}", model_py.display())))?;
    let content = xxhash_rust::xxh3::xxh3_64(&source);
    let mut config = config.clone();
    let completed = PythonBackend::auto_complete(model_py, &source, &stated_json(name, &config), &python)?;
    complete(&mut config, &completed)?;
    // Triton's Python models batch only when the config says so.
    let max_batch_size = config.max_batch_size.unwrap_or(0);
    config.max_batch_size = Some(max_batch_size);
    let tensors = |what: &str, list: &[crate::control::config::TensorConfig]| -> Result<Vec<TensorSpec>> {
        list.iter()
            .map(|t| {
                let datatype = t.datatype.as_deref().and_then(crate::DataType::parse);
                let (Some(datatype), Some(dims)) = (datatype, &t.dims) else {
                    return Err(Error::invalid(format!(
                        "{what} '{}': a Python model's config states each tensor's data_type and dims",
                        t.name
                    )));
                };
                let batch = (max_batch_size > 0).then_some(-1);
                Ok(TensorSpec {
                    name: t.name.clone(),
                    datatype,
                    dims: batch.into_iter().chain(dims.iter().copied()).collect(),
                })
            })
            .collect()
    };
    let io = (tensors("input", &config.input)?, tensors("output", &config.output)?);
    if io.0.is_empty() || io.1.is_empty() {
        return Err(Error::invalid("a Python model's config states its inputs and outputs"));
    }
    let mut spec = ModelSpec::resolve(name, version, &config, &io.0, &io.1, 1)?;
    spec.platform = "";
    spec.backend = "python";
    spec.load.parameters = py.parameters.clone();
    let model_config = crate::control::triton::json(&crate::control::triton::resolved(&spec));
    let backend = PythonBackend::new(name, version, model_py, &model_config, io, python, models);
    let cache = options.cache.clone().filter(|_| spec.cache);
    let warmups = warmup_samples(&spec, model_py)?;
    let mut model = Model::start(spec, &backend, None)?;
    model.cache = cache;
    model.warmups = warmups;
    model.content = content;
    Ok(model)
}

/// What a Python model's config states, in Triton's JSON (what `auto_complete_config` is given).
fn stated_json(name: &str, config: &ModelConfig) -> serde_json::Value {
    use serde_json::json;
    let tensors = |list: &[crate::control::config::TensorConfig]| -> Vec<serde_json::Value> {
        list.iter()
            .map(|t| {
                json!({"name": t.name, "data_type": t.datatype.clone().unwrap_or_else(|| "TYPE_INVALID".into()),
                "dims": t.dims.clone().unwrap_or_default()})
            })
            .collect()
    };
    let parameters: serde_json::Map<String, serde_json::Value> = config
        .python
        .iter()
        .flat_map(|p| &p.parameters)
        .map(|(k, v)| (k.clone(), json!({"string_value": v})))
        .collect();
    let mut c = json!({"name": name, "backend": "python", "max_batch_size": config.max_batch_size.unwrap_or(0),
        "input": tensors(&config.input), "output": tensors(&config.output), "parameters": parameters});
    if config.dynamic_batching.as_ref().is_some_and(|d| d.enabled) {
        c["dynamic_batching"] = json!({});
    }
    c
}

/// `config` with what `auto_complete_config` added or changed (`completed`, Triton's JSON):
/// tensors, `max_batch_size` and dynamic batching.
fn complete(config: &mut ModelConfig, completed: &serde_json::Value) -> Result<()> {
    use crate::control::config::TensorConfig;
    let bad =
        |what: &str| Error::invalid(format!("auto_complete_config returned a config whose {what} is not Triton's"));
    let tensors = |key: &str| -> Result<Vec<TensorConfig>> {
        let Some(list) = completed.get(key).and_then(|v| v.as_array()) else { return Ok(Vec::new()) };
        list.iter()
            .map(|t| {
                let name = t.get("name").and_then(|n| n.as_str()).ok_or_else(|| bad(key))?;
                let datatype = t.get("data_type").and_then(|d| d.as_str()).filter(|d| *d != "TYPE_INVALID");
                let dims = match t.get("dims").and_then(|d| d.as_array()) {
                    Some(d) => {
                        Some(d.iter().map(|x| x.as_i64().ok_or_else(|| bad("dims"))).collect::<Result<Vec<_>>>()?)
                    }
                    None => None,
                };
                Ok(TensorConfig {
                    name: name.to_string(),
                    datatype: datatype.map(str::to_string),
                    dims,
                    label_filename: None,
                    reshape: None,
                    optional: t.get("optional").and_then(|o| o.as_bool()).unwrap_or(false),
                })
            })
            .collect()
    };
    let merge = |stated: &mut Vec<TensorConfig>, given: Vec<TensorConfig>| {
        for g in given {
            match stated.iter_mut().find(|s| s.name == g.name) {
                Some(s) => {
                    s.datatype = s.datatype.take().or(g.datatype);
                    s.dims = s.dims.take().filter(|d| !d.is_empty()).or(g.dims);
                }
                None => stated.push(g),
            }
        }
    };
    merge(&mut config.input, tensors("input")?);
    merge(&mut config.output, tensors("output")?);
    if let Some(n) = completed.get("max_batch_size").and_then(|n| n.as_u64()) {
        config.max_batch_size = Some(n as usize);
    }
    if completed.get("dynamic_batching").is_some() && config.dynamic_batching.as_ref().is_none_or(|d| !d.enabled) {
        config.dynamic_batching =
            Some(crate::control::config::DynamicBatchingConfig { enabled: true, ..Default::default() });
    }
    Ok(())
}

fn load_version(onnx: &Path, name: &str, version: u64, config: &ModelConfig, options: &LoadOptions) -> Result<Model> {
    let started = std::time::Instant::now();
    // The CPU budget is shared by the model's instances: N instances of T threads each would
    // otherwise start N x T threads on T cores.
    let instances = config.instance_count.unwrap_or(1).max(1);
    let ort = config.onnxruntime.clone().unwrap_or_default();
    let fixed_threads = config.threads.or(ort.intra_op_thread_count);
    let threads = fixed_threads.unwrap_or((options.threads / instances).max(1));
    let session =
        ort.apply(OnnxOptions { intra_threads: threads, spinning: options.spinning, ..Default::default() })?;
    let mut backend = OnnxBackend::load(onnx, session)?;
    let mut spec = ModelSpec::resolve(name, version, config, backend.inputs(), backend.outputs(), threads)?;
    spec.onnx = backend.options().clone();
    spec.labels = labels(onnx.parent().and_then(Path::parent).unwrap_or(Path::new(".")), config)?;
    for (output, classes) in backend.labels() {
        // A ZipMap's class labels label its probabilities, unless the config gives a file.
        spec.labels.entry(output.to_string()).or_insert_with(|| classes.to_vec());
    }
    // What the file holds, not where it is: cached answers and remembered calibrations follow it,
    // and processes on other hosts with the same file agree on it.
    let content = backend.content().ok_or_else(|| Error::invalid(format!("cannot read {}", onnx.display())))?;
    if config.calibrate != Some(false) && options.calibrate {
        // Config values always win: only what the config leaves open is measured.
        let fixed_spinning = ort.spinning.or(options.spinning.then_some(true));
        let plans = tuning::plans(options.threads, config.instance_count, fixed_threads, fixed_spinning);
        if let Some(t) = tuning::calibrate(&backend, &spec, content, &plans)? {
            if (t.plan.threads, t.plan.spinning) != (spec.onnx.intra_threads, spec.onnx.spinning) {
                let chosen =
                    OnnxOptions { intra_threads: t.plan.threads, spinning: t.plan.spinning, ..spec.onnx.clone() };
                backend = backend.with_options(chosen)?;
                spec.onnx = backend.options().clone();
            }
            spec.instance_count = t.plan.instances;
            spec.batch.merge_limit = t.merge_limit;
            // A limit measured at one size of a variable-size model's rows scales to the others.
            spec.batch.merge_at = t.row_elements;
            // Single-threaded instances serve load best, but leave a lone request one core: a
            // solo instance on the whole budget takes such work (never beside them), unless the
            // config fixed the instances or their threads.
            let open = config.instance_count.is_none() && fixed_threads.is_none();
            if open && t.plan.threads < options.threads && config.solo_instance != Some(false) {
                spec.solo_threads = options.threads;
            }
            let solo = if spec.solo_threads > 0 {
                let spinning = ort.spinning.unwrap_or(true);
                format!(", solo instance x {} threads, spinning {spinning}", spec.solo_threads)
            } else {
                String::new()
            };
            let chosen = format!(
                "{} instance(s) x {} thread(s), spinning {}, batch limit {}{at}{solo}",
                t.plan.instances,
                t.plan.threads,
                t.plan.spinning,
                t.merge_limit,
                at = if spec.batch.merge_at > 0 {
                    format!(" at rows of {} elements", spec.batch.merge_at)
                } else {
                    String::new()
                },
            );
            tracing::info!(model = %name, version, %chosen, "calibrated");
            spec.load.calibrated = Some(chosen);
        }
    }
    // Asked for, a slow model's threads spin between the operators of a run (not between runs).
    // Not by default: it costs the other models on the same cores (README "Self-tuning").
    let spin_in_run = ort.spin_in_run.unwrap_or(options.spin_in_run && ort.spinning != Some(false));
    if spin_in_run && !spec.onnx.spinning && spec.onnx.intra_threads > 1 {
        match tuning::one_row_time(&backend, &spec) {
            Some(t) if tuning::spins_in_run(spec.onnx.intra_threads, t) => {
                tracing::info!(model = %name, version, one_row_ms = t.as_secs_f64() * 1e3, "threads spin within runs");
                backend = backend.with_options(OnnxOptions { spin_in_run: true, ..spec.onnx.clone() })?;
                spec.onnx = backend.options().clone();
            }
            Some(t) => {
                let one_row_ms = t.as_secs_f64() * 1e3;
                tracing::info!(model = %name, version, one_row_ms, "runs too short to spin within (under 2 ms)");
            }
            None => tracing::info!(model = %name, version, "not spinning within runs: synthetic inputs do not run"),
        }
    }
    if spec.instance_count + usize::from(spec.solo_threads > 0) >= 2 {
        // Two sessions or more hold one copy of the weights between them rather than one each.
        if let Some(shared) = backend.sharing_weights() {
            backend = shared;
        }
    }
    let solo = match spec.solo_threads {
        0 => None,
        n => {
            // It runs only when the model is otherwise idle, so its threads may spin between the
            // operators of a run (lone requests gain, load does not lose: bench/results/kinds.md)
            // unless the config says not to.
            let spinning = ort.spinning.unwrap_or(true);
            let options = OnnxOptions { intra_threads: n, spinning, ..spec.onnx.clone() };
            Some(backend.with_options(options)?.instance()?)
        }
    };
    let cache = options.cache.clone().filter(|_| spec.cache);
    let warmups = warmup_samples(&spec, onnx)?;
    let mut model = Model::start(spec, &backend, solo)?;
    model.cache = cache;
    model.warmups = warmups;
    model.content = content;
    crate::telemetry::metrics::global()
        .model_load_duration
        .with_label_values(&[name, version.to_string().as_str()])
        .set(started.elapsed().as_secs_f64());
    Ok(model)
}

/// The most bytes one warm-up input may hold (a file's, or made up).
const MAX_WARMUP_BYTES: usize = 256 << 20;

/// The config's warm-up requests as tensors (Triton's `model_warmup`): each input of zeros,
/// random values, or the bytes of a file in the model's `warmup/` directory, repeated for the
/// sample's batch size.
fn warmup_samples(spec: &ModelSpec, onnx: &Path) -> Result<Vec<(String, usize, Vec<crate::Tensor>)>> {
    use crate::{DataType, Tensor, TensorData};
    let dir = onnx.parent().and_then(Path::parent).unwrap_or(Path::new(".")).join("warmup");
    let mut seed = 0x9E37_79B9_7F4A_7C15u64;
    let mut random = move || {
        // xorshift: warm-up data needs no quality, only values that are not all alike.
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let mut samples = Vec::new();
    for w in &spec.load.warmup {
        let bad = |why: String| Error::invalid(format!("warm-up '{}': {why}", w.name));
        let rows = w.batch_size.max(1);
        if !spec.batched() && rows > 1 {
            return Err(bad("batch_size must be 1 for a model that does not batch".into()));
        }
        let mut inputs = Vec::new();
        for (name, i) in &w.inputs {
            let dt = DataType::parse(&i.datatype).ok_or_else(|| bad(format!("input '{name}': unknown datatype")))?;
            if i.dims.iter().any(|&d| d < 0) {
                return Err(bad(format!("input '{name}': dims {:?} must all be known", i.dims)));
            }
            let n = i.dims.iter().try_fold(1usize, |a, &d| a.checked_mul(d as usize)).unwrap_or(usize::MAX);
            if n.saturating_mul(dt.size().unwrap_or(1)).saturating_mul(rows) > MAX_WARMUP_BYTES {
                return Err(bad(format!("input '{name}' is larger than {MAX_WARMUP_BYTES} bytes")));
            }
            let shape: Vec<usize> =
                spec.batched().then_some(rows).into_iter().chain(i.dims.iter().map(|&d| d as usize)).collect();
            let sources = [i.zero_data, i.random_data, i.input_data_file.is_some()];
            if sources.iter().filter(|&&s| s).count() != 1 {
                return Err(bad(format!(
                    "input '{name}' needs exactly one of zero_data, random_data, input_data_file"
                )));
            }
            let data = if let Some(file) = &i.input_data_file {
                if Path::new(file).components().count() != 1 || file.starts_with('.') {
                    return Err(bad(format!("input_data_file '{file}' must name a file of the warmup/ directory")));
                }
                let path = dir.join(file);
                let size = std::fs::metadata(&path).map(|m| m.len() as usize).unwrap_or(usize::MAX);
                if size > MAX_WARMUP_BYTES {
                    return Err(bad(format!("cannot read {} (or it is larger than allowed)", path.display())));
                }
                let bytes = std::fs::read(&path).map_err(|e| bad(format!("cannot read {}: {e}", path.display())))?;
                match dt.size() {
                    Some(width) if bytes.len() == n * width => TensorData::Fixed(bytes.repeat(rows).into()),
                    Some(width) => {
                        return Err(bad(format!(
                            "{file} holds {} bytes; dims {:?} of {dt} take {}",
                            bytes.len(),
                            i.dims,
                            n * width
                        )))
                    }
                    None => {
                        // BYTES: each element a 4-byte little-endian length, then its bytes.
                        let mut items = Vec::with_capacity(n);
                        let mut rest = &bytes[..];
                        while rest.len() >= 4 && items.len() < n {
                            let len = u32::from_le_bytes([rest[0], rest[1], rest[2], rest[3]]) as usize;
                            let item = rest
                                .get(4..4 + len)
                                .ok_or_else(|| bad(format!("{file}: an element runs past the end")))?;
                            items.push(bytes::Bytes::copy_from_slice(item));
                            rest = &rest[4 + len..];
                        }
                        if items.len() != n || !rest.is_empty() {
                            return Err(bad(format!("{file} does not hold exactly {n} BYTES elements")));
                        }
                        TensorData::Strings((0..rows).flat_map(|_| items.iter().cloned()).collect())
                    }
                }
            } else if dt == DataType::Bytes {
                // Triton falls back to zero data for strings: empty elements.
                TensorData::Strings(vec![bytes::Bytes::new(); n * rows])
            } else if i.zero_data {
                TensorData::Fixed(vec![0u8; n * rows * dt.size().unwrap_or(1)].into())
            } else {
                random_data(dt, n * rows, &mut random)
            };
            inputs.push(Tensor::new(name.clone(), dt, shape, data));
        }
        samples.push((w.name.clone(), w.count.max(1), inputs));
    }
    Ok(samples)
}

/// `n` random values of `dt`: floats in [0, 1), integers in 0..8 (small enough to index any
/// table a model looks ids up in), booleans.
fn random_data(dt: crate::DataType, n: usize, random: &mut impl FnMut() -> u64) -> crate::TensorData {
    use crate::{DataType as D, Element};
    let mut out = Vec::with_capacity(n * dt.size().unwrap_or(1));
    for _ in 0..n {
        let r = random();
        let unit = (r >> 40) as f32 / (1u64 << 24) as f32;
        let v = match dt {
            D::Bool => (r & 1) as f64,
            dt if dt.is_float() => f64::from(unit),
            _ => (r % 8) as f64,
        };
        crate::dispatch!(dt, T => T::cast(v).put_le(&mut out), bytes => unreachable!("BYTES are made apart"));
    }
    crate::TensorData::Fixed(out.into())
}

/// The class labels of outputs that name a `label_filename`: a file of the model's directory (the
/// one holding the version directories), one label per line.
fn labels(dir: &Path, config: &ModelConfig) -> Result<std::collections::BTreeMap<String, Vec<String>>> {
    let mut labels = std::collections::BTreeMap::new();
    for o in &config.output {
        let Some(file) = &o.label_filename else { continue };
        let labels_of = |e: Error| Error::invalid(format!("output '{}': {e}", o.name));
        labels.insert(o.name.clone(), crate::pipeline::read_labels(dir, file).map_err(labels_of)?);
    }
    Ok(labels)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_a_config_multiplies_are_capped_before_anything_starts() {
        let most = most_threads();
        for text in [
            format!("instance_count = {}", most + 1),
            format!("threads = {}", most + 1),
            format!("[onnxruntime]\nintra_op_thread_count = {}", 100_000),
            "[[warmup]]\nname = \"w\"\ncount = 4000000000\n[warmup.inputs.x]\ndatatype = \"FP32\"\ndims = [1]\nzero_data = true".into(),
        ] {
            let e = parse_config(&text).unwrap_err().to_string();
            assert!(e.contains("more than"), "{text}: {e}");
        }
        assert!(parse_config(&format!("instance_count = {most}")).is_ok());
    }

    #[test]
    fn model_names_are_identifiers() {
        for ok in ["mlp", "resnet-50", "bert_base.v2", "7"] {
            assert!(is_model_name(ok), "{ok}");
        }
        for bad in ["", "..", "a/b", "../etc", ".hidden", "a..b", "a b", "é"] {
            assert!(!is_model_name(bad), "{bad}");
        }
    }

    #[test]
    fn a_repository_that_is_a_hugging_face_directory_holds_it_as_its_one_model() {
        let tmp = std::env::temp_dir().join(format!("ferrite-lone-{}", std::process::id()));
        let hf = tmp.join("bge-small-en-v1.5");
        for dir in [hf.join("1_Pooling"), hf.join("onnx"), tmp.join("a model")] {
            std::fs::create_dir_all(dir).unwrap();
        }
        for dir in [&hf, &tmp.join("a model")] {
            std::fs::write(dir.join("config.json"), "{}").unwrap();
            std::fs::write(dir.join("tokenizer.json"), "{}").unwrap();
        }
        let repo = Repository::open(&hf, LoadOptions::default()).unwrap();
        // Its own folders are its files, not models.
        assert_eq!(repo.names(), ["bge-small-en-v1.5"]);
        assert_eq!(repo.model_dir("bge-small-en-v1.5").unwrap(), hf.canonicalize().unwrap());
        assert!(matches!(repo.model_dir("onnx"), Err(Error::NotFound(_))));
        // The parent is an ordinary repository of two.
        assert_eq!(Repository::open(&tmp, LoadOptions::default()).unwrap().names(), ["a model", "bge-small-en-v1.5"]);
        // A directory whose name is not a model name says so.
        let e = Repository::open(&tmp.join("a model"), LoadOptions::default()).unwrap_err().to_string();
        assert!(e.contains("'a model' is not a valid model name"), "{e}");
        std::fs::remove_dir_all(&tmp).unwrap();
    }
}
