//! The `ferrite` binary: `ferrite serve`, and `ferrite check` before a rollout.

use ferrite_server::{
    grpc, http,
    serve::{self, ServeConfig},
    telemetry,
    tls::{Tls, TlsFiles},
};

use std::{path::PathBuf, sync::Arc, time::Duration};

use clap::{Parser, Subcommand};
use ferrite_core::{
    admission::tenant::Tenants,
    cache::{CacheOptions, ResponseCache, SharedTier},
    Core, Limits, LoadOptions, ModelControl, Startup,
};
use ferrite_redis::RedisTier;

#[derive(Parser)]
#[command(
    name = "ferrite",
    about = "Real-time inference server for ONNX models (KServe V2 protocol)",
    disable_version_flag = true,
    arg_required_else_help = true
)]
struct Cli {
    /// Print Ferrite's version and the ONNX Runtime library's it would load (path and version).
    #[arg(short = 'V', long)]
    version: bool,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    /// Serve every model of a model repository over HTTP and gRPC.
    Serve(Box<ServeArgs>),
    /// Load and validate every model of a repository as `serve` would (config, ONNX file,
    /// warm-up), print one row per model version, and exit non-zero if any fails. No listeners.
    Check(CheckArgs),
}

#[derive(Parser, Debug)]
struct CheckArgs {
    /// Model repository, as for `serve`.
    #[arg(long, alias = "model-id", env = "FERRITE_MODEL_REPOSITORY", default_value = "models")]
    model_repository: PathBuf,
    /// Path of libonnxruntime, as for `serve`.
    #[arg(long, env = "FERRITE_ONNXRUNTIME_LIB")]
    onnxruntime_lib: Option<PathBuf>,
    /// Intra-op threads per model, as for `serve`.
    #[arg(long, env = "FERRITE_THREADS")]
    threads: Option<usize>,
    /// Also run the calibration (as `serve` does by default), to see each model's plan.
    #[arg(long, default_value_t = false, action = clap::ArgAction::Set)]
    calibrate: bool,
    /// Python interpreter, as for `serve`.
    #[arg(long, env = "FERRITE_PYTHON", default_value = "python3")]
    python: PathBuf,
}

/// `ferrite check`: 0 when every model loads, 1 when one does not, 2 when the repository cannot
/// be read.
fn check(args: CheckArgs) -> i32 {
    // Warnings of the loads (a config.pbtxt setting that has no effect here, say) go to stderr.
    tracing_subscriber::fmt().with_writer(std::io::stderr).with_max_level(tracing::Level::WARN).init();
    let mut options = LoadOptions { calibrate: args.calibrate, python: args.python.clone(), ..LoadOptions::default() };
    if let Some(t) = args.threads {
        options.threads = t.max(1);
    }
    match Core::open(&args.model_repository, &options, Limits::default(), Startup::All) {
        Ok(core) => {
            let (text, ok) = ferrite_server::check::report(&core);
            print!("{text}");
            // Python models' workers finalize as their server goes; its shared files go now.
            ferrite_core::engine::python::remove_directory();
            if ok {
                0
            } else {
                1
            }
        }
        Err(e) => {
            eprintln!("ferrite check: {e}");
            2
        }
    }
}

