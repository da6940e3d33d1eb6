//! Canary rollout: a share of a model's unversioned requests goes to a candidate version, and the
//! candidate is withdrawn automatically when, over a sliding window, it does worse than the stable
//! version by more than the thresholds (error rate, p99 latency).
//!
//! ```toml
//! [canary]
//! version = 3
//! weight = 0.05               # share of unversioned requests
//! max_error_rate_delta = 0.05 # candidate error rate - stable error rate
//! max_p99_delta_ms = 50.0     # candidate p99 - stable p99
//! min_samples = 50            # per side, before any comparison
//! window_secs = 60
//! ```
//!
//! Routing is sticky per request id (the same id always lands on the same side); the request
//! header `x-ferrite-canary: always|never` overrides it for testers. Errors are failures of the
//! model (backend errors, timeouts) and answers holding NaN; a client's bad input is not counted.

use std::{
    collections::{BTreeMap, VecDeque},
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc, Mutex,
    },
    time::{Duration, Instant},
};

use serde::Deserialize;

use crate::{control::registry::Served, CanaryRoute, Error, Model, Result};

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CanaryConfig {
    pub version: u64,
    pub weight: f64,
    #[serde(default = "default_error_delta")]
    pub max_error_rate_delta: f64,
    #[serde(default = "default_p99_delta")]
    pub max_p99_delta_ms: f64,
    #[serde(default = "default_min_samples")]
    pub min_samples: usize,
    #[serde(default = "default_window")]
    pub window_secs: u64,
}

fn default_error_delta() -> f64 {
    0.05
}
fn default_p99_delta() -> f64 {
    50.0
}
fn default_min_samples() -> usize {
    50
}
fn default_window() -> u64 {
    60
}

impl CanaryConfig {
    pub fn check(&self) -> Result<()> {
        if !(0.0..=1.0).contains(&self.weight) {
            return Err(Error::invalid("canary weight must be within 0..=1"));
        }
        if self.version == 0 || self.min_samples == 0 || self.window_secs == 0 {
            return Err(Error::invalid("canary version, min_samples and window_secs must be positive"));
        }
        if !(self.max_error_rate_delta >= 0.0 && self.max_p99_delta_ms >= 0.0) {
            return Err(Error::invalid("canary thresholds must not be negative"));
        }
        Ok(())
    }
}

/// Where a canary stands.
#[derive(Debug, Clone, PartialEq)]
pub enum CanaryState {
    /// Taking its share of traffic and being compared.
    Active,
    /// Withdrawn, with the reason; no more traffic.
    Withdrawn(String),
    /// Made the default version by an explicit call.
    Promoted,
}

/// Samples kept per side, whatever the window.
const MAX_SAMPLES: usize = 10_000;

#[derive(Debug, Default)]
struct Window {
    /// (when, failed, latency in µs)
    samples: VecDeque<(Instant, bool, u64)>,
}

impl Window {
    fn push(&mut self, now: Instant, failed: bool, latency: Duration, span: Duration) {
        if self.samples.len() == MAX_SAMPLES {
            self.samples.pop_front();
        }
        self.samples.push_back((now, failed, latency.as_micros() as u64));
        while self.samples.front().is_some_and(|s| now.duration_since(s.0) > span) {
            self.samples.pop_front();
        }
    }

    fn error_rate(&self) -> f64 {
        self.samples.iter().filter(|s| s.1).count() as f64 / self.samples.len().max(1) as f64
    }

    fn p99_ms(&self) -> f64 {
        let mut l: Vec<u64> = self.samples.iter().map(|s| s.2).collect();
        if l.is_empty() {
            return 0.0;
        }
        let i = ((l.len() as f64 * 0.99).ceil() as usize).clamp(1, l.len()) - 1;
        let (_, p99, _) = l.select_nth_unstable(i);
        *p99 as f64 / 1000.0
    }
}

struct Inner {
    state: CanaryState,
    stable: Window,
    candidate: Window,
    since_check: usize,
}

pub struct Canary {
    pub config: CanaryConfig,
    /// The version the candidate is compared with.
    pub stable: u64,
    inner: Mutex<Inner>,
    unkeyed: AtomicU64,
}

impl std::fmt::Debug for Canary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Canary").field("config", &self.config).field("state", &self.state()).finish()
    }
}

/// Which side a routed request went to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    Stable,
    Candidate,
}

