//! Per-tenant admission: a token bucket (rate, burst) and a concurrency cap per tenant, so one
//! noisy tenant cannot starve the others. A tenant is named by a request header the front-ends
//! read (`--tenant-header`); limits come from a TOML file (`--tenant-config`):
//!
//! ```toml
//! [default]          # any tenant not listed, and requests that name none
//! rate = 100         # requests per second
//! burst = 200
//! max_concurrent = 32
//! highest_priority = 2 # the highest priority level its requests may ask for (1 is the highest)
//! [tenants.acme]
//! rate = 1000
//! cache_redis_url = "redis+cluster://10.0.0.7:7000"  # its cache entries in a Redis of its own
//! cache_key_prefix = "acme"                           # and/or under a key prefix of its own
//! ```

use std::{
    collections::{BTreeMap, HashMap},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use serde::Deserialize;

use crate::{Error, Result};

/// Distinct unlisted tenants tracked at once, so a client that invents tenant names cannot make
/// the server hold unbounded state. A full table first drops the entries that hold no state worth
/// keeping (nothing in flight, bucket refilled: the same as a new one); only while none can go do
/// new names share one bucket.
pub const MAX_TRACKED_TENANTS: usize = 10_000;
/// A full table is swept at most this often, so a flood of new names costs no scan per request.
const SWEEP_EVERY: Duration = Duration::from_millis(100);
/// Tenant names longer than this are refused.
pub const MAX_TENANT_NAME: usize = 128;

#[derive(Debug, Clone, Copy, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct TenantLimits {
    /// Requests per second, refilled continuously; 0: no rate limit.
    #[serde(default)]
    pub rate: f64,
    /// Requests allowed in a burst; defaults to one second's worth of `rate`.
    pub burst: Option<f64>,
    /// Requests of this tenant in the engine at once; 0: no limit.
    #[serde(default)]
    pub max_concurrent: usize,
    /// The highest priority level (1 is the highest) this tenant's requests may ask for: one
    /// asking for a higher level is queued at this one (`Core::infer`); 0: any, as in Triton.
    #[serde(default)]
    pub highest_priority: u32,
}

impl Default for TenantLimits {
    fn default() -> Self {
        TenantLimits { rate: 0.0, burst: None, max_concurrent: 0, highest_priority: 0 }
    }
}

/// Where a listed tenant's response-cache entries live in the shared tier, when not with
/// everyone else's: a Redis of its own (so its volume cannot evict theirs), a key prefix of its
/// own (for Redis ACLs such as `~acme:*`), or both.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CachePool {
    pub redis_url: Option<String>,
    pub key_prefix: Option<String>,
}

#[derive(Debug, Clone, Default)]
pub struct TenantConfig {
    pub default: TenantLimits,
    pub tenants: BTreeMap<String, TenantLimits>,
    /// The listed tenants whose cache entries live apart.
    pub cache_pools: BTreeMap<String, CachePool>,
}

/// One `[tenants.<name>]` table as written: its limits and where its cache entries live.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TenantTable {
    #[serde(default)]
    rate: f64,
    burst: Option<f64>,
    #[serde(default)]
    max_concurrent: usize,
    #[serde(default)]
    highest_priority: u32,
    cache_redis_url: Option<String>,
    cache_key_prefix: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TenantFile {
    #[serde(default)]
    default: TenantLimits,
    #[serde(default)]
    tenants: BTreeMap<String, TenantTable>,
}

