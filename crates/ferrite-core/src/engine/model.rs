//! One served model: its resolved spec, its batcher and its statistics, and the checks every
//! request passes before it may queue.

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use tokio::sync::oneshot;
use tracing::Instrument;

use crate::{
    cache::{self, ResponseCache},
    data::tensor::element_count,
    engine::{
        backend::Instance,
        batcher::Batcher,
        classify,
        queue::{Hold, Pending},
        spec::{ModelSpec, TimeoutAction},
    },
    telemetry::{metrics, stats::ModelStats},
    Backend, Error, InferRequest, InferResponse, Result, Tensor, TensorData,
};

/// Most classes one request may be answered with (Triton's classification extension: rows x k
/// over the outputs it asks to classify): 262,144, a batch of 12 with all of ImageNet-21k's.
pub const MAX_CLASSES: usize = 1 << 18;
/// Outputs to classify larger than this (elements, together) are ranked off the async runtime's
/// threads: a top 5 of 5.5 million scores takes about 70 ms.
const CLASSIFY_INLINE: usize = 1 << 16;

/// Records a request whose caller went away before it was answered.
struct Outcome<'m> {
    model: &'m Model,
    start: Instant,
    done: bool,
}

impl Drop for Outcome<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.model.record("failure", "cancelled", self.start.elapsed());
        }
    }
}

/// Where the models that call others (a pipeline's model steps, a Python model's BLS calls)
/// find them: what will serve beside them while they are built, and what serves now when they
/// run (the control plane's registry).
pub trait Models: Send + Sync {
    fn model(&self, name: &str, version: Option<&str>) -> Result<Arc<Model>>;
}

pub struct Model {
    pub spec: ModelSpec,
    pub stats: Arc<ModelStats>,
    batcher: Batcher,
    metrics: metrics::ModelMetrics,
    /// Set when the model enables caching and the process has a cache.
    pub(crate) cache: Option<Arc<ResponseCache>>,
    /// Identifies the files and config this model was loaded from; a reload with the same one
    /// keeps this instance.
    pub(crate) fingerprint: u64,
    /// A hash of the model file's bytes: part of every cache key, so a replaced model is never
    /// answered from entries of the old one, in any process sharing the cache.
    pub(crate) content: u64,
    /// The config's warm-up requests: name, times to run, inputs.
    pub(crate) warmups: Vec<(String, usize, Vec<Tensor>)>,
    /// What a request costs, when the backend can tell before running it.
    cost: Option<crate::engine::backend::Cost>,
    /// A text embedder's token embeddings (TEI's `/embed_all`): its pipeline's steps before the
    /// pool step, on the same model steps, answering the pooled value and `token_count`.
    pub token_embeddings: Option<Arc<Model>>,
}

/// What the cache made of a request ([`Model::look_up`]).
enum Cached<'c> {
    Answer(cache::Value),
    /// Compute it: as the flight's leader (unless it followed one that left), holding the key
    /// in the shared tier when it took it there.
    Compute(Option<cache::Leader<'c>>, Option<cache::Claimed>),
}

impl Model {
    /// Starts the model's batcher on instances of `backend`, and `solo` (see the batcher).
    pub fn start(spec: ModelSpec, backend: &dyn Backend, solo: Option<Box<dyn Instance>>) -> Result<Model> {
        let stats = Arc::new(ModelStats::default());
        let metrics = metrics::ModelMetrics::new(&spec.name, spec.version);
        let batcher = Batcher::start(&spec, backend, solo, stats.clone(), metrics.clone())?;
        let cost = backend.cost();
        Ok(Model {
            spec,
            stats,
            batcher,
            metrics,
            cache: None,
            fingerprint: 0,
            content: 0,
            warmups: Vec::new(),
            cost,
            token_embeddings: None,
        })
    }

    pub fn batcher(&self) -> &Batcher {
        &self.batcher
    }

    /// Validates, queues and awaits one request of at most `max_elements` input elements.
    pub async fn infer(&self, req: InferRequest, max_elements: usize) -> Result<InferResponse> {
        self.infer_holding(req, max_elements, Hold::default()).await
    }

