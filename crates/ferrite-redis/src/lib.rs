//! Redis as the shared tier of the response cache: one server (`redis://`), a Redis Cluster
//! (`redis+cluster://`, slots routed with MOVED/ASK and the topology refreshed by the `redis`
//! crate's cluster client) or a master found through Sentinel (`redis+sentinel://`, found again
//! after a failover). The connection is made (and remade) in the background, so a Redis that is
//! down at start-up or later only makes the cache degraded; writes go through a bounded queue, off
//! the request path.

use std::{
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering::Relaxed},
        Arc, Mutex,
    },
    time::Duration,
};

use ferrite_core::cache::{SharedTier, TierFuture};
use redis::{aio::ConnectionManager, cluster::ClusterClient, cluster_async::ClusterConnection, RedisError};
use tokio::sync::{mpsc, Notify};

/// Writes waiting for Redis; past this, new writes are dropped (and counted by the cache).
const WRITE_QUEUE: usize = 1024;
/// The longest one connection or one reply may take inside the client.
const CALL_TIMEOUT: Duration = Duration::from_secs(1);

enum Write {
    Set(String, Vec<u8>, Duration),
    Del(String),
}

/// Where the tier's Redis is, as `--cache-redis-url` says.
enum Target {
    Single(redis::Client),
    Cluster(ClusterClient),
    /// The sentinels, asked for the master of the named service at each (re)connection.
    Sentinel(tokio::sync::Mutex<redis::sentinel::SentinelClient>),
}

#[derive(Clone)]
enum Conn {
    /// One server, or the master Sentinel named (reconnected to the same address on errors).
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

impl Conn {
    async fn query<T: redis::FromRedisValue>(&mut self, cmd: &redis::Cmd) -> redis::RedisResult<T> {
        match self {
            Conn::Single(c) => cmd.query_async(c).await,
            Conn::Cluster(c) => cmd.query_async(c).await,
        }
    }
}

fn manager_config() -> redis::aio::ConnectionManagerConfig {
    redis::aio::ConnectionManagerConfig::new()
        .set_connection_timeout(Some(CALL_TIMEOUT))
        .set_response_timeout(Some(CALL_TIMEOUT))
        .set_number_of_retries(1)
}

impl Target {
    /// Parses `--cache-redis-url`: `redis://…` or `unix://…` (one server),
    /// `redis+cluster://[user:password@]host:port[,host:port…]` (any nodes of the cluster) or
    /// `redis+sentinel://[user:password@]host:port[,host:port…]/<service>` (the sentinels; the
    /// credentials are the master's).
    fn parse(url: &str) -> Result<Target, String> {
        let bad = |e: &dyn std::fmt::Display| format!("{url:?}: {e}");
        let hosts = |rest: &str| -> Result<(String, Vec<String>), String> {
            let (auth, hosts) = match rest.rsplit_once('@') {
                Some((auth, hosts)) => (format!("{auth}@"), hosts),
                None => (String::new(), rest),
            };
            let nodes: Vec<String> = hosts.split(',').filter(|h| !h.is_empty()).map(str::to_string).collect();
            if nodes.is_empty() {
                return Err(bad(&"no host:port given"));
            }
            Ok((auth, nodes))
        };
        if let Some(rest) = url.strip_prefix("redis+cluster://") {
            let (auth, nodes) = hosts(rest.trim_end_matches('/'))?;
            let nodes: Vec<String> = nodes.iter().map(|n| format!("redis://{auth}{n}")).collect();
            let client = ClusterClient::builder(nodes)
                .connection_timeout(CALL_TIMEOUT)
                .response_timeout(CALL_TIMEOUT)
                .retries(2)
                .build()
                .map_err(|e| bad(&e))?;
            return Ok(Target::Cluster(client));
        }
        if let Some(rest) = url.strip_prefix("redis+sentinel://") {
            let (rest, service) =
                rest.split_once('/').ok_or_else(|| bad(&"name the master's service: .../<service>"))?;
            let service = service.trim_end_matches('/');
            if service.is_empty() {
                return Err(bad(&"name the master's service: .../<service>"));
            }
            let (auth, nodes) = hosts(rest)?;
            let master = if auth.is_empty() {
                None
            } else {
                let info: redis::ConnectionInfo =
                    redis::IntoConnectionInfo::into_connection_info(format!("redis://{auth}localhost"))
                        .map_err(|e| bad(&e))?;
                Some(
                    redis::sentinel::SentinelNodeConnectionInfo::default()
                        .set_redis_connection_info(info.redis_settings().clone()),
                )
            };
            let sentinels: Vec<String> = nodes.iter().map(|n| format!("redis://{n}")).collect();
            let client = redis::sentinel::SentinelClient::build(
                sentinels,
                service.to_string(),
                master,
                redis::sentinel::SentinelServerType::Master,
            )
            .map_err(|e| bad(&e))?;
            return Ok(Target::Sentinel(tokio::sync::Mutex::new(client)));
        }
        if url.starts_with("rediss") || url.contains("+cluster") || url.contains("+sentinel") {
            return Err(bad(&"TLS to Redis is not supported; use redis://, redis+cluster:// or redis+sentinel://"));
        }
        redis::Client::open(url).map(Target::Single).map_err(|e| bad(&e))
    }

