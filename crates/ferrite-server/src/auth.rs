//! Bearer-token auth for every listener. Tokens come from a file (`--auth-token-file`), one per
//! line as `<token> [scope,scope] [tenant=NAME]` (scopes: infer, metrics, admin; default infer).
//! A token with a tenant acts for that tenant whatever header its requests send; the tenants the
//! tenant config lists can only be acted for by their tokens. Comparison is constant-time, and
//! tokens are never logged. The file is re-read when it changes (a Kubernetes Secret update): a
//! file that no longer parses leaves the tokens in use as they were, and says so in the log.

use std::{
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
};

use ferrite_core::admission::tenant::{Tenants, MAX_TENANT_NAME};

/// Who a request's token says it is, put in the request's extensions by the auth layers.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Principal {
    /// The tenant the token acts for, when its line says.
    pub tenant: Option<Arc<str>>,
}

/// What a route needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    Infer,
    Metrics,
    Admin,
}

impl Scope {
    fn parse(s: &str) -> Option<Scope> {
        match s {
            "infer" => Some(Scope::Infer),
            "metrics" => Some(Scope::Metrics),
            "admin" => Some(Scope::Admin),
            _ => None,
        }
    }
}

#[derive(Debug, PartialEq, Eq)]
pub enum Denied {
    /// No token, or not one we know.
    Unauthenticated,
    /// A known token without the scope the route needs.
    Forbidden,
}

type Tokens = Vec<(Vec<u8>, Vec<Scope>, Principal)>;

pub struct Auth {
    tokens: arc_swap::ArcSwap<Tokens>,
    /// Health endpoints answer without a token.
    pub allow_health: bool,
    /// The file the tokens came from, and its state when last read.
    file: Option<(PathBuf, Mutex<Option<FileStamp>>)>,
}

/// What changes when a file is rewritten or replaced (a Secret update swaps a symlink).
type FileStamp = (u64, i64, i64, u64);

fn stamp(path: &Path) -> Option<FileStamp> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(path).ok()?;
    Some((m.len(), m.mtime(), m.mtime_nsec(), m.ino()))
}

impl std::fmt::Debug for Auth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the tokens themselves.
        f.debug_struct("Auth")
            .field("tokens", &self.tokens.load().len())
            .field("allow_health", &self.allow_health)
            .finish()
    }
}

/// Equal iff same length and bytes; the time taken depends only on the lengths.
fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    let mut diff = a.len() ^ b.len();
    for i in 0..a.len().max(b.len()) {
        diff |= (a.get(i).copied().unwrap_or(0) ^ b.get(i).copied().unwrap_or(0)) as usize;
    }
    diff == 0
}

impl Auth {
    pub fn from_file(path: &Path, allow_health: bool) -> Result<Arc<Auth>, String> {
        let before = stamp(path);
        let text = std::fs::read_to_string(path).map_err(|e| format!("--auth-token-file {}: {e}", path.display()))?;
        let tokens = Auth::tokens(&text)?;
        Ok(Arc::new(Auth {
            tokens: arc_swap::ArcSwap::from_pointee(tokens),
            allow_health,
            file: Some((path.to_path_buf(), Mutex::new(before))),
        }))
    }

    /// TEI's `--api-key`: one token for inference and metrics, health open without it.
    pub fn api_key(key: &str) -> Result<Arc<Auth>, String> {
        if key.len() < 16 || key.chars().any(char::is_whitespace) {
            return Err("--api-key: a key of at least 16 characters, without whitespace".into());
        }
        Auth::parse(&format!("{key} infer,metrics"), true)
    }

    pub fn parse(text: &str, allow_health: bool) -> Result<Arc<Auth>, String> {
        Ok(Arc::new(Auth { tokens: arc_swap::ArcSwap::from_pointee(Auth::tokens(text)?), allow_health, file: None }))
    }

