//! Ferrite's engine: tensors, model repository, dynamic batcher and backends.
//!
//! Nothing here knows HTTP, gRPC or Python; the front-ends translate their wire types into
//! [`InferRequest`] and map [`Error`] once.

pub mod backend;
pub mod batcher;
pub mod cache;
pub mod canary;
pub mod config;
pub mod dtype;
pub mod error;
mod lifecycle;
pub mod metrics;
pub mod model;
pub mod onnx;
pub mod queue;
pub mod registry;
pub mod repository;
pub mod stats;
pub mod tenant;
pub mod tensor;

use std::{
    collections::{BTreeMap, BTreeSet},
    path::Path,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, Mutex,
    },
    time::{Duration, Instant},
};

use arc_swap::ArcSwap;

pub use backend::Backend;
pub use canary::CanaryRoute;
pub use dtype::DataType;
pub use error::{Error, Result};
pub use model::{InferRequest, InferResponse, Limits, Model};
pub use registry::{IndexEntry, Registry};
pub use repository::{LoadOptions, Repository};
pub use tensor::{Tensor, TensorData};

/// The engine of one process: the models it serves (swapped atomically on every change) and
/// whether new work is accepted. Cheap to clone.
#[derive(Clone)]
pub struct Core {
    inner: Arc<Inner>,
}

struct Inner {
    cache: Option<Arc<cache::ResponseCache>>,
    registry: ArcSwap<Registry>,
    /// Where models are (re)loaded from; `None` for a core over models loaded elsewhere.
    repository: Option<Repository>,
    /// Serializes loads, reloads and unloads.
    lifecycle: Mutex<Lifecycle>,
    accepting: AtomicBool,
    limits: Limits,
    tenants: Option<Arc<tenant::Tenants>>,
    control: ModelControl,
    /// Requests in the engine now, for `Limits::max_concurrent_requests`.
    in_flight: std::sync::atomic::AtomicUsize,
}

/// Which models should be served, and the state the last change left them in.
#[derive(Default)]
struct Lifecycle {
    /// Models to serve: all on disk, or (explicit control) those loaded through the API.
    wanted: BTreeSet<String>,
    /// Model configs from an external source (etcd), by model name; they replace `config.toml`.
    configs: BTreeMap<String, String>,
    /// The disk and config signature each model was last built from.
    applied: BTreeMap<String, u64>,
}

/// How the served models may change (Triton's `--model-control-mode`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum ModelControl {
    /// As loaded at start (an external config source may still change configs).
    #[default]
    None,
    /// The repository is polled for changes.
    Poll,
    /// The repository API loads and unloads models.
    Explicit,
}

/// Which models a core loads when it starts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Startup {
    All,
    Only(Vec<String>),
}

/// Refuses repository-API parameters other than `unload_dependents` (accepted: there are no
/// ensembles to unload with a model).
fn refuse_parameters<'a>(names: impl IntoIterator<Item = &'a str>) -> Result<()> {
    match names.into_iter().find(|n| *n != "unload_dependents") {
        None => Ok(()),
        Some(n) => Err(Error::Unsupported(format!(
            "parameter '{n}' is not supported: models load from the repository as it is"
        ))),
    }
}

/// Holds one place under `max_concurrent_requests` while a request is in the engine.
struct Admitted<'c>(&'c std::sync::atomic::AtomicUsize);

impl Drop for Admitted<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Core {
    /// Loads every model of the repository at `root`; models that fail are logged and left out.
    pub fn load(root: &Path, options: &LoadOptions, limits: Limits) -> Result<Core> {
        Core::open(root, options, limits, Startup::All)
    }

    /// Opens the repository at `root` and loads the models `startup` names.
    pub fn open(root: &Path, options: &LoadOptions, limits: Limits, startup: Startup) -> Result<Core> {
        Core::open_with_configs(root, options, limits, startup, None)
    }

    /// As `open`, with model configs from an external source (by model name) in place of those
    /// models' `config.toml` from the first load on.
    pub fn open_with_configs(
        root: &Path,
        options: &LoadOptions,
        limits: Limits,
        startup: Startup,
        configs: Option<BTreeMap<String, String>>,
    ) -> Result<Core> {
        let repository = Repository::open(root, options.clone())?;
        let names = match startup {
            Startup::All => repository.names(),
            Startup::Only(names) => names,
        };
        let core = Core::new(Registry::default(), Some(repository), limits, options.cache.clone());
        {
            let mut lc = core.lifecycle();
            lc.wanted.extend(names.iter().cloned());
            lc.configs = configs.unwrap_or_default();
            let repo = core.inner.repository.as_ref().expect("opened above");
            core.rebuild(repo, &mut lc, &names);
        }
        Ok(core)
    }

