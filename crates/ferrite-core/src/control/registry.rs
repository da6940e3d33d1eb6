//! What is served right now: every model's loaded versions and canary, and the state of every
//! model the repository knows (for the repository index). A `Registry` is immutable; a change
//! builds a new one and swaps it in atomically, so a request sees one consistent registry, and a
//! model version replaced mid-request finishes that request on the version it started on.

use std::{collections::BTreeMap, sync::Arc};

pub(crate) use crate::engine::model::release;
use crate::{
    control::canary::{Canary, CanaryState, Side},
    wire::RETRY_AFTER,
    CanaryRoute, Error, Model, Result,
};

/// The loaded versions of one model.
pub struct Served {
    pub name: String,
    pub versions: BTreeMap<u64, Arc<Model>>,
    pub canary: Option<Arc<Canary>>,
}

impl std::fmt::Debug for Served {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let versions: Vec<&u64> = self.versions.keys().collect();
        f.debug_struct("Served")
            .field("name", &self.name)
            .field("versions", &versions)
            .field("canary", &self.canary)
            .finish()
    }
}

impl Served {
    /// The version unversioned requests get when no canary routes them: the highest, leaving out
    /// a candidate that has not been promoted.
    pub fn default_version(&self) -> Option<&Arc<Model>> {
        let candidate = self.canary.as_ref().filter(|c| c.state() != CanaryState::Promoted).map(|c| c.config.version);
        self.versions.iter().rev().find(|(v, _)| Some(**v) != candidate).map(|(_, m)| m)
    }

    /// The model an unversioned request goes to, and the canary and side when a canary chose it.
    fn route(&self, id: Option<&str>, asked: CanaryRoute) -> Option<Routed> {
        if let Some(c) = &self.canary {
            let side = c.route(id, asked);
            let v = if side == Side::Candidate { c.config.version } else { c.stable };
            if let Some(m) = self.versions.get(&v) {
                // Only the router's own choices are compared: a request that forced its side
                // with the header tells nothing of the split (and must not sway it).
                let record = (asked == CanaryRoute::Auto).then(|| (c.clone(), side));
                return Some((m.clone(), record));
            }
        }
        self.default_version().map(|m| (m.clone(), None))
    }
}

/// Where a request goes: the model, and the canary whose window records its outcome, if any.
pub type Routed = (Arc<Model>, Option<(Arc<Canary>, Side)>);

/// The state of a model version in the repository index (Triton's names).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    Ready,
    Unavailable,
}

impl State {
    pub fn as_str(self) -> &'static str {
        match self {
            State::Ready => "READY",
            State::Unavailable => "UNAVAILABLE",
        }
    }
}

/// One row of the repository index.
#[derive(Debug, Clone, PartialEq)]
pub struct IndexEntry {
    pub name: String,
    /// `None` for a model that has no version to show (failed config, unloaded).
    pub version: Option<u64>,
    pub state: State,
    pub reason: String,
}

/// Why a model or some of its versions are not as asked, kept for the index.
#[derive(Debug, Clone, Default)]
pub struct Notes {
    /// About the model as a whole (its config, its directory, an unload).
    pub model: Option<String>,
    /// About single versions (a failed load, a reload that kept the previous files).
    pub versions: BTreeMap<u64, String>,
}

impl Notes {
    /// Every note in one line: the model's, then each version's.
    pub fn reason(&self) -> String {
        let versions = self.versions.iter().map(|(v, e)| format!("version {v}: {e}"));
        self.model.iter().cloned().chain(versions).collect::<Vec<_>>().join("; ")
    }
}

#[derive(Debug, Clone, Default)]
pub struct Registry {
    pub models: BTreeMap<String, Arc<Served>>,
    pub notes: BTreeMap<String, Notes>,
}

impl Registry {
    /// The model `name` at `version` (`None` or empty: the default version).
    pub fn model(&self, name: &str, version: Option<&str>) -> Result<Arc<Model>> {
        self.route(name, version, None, CanaryRoute::Never).map(|(m, _)| m)
    }

