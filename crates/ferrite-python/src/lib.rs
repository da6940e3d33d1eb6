//! Python bindings: the Ferrite core in-process. Thin by design: convert NumPy arrays to core
//! tensors without copying, release the GIL while a request waits and runs, convert outputs to
//! NumPy arrays that keep the Rust buffer alive, and map the core's errors once.

mod convert;

use std::{
    path::PathBuf,
    sync::{Arc, Mutex, OnceLock},
    time::Duration,
};

use ferrite_core::{
    config::{ModelConfig, ModelSpec},
    repository, Core, Error, InferRequest, Limits, LoadOptions, Tensor,
};
use pyo3::{
    create_exception,
    exceptions::{PyException, PyRuntimeError},
    prelude::*,
    types::PyDict,
};

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
        Error::InvalidInput(m) => InvalidInput::new_err(m),
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

static TELEMETRY: Mutex<Option<ferrite_server::telemetry::Telemetry>> = Mutex::new(None);

/// Exports spans over OTLP/gRPC (`endpoint`, default `OTEL_EXPORTER_OTLP_ENDPOINT`) and writes
/// logs at `log` to stderr. Once per process.
#[pyfunction]
#[pyo3(signature = (endpoint=None, *, sample_rate=1.0, log="warn"))]
fn init_tracing(endpoint: Option<String>, sample_rate: f64, log: &str) -> PyResult<()> {
    use ferrite_server::telemetry;
    let mut slot = TELEMETRY.lock().unwrap_or_else(|e| e.into_inner());
    if slot.is_some() {
        return Ok(());
    }
    let cfg = telemetry::TelemetryConfig {
        log_filter: log.to_string(),
        json_logs: false,
        otlp_endpoint: endpoint,
        sample_rate,
    };
    let _context = runtime().enter();
    *slot = Some(telemetry::init(&cfg).map_err(InvalidInput::new_err)?);
    Ok(())
}

/// Flushes and stops span export (call before exit to send what is buffered).
#[pyfunction]
fn shutdown_tracing(py: Python<'_>) {
    let t = TELEMETRY.lock().unwrap_or_else(|e| e.into_inner()).take();
    py.detach(move || {
        let _context = runtime().enter();
        drop(t);
    });
}

/// Loads ONNX Runtime from `path` (the `onnxruntime` package's library, found by the Python side).
#[pyfunction]
fn init_runtime(path: PathBuf) -> PyResult<String> {
    ferrite_core::onnx::init_runtime(Some(&path)).map(|p| p.display().to_string()).map_err(py_err)
}

/// A model repository loaded in-process: every model of `<repository>/<name>/<version>/model.onnx`.
#[pyclass(frozen, module = "ferrite._native")]
struct Engine {
    core: Core,
}

#[pymethods]
impl Engine {
    #[new]
    #[pyo3(signature = (model_repository, *, threads=None, max_request_elements=None))]
    fn new(
        py: Python<'_>,
        model_repository: PathBuf,
        threads: Option<usize>,
        max_request_elements: Option<usize>,
    ) -> PyResult<Self> {
        let options = load_options(threads);
        let limits = limits(max_request_elements);
        let core = py.detach(|| Core::load(&model_repository, &options, limits)).map_err(py_err)?;
        Ok(Engine { core })
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
    let mut options = LoadOptions::default();
    if let Some(t) = threads {
        options.threads = t.max(1);
    }
    options
}

fn limits(max_request_elements: Option<usize>) -> Limits {
    let mut limits = Limits::default();
    if let Some(n) = max_request_elements {
        limits.max_elements = n;
    }
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
        use ferrite_server::telemetry;
        let parent = traceparent.map(|tp| telemetry::from_traceparent(tp, None)).unwrap_or_default();
        telemetry::request_span("python", &self.name, parent)
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
    ) -> PyResult<InferRequest> {
        let model = self.model()?;
        let spec = &model.spec;
        let tensors = convert::inputs(py, spec, inputs, copy)?;
        Ok(InferRequest {
            model_name: self.name.clone(),
            inputs: tensors,
            outputs,
            timeout_us,
            priority,
            ..Default::default()
        })
    }
}

