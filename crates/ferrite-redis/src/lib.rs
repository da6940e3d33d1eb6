//! Redis as the shared tier of the response cache. The connection is made (and remade) in the
//! background, so a Redis that is down at start-up or later only makes the cache degraded; writes
//! go through a bounded queue, off the request path.

use std::{
    sync::{
        atomic::{AtomicU64, Ordering::Relaxed},
        Arc, Mutex,
    },
    time::Duration,
};

use ferrite_core::cache::{SharedTier, TierFuture};
use redis::aio::ConnectionManager;
use tokio::sync::mpsc;

/// Writes waiting for Redis; past this, new writes are dropped (and counted by the cache).
const WRITE_QUEUE: usize = 1024;

enum Write {
    Set(String, Vec<u8>, Duration),
    Del(String),
}

pub struct RedisTier {
    conn: Arc<Mutex<Option<ConnectionManager>>>,
    writes: mpsc::Sender<Write>,
    write_errors: Arc<AtomicU64>,
}

impl RedisTier {
    /// Connects to `url` in the background and starts the writer, which gives each write at most
    /// `write_timeout`. Must run inside a tokio runtime; fails only on a malformed URL.
    pub fn start(url: &str, write_timeout: Duration) -> Result<Arc<RedisTier>, String> {
        let client = redis::Client::open(url).map_err(|e| format!("--cache-redis-url: {e}"))?;
        let (writes, mut queue) = mpsc::channel::<Write>(WRITE_QUEUE);
        let tier =
            Arc::new(RedisTier { conn: Arc::new(Mutex::new(None)), writes, write_errors: Arc::new(AtomicU64::new(0)) });
        let conn = tier.conn.clone();
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
                        *conn.lock().unwrap_or_else(|e| e.into_inner()) = Some(m);
                        return;
                    }
                    Ok(Err(e)) => tracing::warn!(error = %e, "redis cache unavailable; retrying"),
                    Err(_) => tracing::warn!("redis cache connection timed out; retrying"),
                }
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(5));
            }
        });
        let (conn, errors) = (tier.conn.clone(), tier.write_errors.clone());
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
                let done = cmd.query_async::<()>(&mut c);
                if !matches!(tokio::time::timeout(write_timeout, done).await, Ok(Ok(()))) {
                    errors.fetch_add(1, Relaxed);
                }
            }
        });
        Ok(tier)
    }

    fn connection(&self) -> Option<ConnectionManager> {
        self.conn.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

impl SharedTier for RedisTier {
    fn get(&self, key: &str) -> TierFuture<'_, Option<Vec<u8>>> {
        let conn = self.connection();
        let mut cmd = redis::cmd("GET");
        cmd.arg(key);
        Box::pin(async move {
            let mut conn = conn.ok_or_else(|| "not connected".to_string())?;
            cmd.query_async::<Option<Vec<u8>>>(&mut conn).await.map_err(|e| e.to_string())
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
        self.write_errors.load(Relaxed)
    }
}
