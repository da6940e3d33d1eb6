//! Prometheus metrics, one registry per process, named `ferrite_*` with base units. The batcher,
//! the models and the cache record into it; `render` is what a `/metrics` endpoint returns.

use std::sync::OnceLock;

use prometheus::{Encoder, HistogramOpts, HistogramVec, IntCounterVec, IntGaugeVec, Opts, Registry, TextEncoder};

use crate::Error;

/// Seconds, from 100 µs to 10 s.
const DURATION_BUCKETS: &[f64] =
    &[0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0];
const BATCH_BUCKETS: &[f64] = &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0];

pub struct Metrics {
    registry: Registry,
    pub requests: IntCounterVec,
    pub inferences: IntCounterVec,
    pub executions: IntCounterVec,
    pub panics: IntCounterVec,
    pub request_duration: HistogramVec,
    pub queue_duration: HistogramVec,
    pub compute_duration: HistogramVec,
    pub batch_size: HistogramVec,
    pub pending: IntGaugeVec,
    pub cache_hits: IntCounterVec,
    pub cache_misses: IntCounterVec,
    pub cache_coalesced: IntCounterVec,
    pub cache_fleet_coalesced: IntCounterVec,
    pub cache_hot_keys: prometheus::IntGauge,
    pub redis_errors: prometheus::IntCounter,
    pub redis_moved: prometheus::IntCounter,
    pub redis_up: prometheus::IntGauge,
    pub desired_replicas: prometheus::IntGauge,
    pub config_revision: prometheus::IntGauge,
    pub config_refused_revision: prometheus::IntGauge,
    pub model_ready: IntGaugeVec,
    pub model_load_duration: prometheus::GaugeVec,
    pub tenant_refusals: IntCounterVec,
    pub model_load_failures: IntCounterVec,
    pub canary_rollbacks: IntCounterVec,
    pub python_restarts: IntCounterVec,
    pub pipeline_step_duration: HistogramVec,
}

const MODEL: &[&str] = &["model", "version"];

