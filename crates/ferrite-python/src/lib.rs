//! Python bindings: the Ferrite core in-process. Thin by design: convert NumPy arrays to core
//! tensors without copying, release the GIL while a request waits and runs, convert outputs to
//! NumPy arrays that keep the Rust buffer alive, and map the core's errors once.

mod convert;
#[cfg(feature = "serve")]
mod serving;

use std::{
    path::PathBuf,
    sync::{Arc, Mutex, OnceLock},
    time::Duration,
};

use ferrite_core::{
    control::{config::ModelConfig, repository},
    engine::spec::ModelSpec,
    Core, Error, InferRequest, Limits, LoadOptions, Tensor,
};
use pyo3::{create_exception, exceptions::PyException, prelude::*, types::PyDict};

create_exception!(_native, FerriteError, PyException, "Base class of every Ferrite error.");
create_exception!(_native, InvalidInput, FerriteError, "The request does not fit the model.");
create_exception!(_native, ModelNotFound, FerriteError, "No such model or version.");
create_exception!(_native, Unavailable, FerriteError, "The model cannot take work now (queue full, shutting down).");
create_exception!(_native, Overloaded, Unavailable, "Over a concurrency limit: retry later.");
create_exception!(_native, DeadlineExceeded, FerriteError, "The request's timeout ended before it ran.");
create_exception!(_native, Unsupported, FerriteError, "The request asks for something not supported.");
create_exception!(_native, InternalError, FerriteError, "A fault inside the engine.");

/// The one mapping from core errors to Python exceptions.
fn py_err(e: Error) -> PyErr {
    match e {
        Error::InvalidInput(m) | Error::TooLarge(m) => InvalidInput::new_err(m),
        Error::NotFound(m) => ModelNotFound::new_err(m),
        Error::Unavailable { message, .. } => Unavailable::new_err(message),
        Error::Overloaded { message, .. } => Overloaded::new_err(message),
        Error::DeadlineExceeded(m) => DeadlineExceeded::new_err(m),
        Error::Unsupported(m) => Unsupported::new_err(m),
        Error::Internal(m) => InternalError::new_err(m),
    }
}

/// Drives the core's futures (queue waits and timeouts); inference itself runs on the batcher's
/// own threads.
fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("ferrite-py")
            .enable_all()
            .build()
            .expect("tokio runtime")
    })
}

/// Loads ONNX Runtime from `path` (the `onnxruntime` package's library, found by the Python side).
#[pyfunction]
fn init_runtime(path: PathBuf) -> PyResult<String> {
    ferrite_core::engine::onnx::init_runtime(Some(&path)).map(|p| p.display().to_string()).map_err(py_err)
}

/// The version `libonnxruntime` at `path` reports, checked against the range Ferrite supports
/// (an InvalidInput error says what was found and what is needed).
#[pyfunction]
fn library_version(path: PathBuf) -> PyResult<String> {
    ferrite_core::engine::onnx::library_version(&path).map_err(InvalidInput::new_err)
}

/// Writes a crash report into `dir` should a fatal signal end the process (the Python layer has
/// enabled faulthandler first, which then adds every Python thread's stack); returns its path.
#[pyfunction]
fn install_crash_handler(dir: PathBuf) -> PyResult<String> {
    ferrite_core::crash::install(&dir, ferrite_core::engine::onnx::runtime_version().unwrap_or("not loaded"))
        .map(|p| p.display().to_string())
        .map_err(InvalidInput::new_err)
}

/// A model repository loaded in-process: every model of `<repository>/<name>/<version>/model.onnx`.
#[pyclass(frozen, module = "ferrite._native")]
struct Engine {
    core: Core,
}

