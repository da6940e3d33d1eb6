//! Building what a model should serve now: its config (from `config.toml` or Triton's
//! `config.pbtxt`, or from the external config source), the versions its policy selects, each one loaded and validated beside the
//! running ones, and its canary. Versions whose files and config did not change are kept as they
//! are; a version that fails to load or validate leaves the running one (if any) in service and
//! a note for the repository index.

use std::{
    collections::{BTreeMap, BTreeSet},
    sync::Arc,
};

use arc_swap::ArcSwap;

use crate::{
    control::{
        canary::Canary,
        config::ModelConfig,
        registry::{Notes, Registry, Served},
        repository::{ConfigFile, ConfigFormat, OnDisk, Repository, DEFAULT_MODEL_FILENAME},
    },
    Error, Model, Result,
};

/// Which models should be served, and the state the last change left them in.
#[derive(Default)]
pub(crate) struct Lifecycle {
    /// Models to serve: all on disk, or (explicit control) those loaded through the API.
    pub(crate) wanted: BTreeSet<String>,
    /// Model configs from an external source (etcd), by model name; they replace `config.toml`.
    pub(crate) configs: BTreeMap<String, String>,
    /// The disk and config signature each model was last built from.
    pub(crate) applied: BTreeMap<String, u64>,
}

/// What a model's serving depends on, as read from the repository (and the external config):
/// its config text and its version files. A model is rebuilt when this changes.
pub(crate) struct Sources {
    text: Result<String>,
    config: Result<ModelConfig>,
    disk: Result<Vec<OnDisk>>,
}

impl Sources {
    /// `config_text`: the external source's `config.toml` for the model, which replaces the file's.
    pub(crate) fn read(repo: &Repository, name: &str, config_text: Option<&str>) -> Sources {
        let file = match config_text {
            Some(t) => Ok(ConfigFile { format: ConfigFormat::Toml, text: t.to_string() }),
            None => repo.config_file(name),
        };
        let config = file.as_ref().map_err(Clone::clone).and_then(|f| repo.config(name, f));
        let disk = match &config {
            Ok(c) if !c.steps.is_empty() => repo.pipeline_versions(name),
            Ok(c) => repo.versions(name, c.model_filename()),
            Err(_) => repo.versions(name, DEFAULT_MODEL_FILENAME),
        };
        Sources { text: file.map(|f| f.text), config, disk }
    }

    /// Whether the model is a pipeline (built after the models it calls).
    pub(crate) fn is_pipeline(&self) -> bool {
        self.config.as_ref().is_ok_and(|c| !c.steps.is_empty())
    }

    /// The models a pipeline's steps call (none for a model, or a config that does not parse).
    pub(crate) fn calls(&self) -> Vec<String> {
        let Ok(c) = &self.config else { return Vec::new() };
        c.steps
            .iter()
            .filter_map(|s| match s {
                crate::pipeline::StepConfig::Model(m) if m.file.is_none() => Some(m.model.clone()),
                _ => None,
            })
            .collect()
    }

    pub(crate) fn signature(&self) -> u64 {
        let text = self.text.as_deref().unwrap_or_default();
        let files: Vec<(u64, u64)> =
            self.disk.as_deref().unwrap_or_default().iter().map(|d| (d.version, d.fingerprint)).collect();
        xxhash_rust::xxh3::xxh3_64(format!("{text}\u{0}{files:?}").as_bytes())
    }
}