    async fn connect(&self) -> redis::RedisResult<Conn> {
        match self {
            Target::Single(client) => {
                Ok(Conn::Single(ConnectionManager::new_with_config(client.clone(), manager_config()).await?))
            }
            Target::Cluster(client) => Ok(Conn::Cluster(client.get_async_connection().await?)),
            Target::Sentinel(sentinel) => {
                let master = sentinel.lock().await.async_get_client().await?;
                Ok(Conn::Single(ConnectionManager::new_with_config(master, manager_config()).await?))
            }
        }
    }

    fn describe(&self) -> &'static str {
        match self {
            Target::Single(_) => "server",
            Target::Cluster(_) => "cluster",
            Target::Sentinel(_) => "master (from sentinel)",
        }
    }
}

/// A Redis Cluster's hash slots, and the ranges of them the cache keeps a breaker for: the
/// cluster gives each master contiguous ranges, so a node that fails opens only its own.
const SLOTS: usize = 16384;
const SLOT_RANGES: usize = 64;

/// The hash slot of `key` (CRC16-XMODEM of its hash tag, or of the whole key, mod 16384).
fn slot(key: &str) -> u16 {
    let b = key.as_bytes();
    let tagged = b.iter().position(|&c| c == b'{').and_then(|open| {
        let rest = &b[open + 1..];
        rest.iter().position(|&c| c == b'}').filter(|&close| close > 0).map(|close| &rest[..close])
    });
    (crc16::State::<crc16::XMODEM>::calculate(tagged.unwrap_or(b)) as usize % SLOTS) as u16
}

pub struct RedisTier {
    /// This process's name in the locks it takes: random, as process ids repeat across pods.
    id: u64,
    cluster: bool,
    conn: Arc<Mutex<Option<Conn>>>,
    writes: mpsc::Sender<Write>,
    counts: Arc<Counts>,
}

#[derive(Default)]
struct Counts {
    write_errors: AtomicU64,
    moved: AtomicU64,
    said_moved: AtomicBool,
    /// Set for a Sentinel target: errors that may mean a failover make it ask again.
    find_again: Option<Notify>,
}