#[pymethods]
impl Engine {
    #[new]
    #[pyo3(signature = (model_repository, *, threads=None, max_request_elements=None, max_concurrent_requests=None, cache_bytes=None, cache_ttl=300.0, redis_url=None, redis_timeout_ms=5, cache_max_value_bytes=1048576, tenant_header=None, tenant_config=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        model_repository: PathBuf,
        threads: Option<usize>,
        max_request_elements: Option<usize>,
        max_concurrent_requests: Option<usize>,
        cache_bytes: Option<u64>,
        cache_ttl: f64,
        redis_url: Option<String>,
        redis_timeout_ms: u64,
        cache_max_value_bytes: usize,
        tenant_header: Option<String>,
        tenant_config: Option<PathBuf>,
    ) -> PyResult<Self> {
        // As the binary's --tenant-header and --tenant-config: per-tenant limits and cache pools
        // for the requests a server on this engine takes.
        let tenants = match (tenant_header, tenant_config) {
            (Some(header), Some(path)) => {
                Some(ferrite_core::admission::tenant::Tenants::load(&header, &path).map_err(py_err)?)
            }
            (None, None) => None,
            _ => return Err(InvalidInput::new_err("tenant_header and tenant_config are given together")),
        };
        let mut options = load_options(threads);
        // The server's two-tier response cache, for the models whose config enables it: in-process
        // (`cache_bytes`), and Redis shared with other processes (`redis_url`) when given.
        if cache_bytes.is_some() || redis_url.is_some() {
            let shared_timeout = Duration::from_millis(redis_timeout_ms.max(1));
            let redis = |url: Option<&str>, from: &str| -> PyResult<Option<Arc<dyn ferrite_core::cache::SharedTier>>> {
                let Some(url) = url else { return Ok(None) };
                let _context = runtime().enter();
                let tier = ferrite_redis::RedisTier::start(url, shared_timeout * 4)
                    .map_err(|e| InvalidInput::new_err(format!("{from} {e}")))?;
                Ok(Some(tier))
            };
            let mut cache = ferrite_core::cache::ResponseCache::new(
                &ferrite_core::cache::CacheOptions {
                    local_bytes: cache_bytes.unwrap_or(256 << 20),
                    ttl: Duration::from_secs_f64(cache_ttl.clamp(1.0, 1e9)),
                    shared_timeout,
                    max_value_bytes: cache_max_value_bytes,
                    ..Default::default()
                },
                redis(redis_url.as_deref(), "redis_url")?,
            );
            for (tenant, pool) in tenants.iter().flat_map(|t| &t.config().cache_pools) {
                let tier =
                    redis(pool.redis_url.as_deref(), &format!("tenant_config [tenants.{tenant}] cache_redis_url"))?;
                cache = cache.with_pool(tenant, tier, pool.key_prefix.as_deref());
            }
            options.cache = Some(Arc::new(cache));
        }
        let limits = limits(max_request_elements, max_concurrent_requests);
        let mut core = py.detach(|| Core::load(&model_repository, &options, limits)).map_err(py_err)?;
        if let Some(t) = tenants {
            core = core.with_tenants(t);
        }
        Ok(Engine { core })
    }

    /// The response cache's state (None without one): entries and bytes in process, Redis's
    /// state and calls, and the lookups of every model that hit and missed.
    fn cache_stats<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let Some(cache) = self.core.cache() else { return Ok(None) };
        let s = cache.snapshot();
        let d = PyDict::new(py);
        let (mut hits, mut misses) = (0u64, 0u64);
        for m in self.core.models() {
            let snap = m.stats.snapshot(&m.spec.name, m.spec.version);
            hits += snap.inference_stats.cache_hit.count;
            misses += snap.inference_stats.cache_miss.count;
        }
        d.set_item("hits", hits)?;
        d.set_item("misses", misses)?;
        d.set_item("local_entries", s.local_entries)?;
        d.set_item("local_bytes", s.local_bytes)?;
        d.set_item("redis", s.redis)?;
        d.set_item("redis_hits", s.redis_hits)?;
        d.set_item("redis_misses", s.redis_misses)?;
        d.set_item("redis_errors", s.redis_errors)?;
        Ok(Some(d))
    }

    /// Names of the models that loaded.
    fn models(&self) -> Vec<String> {
        self.core.registry().models.keys().cloned().collect()
    }

    /// Models that failed to load, with the reason.
    fn failed(&self) -> Vec<(String, String)> {
        self.core.failed().iter().map(|(k, v)| (k.clone(), v.clone())).collect()
    }

    #[pyo3(signature = (name, version=None))]
    fn model(&self, name: &str, version: Option<&str>) -> PyResult<Model> {
        let m = self.core.model(name, version).map_err(py_err)?;
        Ok(Model { core: self.core.clone(), name: m.spec.name.clone() })
    }

    /// Stops taking requests and drains queued ones (at most `timeout` seconds).
    #[pyo3(signature = (timeout=30.0))]
    fn close(&self, py: Python<'_>, timeout: f64) -> usize {
        self.core.begin_shutdown();
        py.detach(|| self.core.drain(Duration::from_secs_f64(timeout.max(0.0))))
    }
}

fn load_options(threads: Option<usize>) -> LoadOptions {
    // Python models' workers run under this process's own interpreter.
    let python = std::env::current_exe().unwrap_or_else(|_| "python3".into());
    let mut options = LoadOptions { python, ..LoadOptions::default() };
    if let Some(t) = threads {
        options.threads = t.max(1);
    }
    options
}