#[derive(Parser, Debug)]
struct ServeArgs {
    /// Model repository: <dir>/<model>/config.toml and <dir>/<model>/<version>/model.onnx; or
    /// a Hugging Face directory, served as its one model (`--model-id`, as TEI names it).
    #[arg(long, alias = "model-id", env = "FERRITE_MODEL_REPOSITORY", default_value = "models")]
    model_repository: PathBuf,
    /// How the served models may change: `none` (as loaded at start), `poll` (the repository is
    /// watched and changed models reloaded), `explicit` (the repository API loads and unloads).
    #[arg(long, env = "FERRITE_MODEL_CONTROL_MODE", value_enum, default_value_t = ControlMode::None)]
    model_control_mode: ControlMode,
    /// With --model-control-mode poll: seconds between scans of the repository.
    #[arg(long, env = "FERRITE_REPOSITORY_POLL_SECS", default_value_t = 15.0)]
    repository_poll_secs: f64,
    /// With --model-control-mode explicit: models to load at start (repeat it, or `*` for all);
    /// by default none.
    #[arg(long = "load-model", env = "FERRITE_LOAD_MODEL", value_delimiter = ',')]
    load_model: Vec<String>,
    /// Where model configs come from besides config.toml: `etcd://host:port/prefix` reads
    /// `<prefix>/models/<name>` keys (TOML, as config.toml) and applies each change whole.
    #[arg(long, env = "FERRITE_CONFIG_SOURCE")]
    config_source: Option<String>,
    /// Address to listen on: an IP address, or a host name (each listener then takes every
    /// address it resolves to; `--hostname`, as TEI names it).
    #[arg(long, alias = "hostname", env = "FERRITE_HOST", default_value = "127.0.0.1")]
    host: String,
    /// HTTP port (0 picks a free one and logs it; `--port`, as TEI names it).
    #[arg(long, alias = "port", env = "FERRITE_HTTP_PORT", default_value_t = 8000)]
    http_port: u16,
    /// gRPC port (0 picks a free one and logs it).
    #[arg(long, env = "FERRITE_GRPC_PORT", default_value_t = 8001)]
    grpc_port: u16,
    /// Largest gRPC message accepted, in bytes.
    #[arg(long, env = "FERRITE_GRPC_MAX_DECODING_MESSAGE_SIZE", default_value_t = 64 << 20)]
    grpc_max_decoding_message_size: usize,
    /// Largest gRPC message sent, in bytes.
    #[arg(long, env = "FERRITE_GRPC_MAX_ENCODING_MESSAGE_SIZE", default_value_t = 64 << 20)]
    grpc_max_encoding_message_size: usize,
    /// Concurrent HTTP/2 streams per connection, on the gRPC listener and the HTTP one's HTTP/2.
    #[arg(long, env = "FERRITE_GRPC_MAX_CONCURRENT_STREAMS", default_value_t = 1024)]
    grpc_max_concurrent_streams: u32,
    /// Port of the Prometheus `/metrics` listener (0 picks a free one). TEI's `--prometheus-port`.
    #[arg(long, alias = "prometheus-port", env = "FERRITE_METRICS_PORT", default_value_t = 8002)]
    metrics_port: u16,
    /// Serve no metrics listener.
    #[arg(long, env = "FERRITE_NO_METRICS")]
    no_metrics: bool,
    /// Also serve `/metrics` on the HTTP port.
    #[arg(long, env = "FERRITE_METRICS_ON_HTTP")]
    metrics_on_http: bool,
    /// Path of libonnxruntime; by default ORT_DYLIB_PATH, then the onnxruntime package of `python3`.
    #[arg(long, env = "FERRITE_ONNXRUNTIME_LIB")]
    onnxruntime_lib: Option<PathBuf>,
    /// Intra-op threads a model's instances share, where its config does not say (default: the
    /// CPUs this process may use, affinity and cgroup quota counted): N instances get 1/N each.
    #[arg(long, env = "FERRITE_THREADS")]
    threads: Option<usize>,
    /// Let idle ONNX Runtime threads spin (lower hand-off latency, more CPU).
    #[arg(long, env = "FERRITE_SPIN")]
    spin: bool,
    /// Let a slow model's ONNX Runtime threads (a run of one row takes 2 ms or more, on several
    /// threads) spin between the operators of a run, not between runs: faster answers for a model
    /// served alone, at a cost to other models on the same cores.
    #[arg(long, env = "FERRITE_SPIN_IN_RUN")]
    spin_in_run: bool,
    /// Measure each model at load (about two seconds) and choose from its own run times how its
    /// instances use the CPUs (instances x threads, spinning) and the largest batch to merge,
    /// where its config leaves them open (`calibrate = false` in a config skips one model).
    #[arg(long, env = "FERRITE_CALIBRATE", default_value_t = true, action = clap::ArgAction::Set)]
    calibrate: bool,
    /// The Python interpreter that runs Python models' workers (`backend: "python"`), unless a
    /// model names an environment of its own (`EXECUTION_ENV_PATH`); its NumPy is needed.
    #[arg(long, env = "FERRITE_PYTHON", default_value = "python3")]
    python: PathBuf,
    /// Largest request body accepted, in bytes. TEI's `--payload-limit`.
    #[arg(long, alias = "payload-limit", env = "FERRITE_MAX_BODY_BYTES", default_value_t = 64 << 20)]
    max_body_bytes: usize,
    /// Seconds a client has for its TLS handshake and request head (slow senders are cut off).
    #[arg(long, env = "FERRITE_HTTP_HEADER_TIMEOUT_SECS", default_value_t = 10)]
    http_header_timeout_secs: u64,
    /// Seconds a client has to send a whole request body (408 after), and each gRPC message from
    /// its first byte (DEADLINE_EXCEEDED after).
    #[arg(long, env = "FERRITE_HTTP_BODY_TIMEOUT_SECS", default_value_t = 30)]
    http_body_timeout_secs: u64,
    /// Seconds a connection (HTTP or gRPC) may stay open with no request in flight and no answer
    /// moving (between keep-alive requests, or HTTP/2 kept alive by pings alone), or with its
    /// client taking no bytes of the answers written to it; then it is closed.
    #[arg(long, env = "FERRITE_HTTP_IDLE_TIMEOUT_SECS", default_value_t = 60)]
    http_idle_timeout_secs: u64,
    /// Connections each HTTP listener holds at once; more are closed at once (default: a quarter
    /// of the open-files limit, at most 10,000).
    #[arg(long, env = "FERRITE_HTTP_MAX_CONNECTIONS")]
    http_max_connections: Option<usize>,
    /// Bytes of request bodies all requests may hold at once: HTTP bodies and gRPC messages as
    /// they arrive (and decompressed ones as they are written), until answered; answers
    /// until written to their clients (at least a KiB each); a tenant's requests half of it at most;
    /// past it, 503 with Retry-After (gRPC: UNAVAILABLE with a retry hint).
    #[arg(long, env = "FERRITE_MAX_INFLIGHT_BODY_BYTES", default_value_t = http::DEFAULT_BODY_BUDGET)]
    max_inflight_body_bytes: usize,
    /// TLS certificate chain (PEM) for every listener; needs --tls-key.
    #[arg(long, env = "FERRITE_TLS_CERT", requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// TLS private key (PEM) for --tls-cert.
    #[arg(long, env = "FERRITE_TLS_KEY", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// CA (PEM) that client certificates must be signed by: mutual TLS on every listener.
    #[arg(long, env = "FERRITE_TLS_CLIENT_CA", requires = "tls_cert")]
    tls_client_ca: Option<PathBuf>,
    /// Most tensor elements one request may carry (all inputs together).
    #[arg(long, env = "FERRITE_MAX_REQUEST_ELEMENTS", default_value_t = 1 << 23)]
    max_request_elements: usize,
    /// Bearer tokens, one per line as `<token> [scope,scope]` (infer, metrics, admin; default
    /// infer). When set, every route of every listener requires one.
    #[arg(long, env = "FERRITE_AUTH_TOKEN_FILE")]
    auth_token_file: Option<PathBuf>,
    /// With --auth-token-file: let health endpoints (HTTP /v2/health/*, TEI's GET /health, /ping and
    /// /, grpc.health.v1) answer without a token.
    #[arg(long, env = "FERRITE_AUTH_ALLOW_HEALTH")]
    auth_allow_health: bool,
    /// TEI's `--api-key`: one bearer token (at least 16 characters) that every inference and
    /// metrics route requires; health routes answer without it, as TEI's do. Admin routes need a
    /// token file's `admin` token, so the two cannot be given together. Prefer the environment
    /// variable: a command line is visible to every user of the host.
    #[arg(long, env = "FERRITE_API_KEY", hide_env_values = true, conflicts_with = "auth_token_file")]
    api_key: Option<String>,
    /// Triton's system shared-memory extension (`system`): clients on this host register POSIX
    /// shared-memory objects and send tensors through them instead of the request. A client
    /// that may register can read any such object this process can open: turn it on only where
    /// the clients are trusted with this host's (or container's) shared memory.
    #[arg(long, env = "FERRITE_SHARED_MEMORY", value_enum, default_value_t = SharedMemory::Off)]
    shared_memory: SharedMemory,
    /// Requests in the engine at once, all models together; past it, 429 / RESOURCE_EXHAUSTED with
    /// Retry-After. 0: no limit.
    #[arg(long, env = "FERRITE_MAX_CONCURRENT_REQUESTS", default_value_t = 0)]
    max_concurrent_requests: usize,
    /// Inputs one call of TEI's API may carry (texts, pairs, passages, id lists); past it, 413
    /// `Validation`. TEI's `--max-client-batch-size`, and its default.
    #[arg(long, env = "FERRITE_MAX_CLIENT_BATCH_SIZE", default_value_t = 32,
          value_parser = clap::value_parser!(u16).range(1..=2048))]
    max_client_batch_size: u16,
    /// TEI's `--auto-truncate`, taken so that TEI's command lines start: a text over its model's
    /// max input length is cut unless its call says `truncate: false`, with this flag or without.
    #[arg(long)]
    auto_truncate: bool,
    /// Header (HTTP) / metadata key (gRPC) that names the tenant of a request, for per-tenant
    /// limits from --tenant-config. Requests without it share the default tenant's limits.
    #[arg(long, env = "FERRITE_TENANT_HEADER", requires = "tenant_config")]
    tenant_header: Option<String>,
    /// TOML file of per-tenant limits: `[default]` and `[tenants.<name>]` with `rate` (requests
    /// per second), `burst` and `max_concurrent`. Over a limit: 429 / RESOURCE_EXHAUSTED.
    #[arg(long, env = "FERRITE_TENANT_CONFIG", requires = "tenant_header")]
    tenant_config: Option<PathBuf>,
    /// On SIGTERM, how long readiness reports false while requests are still served, before new
    /// ones are refused: longer than the balancer's probe period x failure threshold (Kubernetes:
    /// keep it plus --exit-timeout-secs under terminationGracePeriodSeconds). SIGINT skips it.
    #[arg(long, env = "FERRITE_SHUTDOWN_GRACE_SECS", default_value_t = 5.0)]
    shutdown_grace_secs: f64,
    /// On SIGINT/SIGTERM, how long queued and running requests may take before they are failed.
    #[arg(long, env = "FERRITE_EXIT_TIMEOUT_SECS", default_value_t = 30)]
    exit_timeout_secs: u64,
    /// Response cache: bytes of tensor data the in-process tier may hold.
    #[arg(long, env = "FERRITE_CACHE_LOCAL_BYTES", default_value_t = 256 << 20)]
    cache_local_bytes: u64,
    /// Response cache: seconds an entry lives (in both tiers).
    #[arg(long, env = "FERRITE_CACHE_TTL", default_value_t = 300)]
    cache_ttl: u64,
    /// Response cache: Redis as a second tier shared by processes: redis://host:port/db (one
    /// server), redis+cluster://host:port[,host:port...] (a Redis Cluster) or
    /// redis+sentinel://host:port[,host:port...]/<service> (the master Sentinel names).
    #[arg(long, env = "FERRITE_CACHE_REDIS_URL")]
    cache_redis_url: Option<String>,
    /// Response cache: milliseconds a request may wait on Redis before it counts as a miss.
    #[arg(long, env = "FERRITE_CACHE_REDIS_TIMEOUT_MS", default_value_t = 5)]
    cache_redis_timeout_ms: u64,
    /// Response cache: responses larger than this many bytes are not cached.
    #[arg(long, env = "FERRITE_CACHE_MAX_VALUE_BYTES", default_value_t = 1 << 20)]
    cache_max_value_bytes: usize,
    /// Response cache: the share (0 to 1) of the in-process tier one tenant's entries may hold,
    /// so one tenant's volume cannot evict the others' hot entries.
    #[arg(long, env = "FERRITE_CACHE_TENANT_SHARE", default_value_t = 0.5)]
    cache_tenant_share: f64,
    /// Log filter (tracing's EnvFilter syntax), e.g. `info` or `ferrite_core=debug` (one line per
    /// request at debug; never tensor data).
    #[arg(long, env = "FERRITE_LOG", default_value = "info")]
    log: String,
    /// OTLP/gRPC endpoint for traces (e.g. http://collector:4317); default OTEL_EXPORTER_OTLP_ENDPOINT.
    #[arg(long, env = "FERRITE_OTLP_ENDPOINT")]
    otlp_endpoint: Option<String>,
    /// Share of requests without a trace context that are traced; requests that carry a W3C
    /// traceparent are always traced. Default OTEL_TRACES_SAMPLER_ARG, else 1.
    #[arg(long, env = "FERRITE_TRACE_SAMPLE_RATE")]
    trace_sample_rate: Option<f64>,
    /// Log format: `text` for people, `json` for log pipelines.
    #[arg(long, env = "FERRITE_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    /// TEI's `--json-output`: `--log-format json`.
    #[arg(long)]
    json_output: bool,
    /// Where a crash report is written should a fatal signal end the process (see README: Crash
    /// reports); reports left by earlier processes are logged at start.
    #[arg(long, env = "FERRITE_CRASH_DIR", default_value = ".")]
    crash_dir: PathBuf,
    /// Autoscaling: requests per second one replica serves within its latency target, from which
    /// `ferrite_desired_replicas` follows; 0 (default): it stays at --scale-min-replicas.
    #[arg(long, env = "FERRITE_SCALE_CAPACITY_RPS", default_value_t = 0.0)]
    scale_capacity_rps: f64,
    /// Autoscaling: p99 latency target; over it, the desired replicas are 1.8 times more. 0: none.
    #[arg(long, env = "FERRITE_SCALE_P99_TARGET_MS", default_value_t = 0.0)]
    scale_p99_target_ms: f64,
    #[arg(long, env = "FERRITE_SCALE_MIN_REPLICAS", default_value_t = 1)]
    scale_min_replicas: u64,
    #[arg(long, env = "FERRITE_SCALE_MAX_REPLICAS", default_value_t = 100)]
    scale_max_replicas: u64,
    /// Autoscaling: the window the request rate and p99 are measured over.
    #[arg(long, env = "FERRITE_SCALE_WINDOW_SECS", default_value_t = 30.0)]
    scale_window_secs: f64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum ControlMode {
    None,
    Poll,
    Explicit,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum SharedMemory {
    Off,
    System,
}

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

/// Buffers of 1 MiB and more (request bodies, tensors) get their own mappings, returned to the
/// system when freed. glibc otherwise raises this threshold to the largest block freed, and then
/// serves such buffers from heaps it keeps: a detector at 640x640 under 128 clients held 2.2 GB
/// that way, 1.1 GB with the threshold fixed, at the same throughput (`bench/kinds.py`). An
/// explicit `MALLOC_MMAP_THRESHOLD_` in the environment is left as it is.
///
/// Fixing it also fixes the trim threshold, at glibc's 128 KiB: the free top of a heap past it
/// goes back to the system at each free, so a buffer of 128 KiB to 1 MiB made and freed each
/// request (a gRPC response's encoding, a batch's outputs) was faulted in anew each time: a YOLO
/// at 320x320 over gRPC took 360 faults a request, 170 with this (the rest were its batches'
/// outputs, now in `Reused` buffers). It is set to twice the mmap threshold, as glibc sets it
/// when it moves the mmap threshold itself (unless `MALLOC_TRIM_THRESHOLD_` is set).
fn fix_mmap_threshold() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    if std::env::var_os("MALLOC_MMAP_THRESHOLD_").is_none() {
        // SAFETY: mallopt only sets an allocator parameter; called before any other thread starts.
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, 1 << 20);
        }
        if std::env::var_os("MALLOC_TRIM_THRESHOLD_").is_none() {
            // SAFETY: as above.
            unsafe {
                libc::mallopt(libc::M_TRIM_THRESHOLD, 2 << 20);
            }
        }
    }
}