impl TenantConfig {
    pub fn parse(text: &str) -> Result<TenantConfig> {
        let file: TenantFile = toml::from_str(text).map_err(|e| Error::invalid(format!("tenant config: {e}")))?;
        let mut config = TenantConfig { default: file.default, ..Default::default() };
        for (name, t) in file.tenants {
            if let Some(p) = &t.cache_key_prefix {
                let fits = !p.is_empty()
                    && p.len() <= 64
                    && p.bytes().all(|b| b.is_ascii_alphanumeric() || b"_-.".contains(&b));
                if !fits {
                    return Err(Error::invalid(format!(
                        "tenant config [tenants.{name}]: cache_key_prefix is 1 to 64 of A-Z a-z 0-9 _ - ."
                    )));
                }
            }
            if t.cache_redis_url.is_some() || t.cache_key_prefix.is_some() {
                let pool = CachePool { redis_url: t.cache_redis_url, key_prefix: t.cache_key_prefix };
                config.cache_pools.insert(name.clone(), pool);
            }
            let limits = TenantLimits {
                rate: t.rate,
                burst: t.burst,
                max_concurrent: t.max_concurrent,
                highest_priority: t.highest_priority,
            };
            config.tenants.insert(name, limits);
        }
        for (name, l) in
            std::iter::once(("default", &config.default)).chain(config.tenants.iter().map(|(n, l)| (n.as_str(), l)))
        {
            if !(l.rate >= 0.0 && l.rate.is_finite()) || l.burst.is_some_and(|b| !(b >= 1.0 && b.is_finite())) {
                return Err(Error::invalid(format!("tenant config [{name}]: rate must be >= 0 and burst >= 1")));
            }
        }
        Ok(config)
    }
}

#[derive(Debug)]
struct Bucket {
    limits: TenantLimits,
    tokens: f64,
    refilled: Instant,
    in_flight: usize,
}

impl Bucket {
    fn new(limits: TenantLimits, now: Instant) -> Bucket {
        Bucket { limits, tokens: limits.burst.unwrap_or(limits.rate.max(1.0)), refilled: now, in_flight: 0 }
    }

    /// Nothing in flight and the bucket refilled by `now`: indistinguishable from a new one.
    fn idle(&self, now: Instant) -> bool {
        let l = self.limits;
        let burst = l.burst.unwrap_or(l.rate.max(1.0));
        let tokens = self.tokens + now.saturating_duration_since(self.refilled).as_secs_f64() * l.rate;
        self.in_flight == 0 && (l.rate == 0.0 || tokens >= burst)
    }

    /// Takes a token and a concurrency place, or says which limit refused and when to retry.
    fn admit(&mut self, now: Instant) -> std::result::Result<(), (&'static str, Duration)> {
        let l = self.limits;
        if l.max_concurrent > 0 && self.in_flight >= l.max_concurrent {
            return Err(("concurrency", Duration::from_secs(1)));
        }
        if l.rate > 0.0 {
            let burst = l.burst.unwrap_or(l.rate.max(1.0));
            let elapsed = now.saturating_duration_since(self.refilled).as_secs_f64();
            self.tokens = (self.tokens + elapsed * l.rate).min(burst);
            self.refilled = now;
            if self.tokens < 1.0 {
                return Err(("rate", Duration::from_secs_f64((1.0 - self.tokens) / l.rate)));
            }
            self.tokens -= 1.0;
        }
        self.in_flight += 1;
        Ok(())
    }
}

/// The buckets of every tenant seen; cheap to share.
#[derive(Debug)]
pub struct Tenants {
    config: TenantConfig,
    /// Name of the header (HTTP) or metadata key (gRPC) that names the tenant, lower case.
    pub header: String,
    buckets: Mutex<Buckets>,
}

#[derive(Debug, Default)]
struct Buckets {
    by_key: HashMap<String, Bucket>,
    swept: Option<Instant>,
}

/// Holds a tenant's concurrency place while its request is in the engine.
pub struct TenantPass {
    tenants: Arc<Tenants>,
    key: String,
}

impl Drop for TenantPass {
    fn drop(&mut self) {
        if let Some(b) = self.tenants.lock().by_key.get_mut(&self.key) {
            b.in_flight = b.in_flight.saturating_sub(1);
        }
    }
}

/// The key of requests that name no tenant, and of unlisted tenants once the table is full.
const ANONYMOUS: &str = "";
const OVERFLOW: &str = "\u{0}overflow";

impl Tenants {
    pub fn config(&self) -> &TenantConfig {
        &self.config
    }

    pub fn new(config: TenantConfig, header: &str) -> Arc<Tenants> {
        // Every series a refusal can count in starts at 0, so dashboards and alerts see it before
        // the first refusal.
        let refusals = &crate::telemetry::metrics::global().tenant_refusals;
        for tenant in config.tenants.keys().map(String::as_str).chain(["other"]) {
            for limit in ["rate", "concurrency"] {
                refusals.with_label_values(&[tenant, limit]);
            }
        }
        Arc::new(Tenants { config, header: header.to_ascii_lowercase(), buckets: Mutex::default() })
    }