    /// As `infer`; `hold` is kept until the request's work has stopped (see [`Hold`]).
    pub async fn infer_holding(&self, mut req: InferRequest, max_elements: usize, hold: Hold) -> Result<InferResponse> {
        let start = Instant::now();
        // Counts the request as cancelled if its caller stops waiting (the future is dropped).
        let mut outcome = Outcome { model: self, start, done: false };
        let id = req.id.clone();
        let classes = std::mem::take(&mut req.classification);
        let batch_rows = req.inputs.first().and_then(|t| t.shape.first()).copied();
        let rows = if self.spec.batched() { batch_rows.unwrap_or(1) } else { 1 };
        let result = match self.check_classification(&classes, rows) {
            Ok(()) if classes.is_empty() => self.run(req, max_elements, hold).await,
            Ok(()) => {
                // The places stay held while the classes are ranked, as they are while it runs.
                let kept = Arc::new(hold);
                match self.run(req, max_elements, Hold(vec![Box::new(kept.clone())])).await {
                    Ok(r) => self.classify(r, classes).await,
                    Err(e) => Err(e),
                }
            }
            Err(e) => Err(e),
        };
        outcome.done = true;
        let elapsed = start.elapsed();
        let counter = if result.is_ok() { &self.stats.success } else { &self.stats.fail };
        counter.add(elapsed);
        let (status, reason) = match &result {
            Ok(_) => ("success", ""),
            Err(e) => ("failure", metrics::reason(e)),
        };
        self.record(status, reason, elapsed);
        tracing::debug!(model = %self.spec.name, version = self.spec.version, id = id.as_deref().unwrap_or(""),
            outcome = status, reason, duration_us = elapsed.as_micros() as u64, "request");
        result
    }

    /// Runs one warm-up request of `inputs` (a configured sample, or [`synthetic_inputs`]) straight
    /// through the batcher, blocking the calling thread. Not counted in the statistics of real
    /// traffic.
    pub fn warm_up(&self, inputs: Vec<Tensor>) -> Result<()> {
        let (inputs, rows) = self.check_inputs(inputs, crate::wire::DEFAULT_MAX_ELEMENTS)?;
        let (tx, rx) = oneshot::channel();
        self.batcher.submit(Pending { warmup: true, ..Pending::new(inputs, rows, tx) })?;
        block_on(rx).map_err(|_| Error::internal("the warm-up request was dropped"))?.map(|_| ())
    }

    /// Counts a request refused before it reached this model (admission), and returns its error.
    pub fn record_refusal(&self, e: Error) -> Error {
        self.stats.fail.add(Duration::ZERO);
        self.record("failure", metrics::reason(&e), Duration::ZERO);
        e
    }

    fn record(&self, outcome: &str, reason: &str, elapsed: Duration) {
        if outcome == "success" {
            self.metrics.success.inc();
        } else {
            self.metrics.failure(reason);
        }
        self.metrics.request.observe(elapsed.as_secs_f64());
    }

