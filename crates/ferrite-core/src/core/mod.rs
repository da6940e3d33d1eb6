//! `Core`, the engine of one process, and the path of one request through it: admission, routing
//! to a model version, the model's own checks, cache and batcher, then the canary's record. The
//! control plane (loads, reloads, unloads, polling, external configs) is in `control`.

mod models;

use std::{
    collections::BTreeMap,
    path::Path,
    sync::{atomic::AtomicBool, atomic::Ordering, Arc, Mutex},
    time::{Duration, Instant},
};

use arc_swap::ArcSwap;

use crate::{
    admission::{self, tenant::Tenants, Limits},
    cache::ResponseCache,
    control::{registry, Lifecycle, LoadOptions, Registry, Repository},
    engine::queue::Hold,
    wire::RETRY_AFTER,
    Error, InferRequest, InferResponse, Model, Result,
};

/// The engine of one process: the models it serves (swapped atomically on every change) and
/// whether new work is accepted. Cheap to clone.
#[derive(Clone)]
pub struct Core {
    pub(crate) inner: Arc<Inner>,
}

pub(crate) struct Inner {
    pub(crate) cache: Option<Arc<ResponseCache>>,
    /// Shared with pipelines, whose model steps find the model serving now in it.
    pub(crate) registry: Arc<ArcSwap<Registry>>,
    /// Where models are (re)loaded from; `None` for a core over models loaded elsewhere.
    pub(crate) repository: Option<Repository>,
    /// Serializes loads, reloads and unloads.
    pub(crate) lifecycle: Mutex<Lifecycle>,
    /// What readiness reports: off first at shutdown, while requests are still accepted.
    ready: AtomicBool,
    accepting: AtomicBool,
    limits: Limits,
    tenants: Option<Arc<Tenants>>,
    pub(crate) control: ModelControl,
    /// Requests in the engine now, for `Limits::max_concurrent_requests`.
    in_flight: Arc<std::sync::atomic::AtomicUsize>,
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
        core.load_initial(names, configs.unwrap_or_default());
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
        cache: Option<Arc<ResponseCache>>,
    ) -> Core {
        Core {
            inner: Arc::new(Inner {
                cache,
                registry: Arc::new(ArcSwap::from_pointee(registry)),
                repository,
                lifecycle: Mutex::new(Lifecycle::default()),
                ready: AtomicBool::new(true),
                accepting: AtomicBool::new(true),
                limits,
                tenants: None,
                control: ModelControl::None,
                in_flight: Default::default(),
            }),
        }
    }

    /// Applies per-tenant limits to every request (before any other work). Call before cloning.
    pub fn with_tenants(mut self, tenants: Arc<Tenants>) -> Core {
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

    /// The per-tenant limits, when configured.
    pub fn tenants(&self) -> Option<&Tenants> {
        self.inner.tenants.as_deref()
    }

    /// The process's response cache, if it has one.
    pub fn cache(&self) -> Option<&Arc<ResponseCache>> {
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
        self.inner.registry.load().failed()
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

    /// What readiness probes report: true until shutdown begins (see [`withdraw`](Core::withdraw)).
    pub fn is_ready(&self) -> bool {
        self.inner.ready.load(Ordering::Acquire) && self.is_accepting()
    }

    /// True while new requests are accepted.
    pub fn is_accepting(&self) -> bool {
        self.inner.accepting.load(Ordering::Acquire)
    }

    /// Turns readiness off while requests are still served, so balancers probing it stop
    /// sending work here before [`begin_shutdown`](Core::begin_shutdown) refuses any.
    pub fn withdraw(&self) {
        self.inner.ready.store(false, Ordering::Release);
    }

    pub async fn infer(&self, req: InferRequest) -> Result<InferResponse> {
        let route = self.route(&req)?;
        self.infer_on(route, req, None).await
    }

    /// Whether a version that a request for `model` (at `version`) may go to takes an input
    /// `name` of `datatype` and `shape` ([`Model::check_input`]), its data aside; else why the
    /// one it would most often go to does not. Front-ends ask before decoding a large body's data,
    /// so that data the model would refuse is refused unread. Both sides of a canary are asked:
    /// which one serves a request is chosen once it is whole (by its id).
    pub fn check_input(
        &self,
        model: &str,
        version: Option<&str>,
        name: &str,
        datatype: crate::DataType,
        shape: &[usize],
    ) -> Result<()> {
        let candidates = self.inner.registry.load().candidates(model, version)?;
        let mut checks =
            candidates.iter().map(|m| m.check_input(name, datatype, shape, self.inner.limits.max_elements));
        // The default's answer, unless another side takes the input (there is always one).
        match checks.next() {
            Some(Err(refused)) if !checks.any(|c| c.is_ok()) => Err(refused),
            _ => Ok(()),
        }
    }

    /// The model version `req` goes to (its canary's choice included), chosen once: a caller that
    /// checks or converts inputs against [`Route::model`] runs them on that version.
    pub fn route(&self, req: &InferRequest) -> Result<Route> {
        if !self.is_accepting() {
            return Err(Error::unavailable("server is shutting down", Some(RETRY_AFTER)));
        }
        let (model, canary) = self.inner.registry.load().route(
            &req.model_name,
            req.model_version.as_deref(),
            req.id.as_deref(),
            req.canary,
        )?;
        Ok(Route { model: Some(model), canary })
    }

    /// Takes the places one request of `tenant` to `route`'s model holds (its tenant's, the
    /// process's), or refuses it (counted as the model's refusal). A call split into several
    /// requests (an embeddings call's batches) takes them once and runs each part with
    /// [`infer_on`](Core::infer_on), so a large call is charged as one request.
    pub fn admit(&self, route: &Route, tenant: Option<&str>) -> Result<Arc<Hold>> {
        self.places(route.model(), tenant).map(Arc::new)
    }

    /// Takes the place one of the application's own calls to `route`'s model holds (the Python
    /// package's in-process calls): the process's, never a tenant's, so that clients of a server
    /// on the same engine (anonymous ones share `[default]`) cannot use up the application's rate.
    pub fn admit_own(&self, route: &Route) -> Result<Arc<Hold>> {
        let mut hold = Hold::default();
        self.process_place(route.model(), &mut hold)?;
        Ok(Arc::new(hold))
    }

    fn places(&self, model: &Model, tenant: Option<&str>) -> Result<Hold> {
        let mut hold = Hold::default();
        if let Some(t) = &self.inner.tenants {
            hold.0.push(Box::new(t.admit(tenant, Instant::now()).map_err(|e| model.record_refusal(e))?));
        }
        self.process_place(model, &mut hold)?;
        Ok(hold)
    }

    fn process_place(&self, model: &Model, hold: &mut Hold) -> Result<()> {
        hold.0.push(Box::new(
            admission::Admitted::enter(&self.inner.in_flight, &self.inner.limits)
                .map_err(|e| model.record_refusal(e))?,
        ));
        Ok(())
    }

    /// Runs `req` on the version `route` chose. With `charged`, the request is part of a call
    /// already admitted with [`admit`](Core::admit), whose places it holds rather than taking its own.
    pub async fn infer_on(&self, route: Route, req: InferRequest, charged: Option<Arc<Hold>>) -> Result<InferResponse> {
        let model = route.model();
        // The places are held until the request's work stops (queued or running), not until its
        // client leaves.
        let (hold, req) = match charged {
            Some(call) => (Hold(vec![Box::new(call)]), req),
            None => (self.places(model, req.tenant.as_deref())?, self.within_tenants_priority(model, req)),
        };
        // NaN answers to NaN questions are not the candidate's fault.
        let nan_inputs = route.canary.is_some() && crate::control::canary::has_nan(&req.inputs);
        let start = Instant::now();
        let result = model.infer_holding(req, self.inner.limits.max_elements, hold).await;
        if let Some((canary, side)) = &route.canary {
            canary.observe(&model.spec.name, *side, nan_inputs, &result, start.elapsed());
        }
        result
    }

    /// `req` asking for no higher priority level than its tenant may (`highest_priority`): a
    /// higher one is lowered to it, or to `model`'s lowest where it has fewer levels. Any client
    /// may ask for the highest level (Triton's `priority`); where tenants are configured, one that
    /// should not put its requests ahead of everyone else's need not be able to.
    fn within_tenants_priority(&self, model: &Model, mut req: InferRequest) -> InferRequest {
        let highest = self.inner.tenants.as_ref().map_or(0, |t| t.limits(req.tenant.as_deref()).highest_priority);
        if highest > 0 && req.priority != 0 && req.priority < highest {
            req.priority = highest.min(model.spec.batch.priority_levels.max(1));
        }
        req
    }

    /// The Prometheus text format, with the gauges read from the engine's state brought up to date.
    pub fn metrics(&self) -> String {
        let m = crate::telemetry::metrics::global();
        // Versions unloaded since the last scrape drop out of the per-version gauges.
        m.pending.reset();
        m.model_ready.reset();
        for model in self.models() {
            let v = model.spec.version.to_string();
            let labels = [model.spec.name.as_str(), v.as_str()];
            m.pending.with_label_values(&labels).set(model.batcher().queued() as i64);
            m.model_ready.with_label_values(&labels).set(self.is_ready() as i64);
        }
        if let Some(c) = self.cache() {
            let s = c.snapshot();
            m.redis_up.set((s.redis == "ok") as i64);
            m.cache_hot_keys.set(s.hot_keys.min(i64::MAX as u64) as i64);
        }
        crate::telemetry::metrics::render()
    }

    /// Stops accepting work (readiness off too); queued and running requests go on.
    pub fn begin_shutdown(&self) {
        self.withdraw();
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

/// One request's model version and canary side, chosen by [`Core::route`]. Cloned for the parts
/// of one call; the model is let go off the request path (a version unloaded meanwhile is freed
/// on a thread of its own, not on the caller's).
#[derive(Clone)]
pub struct Route {
    model: Option<Arc<Model>>,
    canary: Option<(Arc<crate::control::canary::Canary>, crate::control::canary::Side)>,
}

impl Route {
    pub fn model(&self) -> &Model {
        self.model.as_deref().expect("a route holds its model until dropped")
    }

    /// A route to a model that serves beside this route's, not on its own name (a text
    /// embedder's token embeddings): no canary is judged by it.
    pub(crate) fn beside(&self, model: Arc<Model>) -> Route {
        Route { model: Some(model), canary: None }
    }
}

impl Drop for Route {
    fn drop(&mut self) {
        if let Some(model) = self.model.take() {
            registry::release(model);
        }
    }
}
