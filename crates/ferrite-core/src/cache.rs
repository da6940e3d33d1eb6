//! The response cache. Tier 1 is in-process (moka: bounded in bytes, TTL, TinyLFU admission).
//! Tier 2 is Redis, shared between processes, and never a point of failure: a lookup waits at
//! most `redis_timeout` and then counts as a miss, repeated errors open a circuit breaker that
//! skips Redis for a while, writes go through a bounded queue after the answer (dropped when
//! full), and a Redis that is down at start-up or later is reconnected in the background.

use std::{
    sync::{
        atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering::Relaxed},
        Arc, Mutex,
    },
    time::{Duration, Instant},
};

use bytes::Bytes;
use redis::aio::ConnectionManager;
use serde::Serialize;
use tokio::sync::mpsc;
use xxhash_rust::xxh3::Xxh3;

use crate::{DataType, Error, Result, Tensor, TensorData};

/// A 128-bit hash of everything that determines a response.
pub type Key = u128;

#[derive(Debug, Clone)]
pub struct CacheOptions {
    /// Budget of the in-process tier, in bytes of tensor data.
    pub local_bytes: u64,
    /// How long an entry lives, in both tiers.
    pub ttl: Duration,
    pub redis_url: Option<String>,
    /// The longest a request waits on Redis before treating it as a miss.
    pub redis_timeout: Duration,
    /// Responses larger than this are not cached.
    pub max_value_bytes: usize,
}

impl Default for CacheOptions {
    fn default() -> Self {
        CacheOptions {
            local_bytes: 256 << 20,
            ttl: Duration::from_secs(300),
            redis_url: None,
            redis_timeout: Duration::from_millis(5),
            max_value_bytes: 1 << 20,
        }
    }
}

/// The key of a request: model, version, every input's name, datatype, shape and bytes (in model
/// order), and which outputs were asked for. Lengths are hashed too, so no two different requests
/// can be made to feed the hasher the same stream.
pub fn key(model: &str, version: u64, inputs: &[Tensor], outputs: Option<&[usize]>) -> Key {
    let mut h = Xxh3::new();
    let mut field = |b: &[u8]| {
        h.update(&(b.len() as u64).to_le_bytes());
        h.update(b);
    };
    field(model.as_bytes());
    field(&version.to_le_bytes());
    for t in inputs {
        field(t.name.as_bytes());
        field(t.datatype.as_str().as_bytes());
        field(&t.shape.iter().flat_map(|d| (*d as u64).to_le_bytes()).collect::<Vec<_>>());
        match &t.data {
            TensorData::Raw(b) => field(b),
            TensorData::Bytes(items) => {
                field(&(items.len() as u64).to_le_bytes());
                for b in items {
                    field(b);
                }
            }
        }
    }
    match outputs {
        None => field(b"*"),
        Some(idx) => field(&idx.iter().flat_map(|i| (*i as u64).to_le_bytes()).collect::<Vec<_>>()),
    }
    h.digest128()
}

type Value = Arc<Vec<Tensor>>;

fn weight(outputs: &[Tensor]) -> usize {
    outputs.iter().map(|t| t.name.len() + 64 + t.data.wire_len()).sum()
}

/// Counters, for statistics and metrics.
#[derive(Debug, Default, Serialize, Clone)]
pub struct CacheSnapshot {
    pub local_entries: u64,
    pub local_bytes: u64,
    pub local_budget_bytes: u64,
    /// "off", "ok" or "degraded" (not connected, or the breaker is open).
    pub redis: &'static str,
    pub redis_hits: u64,
    pub redis_misses: u64,
    pub redis_errors: u64,
    pub redis_timeouts: u64,
    pub redis_writes_dropped: u64,
}

pub struct ResponseCache {
    local: moka::sync::Cache<Key, Value>,
    budget: u64,
    max_value_bytes: usize,
    redis: Option<Arc<RedisTier>>,
}

impl std::fmt::Debug for ResponseCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResponseCache").field("budget", &self.budget).finish_non_exhaustive()
    }
}