    async fn run(&self, req: InferRequest, max_elements: usize, hold: Hold) -> Result<InferResponse> {
        // Child spans only for a request that is being traced (front-ends give the others none).
        let traced = !tracing::Span::current().is_none();
        let child = |span: fn() -> tracing::Span| if traced { span() } else { tracing::Span::none() };
        let validated = child(|| tracing::debug_span!("validate")).in_scope(|| -> Result<_> {
            let (inputs, rows) = self.check_inputs(req.inputs, max_elements)?;
            Ok((inputs, rows, self.check_outputs(req.outputs.as_deref())?, self.level(req.priority)?))
        });
        let (inputs, rows, outputs, level) = validated?;
        // A request over the backend's per-request budget is refused here, before it queues.
        let heavy = match &self.cost {
            Some(c) => (c.of)(&inputs)? > c.heavy,
            None => false,
        };
        let cache = self.cache.as_ref().filter(|_| !req.skip_cache);
        let tenant =
            if self.spec.cache_across_tenants { None } else { Some(req.tenant.as_deref().unwrap_or_default()) };
        // The tenant whose share of the in-process tier an answer counts in.
        let share = tenant.filter(|t| !t.is_empty());
        let key = cache
            .map(|_| cache::key(tenant, &self.spec.name, self.spec.version, self.content, &inputs, outputs.as_deref()));
        let now = Instant::now();
        let policy = &self.spec.batch.level_queues[level.min(self.spec.batch.level_queues.len() - 1)];
        let deadline = policy.timeout(req.timeout_us).map(|t| now + t);
        // With `timeout_action = delay` a late request still runs, so its caller waits for it.
        let wait_limit = deadline.filter(|_| policy.timeout_action == TimeoutAction::Reject);
        // Held while this request computes: identical requests wait on `leading`'s answer here,
        // other processes on `claimed`'s (dropped after the answer's write is queued).
        let (mut leading, mut claimed) = (None, None);
        if let (Some(c), Some(k)) = (cache, key) {
            let lookup = self.look_up(c, k, share, max_elements, wait_limit);
            match lookup.instrument(child(|| tracing::debug_span!("cache"))).await? {
                Cached::Answer(a) => return Ok(self.response(req.id, a.outputs.clone())),
                Cached::Compute(l, mine) => (leading, claimed) = (l, mine),
            }
        }
        let (tx, rx) = oneshot::channel();
        let queued = if traced { tracing::debug_span!("queue", rows) } else { tracing::Span::none() };
        let span = queued.clone();
        self.batcher.submit(Pending {
            id: req.id.clone(),
            parameters: req.parameters,
            inputs,
            rows,
            outputs,
            level,
            enqueued: Instant::now(),
            deadline,
            reply: tx,
            runtime: crate::engine::batcher::answer_runtime(),
            span,
            warmup: false,
            hold,
            heavy,
            share: req.share.as_deref().map(Arc::from),
        })?;
        let answer = match wait_limit {
            None => rx.instrument(queued).await,
            Some(d) => match tokio::time::timeout_at(d.into(), rx).instrument(queued).await {
                Ok(a) => a,
                // Dropping `rx` tells the queue to skip the request.
                Err(_) => return Err(Error::DeadlineExceeded("request timed out before it ran".into())),
            },
        };
        let outputs = answer.map_err(|_| Error::internal("the batcher dropped the request"))??;
        if let (Some(c), Some(k)) = (cache, key) {
            c.put(k, &outputs, share);
        }
        if let Some(l) = leading {
            l.finish(&outputs);
        }
        // Released after the answer's write was queued (writes keep their order).
        drop(claimed);
        Ok(self.response(req.id, outputs))
    }