/// The binary's --max-request-elements and --max-concurrent-requests: every request in the core
/// at once, the application's own calls and its servers' alike (0: no bound).
fn limits(max_request_elements: Option<usize>, max_concurrent_requests: Option<usize>) -> Limits {
    let mut limits = Limits::default();
    if let Some(n) = max_request_elements {
        limits.max_elements = n;
    }
    limits.max_concurrent_requests = max_concurrent_requests.unwrap_or(0);
    limits
}

/// One served model. Calls from many threads and coroutines share its dynamic batcher.
#[pyclass(frozen, module = "ferrite._native")]
struct Model {
    core: Core,
    name: String,
}

impl Model {
    fn span(&self, traceparent: Option<&str>) -> tracing::Span {
        #[cfg(feature = "serve")]
        return serving::request_span(&self.name, traceparent);
        #[cfg(not(feature = "serve"))]
        return {
            let _ = traceparent;
            tracing::Span::none()
        };
    }

    fn model(&self) -> PyResult<Arc<ferrite_core::Model>> {
        self.core.model(&self.name, None).map_err(py_err)
    }

    fn request(
        &self,
        py: Python<'_>,
        inputs: &Bound<'_, PyDict>,
        outputs: Option<Vec<String>>,
        copy: bool,
        timeout_us: Option<u64>,
        priority: u32,
    ) -> PyResult<(ferrite_core::Route, InferRequest)> {
        let mut req =
            InferRequest { model_name: self.name.clone(), outputs, timeout_us, priority, ..Default::default() };
        // The inputs are converted for the version that runs them.
        let route = self.core.route(&req).map_err(py_err)?;
        req.inputs = convert::inputs(py, &route.model().spec, inputs, copy)?;
        Ok((route, req))
    }
}

#[pymethods]
impl Model {
    /// Loads one model directory (`<dir>/config.toml`, `<dir>/<version>/model.onnx`) or one
    /// `.onnx` file, with optional overrides of its config.
    #[staticmethod]
    #[pyo3(signature = (path, *, name=None, max_batch_size=None, max_queue_delay_us=None, instance_count=None, threads=None, max_request_elements=None, max_concurrent_requests=None))]
    #[allow(clippy::too_many_arguments)]
    fn load(
        py: Python<'_>,
        path: PathBuf,
        name: Option<String>,
        max_batch_size: Option<usize>,
        max_queue_delay_us: Option<u64>,
        instance_count: Option<usize>,
        threads: Option<usize>,
        max_request_elements: Option<usize>,
        max_concurrent_requests: Option<usize>,
    ) -> PyResult<Model> {
        let options = load_options(threads);
        let overrides = ModelConfig { max_batch_size, instance_count, threads, ..Default::default() };
        let name = name.unwrap_or_else(|| {
            let stem = if path.is_dir() { path.file_name() } else { path.file_stem() };
            stem.and_then(|s| s.to_str()).unwrap_or("model").to_string()
        });
        let model = py
            .detach(|| repository::load_with(&path, &name, &options, &overrides, max_queue_delay_us))
            .map_err(py_err)?;
        let limits = limits(max_request_elements, max_concurrent_requests);
        let core = Core::from_models([(name.clone(), Arc::new(model))].into(), Default::default(), limits);
        Ok(Model { core, name })
    }

    #[getter]
    fn name(&self) -> &str {
        &self.name
    }

    /// The inputs a request may leave out (`optional` in the model's config).
    fn _optional_inputs(&self) -> PyResult<Vec<String>> {
        Ok(self.model()?.spec.optional.iter().cloned().collect())
    }

    /// (inferences, executions, cache hits, cache misses) of the model so far.
    fn _stats(&self) -> PyResult<(u64, u64, u64, u64)> {
        let m = self.model()?;
        let s = m.stats.snapshot(&m.spec.name, m.spec.version);
        Ok((
            s.inference_count,
            s.execution_count,
            s.inference_stats.cache_hit.count,
            s.inference_stats.cache_miss.count,
        ))
    }

