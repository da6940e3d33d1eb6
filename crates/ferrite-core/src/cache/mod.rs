//! The response cache. Tier 1 is in-process (moka: bounded in bytes, TTL, TinyLFU admission).
//! Tier 2 is a [`SharedTier`] (Redis, provided by the server), shared between processes, and
//! never a point of failure: a lookup waits at most `shared_timeout` and then counts as a miss,
//! repeated errors open a circuit breaker that skips the tier (or, on a cluster, the part of it
//! that fails: a breaker per slot range) for a while, and writes are queued
//! by the tier after the answer (dropped when its queue is full).
//!
//! A miss is computed once however many identical requests arrive while it runs: the first
//! [`join`](ResponseCache::join)s as the flight's [`Leader`], the others follow it and take its
//! answer. A leader that leaves without one (cancelled, failed) releases its followers to compute
//! their own, so it never fails them.
//!
//! Across processes sharing the tier, a hot key (see [`hot`]) is computed once too: the leader of
//! a hot miss [`claim`](ResponseCache::claim)s it in the shared tier; when another process holds
//! it, the leader waits (about twice the model's usual compute time) for that process's answer to
//! appear there, and computes its own only if it does not.

mod hot;
mod key;
mod shared;
mod value;

use std::{
    sync::{
        atomic::{AtomicU64, Ordering::Relaxed},
        Arc,
    },
    time::{Duration, Instant},
};

use bytes::Bytes;
use serde::Serialize;

pub use key::{key, Key};
pub use shared::{Breaker, SharedTier, TierFuture};
pub use value::{decode, encode};

use crate::{telemetry::metrics, Tensor};

#[derive(Debug, Clone)]
pub struct CacheOptions {
    /// Budget of the in-process tier, in bytes of tensor data.
    pub local_bytes: u64,
    /// How long an entry lives, in both tiers.
    pub ttl: Duration,
    /// The longest a request waits on the shared tier before treating it as a miss.
    pub shared_timeout: Duration,
    /// Responses larger than this are not cached.
    pub max_value_bytes: usize,
    /// The share of the in-process tier one named tenant's entries may hold (0 to 1); past it
    /// the tenant's new answers are not kept there until some of its own expire or are evicted,
    /// so one tenant's volume cannot evict every other tenant's hot entries.
    pub tenant_share: f64,
}

impl Default for CacheOptions {
    fn default() -> Self {
        CacheOptions {
            local_bytes: 256 << 20,
            ttl: Duration::from_secs(300),
            shared_timeout: Duration::from_millis(5),
            max_value_bytes: 1 << 20,
            tenant_share: 0.5,
        }
    }
}

/// A cached answer, and the tenant whose share of the in-process tier it counts in (0: none).
pub struct Entry {
    tenant: u64,
    pub outputs: Vec<Tensor>,
}

pub type Value = Arc<Entry>;

fn weight(outputs: &[Tensor]) -> usize {
    outputs.iter().map(|t| t.name.len() + 64 + t.data.wire_len()).sum()
}

/// The tenant an entry counts for: a hash of its name, 0 for none (a model shared across
/// tenants, or a process without tenants).
fn tenant_id(tenant: Option<&str>) -> u64 {
    tenant.filter(|t| !t.is_empty()).map_or(0, |t| xxhash_rust::xxh3::xxh3_64(t.as_bytes()).max(1))
}

/// Counters, for statistics and metrics.
#[derive(Debug, Default, Serialize, Clone)]
pub struct CacheSnapshot {
    pub local_entries: u64,
    pub local_bytes: u64,
    pub local_budget_bytes: u64,
    /// Answers not kept in the in-process tier because their tenant held its share of it.
    pub local_over_share: u64,
    /// "off", "ok" or "degraded" (not connected, or the breaker is open).
    pub redis: &'static str,
    pub redis_hits: u64,
    pub redis_misses: u64,
    pub redis_errors: u64,
    pub redis_timeouts: u64,
    pub redis_writes_dropped: u64,
    /// Values from the shared tier that failed their checks (dropped, and removed from it).
    pub redis_bad_values: u64,
    /// MOVED/ASK replies: the URL names one node of a Redis Cluster (use `redis+cluster://`).
    pub redis_moved: u64,
    /// Keys that became hot in the sketch's current window.
    pub hot_keys: u64,
    /// Hot misses another process was computing: answered from its result, or (not in time)
    /// computed here too.
    pub fleet_answered: u64,
    pub fleet_missed: u64,
}