    /// The tenants named by `header` (an HTTP header, also read as a gRPC metadata key) with the
    /// limits and cache pools of the TOML file `config` (`--tenant-header`/`--tenant-config`; the
    /// Python engine's `tenant_header`/`tenant_config`).
    pub fn load(header: &str, config: &std::path::Path) -> Result<Arc<Tenants>> {
        // HTTP's token characters (RFC 9110), as a header name is written.
        let token = |b: u8| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b);
        if header.is_empty() || !header.bytes().all(token) {
            return Err(Error::invalid(format!("tenant header '{header}' is not a valid header name")));
        }
        let text = std::fs::read_to_string(config)
            .map_err(|e| Error::invalid(format!("tenant config {}: {e}", config.display())))?;
        Ok(Tenants::new(TenantConfig::parse(&text)?, header))
    }

    /// The limits of `tenant`'s requests: its own where the config lists it, else `[default]`'s.
    pub fn limits(&self, tenant: Option<&str>) -> &TenantLimits {
        tenant.and_then(|t| self.config.tenants.get(t)).unwrap_or(&self.config.default)
    }

    /// Whether `name` is a tenant the config names (bound to credentials when tokens say so).
    pub fn is_listed(&self, name: &str) -> bool {
        self.config.tenants.contains_key(name)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Buckets> {
        self.buckets.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Admits one request of `tenant` at `now`, or refuses it with `Overloaded` and a Retry-After.
    pub fn admit(self: &Arc<Self>, tenant: Option<&str>, now: Instant) -> Result<TenantPass> {
        let name = tenant.unwrap_or(ANONYMOUS);
        if name.len() > MAX_TENANT_NAME {
            return Err(Error::invalid(format!("tenant names are at most {MAX_TENANT_NAME} bytes")));
        }
        let listed = self.config.tenants.get(name);
        let mut guard = self.lock();
        let buckets = &mut *guard;
        let full = |b: &Buckets| b.by_key.len() >= MAX_TRACKED_TENANTS;
        let sweep_due = buckets.swept.is_none_or(|t| now.saturating_duration_since(t) >= SWEEP_EVERY);
        if listed.is_none() && !buckets.by_key.contains_key(name) && full(buckets) && sweep_due {
            let config = &self.config;
            buckets.by_key.retain(|k, b| config.tenants.contains_key(k) || !b.idle(now));
            buckets.swept = Some(now);
        }
        let key = if listed.is_some() || buckets.by_key.contains_key(name) || !full(buckets) { name } else { OVERFLOW };
        let limits = listed.copied().unwrap_or(self.config.default);
        let bucket = buckets.by_key.entry(key.to_string()).or_insert_with(|| Bucket::new(limits, now));
        match bucket.admit(now) {
            Ok(()) => Ok(TenantPass { tenants: self.clone(), key: key.to_string() }),
            Err((limit, retry)) => {
                let label = if listed.is_some() { name } else { "other" };
                crate::telemetry::metrics::global().tenant_refusals.with_label_values(&[label, limit]).inc();
                Err(Error::Overloaded {
                    message: format!("tenant '{name}' is over its {limit} limit"),
                    retry_after: Some(retry.max(Duration::from_secs(1))),
                })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tenants(text: &str) -> Arc<Tenants> {
        Tenants::new(TenantConfig::parse(text).unwrap(), "X-Tenant")
    }

    #[test]
    fn tenants_load_from_a_header_name_and_a_file() {
        let dir = std::env::temp_dir().join(format!("ferrite-tenants-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("tenants.toml");
        std::fs::write(&file, "[tenants.acme]\nrate = 5\n").unwrap();
        let t = Tenants::load("X-Tenant", &file).unwrap();
        assert_eq!((t.header.as_str(), t.is_listed("acme")), ("x-tenant", true));
        for bad in ["", "x tenant", "x:tenant", "x\u{e9}"] {
            let e = Tenants::load(bad, &file).err().unwrap().to_string();
            assert!(e.contains("is not a valid header name"), "{bad:?}: {e}");
        }
        let e = Tenants::load("x-tenant", &dir.join("none.toml")).err().unwrap().to_string();
        assert!(e.contains("none.toml"), "{e}");
        std::fs::write(&file, "[tenants.acme]\nrate = -1\n").unwrap();
        assert!(Tenants::load("x-tenant", &file).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_tenants_highest_priority_is_its_own_else_the_defaults() {
        let t = tenants("[default]\nhighest_priority = 2\n[tenants.vip]\n[tenants.mid]\nhighest_priority = 3\n");
        let highest = |name| t.limits(name).highest_priority;
        assert_eq!([highest(Some("vip")), highest(Some("mid")), highest(Some("guest")), highest(None)], [0, 3, 2, 2]);
        assert_eq!(tenants("[default]\n").limits(None).highest_priority, 0, "any, as in Triton");
    }

    #[test]
    fn token_bucket_refills_at_the_rate() {
        let t = tenants("[default]\nrate = 10\nburst = 2\n");
        let now = Instant::now();
        let _a = t.admit(Some("a"), now).unwrap();
        let _b = t.admit(Some("a"), now).unwrap();
        let err = t.admit(Some("a"), now).err().unwrap();
        assert!(matches!(err, Error::Overloaded { retry_after: Some(_), .. }), "{err:?}");
        // Another tenant has its own bucket.
        assert!(t.admit(Some("b"), now).is_ok());
        // 100 ms at 10/s gives one token back.
        assert!(t.admit(Some("a"), now + Duration::from_millis(100)).is_ok());
        assert!(t.admit(Some("a"), now + Duration::from_millis(100)).is_err());
    }

    #[test]
    fn concurrency_places_are_given_back() {
        let t = tenants("[default]\nmax_concurrent = 1\n[tenants.big]\nmax_concurrent = 2\n");
        let now = Instant::now();
        let pass = t.admit(None, now).unwrap();
        assert!(t.admit(None, now).is_err());
        drop(pass);
        assert!(t.admit(None, now).is_ok());
        let _x = t.admit(Some("big"), now).unwrap();
        let _y = t.admit(Some("big"), now).unwrap();
        assert!(t.admit(Some("big"), now).is_err());
    }

    #[test]
    fn invented_tenant_names_do_not_grow_the_table_without_bound() {
        let t = tenants("[default]\nrate = 1\nburst = 1\n");
        let now = Instant::now();
        for i in 0..MAX_TRACKED_TENANTS + 50 {
            let _ = t.admit(Some(&format!("t{i}")), now);
        }
        assert!(t.lock().by_key.len() <= MAX_TRACKED_TENANTS + 1);
        assert!(t.admit(Some(&"x".repeat(MAX_TENANT_NAME + 1)), now).is_err());
        assert!(TenantConfig::parse("[default]\nrate = -1\n").is_err());
        assert!(TenantConfig::parse("[default]\nburst = 0\n").is_err());
        assert!(TenantConfig::parse("[default]\nspeed = 1\n").is_err());
    }

    #[test]
    fn a_flood_of_invented_names_does_not_trap_a_new_tenant_in_the_overflow_bucket() {
        let t = tenants("[default]\nrate = 1\nburst = 1\n");
        let now = Instant::now();
        for i in 0..MAX_TRACKED_TENANTS + 50 {
            let _ = t.admit(Some(&format!("t{i}")), now);
        }
        // Right after the flood every entry still holds state (its token is spent): the newcomer
        // shares the overflow bucket for now.
        let _ = t.admit(Some("newcomer"), now);
        assert!(!t.lock().by_key.contains_key("newcomer"));
        // Once the invented entries' buckets have refilled they hold nothing worth keeping and go:
        // the newcomer gets its own bucket, and its own limits.
        let later = now + Duration::from_secs(2);
        assert!(t.admit(Some("newcomer"), later).is_ok());
        assert!(t.lock().by_key.contains_key("newcomer"));
        assert!(t.lock().by_key.len() < 100, "{}", t.lock().by_key.len());
    }
}
