//! Text embeddings the way their users ask for them (OpenAI's `/v1/embeddings`, TEI's `/embed`):
//! a list of texts to a pipeline that takes one text per row and answers a vector per row. The
//! front-ends only translate; every request goes through `Core::infer`, so the model's limits,
//! tenants, metrics and cache apply.

use std::{future::Future, pin::Pin};

use crate::{engine::spec::ModelSpec, Core, DataType, Error, InferRequest, Result, Route, Tensor, TensorData};

/// Texts one call may carry (OpenAI's limit).
pub const MAX_INPUTS: usize = 2048;

/// The answer: one vector per text, in order, and the tokens they took.
#[derive(Debug, Clone, PartialEq)]
pub struct Embeddings {
    pub model: String,
    pub vectors: Vec<Vec<f32>>,
    pub tokens: u64,
}

/// `(text input, vector output, token count output)` of an embedding pipeline: one BYTES input
/// taking a text per row, and an FP32 output of one vector per row (`embedding` if several).
pub fn tensors(spec: &ModelSpec) -> Option<(String, String, Option<String>)> {
    let [input] = spec.inputs.as_slice() else { return None };
    if input.datatype != DataType::Bytes || !input.dims.is_empty() || !spec.batched() {
        return None;
    }
    let vectors = spec.outputs.iter().filter(|o| o.datatype == DataType::Fp32 && o.dims.len() == 1);
    let output = vectors.clone().find(|o| o.name == "embedding").or(vectors.clone().next())?;
    let count = spec.outputs.iter().find(|o| o.name == "token_count" && o.dims.is_empty()).map(|o| o.name.clone());
    Some((input.name.clone(), output.name.clone(), count))
}

/// The served models that can answer embeddings, by name.
pub fn models(core: &Core) -> Vec<String> {
    let mut names: Vec<String> =
        core.models().iter().filter(|m| tensors(&m.spec).is_some()).map(|m| m.spec.name.clone()).collect();
    names.dedup();
    names
}

/// An embedding model, looked up once for a call: its width is checked and its texts are run on
/// the same version (a canary's choice included).
pub struct Embedder {
    route: Route,
    input: String,
    output: String,
    count: Option<String>,
}

impl Embedder {
    pub fn new(core: &Core, model: &str) -> Result<Embedder> {
        let route = core.route(&InferRequest { model_name: model.to_string(), ..Default::default() })?;
        let (input, output, count) = tensors(&route.model().spec).ok_or_else(|| {
            Error::invalid(format!("model '{model}' does not answer embeddings (one text in, one vector out per row)"))
        })?;
        Ok(Embedder { route, input, output, count })
    }

    /// The width of the vectors the model answers, when its spec fixes it (checked before any work).
    pub fn width(&self) -> Option<usize> {
        let dims = &self.route.model().spec.outputs.iter().find(|o| o.name == self.output)?.dims;
        usize::try_from(*dims.first()?).ok()
    }

    /// Embeds `texts` in calls of at most the model's max batch size; `normalize` scales each
    /// vector to unit length. `tenant` as for `Core::infer`: the whole call is admitted once, as
    /// one request of its tenant, and holds that place until its last batch is done. At most as
    /// many batches as the model has workers are queued at once, so other clients' requests queue
    /// behind a few of a long call's batches, not all of them.
    pub async fn embed(
        self,
        core: &Core,
        texts: Vec<bytes::Bytes>,
        normalize: bool,
        tenant: Option<String>,
    ) -> Result<Embeddings> {
        if texts.is_empty() || texts.len() > MAX_INPUTS {
            return Err(Error::invalid(format!("give 1 to {MAX_INPUTS} texts, not {}", texts.len())));
        }
        let spec = &self.route.model().spec;
        let model = spec.name.clone();
        let rows = spec.batch.max_batch_size.max(1);
        let window = spec.instance_count.max(1);
        let charged = core.admit(&self.route, tenant.as_deref())?;
        let chunks: Vec<&[bytes::Bytes]> = texts.chunks(rows).collect();
        let call = |chunk: &[bytes::Bytes]| {
            let req = InferRequest {
                model_name: model.clone(),
                inputs: vec![Tensor::new(
                    &self.input,
                    DataType::Bytes,
                    vec![chunk.len()],
                    TensorData::Strings(chunk.to_vec()),
                )],
                outputs: Some(std::iter::once(self.output.clone()).chain(self.count.clone()).collect()),
                tenant: tenant.clone(),
                ..Default::default()
            };
            let (core, route, charged) = (core.clone(), self.route.clone(), charged.clone());
            Box::pin(async move { core.infer_on(route, req, Some(charged)).await })
                as Pin<Box<dyn Future<Output = Result<crate::InferResponse>> + Send>>
        };
        let mut vectors = Vec::with_capacity(texts.len());
        let mut tokens = 0u64;
        for resp in windowed(chunks.len(), window, |i| call(chunks[i])).await? {
            let v = &resp.outputs[0];
            let values = crate::pipeline::floats(v)?;
            let width = v.shape.get(1).copied().unwrap_or(0).max(1);
            for row in values.chunks(width) {
                let mut row = row.to_vec();
                if normalize {
                    let norm = row.iter().map(|x| x * x).sum::<f32>().sqrt().max(1e-12);
                    row.iter_mut().for_each(|x| *x /= norm);
                }
                vectors.push(row);
            }
            if let Some(c) = resp.outputs.get(1) {
                tokens += crate::pipeline::floats(c)?.iter().map(|&n| n as u64).sum::<u64>();
            }
        }
        Ok(Embeddings { model, vectors, tokens })
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
