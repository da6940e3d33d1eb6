//! What the wheel adds with the `serve` feature: `ferrite.serve()` (the HTTP and gRPC servers of
//! the `ferrite` binary, over an engine's models, with the same security options) and span export
//! over OpenTelemetry. Without the feature the package links the engine alone.

use std::{path::PathBuf, sync::Mutex, time::Duration};

use ferrite_server::telemetry;
use pyo3::{exceptions::PyRuntimeError, prelude::*};

use crate::{runtime, Engine, InvalidInput, Unavailable};

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(serve, m)?)?;
    m.add_function(wrap_pyfunction!(init_tracing, m)?)?;
    m.add_function(wrap_pyfunction!(shutdown_tracing, m)?)?;
    m.add_class::<Server>()?;
    Ok(())
}

/// The span of one in-process request, a child of the caller's W3C `traceparent` when given.
pub(crate) fn request_span(model: &str, traceparent: Option<&str>) -> tracing::Span {
    let parent = traceparent.map(|tp| telemetry::from_traceparent(tp, None)).unwrap_or_default();
    telemetry::request_span("python", model, parent)
}

static TELEMETRY: Mutex<Option<telemetry::Telemetry>> = Mutex::new(None);

/// Exports spans over OTLP/gRPC (`endpoint`, default `OTEL_EXPORTER_OTLP_ENDPOINT`) and writes
/// logs at `log` to stderr. Once per process.
#[pyfunction]
#[pyo3(signature = (endpoint=None, *, sample_rate=1.0, log="warn"))]
fn init_tracing(endpoint: Option<String>, sample_rate: f64, log: &str) -> PyResult<()> {
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
    /// Stops the listeners (the requests they hold are answered first, for at most `exit_timeout`)
    /// and waits for the server thread. The engine stays open: in-process calls go on, and a
    /// later `serve` can listen again.
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
#[allow(clippy::too_many_arguments)]
#[pyo3(signature = (
    engine, *, host="127.0.0.1", http_port=8000, grpc_port=8001, max_body_bytes=67108864, exit_timeout=30.0,
    auth_token_file=None, auth_allow_health=false, tls_cert=None, tls_key=None, tls_client_ca=None,
    allow_unauthenticated=false, shared_memory="off",
))]
fn serve(
    py: Python<'_>,
    engine: &Engine,
    host: &str,
    http_port: u16,
    grpc_port: u16,
    max_body_bytes: usize,
    exit_timeout: f64,
    auth_token_file: Option<PathBuf>,
    auth_allow_health: bool,
    tls_cert: Option<PathBuf>,
    tls_key: Option<PathBuf>,
    tls_client_ca: Option<PathBuf>,
    allow_unauthenticated: bool,
    shared_memory: &str,
) -> PyResult<Server> {
    use ferrite_server::{auth::Auth, grpc::GrpcLimits, http::HttpLimits, serve as srv, tls};
    let addresses = srv::addresses(host).map_err(|e| InvalidInput::new_err(e.to_string()))?;
    // As the binary: tokens and TLS from files. Listening beyond this machine with no token
    // would open every model to the network, so it takes an explicit yes.
    if !addresses.iter().all(|ip| ip.is_loopback()) && auth_token_file.is_none() && !allow_unauthenticated {
        return Err(InvalidInput::new_err(format!(
            "host {host} is reachable from other machines: pass auth_token_file=..., or allow_unauthenticated=True"
        )));
    }
    let auth =
        auth_token_file.map(|p| Auth::from_file(&p, auth_allow_health)).transpose().map_err(InvalidInput::new_err)?;
    let tls = match (tls_cert, tls_key) {
        (Some(cert), Some(key)) => Some(
            tls::Tls::load(&tls::TlsFiles { cert, key, client_ca: tls_client_ca }).map_err(InvalidInput::new_err)?,
        ),
        (None, None) if tls_client_ca.is_none() => None,
        _ => return Err(InvalidInput::new_err("TLS needs both tls_cert and tls_key (tls_client_ca needs them too)")),
    };
    // As the binary's --shared-memory: off unless asked for, since a client that may register a
    // region can read any shared-memory object this process can open.
    let shared_memory = match shared_memory {
        "off" => false,
        "system" => true,
        other => return Err(InvalidInput::new_err(format!("shared_memory '{other}': 'off' or 'system'"))),
    };
    let http_limits = HttpLimits::new(max_body_bytes);
    let cfg = srv::ServeConfig {
        host: addresses,
        http_port,
        grpc_port,
        http: http_limits.clone(),
        grpc: GrpcLimits { max_decoding_message_size: max_body_bytes, max_encoding_message_size: max_body_bytes },
        grpc_max_concurrent_streams: 1024,
        exit_timeout: Duration::from_secs_f64(exit_timeout.max(0.0)),
        metrics_port: None,
        metrics_on_http: true,
        scale: Default::default(),
        scale_window: Duration::from_secs(30),
        auth,
        tls,
        shm: std::sync::Arc::new(ferrite_server::shm::Regions::new(
            shared_memory,
            max_body_bytes,
            http_limits.body_budget,
        )),
        // The engine is the application's: stopping the server leaves it open for its own calls.
        owns_core: false,
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
                    // Stopped by the application itself: no balancer to wait for.
                    Duration::ZERO
                })
                .await;
            });
        })
        .map_err(|e| PyRuntimeError::new_err(e.to_string()))?;
    let ports = py.detach(move || bound_rx.recv()).map_err(|e| PyRuntimeError::new_err(e.to_string()))?;
    let (http_port, grpc_port) = ports.map_err(Unavailable::new_err)?;
    Ok(Server { http_port, grpc_port, stop: Mutex::new(Some(stop_tx)), thread: Mutex::new(Some(thread)) })
}
