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
    Caller, Core, DataType, Error, InferRequest, Result, Route, Tensor, TensorData,
};

/// Texts one OpenAI call may carry (OpenAI's limit).
pub const MAX_INPUTS: usize = 2048;

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
    /// words; each text is read only as far as the limit needs, off the async runtime's threads.
    pub async fn check_lengths(&self, rows: &[Row]) -> Result<()> {
        let Some(t) = self.text.clone() else { return Ok(()) };
        let rows = rows.to_vec();
        tokio::task::spawn_blocking(move || lengths_fit(&t, &rows))
            .await
            .map_err(|e| Error::internal(format!("the length check failed: {e}")))?
    }

    /// Admits work of the call that runs no model (`/tokenize`, `/decode`) as one request of
    /// its tenant: its rate and concurrency limits apply while the hold is kept.
    pub fn admit(&self, core: &Core, tenant: Option<&str>) -> Result<Arc<crate::engine::queue::Hold>> {
        core.admit(&self.route, tenant)
    }

    /// `texts` with the prompt `name` (sentence-transformers' prompts) put before each, or the
    /// model's default prompt when it names none.
    pub fn prompted(&self, texts: Vec<Bytes>, name: Option<&str>) -> Result<Vec<Bytes>> {
        let prompts = self.text.as_ref().map(|t| (&t.prompts, t.default_prompt.as_deref()));
        let prefix = match (name, prompts) {
            (None, None) | (None, Some((_, None))) => return Ok(texts),
            (Some(n), Some((p, _))) | (None, Some((p, Some(n)))) => p.get(n).ok_or_else(|| {
                let names: Vec<&str> = p.keys().map(String::as_str).collect();
                Error::invalid(format!("prompt_name '{}' is not one of the model's prompts {names:?}", shown(n)))
            })?,
            (Some(n), None) => {
                return Err(Error::invalid(format!("prompt_name '{}': the model has no prompts", shown(n))))
            }
        };
        Ok(texts.into_iter().map(|t| Bytes::from([prefix.as_bytes(), &t].concat())).collect())
    }

    /// Runs `rows` in calls of at most the model's max batch size. `caller` as for
    /// `Core::infer`: the whole call is admitted once, as one request of its tenant, and holds
    /// that place until its last batch is done. At most as many batches as the model has
    /// workers are queued at once, so other clients' requests queue behind a few of a long
    /// call's batches, not all of them.
    pub async fn run(self, core: &Core, rows: Vec<Row>, max_inputs: usize, caller: Caller) -> Result<Answer> {
        let asked = std::iter::once(self.output.clone()).chain(self.count.clone()).collect();
        let vectors = |resp: crate::InferResponse| -> Result<(Vec<Vec<f32>>, u64)> {
            let v = &resp.outputs[0];
            let width = v.shape.iter().skip(1).product::<usize>().max(1);
            let tokens = resp.outputs.get(1).map(counts).transpose()?.map_or(0, |c| c.iter().sum());
            Ok((crate::pipeline::floats(v)?.chunks(width).map(<[f32]>::to_vec).collect(), tokens))
        };
        let answers = self.calls(core, self.route.clone(), asked, &rows, max_inputs, caller, vectors).await?;
        let tokens = answers.iter().map(|(_, t)| t).sum();
        Ok(Answer { model: self.name().to_string(), rows: answers.into_iter().flat_map(|(r, _)| r).collect(), tokens })
    }

    /// `rows` run on `route`'s model (this one's, or one beside it), its `asked` outputs
    /// answered per call and made into `T` by `finish` as each call's answer comes (an error
    /// there stops the calls still running), in order; admitted as this model's requests (see
    /// `run`).
    #[allow(clippy::too_many_arguments)]
    async fn calls<T: Send + 'static>(
        &self,
        core: &Core,
        route: Route,
        asked: Vec<String>,
        rows: &[Row],
        max_inputs: usize,
        caller: Caller,
        finish: impl Fn(crate::InferResponse) -> Result<T> + Clone + Send + 'static,
    ) -> Result<Vec<T>> {
        if rows.is_empty() || rows.len() > max_inputs {
            return Err(Error::invalid(format!("give 1 to {max_inputs} texts, not {}", rows.len())));
        }
        if rows.iter().any(|(_, p)| p.is_some()) != self.pair.is_some() {
            let wants = if self.pair.is_some() { "pairs of texts" } else { "single texts" };
            return Err(Error::invalid(format!("model '{}' reads {wants}", self.name())));
        }
        let spec = &route.model().spec;
        let model = spec.name.clone();
        let per_call = spec.batch.max_batch_size.max(1);
        let window = spec.instance_count.max(1);
        let charged = core.admit(&self.route, caller.tenant.as_deref())?;
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
                outputs: Some(asked.clone()),
                tenant: caller.tenant.clone(),
                share: caller.share.clone(),
                ..Default::default()
            };
            let (core, route, charged, finish) = (core.clone(), route.clone(), charged.clone(), finish.clone());
            Box::pin(async move {
                let answer = core.infer_on(route, req, Some(charged)).await?;
                finish(answer)
            }) as Call<T>
        };
        windowed(chunks.len(), window, |i| call(chunks[i])).await
    }
}