    /// Re-reads the token file if it changed since it was last read. `Ok(true)`: the new tokens
    /// are in use; an error leaves the old ones in use (a half-written file never locks everyone
    /// out, nor lets anyone in).
    pub fn reload_if_changed(&self) -> Result<bool, String> {
        let Some((path, last)) = &self.file else { return Ok(false) };
        let now = stamp(path);
        let mut last = last.lock().unwrap_or_else(|e| e.into_inner());
        if now == *last {
            return Ok(false);
        }
        *last = now;
        let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
        self.tokens.store(Arc::new(Auth::tokens(&text)?));
        Ok(true)
    }

    /// Re-reads the token file every `every` while the process runs.
    pub fn watch(self: &Arc<Self>, every: std::time::Duration) {
        if self.file.is_none() {
            return;
        }
        let auth = Arc::downgrade(self);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                let Some(auth) = auth.upgrade() else { return };
                match auth.reload_if_changed() {
                    Ok(true) => tracing::info!(tokens = auth.tokens.load().len(), "auth token file re-read"),
                    Ok(false) => {}
                    Err(e) => {
                        tracing::error!(error = %e, "auth token file changed but cannot be used; the previous tokens stay in use")
                    }
                }
            }
        });
    }

    fn tokens(text: &str) -> Result<Tokens, String> {
        let mut tokens = Vec::new();
        for (n, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let mut parts = line.split_whitespace();
            let token = parts.next().unwrap_or_default();
            let mut scopes = vec![Scope::Infer];
            let mut principal = Principal::default();
            for part in parts {
                if let Some(tenant) = part.strip_prefix("tenant=") {
                    if tenant.is_empty() || tenant.len() > MAX_TENANT_NAME {
                        return Err(format!(
                            "token file line {}: a tenant name of 1 to {MAX_TENANT_NAME} bytes",
                            n + 1
                        ));
                    }
                    principal.tenant = Some(tenant.into());
                    continue;
                }
                scopes = part
                    .split(',')
                    .map(|s| {
                        Scope::parse(s.trim()).ok_or_else(|| format!("token file line {}: unknown scope '{s}'", n + 1))
                    })
                    .collect::<Result<Vec<_>, _>>()?;
            }
            if token.len() < 16 {
                return Err(format!("token file line {}: tokens must be at least 16 characters", n + 1));
            }
            tokens.push((token.as_bytes().to_vec(), scopes, principal));
        }
        if tokens.is_empty() {
            return Err("the token file holds no token".into());
        }
        Ok(tokens)
    }

    /// Checks an `Authorization` header value against `scope`.
    pub fn check(&self, authorization: Option<&str>, scope: Scope) -> Result<Principal, Denied> {
        // The scheme is case-insensitive (RFC 7235 section 2.1).
        let given = authorization
            .and_then(|v| v.split_once(' '))
            .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
            .map(|(_, token)| token.trim())
            .unwrap_or_default();
        // Compare with every token, so the time does not tell which one matched.
        let mut found: Option<(&Vec<Scope>, &Principal)> = None;
        let tokens = self.tokens.load();
        for (token, scopes, principal) in tokens.iter() {
            if ct_eq(given.as_bytes(), token) {
                found = Some((scopes, principal));
            }
        }
        match found {
            None => Err(Denied::Unauthenticated),
            Some((scopes, principal)) if scopes.contains(&scope) => Ok(principal.clone()),
            Some(_) => Err(Denied::Forbidden),
        }
    }
}

/// The tenant a request acts for: its token's, whatever the header says, with or without a tenant
/// config (the cache keys and shared-memory regions of tokens bound to tenants are their own);
/// else, with a tenant config (`tenants`), the one its header (`claimed` by the config's header
/// name) names, unless tokens are in use and the claim names a tenant the config lists (those
/// are bound to their own tokens: the claim is refused). Without tokens the header is taken on
/// trust; without a config it is not read.
pub fn tenant<'a>(
    principal: Option<&Principal>,
    tenants: Option<&Tenants>,
    claimed: impl FnOnce(&str) -> Option<&'a str>,
) -> Result<Option<String>, String> {
    if let Some(Principal { tenant: Some(t) }) = principal {
        return Ok(Some(t.to_string()));
    }
    let Some(tenants) = tenants else { return Ok(None) };
    match claimed(tenants.header.as_str()) {
        Some(c) if principal.is_some() && tenants.is_listed(c) => {
            Err(format!("tenant '{c}' is bound to its own credentials; this token does not act for it"))
        }
        claimed => Ok(claimed.map(str::to_string)),
    }
}

