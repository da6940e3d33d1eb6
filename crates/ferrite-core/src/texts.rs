//! Text models the way their users call them: embeddings (OpenAI's `/v1/embeddings`, TEI's
//! `/embed`), re-ranking (TEI's `/rerank`, Cohere's and Jina's `/v1/rerank`), classification
//! (TEI's `/predict`) and the tokenizer itself (`/tokenize`, `/decode`). A call names its model,
//! or leaves it to the one served model of its task (a pipeline's `task`). The front-ends only
//! translate; every text goes through `Core::infer`, so the model's limits, tenants, metrics and
//! cache apply.

use std::{future::Future, pin::Pin, sync::Arc};

use bytes::Bytes;

use crate::{
    engine::spec::{ModelSpec, Task, TextSpec},
    Core, DataType, Error, InferRequest, Result, Route, Tensor, TensorData,
};

/// Texts one OpenAI call may carry (OpenAI's limit).
pub const MAX_INPUTS: usize = 2048;
/// Texts (or passages to re-rank) one TEI call may carry: TEI's `max_client_batch_size`.
pub const TEI_MAX_INPUTS: usize = 32;

/// One row: a text, and the second text of a pair (a re-ranker's passage, a pair classifier's).
pub type Row = (Bytes, Option<Bytes>);

/// The answer of a text model: one row of floats per text (a vector, a score, a score per
/// class), in order, and the tokens they took.
#[derive(Debug, Clone, PartialEq)]
pub struct Answer {
    pub model: String,
    pub rows: Vec<Vec<f32>>,
    pub tokens: u64,
}

/// `(text input, vector output, token count output)` of a pipeline that declares no task but
/// has an embedder's shape: one BYTES input taking a text per row, and an FP32 output of one
/// vector per row (`embedding` if several). Such a model answers embeddings when named.
fn embedder_shape(spec: &ModelSpec) -> Option<(String, String, Option<String>)> {
    let [input] = spec.inputs.as_slice() else { return None };
    if input.datatype != DataType::Bytes || !input.dims.is_empty() || !spec.batched() {
        return None;
    }
    let vectors = spec.outputs.iter().filter(|o| o.datatype == DataType::Fp32 && o.dims.len() == 1);
    let output = vectors.clone().find(|o| o.name == "embedding").or(vectors.clone().next())?;
    let count = spec.outputs.iter().find(|o| o.name == "token_count" && o.dims.is_empty()).map(|o| o.name.clone());
    Some((input.name.clone(), output.name.clone(), count))
}

/// What TEI calls each task (its `/info` and its errors).
pub fn tei_name(task: Task) -> &'static str {
    match task {
        Task::Embed => "embedding",
        Task::Rerank => "reranker",
        Task::Classify => "classifier",
    }
}

/// The served models of `task` (any text model when `None`), by name.
pub fn models(core: &Core, task: Option<Task>) -> Vec<String> {
    let mut names: Vec<String> = core
        .models()
        .iter()
        .filter(|m| m.spec.text.as_ref().is_some_and(|t| task.is_none_or(|k| t.task == k)))
        .map(|m| m.spec.name.clone())
        .collect();
    names.dedup();
    names
}

/// The model a call names, or the one served model of `task` when it names none (TEI serves
/// one model and its clients name none).
pub fn pick(core: &Core, model: Option<&str>, task: Option<Task>) -> Result<String> {
    if let Some(m) = model {
        return Ok(m.to_string());
    }
    let (one, many) = match task {
        Some(t) => (format!("has task '{}'", t.as_str()), format!("have task '{}'", t.as_str())),
        None => ("is a text model".to_string(), "are text models".to_string()),
    };
    match models(core, task).as_slice() {
        [name] => Ok(name.clone()),
        [] => Err(Error::NotFound(format!("no served model {one}"))),
        names => {
            Err(Error::invalid(format!("several served models {many} ({}); name one in \"model\"", names.join(", "))))
        }
    }
}

/// A text model, looked up once for a call: its texts are checked and run on the same version
/// (a canary's choice included).
pub struct TextModel {
    route: Route,
    input: String,
    pair: Option<String>,
    output: String,
    count: Option<String>,
    /// The pipeline's text spec; `None` for an undeclared model of an embedder's shape.
    pub text: Option<Arc<TextSpec>>,
}

