//! `Core`'s control-plane operations: the first load, the repository index, loads, unloads and
//! promotions through the repository API, polling the repository, and configs from an external
//! source. Each builds the models' next state beside what serves (`control::lifecycle`) and swaps
//! it in at once.

use std::{
    collections::{BTreeMap, BTreeSet},
    sync::{Arc, MutexGuard},
    time::Duration,
};

use crate::{
    control::{
        canary,
        lifecycle::{self, Lifecycle},
        registry, repository, IndexEntry, Repository,
    },
    Core, Error, ModelControl, Result,
};

/// Refuses repository-API parameters other than `unload_dependents` (accepted, and nothing more is
/// unloaded: a pipeline whose model is unloaded stays, answering 503 naming that model until it
/// is back).
fn refuse_parameters<'a>(names: impl IntoIterator<Item = &'a str>) -> Result<()> {
    match names.into_iter().find(|n| *n != "unload_dependents") {
        None => Ok(()),
        Some(n) => Err(Error::Unsupported(format!(
            "parameter '{n}' is not supported: models load from the repository as it is"
        ))),
    }
}

impl Core {
    /// The first load: `names` from the repository, with `configs` (from an external source, by
    /// model name) in place of their `config.toml`.
    pub(crate) fn load_initial(&self, names: Vec<String>, configs: BTreeMap<String, String>) {
        let Some(repo) = &self.inner.repository else { return };
        let mut lc = self.lifecycle();
        lc.wanted.extend(names.iter().cloned());
        lc.configs = configs;
        let _ = self.rebuild(repo, &mut lc, &names, false);
    }

    fn require_explicit(&self) -> Result<()> {
        if self.inner.control != ModelControl::Explicit {
            return Err(Error::Unsupported(
                "loading, unloading and promoting through the API needs --model-control-mode explicit".into(),
            ));
        }
        Ok(())
    }

    /// The repository index: every model on disk or served, each version's state and why.
    pub fn index(&self) -> Vec<IndexEntry> {
        let mut rows = self.inner.registry.load().index();
        if let Some(repo) = &self.inner.repository {
            for name in repo.names() {
                if !rows.iter().any(|r| r.name == name) {
                    rows.push(IndexEntry {
                        name,
                        version: None,
                        state: registry::State::Unavailable,
                        reason: "not loaded".into(),
                    });
                }
            }
            rows.sort_by(|a, b| (&a.name, a.version).cmp(&(&b.name, b.version)));
        }
        rows
    }

    fn lifecycle(&self) -> MutexGuard<'_, Lifecycle> {
        self.inner.lifecycle.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn repository(&self) -> Result<&Repository> {
        self.inner.repository.as_ref().ok_or_else(|| Error::Unsupported("this engine has no model repository".into()))
    }