impl ResponseCache {
    /// Creates the cache. With a Redis URL this must run inside a tokio runtime: the connection
    /// and the write queue live on it. A Redis that is down only makes the cache degraded.
    pub fn new(options: &CacheOptions) -> Result<ResponseCache> {
        let local = moka::sync::Cache::builder()
            .max_capacity(options.local_bytes)
            .weigher(|_k: &Key, v: &Value| u32::try_from(weight(v)).unwrap_or(u32::MAX))
            .time_to_live(options.ttl)
            .build();
        let redis = match &options.redis_url {
            None => None,
            Some(url) => Some(RedisTier::start(url, options)?),
        };
        Ok(ResponseCache { local, budget: options.local_bytes, max_value_bytes: options.max_value_bytes, redis })
    }

    /// Tier 1, then tier 2 (bounded by the Redis timeout). A Redis hit is promoted to tier 1.
    pub async fn get(&self, key: Key) -> Option<Value> {
        if let Some(v) = self.local.get(&key) {
            return Some(v);
        }
        let redis = self.redis.as_ref()?;
        let v = Arc::new(redis.get(key).await?);
        self.local.insert(key, v.clone());
        Some(v)
    }

    /// Stores a response in tier 1 now and queues it for tier 2.
    pub fn put(&self, key: Key, outputs: &[Tensor]) {
        if weight(outputs) > self.max_value_bytes {
            return;
        }
        self.local.insert(key, Arc::new(outputs.to_vec()));
        if let Some(redis) = &self.redis {
            redis.queue_write(key, outputs);
        }
    }

    pub fn snapshot(&self) -> CacheSnapshot {
        self.local.run_pending_tasks();
        let mut s = CacheSnapshot {
            local_entries: self.local.entry_count(),
            local_bytes: self.local.weighted_size(),
            local_budget_bytes: self.budget,
            redis: "off",
            ..Default::default()
        };
        if let Some(r) = &self.redis {
            s.redis = if r.is_healthy(Instant::now()) { "ok" } else { "degraded" };
            s.redis_hits = r.hits.load(Relaxed);
            s.redis_misses = r.misses.load(Relaxed);
            s.redis_errors = r.errors.load(Relaxed);
            s.redis_timeouts = r.timeouts.load(Relaxed);
            s.redis_writes_dropped = r.dropped.load(Relaxed);
        }
        s
    }
}

/// Opens after `threshold` consecutive failures and stays open for `cooldown`; then one request
/// at a time probes, and the first success closes it.
#[derive(Debug)]
pub struct Breaker {
    threshold: u32,
    cooldown: Duration,
    failures: AtomicU32,
    open_until: Mutex<Option<Instant>>,
    probing: AtomicBool,
}

impl Breaker {
    pub fn new(threshold: u32, cooldown: Duration) -> Breaker {
        Breaker {
            threshold,
            cooldown,
            failures: AtomicU32::new(0),
            open_until: Mutex::new(None),
            probing: AtomicBool::new(false),
        }
    }