impl Metrics {
    fn new() -> prometheus::Result<Metrics> {
        let registry = Registry::new();
        let counter = |name: &str, help: &str, labels: &[&str]| -> prometheus::Result<IntCounterVec> {
            let c = IntCounterVec::new(Opts::new(name, help), labels)?;
            registry.register(Box::new(c.clone()))?;
            Ok(c)
        };
        let histogram = |name: &str, help: &str, buckets: &[f64]| -> prometheus::Result<HistogramVec> {
            let h = HistogramVec::new(HistogramOpts::new(name, help).buckets(buckets.to_vec()), MODEL)?;
            registry.register(Box::new(h.clone()))?;
            Ok(h)
        };
        let gauge = |name: &str, help: &str| -> prometheus::Result<IntGaugeVec> {
            let g = IntGaugeVec::new(Opts::new(name, help), MODEL)?;
            registry.register(Box::new(g.clone()))?;
            Ok(g)
        };
        // One value for the whole process.
        let single = |name: &str, help: &str| -> prometheus::Result<prometheus::IntGauge> {
            let g = prometheus::IntGauge::new(name, help)?;
            registry.register(Box::new(g.clone()))?;
            Ok(g)
        };
        let single_counter = |name: &str, help: &str| -> prometheus::Result<prometheus::IntCounter> {
            let c = prometheus::IntCounter::new(name, help)?;
            registry.register(Box::new(c.clone()))?;
            Ok(c)
        };
        let m = Metrics {
            requests: counter(
                "ferrite_requests_total",
                "Inference requests by outcome (success, failure) and failure reason (invalid, not_found, rejected, throttled, timeout, cancelled, backend, unsupported).",
                &["model", "version", "outcome", "reason"],
            )?,
            inferences: counter("ferrite_inferences_total", "Rows inferred (a batch of 8 counts 8).", MODEL)?,
            executions: counter("ferrite_executions_total", "Batches executed by the backend.", MODEL)?,
            panics: counter(
                "ferrite_backend_panics_total",
                "Runs in which the backend panicked; the run failed (its requests were run apart) and serving went on.",
                MODEL,
            )?,
            request_duration: histogram(
                "ferrite_request_duration_seconds",
                "Time from a request reaching the engine to its answer, cache hits included.",
                DURATION_BUCKETS,
            )?,
            queue_duration: histogram("ferrite_queue_duration_seconds", "Time requests waited in the batcher queue.", DURATION_BUCKETS)?,
            compute_duration: histogram(
                "ferrite_compute_duration_seconds",
                "Time the backend took per batch (inputs, run, outputs).",
                DURATION_BUCKETS,
            )?,
            batch_size: histogram("ferrite_batch_size", "Rows per executed batch.", BATCH_BUCKETS)?,
            pending: gauge("ferrite_pending_requests", "Requests waiting in the batcher queue.")?,
            model_load_failures: counter(
                "ferrite_model_load_failures_total",
                "Model loads and reloads that failed (the previous load, if any, kept serving).",
                &["model"],
            )?,
            canary_rollbacks: counter(
                "ferrite_canary_rollbacks_total",
                "Canary candidates withdrawn automatically for doing worse than the stable version.",
                &["model"],
            )?,
            python_restarts: counter(
                "ferrite_python_restarts_total",
                "Python model workers killed and started again (crashed, hung past the execute timeout, or over their memory limit).",
                &["model"],
            )?,
            tenant_refusals: counter(
                "ferrite_tenant_refusals_total",
                "Requests refused by a tenant's limit (rate, concurrency); tenants not named in the config count as other.",
                &["tenant", "limit"],
            )?,
            cache_hits: counter("ferrite_cache_hits_total", "Response cache lookups that found an answer.", MODEL)?,
            cache_misses: counter("ferrite_cache_misses_total", "Response cache lookups that did not.", MODEL)?,
            cache_coalesced: counter(
                "ferrite_cache_coalesced_total",
                "Cache misses answered by an identical request already computing (not computed again).",
                MODEL,
            )?,
            cache_fleet_coalesced: counter(
                "ferrite_cache_fleet_coalesced_total",
                "Hot cache misses answered by another process sharing the tier, which was computing them (not computed again).",
                MODEL,
            )?,
            cache_hot_keys: single(
                "ferrite_cache_hot_keys",
                "Cache keys that became hot (looked up repeatedly) in the current window of the hot-key sketch.",
            )?,
            redis_errors: single_counter("ferrite_cache_redis_errors_total", "Redis cache calls that failed or timed out.")?,
            config_revision: single(
                "ferrite_config_revision",
                "The etcd revision whose model configs this replica serves (0: configs from files only).",
            )?,
            config_refused_revision: single(
                "ferrite_config_refused_revision",
                "The latest etcd revision whose model configs this replica could not apply (0: none); it serves the previous ones.",
            )?,
            redis_moved: single_counter(
                "ferrite_cache_redis_moved_total",
                "MOVED/ASK replies from a Redis addressed as one server: it is a cluster node (use redis+cluster://).",
            )?,
            redis_up: single("ferrite_cache_redis_up", "1 when the Redis cache tier is connected and healthy, 0 when degraded.")?,
            desired_replicas: single(
                "ferrite_desired_replicas",
                "Replicas this process's load calls for: ceil(req/s / per-replica capacity), x1.8 while p99 is over its target, within [min, max] (--scale-* flags).",
            )?,
            pipeline_step_duration: {
                let h = HistogramVec::new(
                    HistogramOpts::new(
                        "ferrite_pipeline_step_duration_seconds",
                        "Time a pipeline step took per batch (a model step: its queue and run in that model's batcher).",
                    )
                    .buckets(DURATION_BUCKETS.to_vec()),
                    &["model", "step"],
                )?;
                registry.register(Box::new(h.clone()))?;
                h
            },
            model_ready: gauge("ferrite_model_ready", "1 while a model version serves, 0 once it stopped.")?,
            model_load_duration: {
                let g = prometheus::GaugeVec::new(Opts::new("ferrite_model_load_duration_seconds", "How long loading a model version took."), MODEL)?;
                registry.register(Box::new(g.clone()))?;
                g
            },
            registry,
        };
        #[cfg(target_os = "linux")]
        m.registry.register(Box::new(prometheus::process_collector::ProcessCollector::for_self()))?;
        Ok(m)
    }
}

