//! Model configs from etcd (`--config-source etcd://host:port/prefix`).
//!
//! Each key `<prefix>/models/<name>` holds a model's config in the `config.toml` format (its
//! `[canary]` section included); it replaces that model's `config.toml`. The whole prefix is read
//! in one range request, which etcd answers at a single revision, and applied in one swap: a
//! change of several keys in one transaction is applied whole or not at all. A watch on the
//! prefix triggers the next read. When etcd cannot be reached, the last applied configs keep
//! serving and the connection is retried with backoff.

use std::{collections::BTreeMap, time::Duration};

use ferrite_core::Core;
use tokio_stream::StreamExt;

pub mod pb {
    tonic::include_proto!("etcdserverpb");
}

/// `etcd://host:port/prefix` split into the endpoint and the key prefix (with a trailing `/`).
pub fn parse(source: &str) -> anyhow::Result<(String, String)> {
    let rest = source
        .strip_prefix("etcd://")
        .ok_or_else(|| anyhow::anyhow!("--config-source must look like etcd://host:port/prefix"))?;
    let (host, prefix) = rest.split_once('/').unwrap_or((rest, ""));
    if host.is_empty() {
        anyhow::bail!("--config-source {source}: no host");
    }
    let prefix = prefix.trim_matches('/');
    let prefix = if prefix.is_empty() { "/".to_string() } else { format!("/{prefix}/") };
    Ok((format!("http://{host}"), prefix))
}

/// The end of the key range holding every key that starts with `prefix`.
fn range_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

/// A connection to the config source, with the configs read at start-up.
pub struct Source {
    watcher: Watcher,
    first: Snapshot,
}

impl Source {
    /// Connects and reads the configs once; start-up fails if etcd cannot be read.
    pub async fn connect(source: &str) -> anyhow::Result<Source> {
        let (endpoint, prefix) = parse(source)?;
        let channel = tonic::transport::Endpoint::from_shared(endpoint)?
            .connect_timeout(Duration::from_secs(3))
            .timeout(Duration::from_secs(10))
            .connect_lazy();
        let watcher = Watcher { channel, prefix: format!("{prefix}models/") };
        let first = watcher
            .read()
            .await
            .map_err(|e| anyhow::anyhow!("--config-source {source}: cannot read the configs: {e}"))?;
        Ok(Source { watcher, first })
    }

    /// The configs read at start-up: each model's config text.
    pub fn initial(&self) -> BTreeMap<String, String> {
        tracing::info!(revision = self.first.revision, models = self.first.configs.len(), "configs read from etcd");
        ferrite_core::telemetry::metrics::global().config_revision.set(self.first.revision);
        self.first.texts()
    }

    /// Keeps `core`'s configs in step with etcd from now on (`core` was opened with `initial`).
    pub fn follow(self, core: Core) {
        let Source { watcher, first } = self;
        let mut applied = first.configs;
        tokio::spawn(async move {
            let mut backoff = Duration::from_millis(200);
            loop {
                match watcher.follow(&core, &mut applied).await {
                    Ok(()) => backoff = Duration::from_millis(200),
                    Err(e) => {
                        let retry_in_ms = backoff.as_millis() as u64;
                        tracing::warn!(error = %e, retry_in_ms, "config source unreachable; serving the last configs");
                        tokio::time::sleep(backoff).await;
                        backoff = (backoff * 2).min(Duration::from_secs(10));
                    }
                }
            }
        });
    }
}

struct Watcher {
    channel: tonic::transport::Channel,
    /// `<prefix>models/`
    prefix: String,
}

/// One consistent read: the store revision and every key's (mod revision, value).
struct Snapshot {
    revision: i64,
    configs: BTreeMap<String, (i64, String)>,
}

impl Snapshot {
    fn texts(&self) -> BTreeMap<String, String> {
        self.configs.iter().map(|(k, (_, v))| (k.clone(), v.clone())).collect()
    }
}