    fn until(&self) -> Option<Instant> {
        *self.open_until.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether a call may go to Redis at `now`.
    pub fn allow(&self, now: Instant) -> bool {
        match self.until() {
            None => true,
            Some(t) if now < t => false,
            // Half-open: let one probe through.
            Some(_) => !self.probing.swap(true, Relaxed),
        }
    }

    pub fn is_open(&self, now: Instant) -> bool {
        self.until().is_some_and(|t| now < t)
    }

    pub fn success(&self) {
        self.failures.store(0, Relaxed);
        self.probing.store(false, Relaxed);
        *self.open_until.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }

    pub fn failure(&self, now: Instant) {
        self.probing.store(false, Relaxed);
        if self.failures.fetch_add(1, Relaxed) + 1 >= self.threshold {
            *self.open_until.lock().unwrap_or_else(|e| e.into_inner()) = Some(now + self.cooldown);
        }
    }
}

struct RedisTier {
    conn: Mutex<Option<ConnectionManager>>,
    breaker: Breaker,
    timeout: Duration,
    ttl: Duration,
    writes: mpsc::Sender<(Key, Vec<u8>)>,
    hits: AtomicU64,
    misses: AtomicU64,
    errors: AtomicU64,
    timeouts: AtomicU64,
    dropped: AtomicU64,
}

/// Writes waiting for Redis; past this, new writes are dropped (and counted).
const WRITE_QUEUE: usize = 1024;

fn redis_key(key: Key) -> String {
    format!("ferrite:{key:032x}")
}

impl RedisTier {
    fn start(url: &str, options: &CacheOptions) -> Result<Arc<RedisTier>> {
        let client = redis::Client::open(url).map_err(|e| Error::invalid(format!("--cache-redis-url: {e}")))?;
        let (writes, mut queue) = mpsc::channel::<(Key, Vec<u8>)>(WRITE_QUEUE);
        let tier = Arc::new(RedisTier {
            conn: Mutex::new(None),
            breaker: Breaker::new(5, Duration::from_secs(1)),
            timeout: options.redis_timeout,
            ttl: options.ttl,
            writes,
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            errors: AtomicU64::new(0),
            timeouts: AtomicU64::new(0),
            dropped: AtomicU64::new(0),
        });
        // Connect in the background, retrying: starting with Redis down is allowed.
        let connecting = tier.clone();
        tokio::spawn(async move {
            let mut backoff = Duration::from_millis(100);
            loop {
                let config = redis::aio::ConnectionManagerConfig::new()
                    .set_connection_timeout(Some(Duration::from_secs(1)))
                    .set_response_timeout(Some(Duration::from_secs(1)))
                    .set_number_of_retries(1);
                match tokio::time::timeout(
                    Duration::from_secs(3),
                    ConnectionManager::new_with_config(client.clone(), config),
                )
                .await
                {
                    Ok(Ok(m)) => {
                        tracing::info!("redis cache connected");
                        *connecting.conn.lock().unwrap_or_else(|e| e.into_inner()) = Some(m);
                        return;
                    }
                    Ok(Err(e)) => tracing::warn!(error = %e, "redis cache unavailable; retrying"),
                    Err(_) => tracing::warn!("redis cache connection timed out; retrying"),
                }
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(5));
            }
        });
        let writer = tier.clone();
        tokio::spawn(async move {
            while let Some((key, value)) = queue.recv().await {
                let Some(mut conn) = writer.usable() else { continue };
                let mut cmd = redis::cmd("SET");
                cmd.arg(redis_key(key)).arg(value).arg("PX").arg(writer.ttl.as_millis() as u64);
                let set = cmd.query_async::<()>(&mut conn);
                // Writes are off the request path; they may take a little longer than lookups.
                writer.outcome(tokio::time::timeout(writer.timeout * 4, set).await);
            }
        });
        Ok(tier)
    }

    /// A connection, if connected and the breaker lets a call through.
    fn usable(&self) -> Option<ConnectionManager> {
        let conn = self.conn.lock().unwrap_or_else(|e| e.into_inner()).clone()?;
        self.breaker.allow(Instant::now()).then_some(conn)
    }

    fn is_healthy(&self, now: Instant) -> bool {
        self.conn.lock().unwrap_or_else(|e| e.into_inner()).is_some() && !self.breaker.is_open(now)
    }

    fn outcome<T>(&self, r: std::result::Result<redis::RedisResult<T>, tokio::time::error::Elapsed>) -> Option<T> {
        match r {
            Ok(Ok(v)) => {
                self.breaker.success();
                Some(v)
            }
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "redis cache error");
                crate::metrics::global().redis_errors.inc();
                self.errors.fetch_add(1, Relaxed);
                self.breaker.failure(Instant::now());
                None
            }
            Err(_) => {
                crate::metrics::global().redis_errors.inc();
                self.timeouts.fetch_add(1, Relaxed);
                self.errors.fetch_add(1, Relaxed);
                self.breaker.failure(Instant::now());
                None
            }
        }
    }

    async fn get(&self, key: Key) -> Option<Vec<Tensor>> {
        let mut conn = self.usable()?;
        let mut cmd = redis::cmd("GET");
        cmd.arg(redis_key(key));
        let get = cmd.query_async::<Option<Vec<u8>>>(&mut conn);
        let found = self.outcome(tokio::time::timeout(self.timeout, get).await)?;
        match found.map(|v| decode(Bytes::from(v))) {
            Some(Ok(tensors)) => {
                self.hits.fetch_add(1, Relaxed);
                Some(tensors)
            }
            Some(Err(_)) => {
                self.errors.fetch_add(1, Relaxed);
                None
            }
            None => {
                self.misses.fetch_add(1, Relaxed);
                None
            }
        }
    }

    fn queue_write(&self, key: Key, outputs: &[Tensor]) {
        if self.writes.try_send((key, encode(outputs))).is_err() {
            self.dropped.fetch_add(1, Relaxed);
        }
    }
}