    /// Rebuilds `names` from disk (and the external configs) beside what serves, then swaps the
    /// result in at once. Blocks while models load; requests are served meanwhile. `whole`: if
    /// any of them fails, none changes (the refusal, naming the model and why, goes to the index).
    fn rebuild(&self, repo: &Repository, lc: &mut Lifecycle, names: &[String], whole: bool) -> Result<()> {
        if !self.is_accepting() {
            return Ok(());
        }
        let current = self.inner.registry.load_full();
        let mut next = (*current).clone();
        let mut signatures = Vec::new();
        let mut failed = Vec::new();
        // Pipelines that call a model being rebuilt are rebuilt with it, and every pipeline after
        // the models it calls.
        let mut names: Vec<String> = names.to_vec();
        for (pipeline, served) in &current.models {
            let calls = |m: &Arc<crate::Model>| m.spec.uses.iter().any(|u| names.contains(u));
            if !names.contains(pipeline) && served.versions.values().any(calls) {
                names.push(pipeline.clone());
            }
        }
        let read = |n: &String| lifecycle::Sources::read(repo, n, lc.configs.get(n).map(String::as_str));
        let mut planned: Vec<Planned> =
            names.into_iter().filter(|n| lc.wanted.contains(n)).map(|n| (n.clone(), read(&n))).collect();
        // A pipeline that failed for want of a model it calls is tried again when that model is
        // (re)built (Triton's repository manager retries dependents likewise), and so on up.
        let mut waiting: Vec<Planned> = current
            .notes
            .keys()
            .filter(|n| lc.wanted.contains(*n) && !current.models.contains_key(*n))
            .filter(|n| !planned.iter().any(|(p, _)| p == *n))
            .map(|n| (n.clone(), read(n)))
            .filter(|(_, s)| s.is_pipeline())
            .collect();
        while let Some(i) =
            waiting.iter().position(|(_, s)| s.calls().iter().any(|c| planned.iter().any(|(p, _)| p == c)))
        {
            planned.push(waiting.swap_remove(i));
        }
        let (ordered, cycles) = dependency_order(planned);
        for (name, why) in cycles {
            failed.push(format!("model '{name}': {why}"));
            next.models.remove(&name);
            next.notes.insert(name, registry::Notes { model: Some(why), ..Default::default() });
        }
        for (name, sources) in ordered {
            let name = &name;
            signatures.push((name.clone(), sources.signature()));
            let (served, notes) =
                lifecycle::build(repo, name, sources, current.models.get(name), &next, &self.inner.registry);
            match served {
                Some(s) => next.models.insert(name.clone(), s),
                None => next.models.remove(name),
            };
            if notes.model.is_none() && notes.versions.is_empty() {
                next.notes.remove(name);
            } else {
                failed.push(format!("model '{name}': {}", notes.reason()));
                next.notes.insert(name.clone(), notes);
            }
        }
        if whole && !failed.is_empty() {
            // What was built beside is dropped; what served goes on, with the refusal noted.
            let refusal = format!("change refused whole, nothing applied: {}", failed.join("; "));
            let mut kept = (*current).clone();
            for (name, _) in &signatures {
                let notes = kept.notes.entry(name.clone()).or_default();
                notes.model = Some(refusal.clone());
            }
            self.inner.registry.store(Arc::new(kept));
            return Err(Error::invalid(refusal));
        }
        lc.applied.extend(signatures);
        self.inner.registry.store(Arc::new(next));
        Ok(())
    }