/// A `token_count` answer's counts.
fn counts(c: &Tensor) -> Result<Vec<u64>> {
    Ok(crate::pipeline::floats(c)?.iter().map(|&n| n as u64).collect())
}

fn lengths_fit(t: &TextSpec, rows: &[Row]) -> Result<()> {
    for (text, pair) in rows {
        let text = utf8(text)?;
        let pair = pair.as_ref().map(utf8).transpose()?;
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

/// How a call wants its vectors (TEI's `/embed` options; OpenAI's call asks for unit vectors).
#[derive(Debug, Clone, Default)]
pub struct EmbedOptions {
    /// Unit vectors; `false` is refused by a pipeline whose pool step normalizes.
    pub normalize: bool,
    /// `Some(false)`: a text over the max input length is refused instead of cut.
    pub truncate: Option<bool>,
    pub prompt_name: Option<String>,
    /// Vectors cut to this many dimensions (then normalized when `normalize`).
    pub dimensions: Option<u64>,
}

/// A token as TEI's `/tokenize` answers it: its id, the text it covers (the token itself for a
/// special token), and its byte offsets in the text (none for a special token).
#[derive(Debug, Clone, PartialEq)]
pub struct Token {
    pub id: u32,
    pub text: String,
    pub special: bool,
    pub start: Option<usize>,
    pub stop: Option<usize>,
}

/// Text one `/tokenize` call may hand the tokenizer in all (it reads every byte: TEI's tokenize
/// never cuts), and ids one `/decode` call may, so one call costs milliseconds.
pub const TOKENIZE_MAX_BYTES: usize = 1 << 20;

impl TextModel {
    /// `dimensions` in `1..=width` (`width` when the model's spec fixes it).
    pub fn dimensions(&self, asked: Option<u64>) -> Result<Option<usize>> {
        match (asked, self.width()) {
            (None, _) => Ok(None),
            (Some(d), Some(w)) if d == 0 || d > w as u64 => {
                Err(Error::invalid(format!("`dimensions` must be in 1..={w}, not {d}")))
            }
            (Some(0), None) => Err(Error::invalid("`dimensions` must be positive")),
            (Some(d), _) => Ok(Some(d as usize)),
        }
    }

    /// Embeds `texts` as `o` asks: checked (a wrong size before anything runs), prompted, cut
    /// or refused when long, cut to `dimensions` and normalized.
    pub async fn embed(
        self,
        core: &Core,
        texts: Vec<Bytes>,
        o: &EmbedOptions,
        max_inputs: usize,
        caller: Caller,
    ) -> Result<Answer> {
        if o.normalize && self.sparse() {
            // TEI's refusal: a SPLADE vector is the vocabulary's weights, not a direction.
            return Err(Error::Unsupported("`normalize` is not available for SPLADE models".into()));
        }
        let cut = self.dimensions(o.dimensions)?;
        let normalized = self.text.as_ref().is_some_and(|t| t.normalized);
        if normalized && !o.normalize {
            return Err(Error::invalid(format!(
                "model '{}' answers unit vectors (its pool step normalizes); `normalize: false` needs a pipeline \
                 whose pool step does not",
                self.name()
            )));
        }
        let rows = self.single_rows(texts, o.prompt_name.as_deref(), o.truncate).await?;
        let mut a = self.run(core, rows, max_inputs, caller).await?;
        // Unit vectors stay as the pipeline made them unless they are cut.
        let renormalize = o.normalize && (cut.is_some() || !normalized);
        a.rows = a.rows.into_iter().map(|v| shape_vector(v, cut, renormalize)).collect();
        Ok(a)
    }

    /// The rows of single `texts`: prompted, and with `truncate: false` refused when one is over
    /// the max input length.
    async fn single_rows(
        &self,
        texts: Vec<Bytes>,
        prompt_name: Option<&str>,
        truncate: Option<bool>,
    ) -> Result<Vec<Row>> {
        let rows: Vec<Row> = self.prompted(texts, prompt_name)?.into_iter().map(|t| (t, None)).collect();
        if truncate == Some(false) {
            self.check_lengths(&rows).await?;
        }
        Ok(rows)
    }

    /// Whether its vectors are SPLADE's, sparse (its pool step pools so).
    pub fn sparse(&self) -> bool {
        self.text.as_ref().and_then(|t| t.pooling.as_deref()) == Some("splade")
    }

    /// SPLADE's sparse vectors of `texts` (TEI's `/embed_sparse`): each row's entries that are not
    /// zero, as `(index, value)` in index order. A model that does not pool so is refused as TEI
    /// refuses it (424: Unsupported).
    pub async fn embed_sparse(
        self,
        core: &Core,
        texts: Vec<Bytes>,
        (truncate, prompt_name): (Option<bool>, Option<String>),
        max_inputs: usize,
        caller: Caller,
    ) -> Result<(Vec<Vec<(u32, f32)>>, u64)> {
        if !self.sparse() {
            return Err(Error::Unsupported(format!(
                "model '{}' is not an embedding model with SPLADE pooling",
                self.name()
            )));
        }
        let o = EmbedOptions { normalize: false, truncate, prompt_name, dimensions: None };
        let a = self.embed(core, texts, &o, max_inputs, caller).await?;
        let sparse = |v: Vec<f32>| (0u32..).zip(v).filter(|&(_, x)| x != 0.0).collect();
        Ok((a.rows.into_iter().map(sparse).collect(), a.tokens))
    }

    /// Each text's token embeddings (TEI's `/embed_all`): the hidden state its pipeline pools, one
    /// vector per token the text took (special tokens included, padding not), in order. A SPLADE
    /// model is refused as TEI refuses it (424: Unsupported), as is a model without a pool step.
    pub async fn embed_all(
        self,
        core: &Core,
        texts: Vec<Bytes>,
        (truncate, prompt_name): (Option<bool>, Option<String>),
        max_inputs: usize,
        caller: Caller,
    ) -> Result<(Vec<Vec<Vec<f32>>>, u64)> {
        if self.sparse() {
            return Err(Error::Unsupported("`embed_all` is not available for SPLADE models".into()));
        }
        let Some(beside) = self.route.model().token_embeddings.clone() else {
            return Err(Error::Unsupported(format!(
                "model '{}' does not answer token embeddings (a text pipeline that pools its model's does)",
                self.name()
            )));
        };
        let asked: Vec<String> = beside.spec.outputs.iter().map(|o| o.name.clone()).collect();
        let rows = self.single_rows(texts, prompt_name.as_deref(), truncate).await?;
        let route = self.route.beside(beside);
        // The answer holds a vector per token: at most --max-request-elements values in all, as a
        // request's tensors do. Counted as each call's answer comes; past it, the rest stop.
        let most = core.limits().max_elements;
        let held = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let tokens_of = move |resp: crate::InferResponse| -> Result<(Vec<Vec<Vec<f32>>>, u64)> {
            let [hidden, count] = &resp.outputs[..] else {
                return Err(Error::internal("token embeddings answered without their token counts"));
            };
            // [rows, tokens, width]: each row padded to the longest of its call.
            let &[n, padded, width] = &hidden.shape[..] else {
                return Err(Error::internal(format!("token embeddings of shape {:?}", hidden.shape)));
            };
            let counts = counts(count)?;
            if counts.len() != n || counts.iter().any(|&c| c as usize > padded) {
                return Err(Error::internal(format!("token counts {counts:?} of rows of {padded} tokens")));
            }
            let tokens: u64 = counts.iter().sum();
            let values = tokens as usize * width;
            if held.fetch_add(values, std::sync::atomic::Ordering::Relaxed) + values > most {
                return Err(Error::TooLarge(format!(
                    "the texts' token embeddings are more than {most} values (--max-request-elements): send fewer \
                     or shorter texts"
                )));
            }
            let all = crate::pipeline::floats(hidden)?;
            let rows = all.chunks(padded * width).zip(&counts);
            Ok((
                rows.map(|(row, &c)| row[..c as usize * width].chunks(width).map(<[f32]>::to_vec).collect()).collect(),
                tokens,
            ))
        };
        let answers = self.calls(core, route, asked, &rows, max_inputs, caller, tokens_of).await?;
        let tokens = answers.iter().map(|(_, t)| t).sum();
        Ok((answers.into_iter().flat_map(|(r, _)| r).collect(), tokens))
    }

    /// `(index, score)` of each passage for `query`, highest first; `raw` keeps the model's
    /// scores, else each goes through a sigmoid.
    pub async fn rerank(
        self,
        core: &Core,
        query: &str,
        passages: &[String],
        (truncate, raw): (Option<bool>, bool),
        max_inputs: usize,
        caller: Caller,
    ) -> Result<(Answer, Vec<(usize, f32)>)> {
        let query = Bytes::copy_from_slice(query.as_bytes());
        let rows: Vec<Row> =
            passages.iter().map(|p| (query.clone(), Some(Bytes::copy_from_slice(p.as_bytes())))).collect();
        if truncate == Some(false) {
            self.check_lengths(&rows).await?;
        }
        let a = self.run(core, rows, max_inputs, caller).await?;
        let mut scored: Vec<(usize, f32)> = a
            .rows
            .iter()
            .enumerate()
            .map(|(i, r)| {
                let score = r.first().copied().unwrap_or(f32::NAN);
                (i, if raw { score } else { crate::pipeline::sigmoid(score) })
            })
            .collect();
        scored.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        Ok((a, scored))
    }

    /// Each row's classes as `(label, score)`, highest first; `raw` keeps the model's scores,
    /// else one goes through a sigmoid and several through a softmax.
    pub async fn predict(
        self,
        core: &Core,
        rows: Vec<Row>,
        (truncate, raw): (Option<bool>, bool),
        max_inputs: usize,
        caller: Caller,
    ) -> Result<Vec<Vec<(String, f32)>>> {
        if truncate == Some(false) {
            self.check_lengths(&rows).await?;
        }
        let text = self.text.clone();
        let a = self.run(core, rows, max_inputs, caller).await?;
        Ok(a.rows
            .into_iter()
            .map(|scores| {
                let labels = labels(text.as_deref(), scores.len());
                let scores = if raw { scores } else { probabilities(scores) };
                let mut p: Vec<(String, f32)> = labels.into_iter().zip(scores).collect();
                p.sort_by(|a, b| b.1.total_cmp(&a.1));
                p
            })
            .collect())
    }

    /// The tokenizer's tokens of each text (prompted), never cut: at most
    /// [`TOKENIZE_MAX_BYTES`] of text a call, read off the async runtime's threads, under the
    /// tenant's limits (`held`, from [`TextModel::admit`]).
    pub async fn tokenize(
        &self,
        texts: Vec<Bytes>,
        special: bool,
        prompt_name: Option<&str>,
        held: Arc<crate::engine::queue::Hold>,
    ) -> Result<Vec<Vec<Token>>> {
        let texts = self.prompted(texts, prompt_name)?;
        let total: usize = texts.iter().map(Bytes::len).sum();
        if total > TOKENIZE_MAX_BYTES {
            return Err(Error::invalid(format!("{total} bytes to tokenize; at most {TOKENIZE_MAX_BYTES} a call")));
        }
        let t = self.tokenizer()?;
        tokio::task::spawn_blocking(move || {
            let _held = held;
            texts.iter().map(|text| tokens(&t, text, special)).collect()
        })
        .await
        .map_err(|e| Error::internal(format!("tokenizing failed: {e}")))?
    }

    /// Each list of ids as text.
    pub fn decode(&self, lists: &[Vec<u32>], skip_special: bool) -> Result<Vec<String>> {
        let ids: usize = lists.iter().map(Vec::len).sum();
        if ids > TOKENIZE_MAX_BYTES {
            return Err(Error::invalid(format!("{ids} ids to decode; at most {TOKENIZE_MAX_BYTES} a call")));
        }
        let t = self.tokenizer()?;
        lists
            .iter()
            .map(|ids| t.tokenizer.decode(ids, skip_special).map_err(|e| Error::invalid(format!("cannot decode: {e}"))))
            .collect()
    }

    fn tokenizer(&self) -> Result<Arc<TextSpec>> {
        self.text.clone().ok_or_else(|| Error::invalid(format!("model '{}' has no tokenizer", self.name())))
    }
}

fn tokens(t: &TextSpec, text: &Bytes, special: bool) -> Result<Vec<Token>> {
    let text = utf8(text)?;
    let e = t.tokenizer.encode(text, special).map_err(|e| Error::invalid(format!("cannot tokenize: {e}")))?;
    let marks = e.get_special_tokens_mask();
    Ok(e.get_ids()
        .iter()
        .enumerate()
        .map(|(i, &id)| match marks[i] == 1 {
            true => Token { id, text: e.get_tokens()[i].clone(), special: true, start: None, stop: None },
            false => {
                let (start, stop) = e.get_offsets()[i];
                let covered = text.get(start..stop).unwrap_or_default().to_string();
                Token { id, text: covered, special: false, start: Some(start), stop: Some(stop) }
            }
        })
        .collect())
}

/// An embedding as TEI and OpenAI shape it: cut to `dimensions` (matryoshka models), then scaled
/// to unit length when `normalize`.
fn shape_vector(mut v: Vec<f32>, dimensions: Option<usize>, normalize: bool) -> Vec<f32> {
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
fn probabilities(mut scores: Vec<f32>) -> Vec<f32> {
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

/// A client's string as an error shows it: its first 32 characters (a client's megabyte is not
/// sent back).
pub fn shown(s: &str) -> String {
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