impl Canary {
    pub fn new(config: CanaryConfig, stable: u64) -> Canary {
        Canary {
            config,
            stable,
            inner: Mutex::new(Inner {
                state: CanaryState::Active,
                stable: Window::default(),
                candidate: Window::default(),
                since_check: 0,
            }),
            unkeyed: AtomicU64::new(0),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn state(&self) -> CanaryState {
        self.lock().state.clone()
    }

    /// The side an unversioned request goes to. Sticky per request id.
    pub fn route(&self, id: Option<&str>, asked: CanaryRoute) -> Side {
        let state = self.state();
        match (state, asked) {
            (CanaryState::Promoted, _) => return Side::Candidate,
            (CanaryState::Withdrawn(_), _) => return Side::Stable,
            (_, CanaryRoute::Always) => return Side::Candidate,
            (_, CanaryRoute::Never) => return Side::Stable,
            _ => {}
        }
        let point = match id.filter(|i| !i.is_empty()) {
            Some(id) => xxhash_rust::xxh3::xxh3_64(id.as_bytes()),
            // No id: spread evenly (a golden-ratio sequence), without a random source.
            None => self.unkeyed.fetch_add(1, Ordering::Relaxed).wrapping_mul(0x9e37_79b9_7f4a_7c15),
        };
        if (point as f64) < self.config.weight * u64::MAX as f64 {
            Side::Candidate
        } else {
            Side::Stable
        }
    }

    /// Records one routed request's outcome; returns the reason when this sample made the
    /// candidate cross a threshold (it is withdrawn from then on).
    pub fn record(&self, side: Side, failed: bool, latency: Duration) -> Option<String> {
        let now = Instant::now();
        let span = Duration::from_secs(self.config.window_secs);
        let mut inner = self.lock();
        if inner.state != CanaryState::Active {
            return None;
        }
        match side {
            Side::Stable => inner.stable.push(now, failed, latency, span),
            Side::Candidate => inner.candidate.push(now, failed, latency, span),
        }
        inner.since_check += 1;
        // Comparing sorts the latencies; do it every few samples, not on each.
        let n = self.config.min_samples;
        if inner.since_check < 8 || inner.stable.samples.len() < n || inner.candidate.samples.len() < n {
            return None;
        }
        inner.since_check = 0;
        let c = &self.config;
        let (es, ec) = (inner.stable.error_rate(), inner.candidate.error_rate());
        let (ps, pc) = (inner.stable.p99_ms(), inner.candidate.p99_ms());
        let reason = if ec - es > c.max_error_rate_delta {
            format!(
                "canary withdrawn: error rate {ec:.3} vs {es:.3} on version {} (max delta {})",
                self.stable, c.max_error_rate_delta
            )
        } else if pc - ps > c.max_p99_delta_ms {
            format!(
                "canary withdrawn: p99 {pc:.1} ms vs {ps:.1} ms on version {} (max delta {} ms)",
                self.stable, c.max_p99_delta_ms
            )
        } else {
            return None;
        };
        inner.state = CanaryState::Withdrawn(reason.clone());
        Some(reason)
    }

    /// Records the outcome of a request this canary routed: failures of the model (an internal
    /// error, or NaN outputs from inputs that held none) and its latency. A client's own timeout
    /// or bad input is not the model's failure. Withdraws the candidate, logs and counts it when
    /// the comparison says so.
    pub fn observe(
        &self,
        model: &str,
        side: Side,
        nan_inputs: bool,
        result: &Result<crate::InferResponse>,
        latency: Duration,
    ) {
        let failed = match result {
            Ok(r) => !nan_inputs && has_nan(&r.outputs),
            Err(e) => matches!(e, Error::Internal(_)),
        };
        if let Some(reason) = self.record(side, failed, latency) {
            tracing::warn!(model, version = self.config.version, %reason, "canary withdrawn");
            crate::telemetry::metrics::global().canary_rollbacks.with_label_values(&[model]).inc();
        }
    }

    /// The canary for `config` beside `stable` in a rebuilt model: the one `current` holds when
    /// it is the same canary over the same two loads (it keeps its window and state), else new;
    /// a new one over the same candidate file stays withdrawn if the old one was (a config edit
    /// that leaves the candidate as it is does not bring it back).
    pub(crate) fn carry_over(
        current: Option<&Served>,
        config: &CanaryConfig,
        stable: u64,
        versions: &BTreeMap<u64, Arc<Model>>,
    ) -> Arc<Canary> {
        let old = current.and_then(|s| s.canary.as_ref());
        let same_candidate = old.is_some_and(|o| o.config.version == config.version)
            && match (current.and_then(|s| s.versions.get(&config.version)), versions.get(&config.version)) {
                (Some(a), Some(b)) => a.content == b.content,
                _ => false,
            };
        let withdrawn = old.filter(|_| same_candidate).and_then(|o| match o.state() {
            CanaryState::Withdrawn(why) => Some(why),
            _ => None,
        });
        let same = current.and_then(|s| s.canary.as_ref()).filter(|old| {
            old.config == *config
                && old.stable == stable
                && current.is_some_and(|s| {
                    [config.version, stable].iter().all(|v| match (s.versions.get(v), versions.get(v)) {
                        (Some(a), Some(b)) => Arc::ptr_eq(a, b),
                        _ => false,
                    })
                })
        });
        same.cloned().unwrap_or_else(|| {
            let fresh = Canary::new(config.clone(), stable);
            if let Some(why) = withdrawn {
                fresh.lock().state = CanaryState::Withdrawn(why);
            }
            Arc::new(fresh)
        })
    }

    /// Makes the candidate the default version.
    pub fn promote(&self) {
        self.lock().state = CanaryState::Promoted;
    }
}

/// Whether an answer counts as a failure of the model for canary purposes: floating outputs
/// holding NaN.
pub fn has_nan(outputs: &[crate::Tensor]) -> bool {
    use crate::{Element, TensorData};
    outputs.iter().any(|t| {
        let TensorData::Fixed(b) = &t.data else { return false };
        let size = t.datatype.size().unwrap_or(1);
        t.datatype.is_float()
            && crate::dispatch!(t.datatype, T => b.chunks_exact(size).any(|c| T::read_le(c).to_f64().is_nan()), bytes => false)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(weight: f64) -> CanaryConfig {
        toml::from_str(&format!("version = 2\nweight = {weight}\nmin_samples = 20\nmax_p99_delta_ms = 5.0")).unwrap()
    }

    #[test]
    fn routing_follows_the_weight_and_is_sticky_per_id() {
        let c = Canary::new(config(0.2), 1);
        let ids: Vec<String> = (0..5000).map(|i| format!("req-{i}")).collect();
        let share = ids.iter().filter(|id| c.route(Some(id), CanaryRoute::Auto) == Side::Candidate).count();
        assert!((800..1200).contains(&share), "{share} of 5000");
        for id in ids.iter().take(100) {
            assert_eq!(c.route(Some(id), CanaryRoute::Auto), c.route(Some(id), CanaryRoute::Auto));
        }
        let unkeyed = (0..5000).filter(|_| c.route(None, CanaryRoute::Auto) == Side::Candidate).count();
        assert!((800..1200).contains(&unkeyed), "{unkeyed} of 5000");
        assert_eq!(c.route(Some("x"), CanaryRoute::Always), Side::Candidate);
        assert_eq!(c.route(Some("x"), CanaryRoute::Never), Side::Stable);
    }

    #[test]
    fn a_failing_candidate_is_withdrawn_a_good_one_is_not() {
        let ms = Duration::from_millis(1);
        let good = Canary::new(config(0.5), 1);
        for i in 0..500 {
            assert_eq!(good.record(Side::Stable, i % 50 == 0, ms), None);
            assert_eq!(good.record(Side::Candidate, i % 50 == 1, ms), None);
        }
        assert_eq!(good.state(), CanaryState::Active);

        let bad = Canary::new(config(0.5), 1);
        let mut reason = None;
        for i in 0..100 {
            bad.record(Side::Stable, false, ms);
            reason = reason.or(bad.record(Side::Candidate, i % 3 == 0, ms));
        }
        let reason = reason.expect("withdrawn");
        assert!(reason.contains("error rate"), "{reason}");
        assert!(matches!(bad.state(), CanaryState::Withdrawn(_)));
        assert_eq!(bad.route(Some("any"), CanaryRoute::Always), Side::Stable);

        let slow = Canary::new(config(0.5), 1);
        let mut reason = None;
        for _ in 0..100 {
            slow.record(Side::Stable, false, ms);
            reason = reason.or(slow.record(Side::Candidate, false, 20 * ms));
        }
        assert!(reason.expect("withdrawn").contains("p99"));
    }

    #[test]
    fn promotion_sends_everything_to_the_candidate() {
        let c = Canary::new(config(0.0), 1);
        assert_eq!(c.route(Some("a"), CanaryRoute::Auto), Side::Stable);
        c.promote();
        assert_eq!(c.route(Some("a"), CanaryRoute::Never), Side::Candidate);
        assert!(config(1.5).check().is_err());
    }

    #[test]
    fn nan_answers_are_failures() {
        use crate::{DataType, Tensor};
        assert!(has_nan(&[Tensor::from_le("y", DataType::Fp32, vec![2], &[1.0f32, f32::NAN])]));
        assert!(!has_nan(&[Tensor::from_le("y", DataType::Fp32, vec![2], &[1.0f32, f32::INFINITY])]));
    }
}