/// `ferrite --version`: Ferrite's version, and the ONNX Runtime library found (as `serve` would find
/// it without --onnxruntime-lib) with its version, or why none fits. Exits 1 when none does.
fn print_version() {
    use ferrite_core::engine::onnx;
    println!("ferrite {}", ferrite_core::wire::VERSION);
    match onnx::find_library(None) {
        None => {
            println!("onnxruntime: not found ({})", onnx::INSTALL_HINT);
            std::process::exit(1);
        }
        Some(path) => match onnx::library_version(&path) {
            Ok(v) => println!("onnxruntime {v} ({})", path.display()),
            Err(e) => {
                println!("onnxruntime: {e}");
                std::process::exit(1);
            }
        },
    }
}

fn main() {
    fix_mmap_threshold();
    let cli = Cli::parse();
    if cli.version {
        print_version();
        return;
    }
    let Some(command) = cli.command else { return };
    // ONNX Runtime is found and loaded once, here, before any model loads.
    let lib = match &command {
        Command::Serve(args) => args.onnxruntime_lib.as_deref(),
        Command::Check(args) => args.onnxruntime_lib.as_deref(),
    };
    if let Err(e) = ferrite_core::engine::onnx::init_runtime(lib) {
        eprintln!("ferrite: {e}");
        std::process::exit(2);
    }
    let args = match command {
        Command::Serve(args) => *args,
        Command::Check(args) => {
            eprintln!(
                "ferrite {}, onnxruntime {}",
                ferrite_core::wire::VERSION,
                ferrite_core::engine::onnx::runtime_version().unwrap_or("?")
            );
            std::process::exit(check(args))
        }
    };
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("tokio runtime");
    let result = runtime.block_on(async {
        let sample_rate = args
            .trace_sample_rate
            .or_else(|| std::env::var("OTEL_TRACES_SAMPLER_ARG").ok().and_then(|v| v.parse().ok()))
            .unwrap_or(1.0);
        let telemetry = telemetry::init(&telemetry::TelemetryConfig {
            log_filter: args.log.clone(),
            json_logs: args.json_output || matches!(args.log_format, LogFormat::Json),
            otlp_endpoint: args.otlp_endpoint.clone(),
            sample_rate,
        })
        .map_err(anyhow::Error::msg)?;
        match ferrite_core::crash::install(
            &args.crash_dir,
            ferrite_core::engine::onnx::runtime_version().unwrap_or("not loaded"),
        ) {
            Ok(path) => tracing::debug!(report = %path.display(), "crash reports on"),
            Err(e) => tracing::warn!(error = %e, "crash reports off"),
        }
        for earlier in ferrite_core::crash::earlier_reports(&args.crash_dir) {
            tracing::warn!(report = %earlier.display(), "a crash report from an earlier run is there to read");
        }
        let served = serve(args).await;
        drop(telemetry);
        served
    });
    if let Err(e) = result {
        eprintln!("ferrite: {e:#}");
        std::process::exit(1);
    }
}