    /// A core over models loaded elsewhere (one `Model.load` from Python, tests), with no cache
    /// and no repository to reload from.
    pub fn from_models(models: BTreeMap<String, Arc<Model>>, failed: BTreeMap<String, String>, limits: Limits) -> Core {
        let mut registry = Registry::default();
        for (name, m) in models {
            let versions = [(m.spec.version, m)].into();
            registry.models.insert(name.clone(), Arc::new(registry::Served { name, versions, canary: None }));
        }
        for (name, why) in failed {
            registry.notes.insert(name, registry::Notes { model: Some(why), ..Default::default() });
        }
        Core::new(registry, None, limits, None)
    }

    fn new(
        registry: Registry,
        repository: Option<Repository>,
        limits: Limits,
        cache: Option<Arc<cache::ResponseCache>>,
    ) -> Core {
        Core {
            inner: Arc::new(Inner {
                cache,
                registry: ArcSwap::from_pointee(registry),
                repository,
                lifecycle: Mutex::new(Lifecycle::default()),
                accepting: AtomicBool::new(true),
                limits,
                tenants: None,
                control: ModelControl::None,
                in_flight: Default::default(),
            }),
        }
    }

    /// Applies per-tenant limits to every request (before any other work). Call before cloning.
    pub fn with_tenants(mut self, tenants: Arc<tenant::Tenants>) -> Core {
        Arc::get_mut(&mut self.inner).expect("with_tenants is called on a fresh core").tenants = Some(tenants);
        self
    }

    /// Sets how models may change; `Explicit` opens load, unload and promote to the repository
    /// API. Call before cloning.
    pub fn with_model_control(mut self, control: ModelControl) -> Core {
        Arc::get_mut(&mut self.inner).expect("with_model_control is called on a fresh core").control = control;
        self
    }

    pub fn model_control(&self) -> ModelControl {
        self.inner.control
    }

    fn require_explicit(&self) -> Result<()> {
        if self.inner.control != ModelControl::Explicit {
            return Err(Error::Unsupported(
                "loading, unloading and promoting through the API needs --model-control-mode explicit".into(),
            ));
        }
        Ok(())
    }

    /// The per-tenant limits, when configured.
    pub fn tenants(&self) -> Option<&Arc<tenant::Tenants>> {
        self.inner.tenants.as_ref()
    }

    /// The process's response cache, if it has one.
    pub fn cache(&self) -> Option<&Arc<cache::ResponseCache>> {
        self.inner.cache.as_ref()
    }

    /// What is served now: one consistent view, whatever changes meanwhile.
    pub fn registry(&self) -> Arc<Registry> {
        self.inner.registry.load_full()
    }

    /// Every served model version.
    pub fn models(&self) -> Vec<Arc<Model>> {
        self.inner.registry.load().all()
    }

    /// Models that are not served, with the reason.
    pub fn failed(&self) -> BTreeMap<String, String> {
        let r = self.inner.registry.load();
        r.notes
            .iter()
            .filter(|(name, _)| !r.models.contains_key(*name))
            .filter_map(|(name, n)| {
                Some((name.clone(), n.model.clone().or_else(|| n.versions.values().next().cloned())?))
            })
            .collect()
    }

    pub fn limits(&self) -> &Limits {
        &self.inner.limits
    }

    /// The model `name` at `version` (`None` or empty: the default version).
    pub fn model(&self, name: &str, version: Option<&str>) -> Result<Arc<Model>> {
        self.inner.registry.load().model(name, version)
    }

    /// The versions of `name` served now, lowest first.
    pub fn versions(&self, name: &str) -> Vec<u64> {
        self.inner.registry.load().models.get(name).map(|s| s.versions.keys().copied().collect()).unwrap_or_default()
    }

    /// The repository index: every model on disk or served, each version's state and why.
    pub fn index(&self) -> Vec<IndexEntry> {
        let mut rows = self.inner.registry.load().index();
        if let Some(repo) = &self.inner.repository {
            for name in repo.names() {
                if !rows.iter().any(|r| r.name == name) {
                    rows.push(IndexEntry {
                        name,
                        version: None,
                        state: registry::State::Unavailable,
                        reason: "not loaded".into(),
                    });
                }
            }
            rows.sort_by(|a, b| (&a.name, a.version).cmp(&(&b.name, b.version)));
        }
        rows
    }

    fn lifecycle(&self) -> std::sync::MutexGuard<'_, Lifecycle> {
        self.inner.lifecycle.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn repository(&self) -> Result<&Repository> {
        self.inner.repository.as_ref().ok_or_else(|| Error::Unsupported("this engine has no model repository".into()))
    }