impl Watcher {
    async fn read(&self) -> Result<Snapshot, tonic::Status> {
        let mut kv = pb::kv_client::KvClient::new(self.channel.clone());
        let key = self.prefix.as_bytes().to_vec();
        let resp = kv.range(pb::RangeRequest { range_end: range_end(&key), key, limit: 0, revision: 0 }).await?;
        let resp = resp.into_inner();
        let mut configs = BTreeMap::new();
        for kv in resp.kvs {
            let key = String::from_utf8_lossy(&kv.key).to_string();
            let Some(name) = key.strip_prefix(&self.prefix).filter(|n| !n.contains('/')) else { continue };
            match String::from_utf8(kv.value) {
                Ok(text) => {
                    configs.insert(name.to_string(), (kv.mod_revision, text));
                }
                Err(_) => tracing::warn!(key, "config source: value is not UTF-8; ignored"),
            }
        }
        Ok(Snapshot { revision: resp.header.map_or(0, |h| h.revision), configs })
    }

    /// Applies `snap` to `core` and returns what is applied now.
    async fn apply(&self, core: &Core, snap: Snapshot) -> BTreeMap<String, (i64, String)> {
        let core = core.clone();
        let configs = snap.texts();
        let revision = snap.revision;
        // Loading models blocks; keep it off the async threads.
        let applied = tokio::task::spawn_blocking(move || core.apply_configs(revision, configs)).await;
        let m = ferrite_core::telemetry::metrics::global();
        match applied {
            Ok(Ok(())) => m.config_revision.set(revision),
            // Refused whole (logged with its reason): the previous configs go on serving.
            _ => m.config_refused_revision.set(revision),
        }
        snap.configs
    }

    /// Watches the prefix from the applied state on; returns when the watch ends.
    async fn follow(&self, core: &Core, applied: &mut BTreeMap<String, (i64, String)>) -> Result<(), tonic::Status> {
        // Catch up first: changes made while the watch was down.
        let snap = self.read().await?;
        let start = snap.revision + 1;
        if snap.configs != *applied {
            *applied = self.apply(core, snap).await;
        }
        let key = self.prefix.as_bytes().to_vec();
        let create = pb::WatchRequest {
            request_union: Some(pb::watch_request::RequestUnion::CreateRequest(pb::WatchCreateRequest {
                range_end: range_end(&key),
                key,
                start_revision: start,
                progress_notify: true,
            })),
        };
        let (tx, rx) = tokio::sync::mpsc::channel(1);
        let _ = tx.send(create).await;
        let mut watch = pb::watch_client::WatchClient::new(self.channel.clone());
        let mut stream = watch.watch(tokio_stream::wrappers::ReceiverStream::new(rx)).await?.into_inner();
        while let Some(msg) = stream.next().await {
            let msg = msg?;
            if msg.canceled {
                return Err(tonic::Status::aborted(format!("watch cancelled: {}", msg.cancel_reason)));
            }
            if msg.events.is_empty() {
                continue;
            }
            // Events of one transaction arrive together; read the whole prefix at (or after)
            // that revision so the change is applied whole.
            let snap = self.read().await?;
            if snap.configs != *applied {
                *applied = self.apply(core, snap).await;
            }
        }
        drop(tx);
        Err(tonic::Status::unavailable("the watch stream ended"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sources_and_ranges() {
        assert_eq!(
            parse("etcd://127.0.0.1:2379/ferrite").unwrap(),
            ("http://127.0.0.1:2379".into(), "/ferrite/".into())
        );
        assert_eq!(parse("etcd://h:1").unwrap().1, "/");
        assert!(parse("http://h:1/x").is_err());
        assert!(parse("etcd:///x").is_err());
        assert_eq!(range_end(b"/a/"), b"/a0".to_vec());
        assert_eq!(range_end(&[b'a', 0xff]), b"b".to_vec());
    }
}
