//! The core's request and response types: what a front-end hands the core and gets back.

use crate::Tensor;

/// A request as the front-ends hand it to the core.
#[derive(Debug, Clone, Default)]
pub struct InferRequest {
    pub model_name: String,
    /// `None` or empty: the version the model serves.
    pub model_version: Option<String>,
    pub id: Option<String>,
    pub inputs: Vec<Tensor>,
    /// Names of the outputs to return; `None` for all.
    pub outputs: Option<Vec<String>>,
    /// Outputs answered as their top `k` classes (Triton's classification extension), by name.
    pub classification: Vec<(String, usize)>,
    /// 1 is the highest; 0 means the model's default level.
    pub priority: u32,
    /// Microseconds; may only shorten the model's default timeout. 0 means none.
    pub timeout_us: Option<u64>,
    /// Bypass the response cache for this request (request parameter `cache: false`).
    pub skip_cache: bool,
    /// Who sent it, for per-tenant limits (from the `--tenant-header` header).
    pub tenant: Option<String>,
    /// The share of the server it is counted in (the front-end's, `auth::share`; `None`: none):
    /// in a model's queue, requests of several shares take turns, and one share's requests hold
    /// at most half of a priority level's places.
    pub share: Option<String>,
    /// The `x-ferrite-canary` header: how an unversioned request may be routed to a canary.
    pub canary: CanaryRoute,
    /// The request's parameters as a JSON object (a Python model's `parameters()`); `None`: none.
    pub parameters: Option<String>,
}

impl InferRequest {
    /// The bytes its inputs hold in memory (`TensorData::held_len`): what a front-end holds in the
    /// bytes in flight for it, beyond its body's.
    pub fn held_len(&self) -> usize {
        self.inputs.iter().map(|t| t.data.held_len()).sum()
    }
}

/// Whom a call of several requests acts for (an embeddings call's batches): each request's
/// `tenant` and `share`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Caller {
    pub tenant: Option<String>,
    pub share: Option<String>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct InferResponse {
    pub model_name: String,
    pub model_version: String,
    pub id: Option<String>,
    pub outputs: Vec<Tensor>,
}

/// How a request asks to be routed (the `x-ferrite-canary` header).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum CanaryRoute {
    #[default]
    Auto,
    Always,
    Never,
}

impl CanaryRoute {
    pub fn parse(value: &str) -> Option<CanaryRoute> {
        match value.trim() {
            "always" => Some(CanaryRoute::Always),
            "never" => Some(CanaryRoute::Never),
            "auto" | "" => Some(CanaryRoute::Auto),
            _ => None,
        }
    }
}