    /// Rebuilds `names` from disk (and the external configs) beside what serves, then swaps the
    /// result in at once. Blocks while models load; requests are served meanwhile.
    fn rebuild(&self, repo: &Repository, lc: &mut Lifecycle, names: &[String]) {
        if !self.is_ready() {
            return;
        }
        let current = self.inner.registry.load_full();
        let mut next = (*current).clone();
        for name in names {
            if !lc.wanted.contains(name) {
                continue;
            }
            let inputs = lifecycle::Inputs::read(repo, name, lc.configs.get(name).map(String::as_str));
            let signature = inputs.signature();
            let (served, notes) = lifecycle::build(repo, name, inputs, current.models.get(name));
            match served {
                Some(s) => next.models.insert(name.clone(), s),
                None => next.models.remove(name),
            };
            if notes.model.is_none() && notes.versions.is_empty() {
                next.notes.remove(name);
            } else {
                next.notes.insert(name.clone(), notes);
            }
            lc.applied.insert(name.clone(), signature);
        }
        self.inner.registry.store(Arc::new(next));
    }

    /// Loads (or reloads) `name` from the repository, as the repository API's `load` does. Fails
    /// with the reason when anything did not load; what served before keeps serving then.
    /// `parameters` are the names of the request's load parameters (Triton's config and file
    /// overrides): any is refused, since models load from the repository as it is.
    pub fn load_model<'a>(&self, name: &str, parameters: impl IntoIterator<Item = &'a str>) -> Result<()> {
        self.require_explicit()?;
        refuse_parameters(parameters)?;
        let repo = self.repository()?;
        if !repository::is_model_name(name) {
            return Err(Error::invalid(format!("'{name}' is not a valid model name")));
        }
        repo.versions(name)?;
        let mut lc = self.lifecycle();
        lc.wanted.insert(name.to_string());
        self.rebuild(repo, &mut lc, &[name.to_string()]);
        let r = self.inner.registry.load();
        match r.notes.get(name) {
            None => Ok(()),
            Some(n) => {
                let mut why: Vec<String> = n.model.iter().cloned().collect();
                why.extend(n.versions.iter().map(|(v, e)| format!("version {v}: {e}")));
                Err(Error::invalid(format!("failed to load '{name}': {}", why.join("; "))))
            }
        }
    }

    /// Stops serving `name`; its requests in flight finish on it. `parameters` as for `load_model`.
    pub fn unload_model<'a>(&self, name: &str, parameters: impl IntoIterator<Item = &'a str>) -> Result<()> {
        self.require_explicit()?;
        refuse_parameters(parameters)?;
        self.unload(name)
    }

    fn unload(&self, name: &str) -> Result<()> {
        let repo = self.repository()?;
        let mut lc = self.lifecycle();
        let current = self.inner.registry.load_full();
        if !current.models.contains_key(name) && !repo.names().iter().any(|n| n == name) {
            return Err(Error::NotFound(format!("unknown model '{name}'")));
        }
        lc.wanted.remove(name);
        lc.applied.remove(name);
        let mut next = (*current).clone();
        next.models.remove(name);
        next.notes.insert(name.to_string(), registry::Notes { model: Some("unloaded".into()), ..Default::default() });
        self.inner.registry.store(Arc::new(next));
        tracing::info!(model = %name, "model unloaded");
        Ok(())
    }

    /// Makes `name`'s canary candidate its default version.
    pub fn promote_canary(&self, name: &str) -> Result<()> {
        self.require_explicit()?;
        let r = self.inner.registry.load();
        let canary = r.models.get(name).and_then(|s| s.canary.as_ref());
        let c = canary.ok_or_else(|| Error::NotFound(format!("model '{name}' has no canary")))?;
        if let canary::CanaryState::Withdrawn(why) = c.state() {
            return Err(Error::invalid(format!("the canary of '{name}' was withdrawn: {why}")));
        }
        c.promote();
        tracing::info!(model = %name, version = c.config.version, "canary promoted");
        Ok(())
    }

    /// One round of repository polling: models whose files or config changed (and stayed the
    /// same for `debounce`, so half-written files are not picked up) are rebuilt; new model
    /// directories are loaded and removed ones unloaded.
    pub fn poll(&self, debounce: Duration) {
        let Some(repo) = &self.inner.repository else { return };
        let changed = |lc: &mut Lifecycle| {
            let on_disk = repo.names();
            lc.wanted.extend(on_disk.iter().cloned());
            let gone: Vec<String> = lc.wanted.iter().filter(|n| !on_disk.contains(n)).cloned().collect();
            let moved: BTreeMap<String, u64> = lc
                .wanted
                .iter()
                .filter(|n| on_disk.contains(n))
                .map(|n| {
                    (n.clone(), lifecycle::Inputs::read(repo, n, lc.configs.get(n).map(String::as_str)).signature())
                })
                .filter(|(n, sig)| lc.applied.get(n) != Some(sig))
                .collect();
            (gone, moved)
        };
        let (gone, first) = changed(&mut self.lifecycle());
        for name in gone {
            let _ = self.unload(&name);
        }
        if first.is_empty() {
            return;
        }
        std::thread::sleep(debounce);
        let mut lc = self.lifecycle();
        let (_, second) = changed(&mut lc);
        let settled: Vec<String> =
            second.iter().filter(|(n, sig)| first.get(*n) == Some(sig)).map(|(n, _)| n.clone()).collect();
        if !settled.is_empty() {
            tracing::info!(models = ?settled, "repository changed; reloading");
            self.rebuild(repo, &mut lc, &settled);
        }
    }

    /// Replaces the external model configs with `configs` (by model name) read at `revision`,
    /// and rebuilds every model whose config changed, all in one swap: a change of several keys
    /// is applied whole or not at all.
    pub fn apply_configs(&self, revision: i64, configs: BTreeMap<String, String>) {
        let Some(repo) = &self.inner.repository else { return };
        let mut lc = self.lifecycle();
        let changed: Vec<String> = lc
            .configs
            .keys()
            .chain(configs.keys())
            .filter(|n| lc.configs.get(*n) != configs.get(*n))
            .cloned()
            .collect();
        lc.configs = configs;
        let changed: Vec<String> = changed.into_iter().collect::<BTreeSet<_>>().into_iter().collect();
        tracing::info!(revision, models = ?changed, "config change");
        self.rebuild(repo, &mut lc, &changed);
    }

    /// True while new requests are accepted.
    pub fn is_ready(&self) -> bool {
        self.inner.accepting.load(Ordering::Acquire)
    }

    pub async fn infer(&self, req: InferRequest) -> Result<InferResponse> {
        if !self.is_ready() {
            return Err(Error::unavailable("server is shutting down", Some(queue::RETRY_AFTER)));
        }
        let (model, canary) = self.inner.registry.load().route(
            &req.model_name,
            req.model_version.as_deref(),
            req.id.as_deref(),
            req.canary,
        )?;
        let _tenant = match &self.inner.tenants {
            Some(t) => Some(t.admit(req.tenant.as_deref(), Instant::now()).map_err(|e| model.refuse(e))?),
            None => None,
        };
        let cap = self.inner.limits.max_concurrent_requests;
        let now = self.inner.in_flight.fetch_add(1, Ordering::AcqRel) + 1;
        let _admitted = Admitted(&self.inner.in_flight);
        if cap > 0 && now > cap {
            let e = Error::Overloaded {
                message: format!("over --max-concurrent-requests ({cap} requests in flight)"),
                retry_after: Some(queue::RETRY_AFTER),
            };
            return Err(model.refuse(e));
        }
        let start = Instant::now();
        let result = model.infer(req, &self.inner.limits).await;
        if let Some((canary, side)) = canary {
            let failed = match &result {
                Ok(r) => canary::has_nan(&r.outputs),
                Err(e) => matches!(e, Error::Internal(_) | Error::DeadlineExceeded(_)),
            };
            if let Some(reason) = canary.record(side, failed, start.elapsed()) {
                tracing::warn!(model = %model.spec.name, version = canary.config.version, %reason, "canary withdrawn");
                metrics::global().canary_rollbacks.with_label_values(&[model.spec.name.as_str()]).inc();
            }
        }
        // The last request of a replaced or unloaded model frees it (worker threads joined,
        // session released) on a thread of its own, not on the caller's.
        if Arc::strong_count(&model) == 1 {
            let _ = std::thread::Builder::new().name("ferrite-free".into()).spawn(move || drop(model));
        }
        result
    }

    /// Stops accepting work; queued and running requests go on.
    pub fn begin_shutdown(&self) {
        self.inner.accepting.store(false, Ordering::Release);
        for m in self.models() {
            m.batcher().close();
        }
    }

    /// Waits for queued and running work to finish, at most `timeout`, then fails what is left.
    /// Returns how many requests were failed.
    pub fn drain(&self, timeout: Duration) -> usize {
        let deadline = Instant::now() + timeout;
        let mut failed = 0;
        for m in self.models() {
            if !m.batcher().wait_idle(deadline) {
                failed += m.batcher().abort();
            }
        }
        failed
    }
}
