//! Bearer-token auth for every listener. Tokens come from a file (`--auth-token-file`), one per
//! line as `<token> [scope,scope]` (scopes: infer, metrics, admin; default infer). Comparison is
//! constant-time, and tokens are never logged.

use std::{path::Path, sync::Arc};

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

pub struct Auth {
    tokens: Vec<(Vec<u8>, Vec<Scope>)>,
    /// Health endpoints answer without a token.
    pub allow_health: bool,
}

impl std::fmt::Debug for Auth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the tokens themselves.
        f.debug_struct("Auth").field("tokens", &self.tokens.len()).field("allow_health", &self.allow_health).finish()
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
        let text = std::fs::read_to_string(path).map_err(|e| format!("--auth-token-file {}: {e}", path.display()))?;
        Auth::parse(&text, allow_health)
    }

    pub fn parse(text: &str, allow_health: bool) -> Result<Arc<Auth>, String> {
        let mut tokens = Vec::new();
        for (n, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let mut parts = line.split_whitespace();
            let token = parts.next().unwrap_or_default();
            let scopes = match parts.next() {
                None => vec![Scope::Infer],
                Some(list) => list
                    .split(',')
                    .map(|s| {
                        Scope::parse(s.trim()).ok_or_else(|| format!("token file line {}: unknown scope '{s}'", n + 1))
                    })
                    .collect::<Result<Vec<_>, _>>()?,
            };
            if token.len() < 16 {
                return Err(format!("token file line {}: tokens must be at least 16 characters", n + 1));
            }
            tokens.push((token.as_bytes().to_vec(), scopes));
        }
        if tokens.is_empty() {
            return Err("the token file holds no token".into());
        }
        Ok(Arc::new(Auth { tokens, allow_health }))
    }

    /// Checks an `Authorization` header value against `scope`.
    pub fn check(&self, authorization: Option<&str>, scope: Scope) -> Result<(), Denied> {
        let given = authorization.and_then(|v| v.strip_prefix("Bearer ")).map(str::trim).unwrap_or_default();
        // Compare with every token, so the time does not tell which one matched.
        let mut found: Option<&Vec<Scope>> = None;
        for (token, scopes) in &self.tokens {
            if ct_eq(given.as_bytes(), token) {
                found = Some(scopes);
            }
        }
        match found {
            None => Err(Denied::Unauthenticated),
            Some(scopes) if scopes.contains(&scope) => Ok(()),
            Some(_) => Err(Denied::Forbidden),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_scopes_and_refusals() {
        let auth =
            Auth::parse("# comment\nAAAAAAAAAAAAAAAAinfer\nBBBBBBBBBBBBBBBBBBBB metrics,admin\n", false).unwrap();
        assert_eq!(auth.check(Some("Bearer AAAAAAAAAAAAAAAAinfer"), Scope::Infer), Ok(()));
        assert_eq!(auth.check(Some("Bearer AAAAAAAAAAAAAAAAinfer"), Scope::Metrics), Err(Denied::Forbidden));
        assert_eq!(auth.check(Some("Bearer BBBBBBBBBBBBBBBBBBBB"), Scope::Admin), Ok(()));
        assert_eq!(auth.check(Some("Bearer AAAAAAAAAAAAAAAAinfe"), Scope::Infer), Err(Denied::Unauthenticated));
        assert_eq!(auth.check(Some("AAAAAAAAAAAAAAAAinfer"), Scope::Infer), Err(Denied::Unauthenticated));
        assert_eq!(auth.check(None, Scope::Infer), Err(Denied::Unauthenticated));
        assert!(!format!("{auth:?}").contains("AAAA"));
        assert!(Auth::parse("short", false).is_err());
        assert!(Auth::parse("CCCCCCCCCCCCCCCCCCCC root", false).is_err());
        assert!(Auth::parse("\n# none\n", false).is_err());
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
}
