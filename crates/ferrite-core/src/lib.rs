//! Ferrite's engine: tensors, model repository, dynamic batcher and backends.
//!
//! Nothing here knows HTTP, gRPC or Python; the front-ends translate their wire types into
//! [`InferRequest`] and map [`Error`] once.

pub mod backend;
pub mod batcher;
pub mod cache;
pub mod config;
pub mod dtype;
pub mod error;
pub mod metrics;
pub mod model;
pub mod onnx;
pub mod queue;
pub mod repository;
pub mod stats;
pub mod tenant;
pub mod tensor;

use std::{
    collections::BTreeMap,
    path::Path,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

pub use backend::Backend;
pub use dtype::DataType;
pub use error::{Error, Result};
pub use model::{InferRequest, InferResponse, Limits, Model};
pub use repository::LoadOptions;
pub use tensor::{Tensor, TensorData};

/// The engine of one process: the loaded models and whether new work is accepted. Cheap to clone.
#[derive(Clone)]
pub struct Core {
    inner: Arc<Inner>,
}

struct Inner {
    cache: Option<Arc<cache::ResponseCache>>,
    models: BTreeMap<String, Arc<Model>>,
    failed: BTreeMap<String, String>,
    accepting: AtomicBool,
    limits: Limits,
    tenants: Option<Arc<tenant::Tenants>>,
    /// Requests in the engine now, for `Limits::max_concurrent_requests`.
    in_flight: std::sync::atomic::AtomicUsize,
}

/// Holds one place under `max_concurrent_requests` while a request is in the engine.
struct Admitted<'c>(&'c std::sync::atomic::AtomicUsize);

impl Drop for Admitted<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Core {
    /// Loads the repository at `root`; models that fail are logged and left out.
    pub fn load(root: &Path, options: &LoadOptions, limits: Limits) -> Result<Core> {
        let loaded = repository::load_all(root, options)?;
        Ok(Core::new(loaded.models, loaded.failed, limits, options.cache.clone()))
    }

    /// A core over models loaded elsewhere (one `Model.load` from Python, tests), with no cache.
    pub fn from_models(models: BTreeMap<String, Arc<Model>>, failed: BTreeMap<String, String>, limits: Limits) -> Core {
        Core::new(models, failed, limits, None)
    }

    fn new(
        models: BTreeMap<String, Arc<Model>>,
        failed: BTreeMap<String, String>,
        limits: Limits,
        cache: Option<Arc<cache::ResponseCache>>,
    ) -> Core {
        Core {
            inner: Arc::new(Inner {
                cache,
                models,
                failed,
                accepting: AtomicBool::new(true),
                limits,
                tenants: None,
                in_flight: Default::default(),
            }),
        }
    }

    /// Applies per-tenant limits to every request (before any other work). Call before cloning.
    pub fn with_tenants(mut self, tenants: Arc<tenant::Tenants>) -> Core {
        Arc::get_mut(&mut self.inner).expect("with_tenants is called on a fresh core").tenants = Some(tenants);
        self
    }

    /// The per-tenant limits, when configured.
    pub fn tenants(&self) -> Option<&Arc<tenant::Tenants>> {
        self.inner.tenants.as_ref()
    }

    /// The process's response cache, if it has one.
    pub fn cache(&self) -> Option<&Arc<cache::ResponseCache>> {
        self.inner.cache.as_ref()
    }

    pub fn models(&self) -> impl Iterator<Item = &Arc<Model>> {
        self.inner.models.values()
    }

    /// Models that failed to load, with the reason.
    pub fn failed(&self) -> &BTreeMap<String, String> {
        &self.inner.failed
    }

    pub fn limits(&self) -> &Limits {
        &self.inner.limits
    }

    /// The model `name` at `version` (`None` or empty: the one served).
    pub fn model(&self, name: &str, version: Option<&str>) -> Result<&Arc<Model>> {
        let model = self.inner.models.get(name).ok_or_else(|| match self.inner.failed.get(name) {
            Some(why) => Error::unavailable(format!("model '{name}' failed to load: {why}"), None),
            None => Error::NotFound(format!("unknown model '{name}'")),
        })?;
        match version.filter(|v| !v.is_empty()) {
            Some(v) if v.parse::<u64>().ok() != Some(model.spec.version) => {
                Err(Error::NotFound(format!("model '{name}' has no version '{v}'")))
            }
            _ => Ok(model),
        }
    }

    /// True while new requests are accepted.
    pub fn is_ready(&self) -> bool {
        self.inner.accepting.load(Ordering::Acquire)
    }

    pub async fn infer(&self, req: InferRequest) -> Result<InferResponse> {
        if !self.is_ready() {
            return Err(Error::unavailable("server is shutting down", Some(queue::RETRY_AFTER)));
        }
        let model = self.model(&req.model_name, req.model_version.as_deref())?.clone();
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
        model.infer(req, &self.inner.limits).await
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