    /// The model a request for `name` goes to: `version` when it names one, else the canary's
    /// choice (by request `id` and the `x-ferrite-canary` wish), else the default version.
    pub fn route(&self, name: &str, version: Option<&str>, id: Option<&str>, asked: CanaryRoute) -> Result<Routed> {
        let Some(served) = self.models.get(name) else {
            return Err(match self.notes.get(name).and_then(|n| n.model.as_ref()) {
                Some(why) => Error::unavailable(format!("model '{name}' is not available: {why}"), Some(RETRY_AFTER)),
                None => Error::NotFound(format!("unknown model '{name}'")),
            });
        };
        match version.filter(|v| !v.is_empty()) {
            None => served
                .route(id, asked)
                .ok_or_else(|| Error::unavailable(format!("model '{name}' has no version ready"), Some(RETRY_AFTER))),
            Some(v) => v
                .parse::<u64>()
                .ok()
                .and_then(|v| served.versions.get(&v))
                .map(|m| (m.clone(), None))
                .ok_or_else(|| Error::NotFound(format!("model '{name}' has no version '{v}' ready"))),
        }
    }

    /// Every model a request for `name` at `version` may go to, whatever its id and canary wish:
    /// the version it names, else the default and, while a canary runs, its candidate.
    pub fn candidates(&self, name: &str, version: Option<&str>) -> Result<Vec<Arc<Model>>> {
        let (first, _) = self.route(name, version, None, CanaryRoute::Never)?;
        let mut all = vec![first];
        if version.is_none_or(str::is_empty) {
            if let Ok((other, _)) = self.route(name, None, None, CanaryRoute::Always) {
                if !Arc::ptr_eq(&other, &all[0]) {
                    all.push(other);
                }
            }
        }
        Ok(all)
    }

    /// Models that are not served, with the reason.
    pub fn failed(&self) -> BTreeMap<String, String> {
        self.notes
            .iter()
            .filter(|(name, _)| !self.models.contains_key(*name))
            .filter_map(|(name, n)| {
                Some((name.clone(), n.model.clone().or_else(|| n.versions.values().next().cloned())?))
            })
            .collect()
    }

    /// Every served model version.
    pub fn all(&self) -> Vec<Arc<Model>> {
        self.models.values().flat_map(|s| s.versions.values().cloned()).collect()
    }

    /// The repository index: one row per served version, and one per version or model that is
    /// not served, with the reason.
    pub fn index(&self) -> Vec<IndexEntry> {
        let mut rows = Vec::new();
        let names: std::collections::BTreeSet<&String> = self.models.keys().chain(self.notes.keys()).collect();
        for name in names {
            let served = self.models.get(name);
            let notes = self.notes.get(name).cloned().unwrap_or_default();
            let mut versions: std::collections::BTreeSet<u64> = notes.versions.keys().copied().collect();
            if let Some(s) = served {
                versions.extend(s.versions.keys());
            }
            let canary = served.and_then(|s| s.canary.as_ref());
            for v in versions {
                let ready = served.is_some_and(|s| s.versions.contains_key(&v));
                let mut reason = notes.versions.get(&v).cloned().unwrap_or_default();
                if let Some(c) = canary.filter(|c| c.config.version == v) {
                    let state = match c.state() {
                        CanaryState::Active => {
                            format!("canary: weight {} against version {}", c.config.weight, c.stable)
                        }
                        CanaryState::Promoted => "canary promoted".to_string(),
                        CanaryState::Withdrawn(why) => why,
                    };
                    reason = if reason.is_empty() { state } else { format!("{state}; {reason}") };
                }
                let state = if ready { State::Ready } else { State::Unavailable };
                rows.push(IndexEntry { name: name.clone(), version: Some(v), state, reason });
            }
            if served.is_none_or(|s| s.versions.is_empty()) && notes.versions.is_empty() {
                let reason = notes.model.clone().unwrap_or_default();
                rows.push(IndexEntry { name: name.clone(), version: None, state: State::Unavailable, reason });
            } else if let Some(why) = &notes.model {
                // A reload of the whole model failed while its previous versions serve on.
                for row in rows.iter_mut().filter(|r| &r.name == name && r.reason.is_empty()) {
                    row.reason = why.clone();
                }
            }
        }
        rows
    }
}

/// What serves, as a pipeline's model steps see it while the pipeline is built.
impl crate::engine::model::Models for Registry {
    fn model(&self, name: &str, version: Option<&str>) -> Result<Arc<Model>> {
        Registry::model(self, name, version)
    }
}

/// What serves now, as a pipeline's model steps see it when they run: the registry of the moment,
/// let go off the caller's thread (freeing a replaced one joins its models' threads, which may
/// include the caller's).
impl crate::engine::model::Models for arc_swap::ArcSwap<Registry> {
    fn model(&self, name: &str, version: Option<&str>) -> Result<Arc<Model>> {
        let served = self.load_full();
        let model = served.model(name, version);
        release(served);
        model
    }
}