/// One model version's series, looked up once so the hot path does no label hashing (cloned
/// handles share the series).
#[derive(Clone)]
pub struct ModelMetrics {
    labels: [String; 2],
    pub success: prometheus::IntCounter,
    pub request: prometheus::Histogram,
    pub queue: prometheus::Histogram,
    pub compute: prometheus::Histogram,
    pub batch_size: prometheus::Histogram,
    pub inferences: prometheus::IntCounter,
    pub executions: prometheus::IntCounter,
    pub panics: prometheus::IntCounter,
    pub cache_hits: prometheus::IntCounter,
    pub cache_misses: prometheus::IntCounter,
    pub cache_coalesced: prometheus::IntCounter,
    pub cache_fleet_coalesced: prometheus::IntCounter,
}

impl ModelMetrics {
    pub fn new(model: &str, version: u64) -> ModelMetrics {
        let m = global();
        let v = version.to_string();
        let l = [model, v.as_str()];
        ModelMetrics {
            success: m.requests.with_label_values(&[model, v.as_str(), "success", ""]),
            request: m.request_duration.with_label_values(&l),
            queue: m.queue_duration.with_label_values(&l),
            compute: m.compute_duration.with_label_values(&l),
            batch_size: m.batch_size.with_label_values(&l),
            inferences: m.inferences.with_label_values(&l),
            executions: m.executions.with_label_values(&l),
            panics: m.panics.with_label_values(&l),
            cache_hits: m.cache_hits.with_label_values(&l),
            cache_misses: m.cache_misses.with_label_values(&l),
            cache_coalesced: m.cache_coalesced.with_label_values(&l),
            cache_fleet_coalesced: m.cache_fleet_coalesced.with_label_values(&l),
            labels: [model.to_string(), v],
        }
    }

    /// Counts a failed request under its reason.
    pub fn failure(&self, reason: &str) {
        global()
            .requests
            .with_label_values(&[self.labels[0].as_str(), self.labels[1].as_str(), "failure", reason])
            .inc();
    }
}

impl Metrics {
    /// Requests answered so far, and their latency histogram, over every model.
    pub fn request_reading(&self) -> super::scale::Reading {
        use prometheus::core::Collector;
        let mut reading = super::scale::Reading::default();
        for family in self.request_duration.collect() {
            for m in family.get_metric() {
                let h = m.get_histogram();
                reading.count += h.get_sample_count();
                for (i, b) in h.get_bucket().iter().enumerate() {
                    match reading.buckets.get_mut(i) {
                        Some(slot) => slot.1 += b.cumulative_count(),
                        None => reading.buckets.push((b.upper_bound(), b.cumulative_count())),
                    }
                }
            }
        }
        reading
    }
}

/// The process's metrics.
pub fn global() -> &'static Metrics {
    static M: OnceLock<Metrics> = OnceLock::new();
    M.get_or_init(|| Metrics::new().expect("metric definitions are valid"))
}

/// The failure reason label of an error.
pub fn reason(e: &Error) -> &'static str {
    match e {
        Error::InvalidInput(_) => "invalid",
        Error::NotFound(_) => "not_found",
        Error::Unavailable { .. } => "rejected",
        Error::Overloaded { .. } => "throttled",
        Error::TooLarge(_) => "too_large",
        Error::DeadlineExceeded(_) => "timeout",
        Error::Unsupported(_) => "unsupported",
        Error::Internal(_) => "backend",
    }
}

/// The Prometheus text format of every metric, as the gauges read now (`Core::metrics` brings the
/// engine's gauges up to date first).
pub fn render() -> String {
    let m = global();
    let mut out = Vec::new();
    // Encoding gathered families into a Vec cannot fail.
    let _ = TextEncoder::new().encode(&m.registry.gather(), &mut out);
    String::from_utf8(out).unwrap_or_default()
}