    /// Loads (or reloads) `name` from the repository, as the repository API's `load` does. Fails
    /// with the reason when anything did not load; what served before keeps serving then.
    /// `parameters` are the names of the request's load parameters (Triton's config and file
    /// overrides): any is refused, since models load from the repository as it is.
    pub fn load_model<'a>(&self, name: &str, parameters: impl IntoIterator<Item = &'a str>) -> Result<()> {
        self.require_explicit()?;
        refuse_parameters(parameters)?;
        let repo = self.repository()?;
        if !repository::is_model_name(name) {
            return Err(Error::invalid(format!("'{name}' is not a valid model name")));
        }
        repo.versions(name, repository::DEFAULT_MODEL_FILENAME)?;
        let mut lc = self.lifecycle();
        lc.wanted.insert(name.to_string());
        let _ = self.rebuild(repo, &mut lc, &[name.to_string()], false);
        let r = self.inner.registry.load();
        match r.notes.get(name) {
            None => Ok(()),
            Some(n) => Err(Error::invalid(format!("failed to load '{name}': {}", n.reason()))),
        }
    }

    /// Stops serving `name`; its requests in flight finish on it. `parameters` as for `load_model`.
    pub fn unload_model<'a>(&self, name: &str, parameters: impl IntoIterator<Item = &'a str>) -> Result<()> {
        self.require_explicit()?;
        refuse_parameters(parameters)?;
        self.unload(name)
    }

    fn unload(&self, name: &str) -> Result<()> {
        let repo = self.repository()?;
        let mut lc = self.lifecycle();
        let current = self.inner.registry.load_full();
        if !current.models.contains_key(name) && !repo.names().iter().any(|n| n == name) {
            return Err(Error::NotFound(format!("unknown model '{name}'")));
        }
        lc.wanted.remove(name);
        lc.applied.remove(name);
        let mut next = (*current).clone();
        next.models.remove(name);
        next.notes.insert(name.to_string(), registry::Notes { model: Some("unloaded".into()), ..Default::default() });
        self.inner.registry.store(Arc::new(next));
        tracing::info!(model = %name, "model unloaded");
        Ok(())
    }

    /// Makes `name`'s canary candidate its default version.
    pub fn promote_canary(&self, name: &str) -> Result<()> {
        self.require_explicit()?;
        let r = self.inner.registry.load();
        let canary = r.models.get(name).and_then(|s| s.canary.as_ref());
        let c = canary.ok_or_else(|| Error::NotFound(format!("model '{name}' has no canary")))?;
        if let canary::CanaryState::Withdrawn(why) = c.state() {
            return Err(Error::invalid(format!("the canary of '{name}' was withdrawn: {why}")));
        }
        c.promote();
        tracing::info!(model = %name, version = c.config.version, "canary promoted");
        Ok(())
    }

    /// One round of repository polling: models whose files or config changed (and stayed the
    /// same for `debounce`, so half-written files are not picked up) are rebuilt; new model
    /// directories are loaded and removed ones unloaded.
    pub fn poll(&self, debounce: Duration) {
        let Some(repo) = &self.inner.repository else { return };
        let changed = |lc: &mut Lifecycle| {
            let on_disk = repo.names();
            lc.wanted.extend(on_disk.iter().cloned());
            let gone: Vec<String> = lc.wanted.iter().filter(|n| !on_disk.contains(n)).cloned().collect();
            let moved: BTreeMap<String, u64> = lc
                .wanted
                .iter()
                .filter(|n| on_disk.contains(n))
                .map(|n| {
                    (n.clone(), lifecycle::Sources::read(repo, n, lc.configs.get(n).map(String::as_str)).signature())
                })
                .filter(|(n, sig)| lc.applied.get(n) != Some(sig))
                .collect();
            (gone, moved)
        };
        let (gone, first) = changed(&mut self.lifecycle());
        for name in gone {
            let _ = self.unload(&name);
        }
        if first.is_empty() {
            return;
        }
        std::thread::sleep(debounce);
        let mut lc = self.lifecycle();
        let (_, second) = changed(&mut lc);
        let settled: Vec<String> =
            second.iter().filter(|(n, sig)| first.get(*n) == Some(sig)).map(|(n, _)| n.clone()).collect();
        if !settled.is_empty() {
            tracing::info!(models = ?settled, "repository changed; reloading");
            let _ = self.rebuild(repo, &mut lc, &settled, false);
        }
    }

    /// Replaces the external model configs with `configs` (by model name) read at `revision`,
    /// and rebuilds every model whose config changed, all in one swap: a change of several keys
    /// is applied whole or not at all. Every changed model is loaded and checked first; if any
    /// fails, none of the change is applied (the error names the model and why) and the previous
    /// configs keep serving.
    pub fn apply_configs(&self, revision: i64, configs: BTreeMap<String, String>) -> Result<()> {
        let Some(repo) = &self.inner.repository else { return Ok(()) };
        let mut lc = self.lifecycle();
        let changed: BTreeSet<String> = lc
            .configs
            .keys()
            .chain(configs.keys())
            .filter(|n| lc.configs.get(*n) != configs.get(*n))
            .cloned()
            .collect();
        let previous = std::mem::replace(&mut lc.configs, configs);
        let changed: Vec<String> = changed.into_iter().collect();
        tracing::info!(revision, models = ?changed, "config change");
        let applied = self.rebuild(repo, &mut lc, &changed, true);
        if let Err(e) = &applied {
            tracing::error!(revision, error = %e, "config change refused");
            lc.configs = previous;
        }
        applied
    }
}

/// A model to build, with what it is built from.
type Planned = (String, lifecycle::Sources);

/// Models first, then pipelines each after the pipelines it calls (those it calls among `planned`).
/// Pipelines that call each other in a cycle are left out, each with the cycle named.
fn dependency_order(planned: Vec<Planned>) -> (Vec<Planned>, Vec<(String, String)>) {
    let (mut ordered, mut rest): (Vec<_>, Vec<_>) = planned.into_iter().partition(|(_, s)| !s.is_pipeline());
    loop {
        let ready = rest.iter().position(|(_, s)| s.calls().iter().all(|c| !rest.iter().any(|(n, _)| n == c)));
        match ready {
            Some(i) => ordered.push(rest.remove(i)),
            None => break,
        }
    }
    // What is left calls, directly or not, into a cycle: name the cycle from each.
    let cycles = rest
        .iter()
        .map(|(name, _)| {
            let mut path = vec![name.clone()];
            while let Some(next) = rest
                .iter()
                .find(|(n, _)| n == path.last().unwrap_or(name))
                .and_then(|(_, s)| s.calls().into_iter().find(|c| rest.iter().any(|(n, _)| n == c)))
            {
                let seen = path.contains(&next);
                path.push(next);
                if seen || path.len() > rest.len() + 1 {
                    break;
                }
            }
            (name.clone(), format!("pipelines call each other in a cycle: {}", path.join(" -> ")))
        })
        .collect();
    (ordered, cycles)
}