impl Counts {
    /// Looks at a failed call: a MOVED or ASK reply from a plain `redis://` target means it is
    /// one node of a cluster and most keys live elsewhere (counted, and said once in the log); a
    /// lost connection or a read-only reply from a Sentinel's master may mean it failed over.
    fn failed(&self, e: &RedisError) {
        use redis::{ErrorKind, ServerErrorKind};
        let kind = e.kind();
        if matches!(kind, ErrorKind::Server(ServerErrorKind::Moved | ServerErrorKind::Ask)) {
            self.moved.fetch_add(1, Relaxed);
            ferrite_core::telemetry::metrics::global().redis_moved.inc();
            if !self.said_moved.swap(true, Relaxed) {
                tracing::error!(
                    "the Redis cache answers MOVED: --cache-redis-url names one node of a Redis Cluster, so \
                     keys on its other nodes always miss; use redis+cluster://host:port[,host:port...]"
                );
            }
        }
        if let Some(find) = &self.find_again {
            if e.is_io_error()
                || e.is_connection_dropped()
                || e.is_timeout()
                || matches!(kind, ErrorKind::Server(ServerErrorKind::ReadOnly))
            {
                find.notify_one();
            }
        }
    }
}

impl RedisTier {
    /// Connects to `url` in the background and starts the writer, which gives each write at most
    /// `write_timeout`. Must run inside a tokio runtime; fails only on a malformed URL (the error
    /// quotes it; the caller names where it came from).
    pub fn start(url: &str, write_timeout: Duration) -> Result<Arc<RedisTier>, String> {
        let target = Target::parse(url)?;
        let (writes, mut queue) = mpsc::channel::<Write>(WRITE_QUEUE);
        let counts = Arc::new(Counts {
            find_again: matches!(target, Target::Sentinel(_)).then(Notify::new),
            ..Default::default()
        });
        let cluster = matches!(target, Target::Cluster(_));
        let id = {
            use std::hash::{BuildHasher, Hasher};
            std::collections::hash_map::RandomState::new().build_hasher().finish()
        };
        let tier =
            Arc::new(RedisTier { id, cluster, conn: Arc::new(Mutex::new(None)), writes, counts: counts.clone() });
        let conn = tier.conn.clone();
        let found = counts.clone();
        tokio::spawn(async move {
            let what = target.describe();
            let mut backoff = Duration::from_millis(100);
            loop {
                match tokio::time::timeout(Duration::from_secs(3), target.connect()).await {
                    Ok(Ok(c)) => {
                        tracing::info!(redis = what, "redis cache connected");
                        *conn.lock().unwrap_or_else(|e| e.into_inner()) = Some(c);
                        backoff = Duration::from_millis(100);
                        // One server and a cluster reconnect inside the client; a Sentinel's
                        // master is looked up again when calls to it say it may have changed.
                        let Some(find) = &found.find_again else { return };
                        find.notified().await;
                        tracing::warn!("redis cache master unreachable or read-only; asking the sentinels again");
                        continue;
                    }
                    Ok(Err(e)) => tracing::warn!(redis = what, error = %e, "redis cache unavailable; retrying"),
                    Err(_) => tracing::warn!(redis = what, "redis cache connection timed out; retrying"),
                }
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(5));
            }
        });
        let conn = tier.conn.clone();
        tokio::spawn(async move {
            while let Some(write) = queue.recv().await {
                let Some(mut c) = conn.lock().unwrap_or_else(|e| e.into_inner()).clone() else { continue };
                let cmd = match write {
                    Write::Set(key, value, ttl) => {
                        let mut cmd = redis::cmd("SET");
                        cmd.arg(key).arg(value).arg("PX").arg(ttl.as_millis() as u64);
                        cmd
                    }
                    Write::Del(key) => {
                        let mut cmd = redis::cmd("DEL");
                        cmd.arg(key);
                        cmd
                    }
                };
                match tokio::time::timeout(write_timeout, c.query::<()>(&cmd)).await {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => {
                        counts.failed(&e);
                        counts.write_errors.fetch_add(1, Relaxed);
                    }
                    Err(_) => {
                        counts.write_errors.fetch_add(1, Relaxed);
                    }
                }
            }
        });
        Ok(tier)
    }

    fn connection(&self) -> Option<Conn> {
        self.conn.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// MOVED or ASK replies seen from a `redis://` target (it is a cluster node).
    pub fn moved(&self) -> u64 {
        self.counts.moved.load(Relaxed)
    }
}