/// Compact binary form for Redis: per tensor its name, datatype, shape and wire bytes.
pub fn encode(outputs: &[Tensor]) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&(outputs.len() as u32).to_le_bytes());
    for t in outputs {
        out.extend_from_slice(&(t.name.len() as u32).to_le_bytes());
        out.extend_from_slice(t.name.as_bytes());
        out.push(DataType::ALL.iter().position(|&d| d == t.datatype).unwrap_or(0) as u8);
        out.extend_from_slice(&(t.shape.len() as u32).to_le_bytes());
        for d in &t.shape {
            out.extend_from_slice(&(*d as u64).to_le_bytes());
        }
        let wire = t.data.to_wire();
        out.extend_from_slice(&(wire.len() as u64).to_le_bytes());
        out.extend_from_slice(&wire);
    }
    out
}

/// The inverse of `encode`; every length is checked, so a corrupt value is an error, not a panic.
pub fn decode(mut b: Bytes) -> Result<Vec<Tensor>> {
    fn take(b: &mut Bytes, n: usize) -> Result<Bytes> {
        if n > b.len() {
            return Err(Error::internal("corrupt cache value"));
        }
        Ok(b.split_to(n))
    }
    fn int(b: &mut Bytes, n: usize) -> Result<u64> {
        let bytes = take(b, n)?;
        let mut v = [0u8; 8];
        v[..n].copy_from_slice(&bytes);
        Ok(u64::from_le_bytes(v))
    }
    let count = int(&mut b, 4)? as usize;
    let mut out = Vec::with_capacity(count.min(64));
    for _ in 0..count {
        let name_len = int(&mut b, 4)? as usize;
        let name =
            String::from_utf8(take(&mut b, name_len)?.to_vec()).map_err(|_| Error::internal("corrupt cache value"))?;
        let datatype =
            *DataType::ALL.get(int(&mut b, 1)? as usize).ok_or_else(|| Error::internal("corrupt cache value"))?;
        let rank = int(&mut b, 4)? as usize;
        if rank > 64 {
            return Err(Error::internal("corrupt cache value"));
        }
        let shape = (0..rank).map(|_| int(&mut b, 8).map(|d| d as usize)).collect::<Result<Vec<_>>>()?;
        let len = int(&mut b, 8)? as usize;
        let wire = take(&mut b, len)?;
        let count =
            crate::tensor::element_count(&shape, usize::MAX).map_err(|_| Error::internal("corrupt cache value"))?;
        let data = TensorData::from_wire(&name, datatype, count, wire)?;
        out.push(Tensor::new(name, datatype, shape, data));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(name: &str, v: &[f32]) -> Tensor {
        Tensor::from_le(name, DataType::Fp32, vec![1, v.len()], v)
    }

    #[test]
    fn keys_differ_for_every_part_of_the_request() {
        let base = key("m", 1, &[t("x", &[1.0, 2.0])], None);
        assert_eq!(base, key("m", 1, &[t("x", &[1.0, 2.0])], None));
        assert_ne!(base, key("n", 1, &[t("x", &[1.0, 2.0])], None));
        assert_ne!(base, key("m", 2, &[t("x", &[1.0, 2.0])], None));
        assert_ne!(base, key("m", 1, &[t("y", &[1.0, 2.0])], None));
        assert_ne!(base, key("m", 1, &[t("x", &[1.0, 2.5])], None));
        assert_ne!(base, key("m", 1, &[t("x", &[1.0, 2.0])], Some(&[0])));
        assert_ne!(key("m", 1, &[t("x", &[1.0, 2.0])], Some(&[0])), key("m", 1, &[t("x", &[1.0, 2.0])], Some(&[1])));
        let mut reshaped = t("x", &[1.0, 2.0]);
        reshaped.shape = vec![2, 1];
        assert_ne!(base, key("m", 1, &[reshaped], None));
        let s = |items: &[&'static [u8]]| {
            Tensor::new(
                "s",
                DataType::Bytes,
                vec![items.len()],
                TensorData::Bytes(items.iter().map(|b| Bytes::from_static(b)).collect()),
            )
        };
        assert_ne!(key("m", 1, &[s(&[b"ab", b"c"])], None), key("m", 1, &[s(&[b"a", b"bc"])], None));
    }

    #[test]
    fn values_round_trip_and_corruption_is_an_error() {
        let outs = vec![
            t("y", &[1.0, f32::NAN]),
            Tensor::new(
                "s",
                DataType::Bytes,
                vec![2],
                TensorData::Bytes(vec![Bytes::from_static(b"hi"), Bytes::new()]),
            ),
        ];
        let enc = encode(&outs);
        let dec = decode(Bytes::from(enc.clone())).unwrap();
        assert_eq!(dec[1], outs[1]);
        assert_eq!(dec[0].data.to_wire(), outs[0].data.to_wire());
        for cut in [0, 3, 10, enc.len() - 1] {
            assert!(decode(Bytes::from(enc[..cut].to_vec())).is_err(), "cut at {cut}");
        }
    }

    #[test]
    fn breaker_opens_after_repeated_failures_and_probes_after_cooldown() {
        let b = Breaker::new(3, Duration::from_secs(1));
        let t0 = Instant::now();
        for _ in 0..2 {
            b.failure(t0);
        }
        assert!(b.allow(t0));
        b.failure(t0);
        assert!(!b.allow(t0) && b.is_open(t0));
        let later = t0 + Duration::from_millis(1500);
        assert!(b.allow(later), "one probe after the cooldown");
        assert!(!b.allow(later), "only one at a time");
        b.success();
        assert!(b.allow(later) && !b.is_open(later));
    }

    #[tokio::test]
    async fn local_tier_hits_and_stays_within_its_budget() {
        let cache = ResponseCache::new(&CacheOptions { local_bytes: 64 * 1024, ..Default::default() }).unwrap();
        let k = key("m", 1, &[t("x", &[1.0])], None);
        assert!(cache.get(k).await.is_none());
        cache.put(k, &[t("y", &[3.0])]);
        assert_eq!(cache.get(k).await.unwrap()[0], t("y", &[3.0]));
        for i in 0..2000 {
            let k = key("m", 1, &[t("x", &[i as f32])], None);
            cache.put(k, &[t("y", &vec![0.5; 256])]);
        }
        let s = cache.snapshot();
        assert!(s.local_bytes <= 64 * 1024, "{s:?}");
        assert!(s.local_entries > 0 && s.redis == "off");
    }
}

#[cfg(test)]
mod fuzz {
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig { cases: 1024, ..ProptestConfig::default() })]

        /// A corrupt Redis value is an error, never a panic or a huge allocation.
        #[test]
        fn cache_values_never_panic(v in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = super::decode(bytes::Bytes::from(v));
        }

        #[test]
        fn wire_tensors_never_panic(v in proptest::collection::vec(any::<u8>(), 0..256), count in 0usize..64) {
            for dt in crate::DataType::ALL {
                let _ = crate::TensorData::from_wire("x", dt, count, bytes::Bytes::from(v.clone()));
            }
        }

        /// Any config text parses or is refused, and resolving what parses never panics.
        #[test]
        fn configs_never_panic(text in "[a-z_ =\\[\\]0-9\"\n,.-]{0,200}") {
            if let Ok(cfg) = toml::from_str::<crate::config::ModelConfig>(&text) {
                let io = [crate::config::TensorSpec { name: "x".into(), datatype: crate::DataType::Fp32, dims: vec![-1, 4] }];
                let _ = crate::config::ModelSpec::resolve("m", 1, &cfg, &io, &io, 1);
            }
        }
    }
}