/// The share of the bytes in flight (`budget`) and of the places of work (`places`) that a
/// request acting for `tenant` (as `tenant` resolves it) holds them in: its tenant's, where the
/// name is one the server gave or takes on trust; else, where tenants are configured, one share
/// for all others.
/// - Without a config: its token's tenant's (names the token file sets), else none.
/// - With one: a listed tenant's, a token's tenant's, or, without tokens, any tenant its header
///   names (taken on trust, as the limits take it). Where tokens are in use, a tenant named by a
///   token bound to none (one the config does not list: the only kind it may claim) is a name its
///   client may make up without end, and has no share of its own: each such name held half the
///   budget, so two held all of it and every listed tenant's request was refused. Those requests,
///   and those acting for no tenant, hold one share together.
pub fn share<'a>(tenants: Option<&Tenants>, principal: Option<&Principal>, tenant: Option<&'a str>) -> Option<&'a str> {
    let Some(listed) = tenants else { return tenant };
    let own = |t: &&str| principal.is_none_or(|p| p.tenant.as_deref() == Some(*t)) || listed.is_listed(t);
    Some(tenant.filter(own).unwrap_or(OTHERS))
}

/// The share of requests acting for no tenant of their own (`share`): a name no header, token or
/// config can give.
pub const OTHERS: &str = "\u{0}others";

/// The tenant a request acts for (`tenant`, or why its claim is refused), resolved once where its
/// bytes are first charged to a share of the budget (HTTP's body layer, gRPC's call layer) and
/// carried in its extensions to the handler.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Acting {
    /// The tenant it acts for, if any, or why its claim is refused.
    pub tenant: Result<Option<String>, String>,
    /// Where its bytes and work are held (`share`); a request to be refused names no tenant.
    pub share: Option<String>,
}