    /// (name, version, platform, max_batch_size, inputs, outputs) with tensors as
    /// (name, datatype, shape); the Python layer turns it into frozen dataclasses.
    #[allow(clippy::type_complexity)]
    fn _metadata(
        &self,
    ) -> PyResult<(String, String, String, usize, Vec<(String, String, Vec<i64>)>, Vec<(String, String, Vec<i64>)>)>
    {
        let model = self.model()?;
        let spec: &ModelSpec = &model.spec;
        let tensors = |ts: &[ferrite_core::engine::spec::TensorSpec]| {
            ts.iter().map(|t| (t.name.clone(), t.datatype.as_str().to_string(), spec.wire_shape(t))).collect()
        };
        Ok((
            spec.name.clone(),
            spec.version.to_string(),
            spec.platform.to_string(),
            spec.batch.max_batch_size,
            tensors(&spec.inputs),
            tensors(&spec.outputs),
        ))
    }

    /// Runs one request and returns its outputs. The GIL is released while it waits and runs.
    /// `traceparent` (W3C) makes the request's spans children of the caller's.
    #[pyo3(signature = (inputs, outputs=None, *, copy=false, timeout_us=None, priority=0, traceparent=None))]
    #[allow(clippy::too_many_arguments)]
    fn infer<'py>(
        &self,
        py: Python<'py>,
        inputs: &Bound<'py, PyDict>,
        outputs: Option<Vec<String>>,
        copy: bool,
        timeout_us: Option<u64>,
        priority: u32,
        traceparent: Option<&str>,
    ) -> PyResult<Bound<'py, PyDict>> {
        use tracing::Instrument;
        let (route, req) = self.request(py, inputs, outputs, copy, timeout_us, priority)?;
        let span = self.span(traceparent);
        let own = self.core.admit_own(&route).map_err(py_err)?;
        let result = block_on(py, self.core.infer_on(route, req, Some(own)).instrument(span))?;
        convert::outputs(py, result.map_err(py_err)?.outputs)
    }

    /// Queues one request; its result is delivered through `completer` under `token`.
    /// Returns a handle whose `cancel()` drops the request if it has not run yet.
    #[pyo3(signature = (inputs, outputs, copy, timeout_us, priority, completer, token, traceparent=None))]
    #[allow(clippy::too_many_arguments)]
    fn _submit(
        &self,
        py: Python<'_>,
        inputs: &Bound<'_, PyDict>,
        outputs: Option<Vec<String>>,
        copy: bool,
        timeout_us: Option<u64>,
        priority: u32,
        completer: &Completer,
        token: u64,
        traceparent: Option<&str>,
    ) -> PyResult<Pending> {
        use tracing::Instrument;
        let (route, req) = self.request(py, inputs, outputs, copy, timeout_us, priority)?;
        let own = self.core.admit_own(&route).map_err(py_err)?;
        let core = self.core.clone();
        let done = completer.inner.clone();
        let span = self.span(traceparent);
        let handle = runtime().spawn(
            async move {
                let r = core.infer_on(route, req, Some(own)).await.map(|r| r.outputs);
                done.push(token, r);
            }
            .instrument(span),
        );
        Ok(Pending { abort: handle.abort_handle() })
    }

    /// Debug hook for tests: the data pointers the engine would read for `inputs` (no copy means
    /// they equal the arrays' own).
    #[pyo3(signature = (inputs, copy=false))]
    fn _input_pointers(
        &self,
        py: Python<'_>,
        inputs: &Bound<'_, PyDict>,
        copy: bool,
    ) -> PyResult<Vec<(String, usize)>> {
        let model = self.model()?;
        let spec = &model.spec;
        let tensors = convert::inputs(py, spec, inputs, copy)?;
        Ok(tensors.iter().map(|t| (t.name.clone(), convert::data_pointer(t))).collect())
    }
}

/// Wakes the calling thread when the future it polls can make progress.
struct ThreadWaker(std::thread::Thread);

impl std::task::Wake for ThreadWaker {
    fn wake(self: Arc<Self>) {
        self.0.unpark();
    }
    fn wake_by_ref(self: &Arc<Self>) {
        self.0.unpark();
    }
}

