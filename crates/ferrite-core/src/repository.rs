//! The model repository on disk: `<root>/<name>/config.toml` and `<root>/<name>/<version>/model.onnx`.

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    sync::Arc,
};

use crate::{
    cache::ResponseCache,
    config::{ModelConfig, ModelSpec},
    model::Model,
    onnx::{OnnxBackend, OnnxOptions},
    Backend, Error, Result,
};

/// How models are loaded when their config does not say.
#[derive(Debug, Clone)]
pub struct LoadOptions {
    /// Intra-op threads per instance.
    pub threads: usize,
    pub spinning: bool,
    /// The process's response cache, used by models whose config enables it.
    pub cache: Option<Arc<ResponseCache>>,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions {
            threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
            spinning: false,
            cache: None,
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

/// What loading a repository gave: the models that serve, and why the others do not.
#[derive(Default)]
pub struct Loaded {
    pub models: BTreeMap<String, Arc<Model>>,
    pub failed: BTreeMap<String, String>,
}

/// Loads every model under `root`. A directory that fails is reported and skipped.
pub fn load_all(root: &Path, options: &LoadOptions) -> Result<Loaded> {
    let entries = std::fs::read_dir(root)
        .map_err(|e| Error::invalid(format!("cannot read model repository {}: {e}", root.display())))?;
    let mut dirs: Vec<PathBuf> = entries.filter_map(|e| e.ok().map(|e| e.path())).filter(|p| p.is_dir()).collect();
    dirs.sort();
    let mut loaded = Loaded::default();
    for dir in dirs {
        let name = dir.file_name().and_then(|n| n.to_str()).unwrap_or_default().to_string();
        if name.starts_with('.') {
            continue;
        }
        match load_model(&dir, &name, options) {
            Ok(model) => {
                tracing::info!(model = %name, version = model.spec.version, "model ready");
                loaded.models.insert(name, Arc::new(model));
            }
            Err(e) => {
                tracing::error!(model = %name, error = %e, "model skipped");
                loaded.failed.insert(name, e.to_string());
            }
        }
    }
    Ok(loaded)
}

/// Loads the highest version of one model directory.
pub fn load_model(dir: &Path, name: &str, options: &LoadOptions) -> Result<Model> {
    if !is_model_name(name) {
        return Err(Error::invalid(format!("'{name}' is not a valid model name")));
    }
    let config = read_config(dir)?;
    let (version, onnx) = latest_version(dir)?;
    load_version(&onnx, name, version, &config, options)
}

/// Loads a model directory (as `load_model`) or a single `.onnx` file (as version 1), with the
/// `Some` fields of `overrides` and `max_queue_delay_us` replacing what its config says.
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
        let (version, onnx) = latest_version(path)?;
        (read_config(path)?, version, onnx)
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
    load_version(&onnx, name, version, &config, options)
}

fn read_config(dir: &Path) -> Result<ModelConfig> {
    let config_path = dir.join("config.toml");
    if !config_path.exists() {
        return Ok(ModelConfig::default());
    }
    let text = std::fs::read_to_string(&config_path)
        .map_err(|e| Error::invalid(format!("cannot read {}: {e}", config_path.display())))?;
    toml::from_str(&text).map_err(|e| Error::invalid(format!("{}: {e}", config_path.display())))
}

/// The highest positive-integer version directory holding a `model.onnx`.
fn latest_version(dir: &Path) -> Result<(u64, PathBuf)> {
    let version = std::fs::read_dir(dir)
        .map_err(|e| Error::invalid(format!("cannot read {}: {e}", dir.display())))?
        .filter_map(|e| e.ok())
        .filter_map(|e| e.file_name().to_str()?.parse::<u64>().ok().filter(|&v| v > 0))
        .filter(|v| dir.join(v.to_string()).join("model.onnx").is_file())
        .max()
        .ok_or_else(|| Error::invalid("no version directory (a positive integer) holds a model.onnx"))?;
    Ok((version, dir.join(version.to_string()).join("model.onnx")))
}

fn load_version(onnx: &Path, name: &str, version: u64, config: &ModelConfig, options: &LoadOptions) -> Result<Model> {
    let started = std::time::Instant::now();
    let threads = config.threads.unwrap_or(options.threads).max(1);
    let backend = OnnxBackend::load(onnx, OnnxOptions { intra_threads: threads, spinning: options.spinning })?;
    let spec = ModelSpec::resolve(name, version, config, backend.inputs(), backend.outputs(), threads)?;
    let cache = options.cache.clone().filter(|_| spec.cache);
    let mut model = Model::start(spec, &backend)?;
    model.cache = cache;
    crate::metrics::global()
        .model_load_duration
        .with_label_values(&[name, version.to_string().as_str()])
        .set(started.elapsed().as_secs_f64());
    Ok(model)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_names_are_identifiers() {
        for ok in ["mlp", "resnet-50", "bert_base.v2", "7"] {
            assert!(is_model_name(ok), "{ok}");
        }
        for bad in ["", "..", "a/b", "../etc", ".hidden", "a..b", "a b", "é"] {
            assert!(!is_model_name(bad), "{bad}");
        }
    }
}