#[pymethods]
impl Model {
    /// Loads one model directory (`<dir>/config.toml`, `<dir>/<version>/model.onnx`) or one
    /// `.onnx` file, with optional overrides of its config.
    #[staticmethod]
    #[pyo3(signature = (path, *, name=None, max_batch_size=None, max_queue_delay_us=None, instance_count=None, threads=None, max_request_elements=None))]
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
        let core = Core::from_models(
            [(name.clone(), Arc::new(model))].into(),
            Default::default(),
            limits(max_request_elements),
        );
        Ok(Model { core, name })
    }

    #[getter]
    fn name(&self) -> &str {
        &self.name
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
        let batch = spec.batch.max_batch_size > 0;
        let tensors = |ts: &[ferrite_core::config::TensorSpec]| {
            ts.iter()
                .map(|t| {
                    let shape = batch.then_some(-1).into_iter().chain(t.dims.iter().copied()).collect();
                    (t.name.clone(), t.datatype.as_str().to_string(), shape)
                })
                .collect()
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
        let req = self.request(py, inputs, outputs, copy, timeout_us, priority)?;
        let span = self.span(traceparent);
        let result = block_on(py, self.core.infer(req).instrument(span))?;
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
        let req = self.request(py, inputs, outputs, copy, timeout_us, priority)?;
        let core = self.core.clone();
        let done = completer.inner.clone();
        let span = self.span(traceparent);
        let handle = runtime().spawn(
            async move {
                let r = core.infer(req).await.map(|r| r.outputs);
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

/// A running HTTP + gRPC server over an engine's models.
#[pyclass(frozen, module = "ferrite._native")]
struct Server {
    #[pyo3(get)]
    http_port: u16,
    #[pyo3(get)]
    grpc_port: u16,
    stop: Mutex<Option<tokio::sync::oneshot::Sender<()>>>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

#[pymethods]
impl Server {
    /// Shuts down (readiness off, queued work drained) and waits for the server thread.
    fn stop(&self, py: Python<'_>) {
        if let Some(tx) = self.stop.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take() {
            py.detach(|| {
                let _ = t.join();
            });
        }
    }
}

/// Starts HTTP and gRPC servers on `engine`'s models in a background thread.
#[pyfunction]
#[pyo3(signature = (engine, *, host="127.0.0.1", http_port=8000, grpc_port=8001, max_body_bytes=67108864, exit_timeout=30.0))]
fn serve(
    py: Python<'_>,
    engine: &Engine,
    host: &str,
    http_port: u16,
    grpc_port: u16,
    max_body_bytes: usize,
    exit_timeout: f64,
) -> PyResult<Server> {
    use ferrite_server::{grpc::GrpcLimits, http::HttpLimits, serve as srv};
    let cfg = srv::ServeConfig {
        host: host.parse().map_err(|e| InvalidInput::new_err(format!("host '{host}': {e}")))?,
        http_port,
        grpc_port,
        http: HttpLimits::new(max_body_bytes),
        grpc: GrpcLimits { max_decoding_message_size: max_body_bytes, max_encoding_message_size: max_body_bytes },
        grpc_max_concurrent_streams: 1024,
        exit_timeout: Duration::from_secs_f64(exit_timeout.max(0.0)),
        metrics_port: None,
        metrics_on_http: true,
        auth: None,
        tls: None,
    };
    let core = engine.core.clone();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let (bound_tx, bound_rx) = std::sync::mpsc::channel();
    let thread = std::thread::Builder::new()
        .name("ferrite-serve".into())
        .spawn(move || {
            let rt = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
                Ok(rt) => rt,
                Err(e) => {
                    let _ = bound_tx.send(Err(e.to_string()));
                    return;
                }
            };
            rt.block_on(async move {
                let bound = match srv::bind(&cfg).await {
                    Ok(b) => b,
                    Err(e) => {
                        let _ = bound_tx.send(Err(e.to_string()));
                        return;
                    }
                };
                let _ = bound_tx.send(Ok((bound.http_addr.port(), bound.grpc_addr.port())));
                srv::run(core, bound, &cfg, async move {
                    let _ = stop_rx.await;
                })
                .await;
            });
        })
        .map_err(|e| PyRuntimeError::new_err(e.to_string()))?;
    let ports = py.detach(move || bound_rx.recv()).map_err(|e| PyRuntimeError::new_err(e.to_string()))?;
    let (http_port, grpc_port) = ports.map_err(Unavailable::new_err)?;
    Ok(Server { http_port, grpc_port, stop: Mutex::new(Some(stop_tx)), thread: Mutex::new(Some(thread)) })
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add_function(wrap_pyfunction!(init_runtime, m)?)?;
    m.add_function(wrap_pyfunction!(serve, m)?)?;
    m.add_function(wrap_pyfunction!(init_tracing, m)?)?;
    m.add_function(wrap_pyfunction!(shutdown_tracing, m)?)?;
    m.add_class::<Engine>()?;
    m.add_class::<Model>()?;
    m.add_class::<Completer>()?;
    m.add_class::<Pending>()?;
    m.add_class::<Server>()?;
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