impl Acting {
    /// What `ext` carries, else resolved from its principal and `claimed` (the header).
    pub fn of<'a>(
        ext: &http::Extensions,
        tenants: Option<&Tenants>,
        claimed: impl FnOnce(&str) -> Option<&'a str>,
    ) -> Acting {
        if let Some(acting) = ext.get::<Acting>() {
            return acting.clone();
        }
        let tenant = tenant(ext.get(), tenants, claimed);
        let share = share(tenants, ext.get(), tenant.as_ref().ok().and_then(Option::as_deref)).map(str::to_string);
        Acting { tenant, share }
    }

    /// Whom a call of several requests acts for, or why its claim is refused.
    pub fn caller(self) -> Result<ferrite_core::Caller, String> {
        Ok(ferrite_core::Caller { tenant: self.tenant?, share: self.share })
    }

    /// The share its bytes and work are held in (`share`).
    pub fn share(&self) -> Option<&str> {
        self.share.as_deref()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_scopes_and_refusals() {
        let auth =
            Auth::parse("# comment\nAAAAAAAAAAAAAAAAinfer\nBBBBBBBBBBBBBBBBBBBB metrics,admin\n", false).unwrap();
        assert_eq!(auth.check(Some("Bearer AAAAAAAAAAAAAAAAinfer"), Scope::Infer), Ok(Principal::default()));
        assert_eq!(auth.check(Some("Bearer AAAAAAAAAAAAAAAAinfer"), Scope::Metrics), Err(Denied::Forbidden));
        assert_eq!(auth.check(Some("Bearer BBBBBBBBBBBBBBBBBBBB"), Scope::Admin), Ok(Principal::default()));
        assert_eq!(auth.check(Some("Bearer AAAAAAAAAAAAAAAAinfe"), Scope::Infer), Err(Denied::Unauthenticated));
        assert_eq!(auth.check(Some("AAAAAAAAAAAAAAAAinfer"), Scope::Infer), Err(Denied::Unauthenticated));
        assert_eq!(auth.check(Some("bearer AAAAAAAAAAAAAAAAinfer"), Scope::Infer), Ok(Principal::default()));
        assert_eq!(auth.check(Some("BEARER AAAAAAAAAAAAAAAAinfer"), Scope::Infer), Ok(Principal::default()));
        assert_eq!(auth.check(Some("Basic AAAAAAAAAAAAAAAAinfer"), Scope::Infer), Err(Denied::Unauthenticated));
        assert_eq!(auth.check(None, Scope::Infer), Err(Denied::Unauthenticated));
        assert!(!format!("{auth:?}").contains("AAAA"));
        assert!(Auth::parse("short", false).is_err());
        assert!(Auth::parse("CCCCCCCCCCCCCCCCCCCC root", false).is_err());
        assert!(Auth::parse("\n# none\n", false).is_err());
    }

    #[test]
    fn a_token_bound_to_a_tenant_acts_for_it_and_listed_tenants_cannot_be_claimed() {
        use ferrite_core::admission::tenant::TenantConfig;
        let auth = Auth::parse("acme-token-0123456789 infer tenant=acme\nplain-token-0123456789\n", false).unwrap();
        let acme = auth.check(Some("Bearer acme-token-0123456789"), Scope::Infer).unwrap();
        assert_eq!(acme.tenant.as_deref(), Some("acme"));
        let plain = auth.check(Some("Bearer plain-token-0123456789"), Scope::Infer).unwrap();
        let tenants = Tenants::new(TenantConfig::parse("[tenants.acme]\nrate = 100\n").unwrap(), "x-tenant");
        let header = |value: &'static str| move |name: &str| (name == "x-tenant").then_some(value);
        // The bound token's tenant wins over any header.
        assert_eq!(tenant(Some(&acme), Some(&tenants), header("other")), Ok(Some("acme".into())));
        // An unbound token may name unlisted tenants, never a listed one.
        assert_eq!(tenant(Some(&plain), Some(&tenants), header("team-b")), Ok(Some("team-b".into())));
        assert!(tenant(Some(&plain), Some(&tenants), header("acme")).unwrap_err().contains("bound"));
        // Without tokens the header is taken on trust.
        assert_eq!(tenant(None, Some(&tenants), header("acme")), Ok(Some("acme".into())));
        // Without a tenant config a bound token still acts for its tenant (its cache entries and
        // shared-memory regions are its own); the header is not read.
        assert_eq!(tenant(Some(&acme), None, header("other")), Ok(Some("acme".into())));
        assert_eq!(tenant(Some(&plain), None, header("acme")), Ok(None));
        assert_eq!(tenant(None, None, header("acme")), Ok(None));
        assert!(Auth::parse("acme-token-0123456789 tenant=", false).is_err());
    }

    #[test]
    fn the_tenant_a_request_acts_for_is_resolved_once_and_carried() {
        use ferrite_core::admission::tenant::TenantConfig;
        let auth = Auth::parse("plain-token-0123456789\n", false).unwrap();
        let plain = auth.check(Some("Bearer plain-token-0123456789"), Scope::Infer).unwrap();
        let tenants = Tenants::new(TenantConfig::parse("[tenants.acme]\nrate = 100\n").unwrap(), "x-tenant");
        let mut ext = http::Extensions::new();
        let never = |_: &str| -> Option<&str> { panic!("resolved again") };
        // Nothing carried: resolved from the principal and the header.
        let named = Acting::of(&ext, Some(&tenants), |_| Some("beta"));
        assert_eq!((named.tenant.clone(), named.share()), (Ok(Some("beta".into())), Some("beta")));
        ext.insert(plain);
        let refused = Acting::of(&ext, Some(&tenants), |_| Some("acme"));
        assert!(refused.tenant.is_err());
        assert_eq!(refused.share(), Some(OTHERS), "a claim to be refused is charged as no tenant's");
        // Carried: the header is not read again, and the refusal stands.
        ext.insert(refused.clone());
        assert_eq!(Acting::of(&ext, Some(&tenants), never), refused);
        ext.insert(named.clone());
        assert_eq!(Acting::of(&ext, None, never), named);
    }

    #[test]
    fn names_a_client_may_make_up_hold_no_share_of_their_own() {
        use ferrite_core::admission::tenant::TenantConfig;
        let auth = Auth::parse(
            "acme-token-0123456789 infer tenant=acme\nbob-token-0123456789 tenant=bob\nplain-token-0123456789\n",
            false,
        )
        .unwrap();
        let token = |t: &str| auth.check(Some(&format!("Bearer {t}-token-0123456789")), Scope::Infer).unwrap();
        let (acme, bob, plain) = (token("acme"), token("bob"), token("plain"));
        let tenants = Tenants::new(TenantConfig::parse("[tenants.acme]\nrate = 100\n").unwrap(), "x-tenant");
        let with = |p: Option<&Principal>, t| share(Some(&tenants), p, t);
        // Listed, or bound to a token: its own.
        assert_eq!([with(Some(&acme), Some("acme")), with(Some(&bob), Some("bob"))], [Some("acme"), Some("bob")]);
        // A token bound to none names made-up tenants: one share for them all, and for none.
        let made_up =
            [with(Some(&plain), Some("guest-1")), with(Some(&plain), Some("guest-2")), with(Some(&plain), None)];
        assert_eq!(made_up, [Some(OTHERS); 3]);
        // Without tokens the header is taken on trust, unlisted names too; none is the others'.
        assert_eq!([with(None, Some("guest-1")), with(None, None)], [Some("guest-1"), Some(OTHERS)]);
        // Without a config: the token's tenant's, else none.
        assert_eq!((share(None, Some(&bob), Some("bob")), share(None, Some(&plain), None)), (Some("bob"), None));
        // As a request carries it: a claim refused is no tenant's.
        let mut ext = http::Extensions::new();
        ext.insert(plain);
        assert_eq!(Acting::of(&ext, Some(&tenants), |_| Some("guest-9")).share(), Some(OTHERS));
        assert_eq!(Acting::of(&ext, Some(&tenants), |_| Some("acme")).share(), Some(OTHERS));
        assert_eq!(Acting::of(&http::Extensions::new(), Some(&tenants), |_| Some("guest-9")).share(), Some("guest-9"));
    }

    #[test]
    fn constant_time_equality() {
        assert!(ct_eq(b"abc", b"abc"));
        assert!(!ct_eq(b"abc", b"abd"));
        assert!(!ct_eq(b"abc", b"abcd"));
        assert!(!ct_eq(b"", b"a"));
        // Lengths that differ by a multiple of 256 still differ.
        assert!(!ct_eq(&[0u8; 256], b""));
    }

    #[test]
    fn a_changed_token_file_is_re_read_and_a_broken_one_keeps_the_old_tokens() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokens");
        std::fs::write(&path, "first-token-0123456789 infer\n").unwrap();
        let auth = Auth::from_file(&path, false).unwrap();
        let bearer = |t: &str| format!("Bearer {t}");
        assert!(auth.check(Some(&bearer("first-token-0123456789")), Scope::Infer).is_ok());
        assert_eq!(auth.reload_if_changed(), Ok(false));
        // A Secret update replaces the file (a new inode), as a rename does.
        std::fs::write(dir.path().join("next"), "second-token-0123456789 infer\n").unwrap();
        std::fs::rename(dir.path().join("next"), &path).unwrap();
        assert_eq!(auth.reload_if_changed(), Ok(true));
        assert!(auth.check(Some(&bearer("second-token-0123456789")), Scope::Infer).is_ok());
        assert_eq!(auth.check(Some(&bearer("first-token-0123456789")), Scope::Infer), Err(Denied::Unauthenticated));
        std::fs::write(dir.path().join("next"), "short\n").unwrap();
        std::fs::rename(dir.path().join("next"), &path).unwrap();
        assert!(auth.reload_if_changed().is_err());
        assert!(auth.check(Some(&bearer("second-token-0123456789")), Scope::Infer).is_ok());
    }
}
