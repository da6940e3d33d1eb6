//! The shared (second) tier of the response cache: a store other processes read too. The core
//! only defines what it needs of one; the server and the Python package provide Redis.

use std::{
    future::Future,
    pin::Pin,
    sync::{
        atomic::{AtomicBool, AtomicU32, Ordering::Relaxed},
        Mutex,
    },
    time::{Duration, Instant},
};

/// What a shared-tier call returns: the value, or the error's text.
pub type TierFuture<'a, T> = Pin<Box<dyn Future<Output = std::result::Result<T, String>> + Send + 'a>>;

/// A key-value store shared between processes. The cache bounds every lookup by a timeout and
/// guards them with a [`Breaker`]; the tier only does the I/O.
pub trait SharedTier: Send + Sync {
    /// The value stored under `key`, if any.
    fn get(&self, key: &str) -> TierFuture<'_, Option<Vec<u8>>>;
    /// Queues a write of `value` under `key`, to live `ttl`, done off the request path. False
    /// when the tier's write queue is full and the write was dropped.
    fn put(&self, key: String, value: Vec<u8>, ttl: Duration) -> bool;
    /// Queues the removal of `key` (a value that failed its checks), like `put`.
    fn remove(&self, key: String) -> bool;
    /// Whether the tier has a connection now.
    fn connected(&self) -> bool;
    /// Writes that failed so far.
    fn write_errors(&self) -> u64;
    /// Replies that said the key lives on another node (a cluster node addressed as one server).
    fn moved(&self) -> u64 {
        0
    }
    /// How many parts the tier's keys fall into that fail apart (a cluster's nodes); the cache
    /// keeps a breaker for each, so one node down does not take the others' keys off the tier.
    fn shards(&self) -> usize {
        1
    }
    /// The part `key` falls into, below [`shards`](SharedTier::shards).
    fn shard(&self, key: &str) -> usize {
        let _ = key;
        0
    }
    /// Takes `key` for `ttl` unless another process holds it (Redis `SET NX PX`): true when this
    /// one took it. A tier that cannot tell says true (every process then computes its own).
    fn claim(&self, key: String, ttl: Duration) -> TierFuture<'_, bool> {
        let _ = (key, ttl);
        Box::pin(async { Ok(true) })
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

    /// Closed: calls go through. Open or half-open (waiting for a probe to succeed): not.
    pub fn is_closed(&self) -> bool {
        self.until().is_none()
    }

    /// A probe that ended with no outcome (its request was cancelled): the next call probes.
    pub fn abandon(&self) {
        self.probing.store(false, Relaxed);
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