impl TextModel {
    /// The served model `model`, which must answer `task` (`None`: any text model, for the
    /// tokenizer routes).
    pub fn new(core: &Core, model: &str, task: Option<Task>) -> Result<TextModel> {
        let route = core.route(&InferRequest { model_name: model.to_string(), ..Default::default() })?;
        let spec = &route.model().spec;
        let text = spec.text.clone();
        match (&text, task) {
            (Some(t), Some(want)) if t.task != want => {
                // TEI's words ("Model is not a re-ranker model"), with the task it has.
                let noun = match want {
                    Task::Embed => "an embedding",
                    Task::Rerank => "a re-ranker",
                    Task::Classify => "a classifier",
                };
                return Err(Error::Unsupported(format!(
                    "model '{model}' is not {noun} model (its task is '{}')",
                    t.task.as_str()
                )));
            }
            (Some(t), _) => {
                let (input, pair, output, count) = (t.input.clone(), t.pair.clone(), t.output.clone(), t.count.clone());
                return Ok(TextModel { route, input, pair, output, count, text });
            }
            (None, Some(Task::Embed)) => {
                if let Some((input, output, count)) = embedder_shape(spec) {
                    return Ok(TextModel { route, input, pair: None, output, count, text: None });
                }
            }
            (None, _) => {}
        }
        let what = task.map_or("a text model (a pipeline that tokenizes)".to_string(), |t| {
            format!("a text pipeline of task '{}' (one text in, one vector out per row)", t.as_str())
        });
        Err(Error::Unsupported(format!("model '{model}' is not {what}")))
    }

    pub fn name(&self) -> &str {
        &self.route.model().spec.name
    }

    /// The width of the vectors or scores the model answers, when its spec fixes it.
    pub fn width(&self) -> Option<usize> {
        let dims = &self.route.model().spec.outputs.iter().find(|o| o.name == self.output)?.dims;
        usize::try_from(*dims.first().unwrap_or(&1)).ok()
    }

    /// Refuses a row over the model's `max_length` tokens (TEI's `truncate: false`), in TEI's
    /// words; each text is read only as far as the limit needs.
    pub fn check_lengths(&self, rows: &[Row]) -> Result<()> {
        let Some(t) = &self.text else { return Ok(()) };
        for (text, pair) in rows {
            let text = utf8(text)?;
            let pair = pair.as_ref().map(|p| utf8(p)).transpose()?;
            let e = crate::pipeline::encode(&t.tokenizer, text, pair, t.special_tokens, t.max_length)?;
            let n = e.get_ids().len();
            if n > t.max_length {
                // A text longer than the first prefix `encode` reads may have been read in part.
                let read_whole = |s: &str| s.len() <= t.max_length.saturating_mul(8).max(256);
                let whole = read_whole(text) && pair.is_none_or(read_whole);
                let given = if whole { n.to_string() } else { format!("at least {n}") };
                // TEI's words (its check is the same: more than the max input length).
                return Err(Error::invalid(format!(
                    "`inputs` must have less than {} tokens. Given: {given}",
                    t.max_length
                )));
            }
        }
        Ok(())
    }

    /// `texts` with the prompt `name` (sentence-transformers' prompts) put before each, or the
    /// model's default prompt when it names none.
    pub fn prompted(&self, texts: Vec<Bytes>, name: Option<&str>) -> Result<Vec<Bytes>> {
        let prompts = self.text.as_ref().map(|t| (&t.prompts, t.default_prompt.as_deref()));
        let prefix = match (name, prompts) {
            (None, None) | (None, Some((_, None))) => return Ok(texts),
            (Some(n), Some((p, _))) | (None, Some((p, Some(n)))) => p.get(n).ok_or_else(|| {
                let names: Vec<&str> = p.keys().map(String::as_str).collect();
                Error::invalid(format!("prompt_name '{}' is not one of the model's prompts {names:?}", cut(n)))
            })?,
            (Some(n), None) => {
                return Err(Error::invalid(format!("prompt_name '{}': the model has no prompts", cut(n))))
            }
        };
        Ok(texts.into_iter().map(|t| Bytes::from([prefix.as_bytes(), &t].concat())).collect())
    }

