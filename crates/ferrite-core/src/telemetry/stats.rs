//! Per-model statistics, shaped as Triton's statistics extension reports them.

use std::{
    collections::BTreeMap,
    sync::{
        atomic::{AtomicU64, Ordering::Relaxed},
        Mutex,
    },
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use serde::Serialize;

#[derive(Debug, Default)]
pub struct Counter {
    count: AtomicU64,
    ns: AtomicU64,
}

impl Counter {
    pub fn add(&self, d: Duration) {
        self.add_n(1, d);
    }

    pub fn add_n(&self, n: u64, d: Duration) {
        self.count.fetch_add(n, Relaxed);
        self.ns.fetch_add(d.as_nanos() as u64, Relaxed);
    }

    pub fn snapshot(&self) -> StatDuration {
        StatDuration { count: self.count.load(Relaxed), ns: self.ns.load(Relaxed) }
    }
}

/// A count and the total nanoseconds spent (Triton's `StatisticDuration`).
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq)]
pub struct StatDuration {
    pub count: u64,
    pub ns: u64,
}

#[derive(Debug, Default)]
pub struct ModelStats {
    pub success: Counter,
    pub fail: Counter,
    pub queue: Counter,
    pub compute_input: Counter,
    pub compute_infer: Counter,
    pub compute_output: Counter,
    /// Lookups that found a response, and those that did not (with the time they took).
    pub cache_hit: Counter,
    pub cache_miss: Counter,
    /// Rows inferred (a batch of 8 counts 8).
    pub inference_count: AtomicU64,
    /// Batches run.
    pub execution_count: AtomicU64,
    last_inference_ms: AtomicU64,
    batches: Mutex<BTreeMap<usize, (StatDuration, StatDuration, StatDuration)>>,
}

#[derive(Debug, Clone, Serialize)]
pub struct InferenceStats {
    pub success: StatDuration,
    pub fail: StatDuration,
    pub queue: StatDuration,
    pub compute_input: StatDuration,
    pub compute_infer: StatDuration,
    pub compute_output: StatDuration,
    pub cache_hit: StatDuration,
    pub cache_miss: StatDuration,
}

#[derive(Debug, Clone, Serialize)]
pub struct BatchStats {
    pub batch_size: usize,
    pub compute_input: StatDuration,
    pub compute_infer: StatDuration,
    pub compute_output: StatDuration,
}

#[derive(Debug, Clone, Serialize)]
pub struct StatsSnapshot {
    pub name: String,
    pub version: String,
    pub last_inference: u64,
    pub inference_count: u64,
    pub execution_count: u64,
    pub inference_stats: InferenceStats,
    pub batch_stats: Vec<BatchStats>,
}

impl ModelStats {
    /// Records one executed batch of `rows` rows from `requests` requests. As in Triton, each
    /// request is charged the whole batch's compute time; batch statistics count executions.
    pub fn record_batch(&self, rows: usize, requests: usize, input: Duration, infer: Duration, output: Duration) {
        self.inference_count.fetch_add(rows as u64, Relaxed);
        self.execution_count.fetch_add(1, Relaxed);
        let n = requests as u32;
        self.compute_input.add_n(requests as u64, input * n);
        self.compute_infer.add_n(requests as u64, infer * n);
        self.compute_output.add_n(requests as u64, output * n);
        let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default().as_millis() as u64;
        self.last_inference_ms.store(now, Relaxed);
        let mut batches = self.batches.lock().unwrap_or_else(|e| e.into_inner());
        let entry = batches.entry(rows).or_default();
        for (d, t) in [(&mut entry.0, input), (&mut entry.1, infer), (&mut entry.2, output)] {
            d.count += 1;
            d.ns += t.as_nanos() as u64;
        }
    }

    pub fn snapshot(&self, name: &str, version: u64) -> StatsSnapshot {
        let batches = self.batches.lock().unwrap_or_else(|e| e.into_inner());
        StatsSnapshot {
            name: name.to_string(),
            version: version.to_string(),
            last_inference: self.last_inference_ms.load(Relaxed),
            inference_count: self.inference_count.load(Relaxed),
            execution_count: self.execution_count.load(Relaxed),
            inference_stats: InferenceStats {
                success: self.success.snapshot(),
                fail: self.fail.snapshot(),
                queue: self.queue.snapshot(),
                compute_input: self.compute_input.snapshot(),
                compute_infer: self.compute_infer.snapshot(),
                compute_output: self.compute_output.snapshot(),
                cache_hit: self.cache_hit.snapshot(),
                cache_miss: self.cache_miss.snapshot(),
            },
            batch_stats: batches
                .iter()
                .map(|(&batch_size, &(i, c, o))| BatchStats {
                    batch_size,
                    compute_input: i,
                    compute_infer: c,
                    compute_output: o,
                })
                .collect(),
        }
    }
}