/// Polls `fut` on the calling thread with the GIL released: the batcher's reply wakes this thread
/// directly, with no executor hop. Every 50 ms it takes the GIL to let Ctrl-C through; on an
/// interrupt the future is dropped, which frees the request's queue slot.
fn block_on<F: std::future::Future + Send>(py: Python<'_>, fut: F) -> PyResult<F::Output>
where
    F::Output: Send,
{
    const SIGNAL_CHECK: Duration = Duration::from_millis(50);
    // A reply that comes within this window is taken without the cost of a park and unpark.
    const SPIN: Duration = Duration::from_micros(30);
    // Request timeouts register their timers with the runtime's driver.
    let _context = runtime().enter();
    let mut fut = std::pin::pin!(fut);
    loop {
        let polled = py.detach(|| {
            let waker = std::task::Waker::from(Arc::new(ThreadWaker(std::thread::current())));
            let mut cx = std::task::Context::from_waker(&waker);
            let start = std::time::Instant::now();
            let until = start + SIGNAL_CHECK;
            loop {
                if let std::task::Poll::Ready(v) = fut.as_mut().poll(&mut cx) {
                    return Some(v);
                }
                let now = std::time::Instant::now();
                if now >= until {
                    return None;
                }
                if now - start < SPIN {
                    std::hint::spin_loop();
                } else {
                    std::thread::park_timeout(until - now);
                }
            }
        });
        match polled {
            Some(v) => return Ok(v),
            None => py.check_signals()?,
        }
    }
}

/// A queued asynchronous request.
#[pyclass(frozen, module = "ferrite._native")]
struct Pending {
    abort: tokio::task::AbortHandle,
}

#[pymethods]
impl Pending {
    /// Drops the request: if it has not run yet, it never will.
    fn cancel(&self) {
        self.abort.abort();
    }
}

type Done = (u64, ferrite_core::Result<Vec<Tensor>>);

struct CompleterInner {
    done: Mutex<Vec<Done>>,
    wake: std::io::PipeWriter,
}

impl CompleterInner {
    /// Called on engine threads, never with the GIL: queue the result, and write one wake-up byte
    /// only when the queue was empty, so a burst of completions costs the loop one wake-up.
    fn push(&self, token: u64, r: ferrite_core::Result<Vec<Tensor>>) {
        let mut done = self.done.lock().unwrap_or_else(|e| e.into_inner());
        let was_empty = done.is_empty();
        done.push((token, r));
        drop(done);
        if was_empty {
            use std::io::Write;
            let _ = (&self.wake).write(&[1]);
        }
    }
}

/// Delivers completions to one asyncio loop through a pipe it watches with `add_reader`.
#[pyclass(frozen, module = "ferrite._native")]
struct Completer {
    inner: Arc<CompleterInner>,
    read: std::io::PipeReader,
}

#[pymethods]
impl Completer {
    #[new]
    fn new() -> PyResult<Self> {
        let (read, wake) = std::io::pipe()?;
        Ok(Completer { inner: Arc::new(CompleterInner { done: Mutex::new(Vec::new()), wake }), read })
    }

    /// The file descriptor that becomes readable when results wait.
    fn fileno(&self) -> i32 {
        use std::os::fd::AsRawFd;
        self.read.as_raw_fd()
    }

    /// Takes every waiting result: (token, outputs dict or exception instance, ok).
    fn drain<'py>(&self, py: Python<'py>) -> PyResult<Vec<(u64, Bound<'py, PyAny>, bool)>> {
        let done = std::mem::take(&mut *self.inner.done.lock().unwrap_or_else(|e| e.into_inner()));
        let mut out = Vec::with_capacity(done.len());
        for (token, r) in done {
            let item = match r.map_err(py_err).and_then(|outs| convert::outputs(py, outs)) {
                Ok(dict) => (token, dict.into_any(), true),
                Err(e) => (token, e.into_value(py).into_bound(py).into_any(), false),
            };
            out.push(item);
        }
        Ok(out)
    }
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add_function(wrap_pyfunction!(init_runtime, m)?)?;
    m.add_function(wrap_pyfunction!(library_version, m)?)?;
    m.add_function(wrap_pyfunction!(install_crash_handler, m)?)?;
    m.add("__version__", ferrite_core::wire::VERSION)?;
    m.add("SUPPORTED_ONNXRUNTIME", format!("1.{}", ferrite_core::engine::onnx::SUPPORTED_MINOR))?;
    #[cfg(feature = "serve")]
    serving::register(m)?;
    m.add_class::<Engine>()?;
    m.add_class::<Model>()?;
    m.add_class::<Completer>()?;
    m.add_class::<Pending>()?;
    m.add_class::<convert::OutputBuffer>()?;
    m.add("FerriteError", py.get_type::<FerriteError>())?;
    m.add("InvalidInput", py.get_type::<InvalidInput>())?;
    m.add("ModelNotFound", py.get_type::<ModelNotFound>())?;
    m.add("Unavailable", py.get_type::<Unavailable>())?;
    m.add("Overloaded", py.get_type::<Overloaded>())?;
    m.add("DeadlineExceeded", py.get_type::<DeadlineExceeded>())?;
    m.add("Unsupported", py.get_type::<Unsupported>())?;
    m.add("InternalError", py.get_type::<InternalError>())?;
    Ok(())
}