impl SharedTier for RedisTier {
    fn get(&self, key: &str) -> TierFuture<'_, Option<Vec<u8>>> {
        let conn = self.connection();
        let mut cmd = redis::cmd("GET");
        cmd.arg(key);
        Box::pin(async move {
            let mut conn = conn.ok_or_else(|| "not connected".to_string())?;
            conn.query::<Option<Vec<u8>>>(&cmd).await.map_err(|e| {
                self.counts.failed(&e);
                e.to_string()
            })
        })
    }

    fn put(&self, key: String, value: Vec<u8>, ttl: Duration) -> bool {
        self.writes.try_send(Write::Set(key, value, ttl)).is_ok()
    }

    fn remove(&self, key: String) -> bool {
        self.writes.try_send(Write::Del(key)).is_ok()
    }

    fn connected(&self) -> bool {
        self.conn.lock().unwrap_or_else(|e| e.into_inner()).is_some()
    }

    fn write_errors(&self) -> u64 {
        self.counts.write_errors.load(Relaxed)
    }

    fn moved(&self) -> u64 {
        RedisTier::moved(self)
    }

    fn shards(&self) -> usize {
        if self.cluster {
            SLOT_RANGES
        } else {
            1
        }
    }

    fn shard(&self, key: &str) -> usize {
        if self.cluster {
            slot(key) as usize * SLOT_RANGES / SLOTS
        } else {
            0
        }
    }

    fn claim(&self, key: String, ttl: Duration) -> TierFuture<'_, bool> {
        let conn = self.connection();
        let mut set = redis::cmd("SET");
        set.arg(&key).arg(self.id).arg("NX").arg("PX").arg(ttl.as_millis().max(1) as u64);
        let mut holder = redis::cmd("GET");
        holder.arg(&key);
        Box::pin(async move {
            let mut conn = conn.ok_or_else(|| "not connected".to_string())?;
            let failed = |e: RedisError| {
                self.counts.failed(&e);
                e.to_string()
            };
            // "OK" when set, nil when someone holds the key: another process, or this one (a
            // leader here whose release is still queued), which must not wait for itself.
            if conn.query::<Option<String>>(&set).await.map_err(failed)?.is_some() {
                return Ok(true);
            }
            let held_by = conn.query::<Option<u64>>(&holder).await.map_err(failed)?;
            Ok(held_by == Some(self.id))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_redis_clusters() {
        // Values from `CLUSTER KEYSLOT` on a real Redis 7.
        assert_eq!(slot("foo"), 12182);
        assert_eq!(slot("bar"), 5061);
        assert_eq!(slot("{user1000}.following"), 3443);
        assert_eq!(slot("user1000"), 3443);
        // An empty tag is no tag: the whole key counts.
        assert_eq!(slot("foo{}{bar}"), 8363);
        assert_eq!(slot("{}x"), 10595);
        assert_eq!(slot("ferrite:0123456789abcdef0123456789abcdef"), 8738);
    }

    #[test]
    fn urls_name_their_topology() {
        assert!(matches!(Target::parse("redis://127.0.0.1:6379/0"), Ok(Target::Single(_))));
        assert!(matches!(Target::parse("redis+cluster://a:7000,b:7001,c:7002"), Ok(Target::Cluster(_))));
        assert!(matches!(Target::parse("redis+cluster://user:pw@a:7000/"), Ok(Target::Cluster(_))));
        assert!(matches!(Target::parse("redis+sentinel://a:26379,b:26379/mymaster"), Ok(Target::Sentinel(_))));
        assert!(matches!(Target::parse("redis+sentinel://:pw@a:26379/mymaster"), Ok(Target::Sentinel(_))));
        for bad in ["redis+cluster://", "redis+sentinel://a:26379", "redis+sentinel://a:26379/", "rediss://a", "x://"] {
            assert!(Target::parse(bad).is_err(), "{bad}");
        }
    }
}