async fn serve(args: ServeArgs) -> anyhow::Result<()> {
    // Before the models load: a name that does not resolve fails at once.
    let host = serve::addresses(&args.host).map_err(|e| anyhow::anyhow!("--host: {e}"))?;
    let tenants = match (&args.tenant_header, &args.tenant_config) {
        (Some(header), Some(path)) => Some(Tenants::load(header, path)?),
        _ => None,
    };
    let shared_timeout = Duration::from_millis(args.cache_redis_timeout_ms.max(1));
    // Writes are off the request path; they may take a little longer than lookups.
    let redis = |url: &str, from: &str| {
        RedisTier::start(url, shared_timeout * 4)
            .map(|t| t as Arc<dyn SharedTier>)
            .map_err(|e| anyhow::anyhow!("{from} {e}"))
    };
    let shared = args.cache_redis_url.as_deref().map(|u| redis(u, "--cache-redis-url")).transpose()?;
    let mut cache = ResponseCache::new(
        &CacheOptions {
            local_bytes: args.cache_local_bytes,
            ttl: Duration::from_secs(args.cache_ttl.max(1)),
            shared_timeout,
            max_value_bytes: args.cache_max_value_bytes,
            tenant_share: args.cache_tenant_share,
        },
        shared,
    );
    for (tenant, pool) in tenants.iter().flat_map(|t| &t.config().cache_pools) {
        let from = format!("--tenant-config [tenants.{tenant}] cache_redis_url");
        let tier = pool.redis_url.as_deref().map(|u| redis(u, &from)).transpose()?;
        cache = cache.with_pool(tenant, tier, pool.key_prefix.as_deref());
    }
    let mut options = LoadOptions {
        spinning: args.spin,
        spin_in_run: args.spin_in_run,
        calibrate: args.calibrate,
        cache: Some(Arc::new(cache)),
        python: args.python.clone(),
        ..LoadOptions::default()
    };
    if let Some(t) = args.threads {
        options.threads = t.max(1);
    }
    let repo = args.model_repository.clone();
    let limits = Limits {
        max_elements: args.max_request_elements,
        max_concurrent_requests: args.max_concurrent_requests,
        max_client_batch_size: args.max_client_batch_size.into(),
    };
    let startup = match args.model_control_mode {
        ControlMode::Explicit if !args.load_model.iter().any(|m| m == "*") => Startup::Only(args.load_model.clone()),
        _ => Startup::All,
    };
    let control = match args.model_control_mode {
        ControlMode::None => ModelControl::None,
        ControlMode::Poll => ModelControl::Poll,
        ControlMode::Explicit => ModelControl::Explicit,
    };
    // Configs from etcd are read before the first load, so models load once, with them.
    let source = match &args.config_source {
        Some(s) => Some(ferrite_server::config_source::Source::connect(s).await?),
        None => None,
    };
    let initial = source.as_ref().map(|s| s.initial());
    let mut core =
        tokio::task::spawn_blocking(move || Core::open_with_configs(&repo, &options, limits, startup, initial))
            .await??
            .with_model_control(control);
    if let Some(t) = tenants {
        core = core.with_tenants(t);
    }
    if control == ModelControl::Poll {
        let interval = Duration::from_secs_f64(args.repository_poll_secs.max(0.1));
        let core = core.clone();
        // Changes must hold still this long before they are loaded (half-written files do not).
        let debounce = interval.min(Duration::from_secs(1)) / 2;
        std::thread::Builder::new().name("ferrite-poll".into()).spawn(move || loop {
            std::thread::sleep(interval);
            core.poll(debounce);
        })?;
    }
    if let Some(source) = source {
        source.follow(core.clone());
    }
    // Its shares are the requests' own (`auth::share`), with tenants configured or not.
    let body_budget = ferrite_server::budget::Budget::new(args.max_inflight_body_bytes);
    let cfg = ServeConfig {
        host,
        http_port: args.http_port,
        grpc_port: args.grpc_port,
        http: http::HttpLimits {
            max_body_bytes: args.max_body_bytes,
            header_timeout: Duration::from_secs(args.http_header_timeout_secs.max(1)),
            body_timeout: Duration::from_secs(args.http_body_timeout_secs.max(1)),
            idle_timeout: Duration::from_secs(args.http_idle_timeout_secs.max(1)),
            max_connections: args.http_max_connections.unwrap_or_else(http::default_max_connections).max(1),
            max_streams: args.grpc_max_concurrent_streams,
            body_budget: body_budget.clone(),
        },
        grpc: grpc::GrpcLimits {
            max_decoding_message_size: args.grpc_max_decoding_message_size,
            max_encoding_message_size: args.grpc_max_encoding_message_size,
        },
        grpc_max_concurrent_streams: args.grpc_max_concurrent_streams,
        exit_timeout: Duration::from_secs(args.exit_timeout_secs),
        metrics_port: (!args.no_metrics).then_some(args.metrics_port),
        metrics_on_http: args.metrics_on_http,
        scale: ferrite_core::telemetry::scale::ScalePolicy {
            capacity_rps: args.scale_capacity_rps,
            p99_target_s: args.scale_p99_target_ms / 1000.0,
            min: args.scale_min_replicas,
            max: args.scale_max_replicas,
        },
        scale_window: Duration::from_secs_f64(args.scale_window_secs.clamp(1.0, 3600.0)),
        auth: match (&args.auth_token_file, &args.api_key) {
            (Some(p), _) => Some(ferrite_server::auth::Auth::from_file(p, args.auth_allow_health)),
            (None, Some(key)) => Some(ferrite_server::auth::Auth::api_key(key)),
            (None, None) => None,
        }
        .transpose()
        .map_err(anyhow::Error::msg)?,
        tls: match (&args.tls_cert, &args.tls_key) {
            (Some(cert), Some(key)) => Some(
                Tls::load(&TlsFiles { cert: cert.clone(), key: key.clone(), client_ca: args.tls_client_ca.clone() })
                    .map_err(anyhow::Error::msg)?,
            ),
            _ => None,
        },
        // Tensors read from shared memory count against the bodies' budget.
        shm: Arc::new(ferrite_server::shm::Regions::new(
            args.shared_memory == SharedMemory::System,
            args.max_body_bytes,
            body_budget,
        )),
        owns_core: true,
    };
    let bound = serve::bind(&cfg).await?;
    let metrics = bound.metrics_addr.map(|a| a.to_string()).unwrap_or_else(|| "off".into());
    // Each listener is on every address of --host; the ports are the first one's.
    let addresses = bound.addresses.iter().map(ToString::to_string).collect::<Vec<_>>().join(",");
    tracing::info!(http = %bound.http_addr, grpc = %bound.grpc_addr, %metrics, %addresses, models = core.models().len(), "listening");
    let grace = Duration::try_from_secs_f64(args.shutdown_grace_secs).unwrap_or_default();
    serve::run(core, bound, &cfg, shutdown_signal(grace)).await;
    Ok(())
}

/// Waits for SIGTERM (a balancer or orchestrator stopping this replica: `grace` given) or SIGINT
/// (someone at a terminal: none).
async fn shutdown_signal(grace: Duration) -> Duration {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => Duration::ZERO,
        _ = term.recv() => grace,
    }
}