pub struct ResponseCache {
    local: moka::sync::Cache<Key, Value>,
    budget: u64,
    /// Bytes each tenant's entries hold in the in-process tier, and the most one may.
    held: Arc<std::sync::Mutex<std::collections::HashMap<u64, u64>>>,
    tenant_budget: u64,
    /// Answers not kept in the in-process tier because their tenant held its share.
    over_share: AtomicU64,
    max_value_bytes: usize,
    ttl: Duration,
    shared: Option<Shared>,
    /// Misses being computed now: each leader's answer, once it has one. Bounded by the requests
    /// in flight (each entry's leader is one).
    flights: std::sync::Mutex<std::collections::HashMap<Key, Answer>>,
    /// Listed tenants whose entries live apart in the shared tier, by name.
    pools: std::collections::HashMap<String, Pool>,
    heat: hot::Heat,
    fleet_answered: AtomicU64,
    fleet_missed: AtomicU64,
}

/// What [`ResponseCache::claim`] found for a hot miss.
pub enum Claim {
    /// Compute it here (not hot, no shared tier, or this process took it: the claim, if any, is
    /// released when the [`Claimed`] guard goes, after the answer was queued for the tier).
    Compute(Option<Claimed>),
    /// Another process computed it meanwhile.
    Answered(Value),
    /// An identical request here finished it between this one's lookup and its lead.
    Found(Value),
}

/// A hot key this process took in the shared tier; dropped, it queues the release (after the
/// answer's write, as writes keep their order).
pub struct Claimed {
    tier: Arc<dyn SharedTier>,
    lock: String,
}

impl Drop for Claimed {
    fn drop(&mut self) {
        self.tier.remove(std::mem::take(&mut self.lock));
    }
}

/// How often a process waiting for another's answer looks for it.
const FLEET_POLL: Duration = Duration::from_millis(2);

/// A tenant's own place in the shared tier: a tier of its own (`None`: the default one) and a
/// prefix of its own for its keys.
struct Pool {
    shared: Option<Shared>,
    prefix: String,
}

type Answer = tokio::sync::watch::Receiver<Option<Value>>;

/// What [`ResponseCache::join`] makes of a miss.
pub enum Flight<'c> {
    /// Compute it, and [`finish`](Leader::finish) with the answer.
    Lead(Leader<'c>),
    /// An identical request is computing it: [`follow`] it.
    Follow(Answer),
}

/// The request computing a key's answer for every identical one that arrives meanwhile. Dropped
/// without [`finish`](Leader::finish), it releases its followers.
pub struct Leader<'c> {
    cache: &'c ResponseCache,
    key: Key,
    answer: tokio::sync::watch::Sender<Option<Value>>,
}

impl Leader<'_> {
    /// Hands `outputs` to the followers.
    pub fn finish(self, outputs: &[Tensor]) {
        let _ = self.answer.send(Some(Arc::new(Entry { tenant: 0, outputs: outputs.to_vec() })));
    }
}

impl Drop for Leader<'_> {
    fn drop(&mut self) {
        self.cache.flights.lock().unwrap_or_else(|e| e.into_inner()).remove(&self.key);
    }
}

/// The leader's answer; `None` when it left without one (the follower then computes its own).
pub async fn follow(mut answer: Answer) -> Option<Value> {
    answer.wait_for(Option::is_some).await.ok().and_then(|v| v.clone())
}

/// The shared tier with what guards it.
struct Shared {
    tier: Arc<dyn SharedTier>,
    /// One per [`SharedTier::shards`]: a cluster's failing node opens only its own slots'.
    breakers: Vec<Breaker>,
    timeout: Duration,
    hits: AtomicU64,
    misses: AtomicU64,
    errors: AtomicU64,
    timeouts: AtomicU64,
    dropped: AtomicU64,
    bad: AtomicU64,
}

impl std::fmt::Debug for ResponseCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResponseCache").field("budget", &self.budget).finish_non_exhaustive()
    }
}

/// The key a value lives under in the shared tier: `[<prefix>:]ferrite:<hash>`.
fn shared_key(prefix: &str, key: Key) -> String {
    if prefix.is_empty() {
        format!("ferrite:{key:032x}")
    } else {
        format!("{prefix}:ferrite:{key:032x}")
    }
}

