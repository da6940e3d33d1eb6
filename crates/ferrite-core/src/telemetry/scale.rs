//! `ferrite_desired_replicas`: the replica count this process's load calls for, for an autoscaler
//! (KEDA, or an HPA on a Pods or external metric) to use directly. From the requests answered in
//! a sliding window: ⌈req/s ÷ per-replica capacity⌉, times 1.8 when the window's p99 exceeds its
//! target, clamped to [min, max].

use std::{collections::VecDeque, time::Instant};

/// How the desired count is computed (the `--scale-*` flags).
#[derive(Debug, Clone, PartialEq)]
pub struct ScalePolicy {
    /// Requests per second one replica serves within its latency target.
    pub capacity_rps: f64,
    /// p99 latency target in seconds; 0: latency is not considered.
    pub p99_target_s: f64,
    pub min: u64,
    pub max: u64,
}

impl Default for ScalePolicy {
    /// No capacity given: the desired count stays at the minimum, 1.
    fn default() -> Self {
        ScalePolicy { capacity_rps: 0.0, p99_target_s: 0.0, min: 1, max: 100 }
    }
}

/// The extra replicas asked for while p99 is over its target.
pub const SLOW_FACTOR: f64 = 1.8;

/// The replicas `rps` calls for under `policy`, given the window's `p99` (seconds, if known).
pub fn desired_replicas(policy: &ScalePolicy, rps: f64, p99: Option<f64>) -> u64 {
    let base = if policy.capacity_rps > 0.0 { (rps.max(0.0) / policy.capacity_rps).ceil() } else { 0.0 };
    let slow = policy.p99_target_s > 0.0 && p99.is_some_and(|p| p > policy.p99_target_s);
    let wanted = if slow { (base * SLOW_FACTOR).ceil() } else { base };
    (wanted.min(u64::MAX as f64) as u64).clamp(policy.min, policy.max.max(policy.min))
}

/// A cumulative reading of the request counter and latency histogram (all models summed).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Reading {
    pub count: u64,
    /// (upper bound in seconds, cumulative count), ascending.
    pub buckets: Vec<(f64, u64)>,
}

/// Readings over a sliding window, from which the rate and p99 of the window follow.
#[derive(Debug, Default)]
pub struct Window {
    readings: VecDeque<(Instant, Reading)>,
}

impl Window {
    /// Adds `reading` taken at `at`, forgetting those older than `span` (but the newest of them,
    /// which starts the window).
    pub fn push(&mut self, at: Instant, reading: Reading, span: std::time::Duration) {
        self.readings.push_back((at, reading));
        while self.readings.len() > 2 && at.duration_since(self.readings[1].0) >= span {
            self.readings.pop_front();
        }
    }

    /// Requests per second and p99 (seconds; `None` without requests) over the window.
    pub fn rate_and_p99(&self) -> (f64, Option<f64>) {
        let (Some((t0, first)), Some((t1, last))) = (self.readings.front(), self.readings.back()) else {
            return (0.0, None);
        };
        let secs = t1.duration_since(*t0).as_secs_f64();
        let n = last.count.saturating_sub(first.count);
        if secs <= 0.0 || n == 0 {
            return (0.0, None);
        }
        let delta: Vec<(f64, u64)> = last
            .buckets
            .iter()
            .map(|&(le, c)| (le, c.saturating_sub(first.buckets.iter().find(|b| b.0 == le).map_or(0, |b| b.1))))
            .collect();
        (n as f64 / secs, Some(quantile(&delta, n, 0.99)))
    }
}

/// The `q` quantile of `n` observations in cumulative `buckets`, interpolated linearly within the
/// bucket it falls in (as Prometheus' histogram_quantile); past the last bound, that bound.
fn quantile(buckets: &[(f64, u64)], n: u64, q: f64) -> f64 {
    let rank = q * n as f64;
    let mut lower = (0.0, 0u64);
    for &(le, c) in buckets {
        if c as f64 >= rank {
            let within = (c - lower.1) as f64;
            let fraction = if within > 0.0 { (rank - lower.1 as f64) / within } else { 1.0 };
            return lower.0 + (le - lower.0) * fraction;
        }
        lower = (le, c);
    }
    lower.0
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn policy() -> ScalePolicy {
        ScalePolicy { capacity_rps: 100.0, p99_target_s: 0.05, min: 2, max: 10 }
    }

    #[test]
    fn the_rule_rounds_up_scales_when_slow_and_clamps() {
        let p = policy();
        assert_eq!(desired_replicas(&p, 0.0, None), 2, "never under min");
        assert_eq!(desired_replicas(&p, 250.0, Some(0.01)), 3, "⌈250 / 100⌉");
        assert_eq!(desired_replicas(&p, 301.0, Some(0.01)), 4);
        assert_eq!(desired_replicas(&p, 250.0, Some(0.08)), 6, "⌈3 × 1.8⌉ = 6 while p99 is over target");
        assert_eq!(desired_replicas(&p, 2000.0, Some(0.01)), 10, "never over max");
        let no_target = ScalePolicy { p99_target_s: 0.0, ..p };
        assert_eq!(desired_replicas(&no_target, 250.0, Some(9.0)), 3);
    }

    #[test]
    fn a_window_gives_the_rate_and_p99_of_its_span() {
        let t0 = Instant::now();
        let bounds = [0.01, 0.1, 1.0];
        let reading = |count: u64, per: [u64; 3]| Reading {
            count,
            buckets: bounds.iter().zip(per).map(|(&b, c)| (b, c)).collect(),
        };
        let mut w = Window::default();
        w.push(t0, reading(1000, [900, 990, 1000]), Duration::from_secs(10));
        // 10 s later: 500 more requests, 400 under 10 ms, 100 between 10 and 100 ms.
        w.push(t0 + Duration::from_secs(10), reading(1500, [1300, 1490, 1500]), Duration::from_secs(10));
        let (rps, p99) = w.rate_and_p99();
        assert!((rps - 50.0).abs() < 1e-9);
        // rank 495 of 500: 95 into the 100 between 10 and 100 ms.
        assert!((p99.unwrap() - (0.01 + 0.09 * 0.95)).abs() < 1e-9, "{p99:?}");
        // Older readings leave the window.
        w.push(t0 + Duration::from_secs(25), reading(1500, [1300, 1490, 1500]), Duration::from_secs(10));
        assert_eq!(w.rate_and_p99(), (0.0, None));
    }
}