    /// Runs `rows` in calls of at most the model's max batch size. `tenant` as for
    /// `Core::infer`: the whole call is admitted once, as one request of its tenant, and holds
    /// that place until its last batch is done. At most as many batches as the model has
    /// workers are queued at once, so other clients' requests queue behind a few of a long
    /// call's batches, not all of them.
    pub async fn run(self, core: &Core, rows: Vec<Row>, max_inputs: usize, tenant: Option<String>) -> Result<Answer> {
        if rows.is_empty() || rows.len() > max_inputs {
            return Err(Error::invalid(format!("give 1 to {max_inputs} texts, not {}", rows.len())));
        }
        if rows.iter().any(|(_, p)| p.is_some()) != self.pair.is_some() {
            let wants = if self.pair.is_some() { "pairs of texts" } else { "single texts" };
            return Err(Error::invalid(format!("model '{}' reads {wants}", self.name())));
        }
        let spec = &self.route.model().spec;
        let model = spec.name.clone();
        let per_call = spec.batch.max_batch_size.max(1);
        let window = spec.instance_count.max(1);
        let charged = core.admit(&self.route, tenant.as_deref())?;
        let chunks: Vec<&[Row]> = rows.chunks(per_call).collect();
        let call = |chunk: &[Row]| {
            let column = |name: &str, of: &dyn Fn(&Row) -> Bytes| {
                let items = chunk.iter().map(of).collect();
                Tensor::new(name, DataType::Bytes, vec![chunk.len()], TensorData::Strings(items))
            };
            let mut inputs = vec![column(&self.input, &|r| r.0.clone())];
            if let Some(pair) = &self.pair {
                inputs.push(column(pair, &|r| r.1.clone().unwrap_or_default()));
            }
            let req = InferRequest {
                model_name: model.clone(),
                inputs,
                outputs: Some(std::iter::once(self.output.clone()).chain(self.count.clone()).collect()),
                tenant: tenant.clone(),
                ..Default::default()
            };
            let (core, route, charged) = (core.clone(), self.route.clone(), charged.clone());
            Box::pin(async move { core.infer_on(route, req, Some(charged)).await })
                as Pin<Box<dyn Future<Output = Result<crate::InferResponse>> + Send>>
        };
        let mut out = Vec::with_capacity(rows.len());
        let mut tokens = 0u64;
        for resp in windowed(chunks.len(), window, |i| call(chunks[i])).await? {
            let v = &resp.outputs[0];
            let values = crate::pipeline::floats(v)?;
            let width = v.shape.iter().skip(1).product::<usize>().max(1);
            out.extend(values.chunks(width).map(<[f32]>::to_vec));
            if let Some(c) = resp.outputs.get(1) {
                tokens += crate::pipeline::floats(c)?.iter().map(|&n| n as u64).sum::<u64>();
            }
        }
        Ok(Answer { model, rows: out, tokens })
    }
}

/// An embedding as TEI and OpenAI shape it: cut to `dimensions` (matryoshka models), then scaled
/// to unit length when `normalize`.
pub fn shape_vector(mut v: Vec<f32>, dimensions: Option<usize>, normalize: bool) -> Vec<f32> {
    if let Some(d) = dimensions {
        v.truncate(d);
    }
    if normalize {
        let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt().max(1e-12);
        v.iter_mut().for_each(|x| *x /= norm);
    }
    v
}

/// Raw scores to what TEI answers without `raw_scores`: one score through a sigmoid, several
/// through a softmax.
pub fn probabilities(mut scores: Vec<f32>) -> Vec<f32> {
    match scores.as_mut_slice() {
        [one] => *one = crate::pipeline::sigmoid(*one),
        many => crate::pipeline::softmax(many),
    }
    scores
}

/// The labels of a classifier's `width` scores: its own, else `LABEL_0`, `LABEL_1`, ... (as
/// Hugging Face names classes a config leaves unnamed).
pub fn labels(text: Option<&TextSpec>, width: usize) -> Vec<String> {
    match text {
        Some(t) if t.labels.len() == width => t.labels.clone(),
        _ => (0..width).map(|i| format!("LABEL_{i}")).collect(),
    }
}

fn utf8(b: &Bytes) -> Result<&str> {
    std::str::from_utf8(b).map_err(|_| Error::invalid("the text is not UTF-8"))
}

/// A client's string as an error shows it: its first 32 characters.
fn cut(s: &str) -> String {
    let shown: String = s.chars().take(32).collect();
    if shown.len() < s.len() {
        format!("{shown}...")
    } else {
        shown
    }
}

type Call<T> = Pin<Box<dyn Future<Output = Result<T>> + Send>>;

/// Runs `make(0..n)` with at most `window` of them in flight; results in order. The first error
/// ends the call (the calls in flight are dropped, and their queued work with them).
async fn windowed<T>(n: usize, window: usize, mut make: impl FnMut(usize) -> Call<T>) -> Result<Vec<T>> {
    let mut done: Vec<Option<T>> = (0..n).map(|_| None).collect();
    let mut running: Vec<(usize, Call<T>)> = Vec::new();
    let mut next = 0;
    std::future::poll_fn(|cx| loop {
        while running.len() < window && next < n {
            running.push((next, make(next)));
            next += 1;
        }
        let mut progressed = false;
        let mut failed = None;
        running.retain_mut(|(i, f)| match f.as_mut().poll(cx) {
            std::task::Poll::Ready(Ok(v)) => {
                done[*i] = Some(v);
                progressed = true;
                false
            }
            std::task::Poll::Ready(Err(e)) => {
                failed.get_or_insert(e);
                false
            }
            std::task::Poll::Pending => true,
        });
        if let Some(e) = failed {
            return std::task::Poll::Ready(Err(e));
        }
        if running.is_empty() && next == n {
            return std::task::Poll::Ready(Ok(()));
        }
        if !progressed {
            return std::task::Poll::Pending;
        }
    })
    .await?;
    Ok(done.into_iter().flatten().collect())
}