impl ResponseCache {
    /// Creates the cache, with `shared` as its second tier when given.
    pub fn new(options: &CacheOptions, shared: Option<Arc<dyn SharedTier>>) -> ResponseCache {
        let held: Arc<std::sync::Mutex<std::collections::HashMap<u64, u64>>> = Arc::default();
        let released = held.clone();
        let local = moka::sync::Cache::builder()
            .max_capacity(options.local_bytes)
            .weigher(|_k: &Key, v: &Value| u32::try_from(weight(&v.outputs)).unwrap_or(u32::MAX))
            .time_to_live(options.ttl)
            .eviction_listener(move |_k, v: Value, _cause| {
                if v.tenant != 0 {
                    let mut held = released.lock().unwrap_or_else(|e| e.into_inner());
                    if let Some(n) = held.get_mut(&v.tenant) {
                        *n = n.saturating_sub(weight(&v.outputs) as u64);
                        if *n == 0 {
                            held.remove(&v.tenant);
                        }
                    }
                }
            })
            .build();
        let shared = shared.map(|tier| Shared::new(tier, options.shared_timeout));
        ResponseCache {
            local,
            budget: options.local_bytes,
            held,
            tenant_budget: (options.local_bytes as f64 * options.tenant_share.clamp(0.0, 1.0)) as u64,
            over_share: AtomicU64::new(0),
            max_value_bytes: options.max_value_bytes,
            ttl: options.ttl,
            shared,
            flights: Default::default(),
            pools: Default::default(),
            heat: Default::default(),
            fleet_answered: AtomicU64::new(0),
            fleet_missed: AtomicU64::new(0),
        }
    }

    /// Keeps the shared-tier entries of `tenant` apart: in `tier` when given (else the default
    /// tier), under `prefix` when given.
    pub fn with_pool(mut self, tenant: &str, tier: Option<Arc<dyn SharedTier>>, prefix: Option<&str>) -> Self {
        let timeout = self.shared.as_ref().map_or(CacheOptions::default().shared_timeout, |s| s.timeout);
        let pool = Pool { shared: tier.map(|t| Shared::new(t, timeout)), prefix: prefix.unwrap_or_default().into() };
        self.pools.insert(tenant.to_string(), pool);
        self
    }

    /// The shared tier `tenant`'s entries live in, and their keys' prefix.
    fn place(&self, tenant: Option<&str>) -> (Option<&Shared>, &str) {
        match tenant.and_then(|t| self.pools.get(t)) {
            Some(p) => (p.shared.as_ref().or(self.shared.as_ref()), &p.prefix),
            None => (self.shared.as_ref(), ""),
        }
    }

    /// Every shared tier: the default one and the tenants' own.
    fn tiers(&self) -> impl Iterator<Item = &Shared> {
        self.shared.iter().chain(self.pools.values().filter_map(|p| p.shared.as_ref()))
    }