    /// The cache's part of a request: a hit, or an identical request's answer (in flight here, or
    /// computed by another process for a hot key), each within the request's deadline; else the
    /// go-ahead to compute it, leading the identical requests that arrive meanwhile.
    async fn look_up<'c>(
        &self,
        c: &'c ResponseCache,
        k: cache::Key,
        share: Option<&str>,
        max_elements: usize,
        wait_limit: Option<Instant>,
    ) -> Result<Cached<'c>> {
        let t = Instant::now();
        if let Some(hit) = c.get(k, max_elements, share).await {
            // A hit never enters the queue.
            self.stats.cache_hit.add(t.elapsed());
            self.metrics.cache_hits.inc();
            return Ok(Cached::Answer(hit));
        }
        self.stats.cache_miss.add(t.elapsed());
        self.metrics.cache_misses.inc();
        let leader = match c.join(k) {
            cache::Flight::Lead(l) => l,
            cache::Flight::Follow(answer) => {
                // An identical request is computing this answer: wait for it; if it leaves
                // without one, compute it here (leading no one: the flight is its leader's).
                let answer = match wait_limit {
                    None => cache::follow(answer).await,
                    Some(d) => tokio::time::timeout_at(d.into(), cache::follow(answer))
                        .await
                        .map_err(|_| Error::DeadlineExceeded("request timed out before it ran".into()))?,
                };
                return Ok(match answer {
                    Some(a) => {
                        self.metrics.cache_coalesced.inc();
                        Cached::Answer(a)
                    }
                    None => Cached::Compute(None, None),
                });
            }
        };
        // A hot key may be computing in another process sharing the tier: wait for its answer
        // rather than compute it again.
        let mut wait = self.fleet_wait();
        if let Some(d) = wait_limit {
            wait = wait.min(d.saturating_duration_since(Instant::now()));
        }
        let (answer, counted) = match c.claim(k, max_elements, share, wait).await {
            cache::Claim::Compute(claimed) => return Ok(Cached::Compute(Some(leader), claimed)),
            cache::Claim::Found(a) => (a, &self.metrics.cache_coalesced),
            cache::Claim::Answered(a) => (a, &self.metrics.cache_fleet_coalesced),
        };
        counted.inc();
        leader.finish(&answer.outputs);
        Ok(Cached::Answer(answer))
    }

    /// How long a hot miss waits for another process's answer: about twice what computing a
    /// request has taken here (queue and compute, mean so far), within 5 ms to 1 s.
    fn fleet_wait(&self) -> Duration {
        let s = &self.stats;
        let queue = s.queue.snapshot();
        let ns = [&s.compute_input, &s.compute_infer, &s.compute_output].iter().map(|c| c.snapshot().ns).sum::<u64>();
        let per = match queue.count {
            0 => Duration::from_millis(50),
            n => Duration::from_nanos(queue.ns.saturating_add(ns) / n),
        };
        (per * 2).clamp(Duration::from_millis(5), Duration::from_secs(1))
    }

    fn response(&self, id: Option<String>, outputs: Vec<Tensor>) -> InferResponse {
        InferResponse { model_name: self.spec.name.clone(), model_version: self.spec.version.to_string(), id, outputs }
    }

    /// Where the model takes an input `name` of `datatype` and `shape`, and its element count,
    /// or why it does not (its name, datatype, shape, batch size and element count; not its
    /// data): each input is checked so before it is queued, and a front-end may check a large
    /// body's inputs so before it decodes their data.
    pub fn check_input(
        &self,
        name: &str,
        datatype: crate::DataType,
        shape: &[usize],
        max_elements: usize,
    ) -> Result<(usize, usize)> {
        let spec = &self.spec;
        let Some(i) = spec.inputs.iter().position(|s| s.name == name) else {
            let names: Vec<&str> = spec.inputs.iter().map(|s| s.name.as_str()).collect();
            return Err(Error::invalid(format!(
                "unexpected input '{name}' for model '{}'; it takes {names:?}",
                spec.name
            )));
        };
        let s = &spec.inputs[i];
        if datatype != s.datatype {
            return Err(Error::invalid(format!("input '{name}': expected datatype {}, got {datatype}", s.datatype)));
        }
        let expected = spec.wire_shape(s);
        let fits = shape.len() == expected.len() && shape.iter().zip(&expected).all(|(&d, &e)| e < 0 || d as i64 == e);
        if !fits {
            return Err(Error::invalid(format!("input '{name}': expected shape {expected:?}, got {shape:?}")));
        }
        // A shape the model's reshape cannot take is refused here, before it joins a batch.
        let batched = spec.batched();
        if let Some(to) = spec.reshape.get(name) {
            crate::engine::spec::reshaped(shape, batched, to)
                .map_err(|e| Error::invalid(format!("input '{name}': {e}")))?;
        }
        if batched && !(1..=spec.batch.max_batch_size).contains(&shape[0]) {
            return Err(Error::invalid(format!(
                "input '{name}': batch size {} is outside 1..={} (max_batch_size)",
                shape[0], spec.batch.max_batch_size
            )));
        }
        Ok((i, element_count(shape, max_elements)?))
    }

    /// Puts inputs in model order and checks each against the spec before anything is queued.
    fn check_inputs(&self, given: Vec<Tensor>, max_elements: usize) -> Result<(Vec<Tensor>, usize)> {
        let spec = &self.spec;
        let batched = spec.batched();
        let mut slots: Vec<Option<Tensor>> = vec![None; spec.inputs.len()];
        let mut elements = 0usize;
        for t in given {
            let (i, n) = self.check_input(&t.name, t.datatype, &t.shape, max_elements)?;
            if slots[i].is_some() {
                return Err(Error::invalid(format!("input '{}' is given more than once", t.name)));
            }
            t.check_size(n)?;
            elements = elements
                .checked_add(n)
                .filter(|&n| n <= max_elements)
                .ok_or_else(|| Error::invalid(format!("request has more than {max_elements} elements")))?;
            // ONNX Runtime's strings are UTF-8: a BYTES element that is not would fail the whole
            // batch it joined, so it is refused here, before it can share one. (Pipelines and
            // Python models take any bytes: encoded images.)
            let any_bytes = spec.is_pipeline() || spec.backend == "python";
            if let (false, TensorData::Strings(items)) = (any_bytes, &t.data) {
                if let Some(n) = items.iter().position(|b| std::str::from_utf8(b).is_err()) {
                    return Err(Error::invalid(format!("input '{}': BYTES element {n} is not UTF-8", t.name)));
                }
            }
            slots[i] = Some(t);
        }
        // Optional inputs left out are left out of the run too.
        let inputs = slots
            .into_iter()
            .zip(&spec.inputs)
            .filter(|(t, s)| t.is_some() || !spec.optional.contains(&s.name))
            .map(|(t, s)| t.ok_or_else(|| Error::invalid(format!("missing input '{}'", s.name))))
            .collect::<Result<Vec<_>>>()?;
        let rows = if batched { inputs.first().map_or(1, |t| t.shape[0]) } else { 1 };
        if batched && inputs.iter().any(|t| t.shape[0] != rows) {
            return Err(Error::invalid("inputs disagree on the batch size (dim 0)"));
        }
        Ok((inputs, rows))
    }

    fn check_outputs(&self, wanted: Option<&[String]>) -> Result<Option<Vec<usize>>> {
        let Some(names) = wanted else { return Ok(None) };
        let mut idx = Vec::with_capacity(names.len());
        for n in names {
            let i = self.spec.outputs.iter().position(|o| &o.name == n).ok_or_else(|| {
                Error::invalid(format!("unknown output '{n}' requested from model '{}'", self.spec.name))
            })?;
            if idx.contains(&i) {
                return Err(Error::invalid(format!("output '{n}' is requested more than once")));
            }
            idx.push(i);
        }
        Ok(Some(idx))
    }

    /// Refuses classification of an output the model lacks or whose type has no order, and, where
    /// the outputs' sizes are fixed, more than `MAX_CLASSES` classes for `rows` rows before the
    /// model runs (outputs of variable size are counted once they are there).
    fn check_classification(&self, classes: &[(String, usize)], rows: usize) -> Result<()> {
        let mut asked = 0usize;
        for (name, k) in classes {
            let Some(o) = self.spec.outputs.iter().find(|o| &o.name == name) else {
                return Err(Error::invalid(format!(
                    "unknown output '{name}' requested from model '{}'",
                    self.spec.name
                )));
            };
            if !classify::classifiable(o.datatype) || *k == 0 {
                return Err(Error::invalid(format!(
                    "output '{name}' ({}) cannot be classified into {k} classes",
                    o.datatype
                )));
            }
            let per_row = o.dims.iter().try_fold(1usize, |n, &d| Some(n.saturating_mul(usize::try_from(d).ok()?)));
            asked = asked.saturating_add(rows.saturating_mul((*k).min(per_row.unwrap_or(0))));
        }
        classes_fit(asked)
    }

    /// Replaces each output asked for as classes by its top k (see `classify`). At most
    /// `MAX_CLASSES` a request: each is a string of its own, and ranking them all costs seconds on
    /// a segmentation map's millions of scores. Large outputs are ranked off the async runtime's
    /// threads (the I/O threads, when a listener is the caller).
    async fn classify(&self, resp: InferResponse, classes: Vec<(String, usize)>) -> Result<InferResponse> {
        let batched = self.spec.batched();
        let (mut asked, mut elements) = (0usize, 0usize);
        for t in resp.outputs.iter() {
            if let Some((_, k)) = classes.iter().find(|(name, _)| *name == t.name) {
                asked = asked.saturating_add(classify::classes(t, *k, batched));
                elements = elements.saturating_add(t.element_count());
            }
        }
        classes_fit(asked)?;
        match tokio::runtime::Handle::try_current() {
            Ok(rt) if elements > CLASSIFY_INLINE => {
                let labels: Labels = self
                    .spec
                    .labels
                    .iter()
                    .filter(|(output, _)| classes.iter().any(|(name, _)| name == *output))
                    .map(|(output, l)| (output.clone(), l.clone()))
                    .collect();
                rt.spawn_blocking(move || rank(resp, &classes, batched, &labels))
                    .await
                    .map_err(|e| Error::internal(format!("classification failed: {e}")))?
            }
            _ => rank(resp, &classes, batched, &self.spec.labels),
        }
    }

    fn level(&self, priority: u32) -> Result<usize> {
        let levels = self.spec.batch.priority_levels.max(1);
        let p = if priority == 0 { self.spec.batch.default_priority_level } else { priority };
        if p > levels {
            return Err(Error::invalid(format!("priority {priority} is outside 1..={levels}")));
        }
        Ok(p.max(1) as usize - 1)
    }
}