/// What `name` should serve given `sources`, built beside `current`. `None` when nothing can serve.
/// A pipeline finds the models it calls in `models` (what will serve beside it) and, when it
/// runs, in `registry`.
pub(crate) fn build(
    repo: &Repository,
    name: &str,
    sources: Sources,
    current: Option<&Arc<Served>>,
    models: &Registry,
    registry: &Arc<ArcSwap<Registry>>,
) -> (Option<Arc<Served>>, Notes) {
    let mut notes = Notes::default();
    // The model's failure counters exist (at 0) from its first load on, for dashboards and alerts.
    let m = crate::telemetry::metrics::global();
    m.model_load_failures.with_label_values(&[name]);
    m.canary_rollbacks.with_label_values(&[name]);
    let planned = (|| -> Result<(ModelConfig, String, Vec<OnDisk>)> {
        let text = sources.text?;
        let config = sources.config?;
        let disk = sources.disk?;
        if disk.is_empty() {
            let file = config.model_filename();
            return Err(Error::invalid(format!("no version directory (a positive integer) holds a {file}")));
        }
        Ok((config, text, disk))
    })();
    let (config, text, disk) = match planned {
        Ok(p) => p,
        Err(e) => {
            failed(name, None, &e);
            notes.model = Some(match current {
                Some(_) => format!("reload failed: {e}; the previous load keeps serving"),
                None => e.to_string(),
            });
            return (current.cloned(), notes);
        }
    };
    for note in &config.notes {
        tracing::warn!(model = %name, "{note}");
    }
    let policy = config.version_policy.as_ref().and_then(|p| p.resolve().ok()).unwrap_or_default();
    let candidate = config.canary.as_ref().map(|c| c.version);
    // The policy picks the stable versions; a canary's candidate is served on top of them.
    let stable_on_disk: Vec<u64> = disk.iter().map(|d| d.version).filter(|v| Some(*v) != candidate).collect();
    let mut wanted = policy.select(&stable_on_disk);
    if let Some(c) = candidate {
        if disk.iter().any(|d| d.version == c) {
            wanted.push(c);
        } else {
            notes.model = Some(format!("canary version {c} has no model.onnx"));
        }
    }
    let mut config_hash = xxhash_rust::xxh3::xxh3_64(text.as_bytes());
    // A pipeline is rebuilt when a model it calls changed (its interface, its cached answers).
    for step in &config.steps {
        if let crate::pipeline::StepConfig::Model(m) = step {
            let served = models.models.get(&m.model);
            let prints: Vec<u64> = served.iter().flat_map(|s| s.versions.values().map(|v| v.fingerprint)).collect();
            config_hash = xxhash_rust::xxh3::xxh3_64(format!("{config_hash}{}{prints:?}", m.model).as_bytes());
        }
    }
    let mut versions = BTreeMap::new();
    for v in wanted {
        let Some(d) = disk.iter().find(|d| d.version == v) else { continue };
        let fingerprint =
            xxhash_rust::xxh3::xxh3_64(&[config_hash.to_le_bytes(), d.fingerprint.to_le_bytes()].concat());
        let old = current.and_then(|c| c.versions.get(&v));
        if let Some(old) = old.filter(|m| m.fingerprint == fingerprint) {
            versions.insert(v, old.clone());
            continue;
        }
        let loaded = if config.steps.is_empty() {
            let models: Arc<dyn crate::engine::model::Models> = registry.clone();
            repo.load_version(name, d, &config, fingerprint, Some(Arc::downgrade(&models)))
        } else {
            repo.load_pipeline(name, v, &config, fingerprint, models, registry.clone())
        };
        match loaded.and_then(|m| validate(m, old.map(|o| o.as_ref()))) {
            Ok(m) => {
                tracing::info!(model = %name, version = v, replaced = old.is_some(), "model version ready");
                versions.insert(v, Arc::new(m));
            }
            Err(e) => {
                failed(name, Some(v), &e);
                match old {
                    Some(old) => {
                        notes.versions.insert(v, format!("reload failed: {e}; the previous load keeps serving"));
                        versions.insert(v, old.clone());
                    }
                    None => {
                        notes.versions.insert(v, e.to_string());
                    }
                }
            }
        }
    }
    if versions.is_empty() {
        let why = notes.reason();
        notes.model.get_or_insert_with(|| format!("no version could be loaded ({why})"));
        return (None, notes);
    }
    let canary = config.canary.as_ref().filter(|c| versions.contains_key(&c.version)).and_then(|c| {
        let stable = versions.keys().rev().copied().find(|&v| v != c.version);
        if stable.is_none() {
            notes.model = Some(format!("canary version {} has no stable version to run beside", c.version));
        }
        let stable = stable?;
        Some(Canary::carry_over(current.map(|s| s.as_ref()), c, stable, &versions))
    });
    (Some(Arc::new(Served { name: name.to_string(), versions, canary })), notes)
}

/// A replacement for a served version must keep its interface (publish a new version to change
/// it). Every new load runs the config's warm-up requests, and fails if one fails (as Triton's
/// `model_warmup`). Without any, a load whose input dims are all known runs a synthetic request;
/// its failure refuses a replacement (the running version keeps serving) but not a first load:
/// ONNX Runtime has already checked the model as it loaded it, and made-up data proves little.
fn validate(model: Model, old: Option<&Model>) -> Result<Model> {
    if let Some(old) = old {
        let sig = |m: &Model| {
            let t = |v: &[crate::engine::spec::TensorSpec]| {
                v.iter().map(|t| (t.name.clone(), t.datatype)).collect::<Vec<_>>()
            };
            (t(&m.spec.inputs), t(&m.spec.outputs))
        };
        if sig(&model) != sig(old) {
            return Err(Error::invalid(format!(
                "the new files change the inputs or outputs of version {} (publish a new version instead)",
                old.spec.version
            )));
        }
    }
    for (name, count, inputs) in &model.warmups {
        for _ in 0..*count {
            model.warm_up(inputs.clone()).map_err(|e| Error::invalid(format!("warm-up '{name}' failed: {e}")))?;
        }
    }
    // Synthetic data only where every dim is known: a graph that takes variable sizes (a detector
    // whose feature maps must line up, say) may refuse any size made up here, though it serves
    // real inputs.
    // (A pipeline takes images and texts, which made-up data is not.)
    // (Nor is user code run on made-up data: a Python model's may act on what it is given.)
    let known = model.spec.inputs.iter().all(|t| t.dims.iter().all(|&d| d >= 0))
        && !model.spec.is_pipeline()
        && model.spec.backend != "python";
    if model.warmups.is_empty() && known {
        let inputs = crate::engine::model::synthetic_inputs(&model.spec, 1);
        if let Err(e) = model.warm_up(inputs) {
            if old.is_some() {
                return Err(Error::invalid(format!("synthetic warm-up inference failed: {e}")));
            }
            tracing::warn!(model = %model.spec.name, version = model.spec.version, error = %e,
                "a synthetic warm-up request failed; the model serves anyway (state a warm-up in its config to check it)");
        }
    }
    Ok(model)
}

fn failed(name: &str, version: Option<u64>, e: &Error) {
    let v = version.map(|v| v.to_string()).unwrap_or_default();
    tracing::error!(model = %name, version = %v, error = %e, "model load failed");
    crate::telemetry::metrics::global().model_load_failures.with_label_values(&[name]).inc();
}