    /// Leads the computation of `key`'s answer, or follows the request already leading it.
    pub fn join(&self, key: Key) -> Flight<'_> {
        let mut flights = self.flights.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(answer) = flights.get(&key) {
            return Flight::Follow(answer.clone());
        }
        let (answer, rx) = tokio::sync::watch::channel(None);
        flights.insert(key, rx);
        Flight::Lead(Leader { cache: self, key, answer })
    }

    /// Tier 1, then tier 2 (bounded by the shared tier's timeout). A tier-2 value is checked like
    /// client input (each tensor at most `max_elements` elements); a bad one is dropped from the
    /// shared tier and counted, and a good one is promoted to tier 1 (in `tenant`'s share).
    pub async fn get(&self, key: Key, max_elements: usize, tenant: Option<&str>) -> Option<Value> {
        self.heat.touch(key);
        if let Some(v) = self.local.get(&key) {
            return Some(v);
        }
        let (shared, prefix) = self.place(tenant);
        let outputs = shared?.get(shared_key(prefix, key), max_elements).await?;
        Some(self.keep(key, outputs, tenant))
    }

    /// For the leader of a miss: when the key is hot and a shared tier is up, takes it there, or,
    /// when another process holds it, waits at most `wait` for that process's answer to appear.
    pub async fn claim(&self, key: Key, max_elements: usize, tenant: Option<&str>, wait: Duration) -> Claim {
        if let Some(v) = self.local.get(&key) {
            return Claim::Found(v);
        }
        let (Some(shared), prefix) = self.place(tenant) else { return Claim::Compute(None) };
        if !self.heat.is_hot(key) || !shared.tier.connected() {
            return Claim::Compute(None);
        }
        let value = shared_key(prefix, key);
        if shared.breaker(&value).is_open(Instant::now()) {
            return Claim::Compute(None);
        }
        let lock = format!("{value}:lock");
        match tokio::time::timeout(shared.timeout, shared.tier.claim(lock.clone(), wait)).await {
            Ok(Ok(true)) => return Claim::Compute(Some(Claimed { tier: shared.tier.clone(), lock })),
            Ok(Ok(false)) => {}
            // An error or a slow tier: compute here, as for any miss.
            _ => return Claim::Compute(None),
        }
        let until = Instant::now() + wait;
        while Instant::now() < until {
            tokio::time::sleep(FLEET_POLL).await;
            if let Some(outputs) = shared.get(value.clone(), max_elements).await {
                self.fleet_answered.fetch_add(1, Relaxed);
                return Claim::Answered(self.keep(key, outputs, tenant));
            }
        }
        self.fleet_missed.fetch_add(1, Relaxed);
        Claim::Compute(None)
    }

    /// Stores a response in tier 1 now (within `tenant`'s share) and queues it for tier 2.
    pub fn put(&self, key: Key, outputs: &[Tensor], tenant: Option<&str>) {
        if weight(outputs) > self.max_value_bytes {
            return;
        }
        self.keep(key, outputs.to_vec(), tenant);
        if let (Some(s), prefix) = self.place(tenant) {
            if !s.tier.put(shared_key(prefix, key), encode(outputs), self.ttl) {
                s.dropped.fetch_add(1, Relaxed);
            }
        }
    }

    /// The entry of `outputs`, kept in tier 1 unless its tenant holds its share already.
    fn keep(&self, key: Key, outputs: Vec<Tensor>, tenant: Option<&str>) -> Value {
        let tenant = tenant_id(tenant);
        let entry = Arc::new(Entry { tenant, outputs });
        if tenant != 0 {
            let w = weight(&entry.outputs) as u64;
            let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
            let mine = held.entry(tenant).or_default();
            if *mine + w > self.tenant_budget {
                self.over_share.fetch_add(1, Relaxed);
                return entry;
            }
            *mine += w;
        }
        self.local.insert(key, entry.clone());
        entry
    }

    pub fn snapshot(&self) -> CacheSnapshot {
        self.local.run_pending_tasks();
        let mut s = CacheSnapshot {
            local_entries: self.local.entry_count(),
            local_bytes: self.local.weighted_size(),
            local_budget_bytes: self.budget,
            local_over_share: self.over_share.load(Relaxed),
            hot_keys: self.heat.hot_keys(),
            fleet_answered: self.fleet_answered.load(Relaxed),
            fleet_missed: self.fleet_missed.load(Relaxed),
            redis: "off",
            ..Default::default()
        };
        // Summed over every shared tier; "ok" only while calls go through to all of them (a
        // breaker waiting for its probe does not).
        for r in self.tiers() {
            let ok = r.tier.connected() && r.breakers.iter().all(Breaker::is_closed);
            s.redis = if ok && s.redis != "degraded" { "ok" } else { "degraded" };
            s.redis_hits += r.hits.load(Relaxed);
            s.redis_misses += r.misses.load(Relaxed);
            s.redis_errors += r.errors.load(Relaxed) + r.tier.write_errors();
            s.redis_timeouts += r.timeouts.load(Relaxed);
            s.redis_writes_dropped += r.dropped.load(Relaxed);
            s.redis_bad_values += r.bad.load(Relaxed);
            s.redis_moved += r.tier.moved();
        }
        s
    }
}

impl Shared {
    fn new(tier: Arc<dyn SharedTier>, timeout: Duration) -> Shared {
        Shared {
            breakers: (0..tier.shards().max(1)).map(|_| Breaker::new(5, Duration::from_secs(1))).collect(),
            tier,
            timeout,
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            errors: AtomicU64::new(0),
            timeouts: AtomicU64::new(0),
            dropped: AtomicU64::new(0),
            bad: AtomicU64::new(0),
        }
    }

