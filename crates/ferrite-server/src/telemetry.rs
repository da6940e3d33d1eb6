//! Logs and traces. Logs go to stderr, human-readable or JSON. When an OTLP endpoint is set
//! (`--otlp-endpoint`, or the standard `OTEL_EXPORTER_OTLP_ENDPOINT`), spans are exported over
//! OTLP/gRPC, and an incoming W3C `traceparent`/`tracestate` continues the caller's trace.
//! With no endpoint no OpenTelemetry layer exists and request spans (DEBUG level) are disabled.

use opentelemetry::{
    propagation::{Extractor, TextMapPropagator},
    trace::{Link, SpanKind, TraceContextExt, TraceId, TracerProvider as _},
    Context, KeyValue,
};
use opentelemetry_sdk::{
    propagation::TraceContextPropagator,
    trace::{Sampler, SamplingDecision, SamplingResult, SdkTracerProvider, ShouldSample},
};
use tracing_subscriber::{layer::SubscriberExt, util::SubscriberInitExt, EnvFilter, Layer};

pub struct TelemetryConfig {
    pub log_filter: String,
    pub json_logs: bool,
    pub otlp_endpoint: Option<String>,
    /// Share of requests without a trace context that are traced (0.0 to 1.0).
    pub sample_rate: f64,
}

/// Keeps the exporter alive; dropping it flushes what is buffered.
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        if let Some(p) = self.provider.take() {
            let _ = p.shutdown();
        }
    }
}

/// Traces every request that arrives with a trace context, and every batch that serves a traced
/// request (its links); samples the others at `rate`.
#[derive(Debug, Clone)]
struct ContextOrRatio(Sampler);

impl ShouldSample for ContextOrRatio {
    fn should_sample(
        &self,
        parent: Option<&Context>,
        trace_id: TraceId,
        name: &str,
        kind: &SpanKind,
        attributes: &[KeyValue],
        links: &[Link],
    ) -> SamplingResult {
        if let Some(p) = parent.filter(|p| p.span().span_context().is_valid()) {
            return SamplingResult {
                decision: SamplingDecision::RecordAndSample,
                attributes: Vec::new(),
                trace_state: p.span().span_context().trace_state().clone(),
            };
        }
        if links.iter().any(|l| l.span_context.is_sampled()) {
            return SamplingResult {
                decision: SamplingDecision::RecordAndSample,
                attributes: Vec::new(),
                trace_state: Default::default(),
            };
        }
        self.0.should_sample(parent, trace_id, name, kind, attributes, links)
    }
}

/// The sample rate for requests without a trace context (f64 bits); set once tracing is on.
static SAMPLE_RATE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Installs the global subscriber. Call inside the tokio runtime (the exporter runs on it).
pub fn init(cfg: &TelemetryConfig) -> Result<Telemetry, String> {
    let logs_filter = EnvFilter::try_new(&cfg.log_filter).map_err(|e| format!("--log: {e}"))?;
    let logs = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
    let logs = if cfg.json_logs { logs.json().boxed() } else { logs.boxed() }.with_filter(logs_filter);
    let endpoint = cfg.otlp_endpoint.clone().or_else(|| std::env::var("OTEL_EXPORTER_OTLP_ENDPOINT").ok());
    let Some(endpoint) = endpoint.filter(|e| !e.is_empty()) else {
        tracing_subscriber::registry().with(logs).init();
        return Ok(Telemetry { provider: None });
    };
    use opentelemetry_otlp::WithExportConfig;
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_tonic()
        .with_endpoint(endpoint)
        .build()
        .map_err(|e| format!("--otlp-endpoint: {e}"))?;
    let processor = opentelemetry_sdk::trace::span_processor_with_async_runtime::BatchSpanProcessor::builder(
        exporter,
        opentelemetry_sdk::runtime::Tokio,
    )
    .build();
    let provider = SdkTracerProvider::builder()
        .with_span_processor(processor)
        .with_sampler(ContextOrRatio(Sampler::TraceIdRatioBased(cfg.sample_rate.clamp(0.0, 1.0))))
        .with_resource(opentelemetry_sdk::Resource::builder().with_service_name("ferrite").build())
        .build();
    SAMPLE_RATE.store(cfg.sample_rate.clamp(0.0, 1.0).to_bits(), std::sync::atomic::Ordering::Relaxed);
    ENABLED.store(true, std::sync::atomic::Ordering::Relaxed);
    let tracer = provider.tracer("ferrite");
    // Request spans are at DEBUG so they cost nothing when tracing is off.
    let traces = tracing_opentelemetry::layer()
        .with_tracer(tracer)
        .with_filter(EnvFilter::new("ferrite_core=debug,ferrite_server=debug"));
    tracing_subscriber::registry().with(logs).with(traces).init();
    Ok(Telemetry { provider: Some(provider) })
}

/// Set once spans are exported; until then no request parses trace headers.
static ENABLED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// The caller's trace context from W3C headers (`traceparent`, `tracestate`). An empty context,
/// with nothing parsed, when tracing is off or the caller sent none.
pub fn extract(carrier: &dyn Extractor) -> Context {
    if !ENABLED.load(std::sync::atomic::Ordering::Relaxed) || carrier.get("traceparent").is_none() {
        return Context::new();
    }
    TraceContextPropagator::new().extract(carrier)
}

/// The context a W3C `traceparent` (and optional `tracestate`) value names.
pub fn from_traceparent(traceparent: &str, tracestate: Option<&str>) -> Context {
    let mut carrier = std::collections::HashMap::new();
    carrier.insert("traceparent".to_string(), traceparent.to_string());
    if let Some(ts) = tracestate {
        carrier.insert("tracestate".to_string(), ts.to_string());
    }
    extract(&carrier)
}

/// HTTP headers as a propagation carrier.
pub struct Headers<'a>(pub &'a axum::http::HeaderMap);

impl Extractor for Headers<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }
    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(|k| k.as_str()).collect()
    }
}

/// gRPC metadata as a propagation carrier.
pub struct Metadata<'a>(pub &'a tonic::metadata::MetadataMap);

impl Extractor for Metadata<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }
    fn keys(&self) -> Vec<&str> {
        self.0
            .keys()
            .filter_map(|k| match k {
                tonic::metadata::KeyRef::Ascii(k) => Some(k.as_str()),
                tonic::metadata::KeyRef::Binary(_) => None,
            })
            .collect()
    }
}

/// A request span for `front` (http, grpc, python) whose parent is the caller's context, if it
/// sent one. A request without a context that the sample rate leaves out gets no span at all, so
/// the engine builds none of its child spans either (the core checks `Span::current()`).
pub fn request_span(front: &'static str, model: &str, parent: Context) -> tracing::Span {
    use tracing_opentelemetry::OpenTelemetrySpanExt;
    let traced = parent.span().span_context().is_valid();
    if !traced {
        let rate = f64::from_bits(SAMPLE_RATE.load(std::sync::atomic::Ordering::Relaxed));
        if rate <= 0.0 || (rate < 1.0 && rand_unit() >= rate) {
            return tracing::Span::none();
        }
    }
    let span = tracing::debug_span!("receive", front, model = %model);
    if traced {
        let _ = span.set_parent(parent);
    }
    span
}

/// A cheap uniform number in [0, 1) for sampling (not for anything that needs randomness).
fn rand_unit() -> f64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64));
    (h.finish() >> 11) as f64 / (1u64 << 53) as f64
}