/// Refuses a request answered with more than `MAX_CLASSES` classes.
fn classes_fit(asked: usize) -> Result<()> {
    if asked > MAX_CLASSES {
        return Err(Error::invalid(format!(
            "classification asks for {asked} classes (rows x k); at most {MAX_CLASSES} a request"
        )));
    }
    Ok(())
}

/// Class labels by output (a model's `label_filename`s).
type Labels = std::collections::BTreeMap<String, Vec<String>>;

/// Replaces each output of `resp` asked for as classes by its top k.
fn rank(mut resp: InferResponse, classes: &[(String, usize)], batched: bool, labels: &Labels) -> Result<InferResponse> {
    for (name, k) in classes {
        if let Some(t) = resp.outputs.iter_mut().find(|t| &t.name == name) {
            *t = classify::top_k(t, *k, batched, labels.get(name).map(Vec::as_slice))?;
        }
    }
    Ok(resp)
}

/// Lets go of a request's model (or a registry). The last holder of a replaced or unloaded model
/// frees it (worker threads joined, session released) on a thread of its own, not the caller's.
pub(crate) fn release<T: Send + Sync + 'static>(value: Arc<T>) {
    if Arc::strong_count(&value) == 1 {
        let _ = std::thread::Builder::new().name("ferrite-free".into()).spawn(move || drop(value));
    }
}