    /// One lookup, if connected and the breaker lets it through; an error, a timeout or a value
    /// that does not decode counts as a miss.
    async fn get(&self, key: String, max_elements: usize) -> Option<Vec<Tensor>> {
        let breaker = self.breaker(&key);
        if !self.tier.connected() || !breaker.allow(Instant::now()) {
            return None;
        }
        // If the request carrying this call is cancelled mid-lookup, the call has no outcome:
        // the guard frees the breaker's probe, so a half-open breaker is not stuck waiting for it.
        struct Probe<'b>(&'b Breaker, bool);
        impl Drop for Probe<'_> {
            fn drop(&mut self) {
                if !self.1 {
                    self.0.abandon();
                }
            }
        }
        let mut call = Probe(breaker, false);
        let found = tokio::time::timeout(self.timeout, self.tier.get(&key)).await;
        call.1 = true;
        let found = match found {
            Ok(Ok(v)) => {
                breaker.success();
                v
            }
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "shared cache error");
                self.failed(breaker);
                return None;
            }
            Err(_) => {
                self.timeouts.fetch_add(1, Relaxed);
                self.failed(breaker);
                return None;
            }
        };
        match found.map(|v| decode(Bytes::from(v), max_elements)) {
            Some(Ok(tensors)) => {
                self.hits.fetch_add(1, Relaxed);
                Some(tensors)
            }
            Some(Err(e)) => {
                tracing::warn!(error = %e, "a shared cache value failed its checks; removed");
                self.bad.fetch_add(1, Relaxed);
                self.tier.remove(key);
                None
            }
            None => {
                self.misses.fetch_add(1, Relaxed);
                None
            }
        }
    }

    /// The breaker of the part of the tier `key` lives in.
    fn breaker(&self, key: &str) -> &Breaker {
        &self.breakers[self.tier.shard(key) % self.breakers.len()]
    }

    fn failed(&self, breaker: &Breaker) {
        metrics::global().redis_errors.inc();
        self.errors.fetch_add(1, Relaxed);
        breaker.failure(Instant::now());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{DataType, TensorData};
    use bytes::Bytes;

    fn t(name: &str, v: &[f32]) -> Tensor {
        Tensor::from_le(name, DataType::Fp32, vec![1, v.len()], v)
    }

    #[test]
    fn keys_differ_for_every_part_of_the_request() {
        let base = key(None, "m", 1, 0, &[t("x", &[1.0, 2.0])], None);
        assert_eq!(base, key(None, "m", 1, 0, &[t("x", &[1.0, 2.0])], None));
        assert_ne!(base, key(None, "n", 1, 0, &[t("x", &[1.0, 2.0])], None));
        assert_ne!(base, key(None, "m", 2, 0, &[t("x", &[1.0, 2.0])], None));
        assert_ne!(base, key(None, "m", 1, 7, &[t("x", &[1.0, 2.0])], None), "a replaced model file");
        assert_ne!(base, key(None, "m", 1, 0, &[t("y", &[1.0, 2.0])], None));
        assert_ne!(base, key(None, "m", 1, 0, &[t("x", &[1.0, 2.5])], None));
        assert_ne!(base, key(None, "m", 1, 0, &[t("x", &[1.0, 2.0])], Some(&[0])));
        // Each tenant's answers are its own; "" (no tenant named) is a tenant too, apart from
        // a model shared by every tenant (None).
        let of = |tenant| key(tenant, "m", 1, 0, &[t("x", &[1.0, 2.0])], None);
        assert_ne!(of(Some("a")), of(Some("b")));
        assert_ne!(of(Some("")), base);
        assert_ne!(of(Some("ab")), key(Some("a"), "bm", 1, 0, &[t("x", &[1.0, 2.0])], None));
        assert_ne!(
            key(None, "m", 1, 0, &[t("x", &[1.0, 2.0])], Some(&[0])),
            key(None, "m", 1, 0, &[t("x", &[1.0, 2.0])], Some(&[1]))
        );
        let mut reshaped = t("x", &[1.0, 2.0]);
        reshaped.shape = vec![2, 1];
        assert_ne!(base, key(None, "m", 1, 0, &[reshaped], None));
        let s = |items: &[&'static [u8]]| {
            Tensor::new(
                "s",
                DataType::Bytes,
                vec![items.len()],
                TensorData::Strings(items.iter().map(|b| Bytes::from_static(b)).collect()),
            )
        };
        assert_ne!(key(None, "m", 1, 0, &[s(&[b"ab", b"c"])], None), key(None, "m", 1, 0, &[s(&[b"a", b"bc"])], None));
    }

    #[test]
    fn values_round_trip_and_corruption_is_an_error() {
        let outs = vec![
            t("y", &[1.0, f32::NAN]),
            Tensor::new(
                "s",
                DataType::Bytes,
                vec![2],
                TensorData::Strings(vec![Bytes::from_static(b"hi"), Bytes::new()]),
            ),
        ];
        let enc = encode(&outs);
        let dec = decode(Bytes::from(enc.clone()), 1 << 20).unwrap();
        assert_eq!(dec[1], outs[1]);
        assert_eq!(dec[0].data.to_wire(), outs[0].data.to_wire());
        for cut in [0, 3, 10, enc.len() - 1] {
            assert!(decode(Bytes::from(enc[..cut].to_vec()), 1 << 20).is_err(), "cut at {cut}");
        }
    }

    #[test]
    fn a_forged_value_whose_sizes_wrap_is_refused() {
        // One FP64 tensor claiming shape [1, 2^61 + 2] with 16 bytes: 8 x (2^61 + 2) wraps to 16.
        let mut v = Vec::new();
        v.extend_from_slice(&1u32.to_le_bytes());
        v.extend_from_slice(&1u32.to_le_bytes());
        v.push(b'y');
        v.push(DataType::ALL.iter().position(|&d| d == DataType::Fp64).unwrap() as u8);
        v.extend_from_slice(&2u32.to_le_bytes());
        v.extend_from_slice(&1u64.to_le_bytes());
        v.extend_from_slice(&((1u64 << 61) + 2).to_le_bytes());
        v.extend_from_slice(&16u64.to_le_bytes());
        v.extend_from_slice(&[0u8; 16]);
        assert!(decode(Bytes::from(v.clone()), usize::MAX).is_err(), "the product is checked");
        assert!(decode(Bytes::from(v), 1 << 23).is_err(), "and bounded by the element cap");
    }

    /// A shared tier in memory whose lookups can be made to hang.
    #[derive(Default)]
    struct FakeTier {
        values: std::sync::Mutex<std::collections::HashMap<String, Vec<u8>>>,
        hang: std::sync::atomic::AtomicBool,
        removed: std::sync::Mutex<Vec<String>>,
    }

    impl SharedTier for FakeTier {
        fn get(&self, key: &str) -> TierFuture<'_, Option<Vec<u8>>> {
            let v = self.values.lock().unwrap().get(key).cloned();
            let hang = self.hang.load(Relaxed);
            Box::pin(async move {
                if hang {
                    std::future::pending::<()>().await;
                }
                Ok(v)
            })
        }
        fn put(&self, key: String, value: Vec<u8>, _ttl: Duration) -> bool {
            self.values.lock().unwrap().insert(key, value);
            true
        }
        fn remove(&self, key: String) -> bool {
            self.values.lock().unwrap().remove(&key);
            self.removed.lock().unwrap().push(key);
            true
        }
        fn connected(&self) -> bool {
            true
        }
        fn write_errors(&self) -> u64 {
            0
        }
    }

    #[tokio::test]
    async fn a_pinned_tenant_reads_and_writes_only_its_own_pool() {
        let (default, own, prefixed) = (Arc::new(FakeTier::default()), Arc::new(FakeTier::default()), "globex");
        let cache = ResponseCache::new(&CacheOptions::default(), Some(default.clone()))
            .with_pool("acme", Some(own.clone()), Some("acme"))
            .with_pool(prefixed, None, Some(prefixed));
        let k = key(None, "m", 1, 0, &[t("x", &[1.0])], None);
        for tenant in [Some("acme"), Some("globex"), Some("initech"), None] {
            cache.put(k, &[t("y", &[2.0])], tenant);
        }
        let names = |tier: &FakeTier| {
            let mut v: Vec<String> = tier.values.lock().unwrap().keys().cloned().collect();
            v.sort();
            v
        };
        assert_eq!(names(&own), vec![shared_key("acme", k)]);
        assert_eq!(names(&default), vec![shared_key("", k), shared_key("globex", k)]);
        assert!(shared_key("acme", k).starts_with("acme:ferrite:"));
        // acme's lookups go to its own tier only: a value in the default tier is not its hit.
        cache.local.invalidate_all();
        own.values.lock().unwrap().clear();
        assert!(cache.get(k, 1 << 20, Some("acme")).await.is_none());
        assert!(cache.get(k, 1 << 20, Some("initech")).await.is_some());
        assert_eq!(cache.snapshot().redis_hits, 1);
    }

    #[tokio::test]
    async fn a_bad_shared_value_is_dropped_from_the_tier_and_counted() {
        let tier = Arc::new(FakeTier::default());
        let cache = ResponseCache::new(&CacheOptions::default(), Some(tier.clone()));
        let k = key(None, "m", 1, 0, &[t("x", &[1.0])], None);
        tier.values.lock().unwrap().insert(shared_key("", k), vec![1, 2, 3]);
        assert!(cache.get(k, 1 << 20, None).await.is_none());
        assert_eq!(cache.snapshot().redis_bad_values, 1);
        assert_eq!(*tier.removed.lock().unwrap(), vec![shared_key("", k)]);
        // A good value is a hit, and promoted to tier 1.
        cache.put(k, &[t("y", &[2.0])], None);
        cache.local.invalidate(&k);
        assert_eq!(cache.get(k, 1 << 20, None).await.unwrap().outputs[0], t("y", &[2.0]));
    }

    /// A cluster of two nodes, the first down: keys are on one or the other by their last digit.
    #[derive(Default)]
    struct HalfDown(std::sync::Mutex<std::collections::HashMap<String, Vec<u8>>>);

    impl SharedTier for HalfDown {
        fn get(&self, key: &str) -> TierFuture<'_, Option<Vec<u8>>> {
            let found = self.0.lock().unwrap().get(key).cloned();
            let down = self.shard(key) == 0;
            Box::pin(async move {
                if down {
                    Err("connection refused".into())
                } else {
                    Ok(found)
                }
            })
        }
        fn put(&self, key: String, value: Vec<u8>, _ttl: Duration) -> bool {
            self.0.lock().unwrap().insert(key, value);
            true
        }
        fn remove(&self, _key: String) -> bool {
            true
        }
        fn connected(&self) -> bool {
            true
        }
        fn write_errors(&self) -> u64 {
            0
        }
        fn shards(&self) -> usize {
            2
        }
        fn shard(&self, key: &str) -> usize {
            key.bytes().last().map_or(0, |b| (b % 2) as usize)
        }
    }

    #[tokio::test]
    async fn a_failing_node_opens_only_its_own_breaker() {
        let cache = ResponseCache::new(&CacheOptions::default(), Some(Arc::new(HalfDown::default())));
        let keys: Vec<Key> = (0..64).map(|i| key(None, "m", 1, 0, &[t("x", &[i as f32])], None)).collect();
        let on =
            |node: usize| keys.iter().copied().filter(move |k| HalfDown::default().shard(&shared_key("", *k)) == node);
        for k in keys.iter().copied() {
            cache.put(k, &[t("y", &[1.0])], None);
            cache.local.invalidate(&k);
        }
        // The down node's lookups fail until its breaker opens; the other node's still hit.
        for k in on(0) {
            assert!(cache.get(k, 1 << 20, None).await.is_none());
        }
        let shared = cache.shared.as_ref().unwrap();
        assert!(!shared.breakers[0].is_closed() && shared.breakers[1].is_closed());
        let up: Vec<Key> = on(1).collect();
        assert!(!up.is_empty());
        for k in &up {
            cache.local.invalidate(k);
            assert!(cache.get(*k, 1 << 20, None).await.is_some(), "a healthy node's key is still a hit");
        }
        assert_eq!(cache.snapshot().redis, "degraded");
        assert_eq!(cache.snapshot().redis_hits, up.len() as u64);
    }

    #[tokio::test]
    async fn a_probe_whose_request_is_cancelled_does_not_stick_the_breaker() {
        let tier = Arc::new(FakeTier::default());
        let options = CacheOptions { shared_timeout: Duration::from_secs(30), ..Default::default() };
        let cache = Arc::new(ResponseCache::new(&options, Some(tier.clone())));
        let shared = cache.shared.as_ref().unwrap();
        // Open the breaker, and let its cooldown pass.
        let past = Instant::now() - Duration::from_secs(10);
        for _ in 0..5 {
            shared.breakers[0].failure(past);
        }
        assert!(!shared.breakers[0].is_closed());
        // The probe's request is cancelled mid-lookup (client gone): the lookup hangs, then drops.
        tier.hang.store(true, Relaxed);
        let k = key(None, "m", 1, 0, &[t("x", &[1.0])], None);
        let probe = tokio::time::timeout(Duration::from_millis(50), cache.get(k, 1 << 20, None)).await;
        assert!(probe.is_err(), "the lookup was cancelled");
        assert_eq!(cache.snapshot().redis, "degraded", "no probe succeeded yet");
        // The tier is back: the next request probes, succeeds and closes the breaker.
        tier.hang.store(false, Relaxed);
        cache.put(k, &[t("y", &[2.0])], None);
        cache.local.invalidate(&k);
        assert!(cache.get(k, 1 << 20, None).await.is_some());
        assert!(shared.breakers[0].is_closed());
        assert_eq!(cache.snapshot().redis, "ok");
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
        let cache = ResponseCache::new(&CacheOptions { local_bytes: 64 * 1024, ..Default::default() }, None);
        let k = key(None, "m", 1, 0, &[t("x", &[1.0])], None);
        assert!(cache.get(k, 1 << 20, None).await.is_none());
        cache.put(k, &[t("y", &[3.0])], None);
        assert_eq!(cache.get(k, 1 << 20, None).await.unwrap().outputs[0], t("y", &[3.0]));
        for i in 0..2000 {
            let k = key(None, "m", 1, 0, &[t("x", &[i as f32])], None);
            cache.put(k, &[t("y", &vec![0.5; 256])], None);
        }
        let s = cache.snapshot();
        assert!(s.local_bytes <= 64 * 1024, "{s:?}");
        assert!(s.local_entries > 0 && s.redis == "off");
    }

    #[tokio::test]
    async fn one_tenant_cannot_take_more_than_its_share_of_the_local_tier() {
        let cache = ResponseCache::new(&CacheOptions { local_bytes: 256 * 1024, ..Default::default() }, None);
        let value = [t("y", &vec![0.5; 256])];
        let bob: Vec<Key> = (0..20).map(|i| key(Some("bob"), "m", 1, 0, &[t("x", &[i as f32])], None)).collect();
        for &k in &bob {
            cache.put(k, &value, Some("bob"));
            for _ in 0..5 {
                assert!(cache.get(k, 1 << 20, Some("bob")).await.is_some());
            }
        }
        for i in 0..5000 {
            let k = key(Some("alice"), "m", 1, 0, &[t("x", &[i as f32])], None);
            cache.put(k, &value, Some("alice"));
        }
        cache.local.run_pending_tasks();
        let mut kept = 0;
        for &k in &bob {
            kept += cache.get(k, 1 << 20, Some("bob")).await.is_some() as usize;
        }
        assert_eq!(kept, 20, "bob's entries survive alice's flood");
        let s = cache.snapshot();
        assert!(s.local_over_share > 0 && s.local_bytes <= 256 * 1024, "{s:?}");
        // Alice's entries expire or go, and her share frees: the accounting follows evictions.
        cache.local.invalidate_all();
        cache.local.run_pending_tasks();
        assert!(cache.held.lock().unwrap().is_empty());
    }
    #[tokio::test]
    async fn a_miss_is_led_once_and_followers_take_the_answer_or_are_released() {
        let cache = ResponseCache::new(&CacheOptions::default(), None);
        let Flight::Lead(leader) = cache.join(1) else { panic!("the first request leads") };
        let Flight::Follow(first) = cache.join(1) else { panic!("an identical one follows") };
        let Flight::Follow(second) = cache.join(1) else { panic!("so does the next") };
        assert!(matches!(cache.join(2), Flight::Lead(_)), "another key leads its own flight");
        let waiting = tokio::spawn(follow(first));
        leader.finish(&[t("y", &[3.0])]);
        let answer = waiting.await.unwrap().expect("the leader's answer");
        assert_eq!(answer.outputs[0].data.wire_len(), 4);
        // The leader finished and left: a follower that joined before still gets the answer, a
        // request arriving now leads anew (its lookup would have hit the cache).
        assert!(follow(second).await.is_some());
        let Flight::Lead(leader) = cache.join(1) else { panic!("the flight ended with its leader") };
        let Flight::Follow(follower) = cache.join(1) else { panic!("follows") };
        drop(leader);
        assert!(follow(follower).await.is_none(), "a leader leaving without an answer releases its followers");
        assert!(cache.flights.lock().unwrap().is_empty());
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
            let _ = super::value::decode(bytes::Bytes::from(v), 1 << 20);
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
            if let Ok(cfg) = toml::from_str::<crate::control::config::ModelConfig>(&text) {
                let io = [crate::engine::spec::TensorSpec { name: "x".into(), datatype: crate::DataType::Fp32, dims: vec![-1, 4] }];
                let _ = crate::engine::spec::ModelSpec::resolve("m", 1, &cfg, &io, &io, 1);
            }
        }
    }
}