/// Waits for `f` on the calling thread, inside an async runtime or not (the batcher answers from
/// its own threads, so nothing here needs the runtime).
fn block_on<F: std::future::Future>(f: F) -> F::Output {
    struct Unpark(std::thread::Thread);
    impl std::task::Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.0.unpark()
        }
    }
    let waker = Arc::new(Unpark(std::thread::current())).into();
    let mut cx = std::task::Context::from_waker(&waker);
    let mut f = std::pin::pin!(f);
    loop {
        if let std::task::Poll::Ready(v) = f.as_mut().poll(&mut cx) {
            return v;
        }
        std::thread::park();
    }
}

/// Synthetic inputs of `rows` rows (when the model batches) for `spec`: no zeros (ones, halves
/// and "a"s), variable dims as 1. For warm-ups and the calibration.
pub fn synthetic_inputs(spec: &ModelSpec, rows: usize) -> Vec<Tensor> {
    use crate::{Element, TensorData};
    spec.inputs
        .iter()
        .map(|s| {
            let shape: Vec<usize> = spec
                .batched()
                .then_some(rows)
                .into_iter()
                .chain(s.dims.iter().map(|&d| if d < 0 { 1 } else { d as usize }))
                .collect();
            let n: usize = shape.iter().product();
            // Floats a half, integers and booleans one, strings "a".
            let v = if s.datatype.is_float() { 0.5 } else { 1.0 };
            let data = crate::dispatch!(s.datatype, T => {
                let mut buf = Vec::with_capacity(n * std::mem::size_of::<T>());
                (0..n).for_each(|_| T::cast(v).put_le(&mut buf));
                TensorData::Fixed(buf.into())
            }, bytes => TensorData::Strings(vec![bytes::Bytes::from_static(b"a"); n]));
            Tensor::new(s.name.clone(), s.datatype, shape, data)
        })
        .collect()
}
