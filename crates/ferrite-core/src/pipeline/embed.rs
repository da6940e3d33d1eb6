//! Text embeddings the way their users ask for them (OpenAI's `/v1/embeddings`, TEI's `/embed`):
//! a list of texts to a pipeline that takes one text per row and answers a vector per row. The
//! front-ends only translate; every request goes through `Core::infer`, so the model's limits,
//! tenants, metrics and cache apply.

use std::{future::Future, pin::Pin};

use crate::{engine::spec::ModelSpec, Core, DataType, Error, InferRequest, Result, Tensor, TensorData};

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

/// Embeds `texts` with `model` (in calls of at most its max batch size, run at once);
/// `normalize` scales each vector to unit length. `tenant` as for `Core::infer`.
pub async fn embed(
    core: &Core,
    model: &str,
    texts: Vec<bytes::Bytes>,
    normalize: bool,
    tenant: Option<String>,
) -> Result<Embeddings> {
    if texts.is_empty() || texts.len() > MAX_INPUTS {
        return Err(Error::invalid(format!("give 1 to {MAX_INPUTS} texts, not {}", texts.len())));
    }
    let m = core.model(model, None)?;
    let (input, output, count) = tensors(&m.spec).ok_or_else(|| {
        Error::invalid(format!("model '{model}' does not answer embeddings (one text in, one vector out per row)"))
    })?;
    let rows = m.spec.batch.max_batch_size.max(1);
    let mut calls: Vec<Pin<Box<dyn Future<Output = Result<crate::InferResponse>> + Send>>> = Vec::new();
    for chunk in texts.chunks(rows) {
        let req = InferRequest {
            model_name: model.to_string(),
            inputs: vec![Tensor::new(&input, DataType::Bytes, vec![chunk.len()], TensorData::Strings(chunk.to_vec()))],
            outputs: Some(std::iter::once(output.clone()).chain(count.clone()).collect()),
            tenant: tenant.clone(),
            ..Default::default()
        };
        let core = core.clone();
        calls.push(Box::pin(async move { core.infer(req).await }));
    }
    let mut vectors = Vec::with_capacity(texts.len());
    let mut tokens = 0u64;
    for resp in join_all(calls).await {
        let resp = resp?;
        let v = &resp.outputs[0];
        let values = super::floats(v)?;
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
            tokens += super::floats(c)?.iter().map(|&n| n as u64).sum::<u64>();
        }
    }
    Ok(Embeddings { model: model.to_string(), vectors, tokens })
}

/// Awaits every future at once; results in order.
async fn join_all<T>(mut futures: Vec<Pin<Box<dyn Future<Output = T> + Send>>>) -> Vec<T> {
    let mut done: Vec<Option<T>> = futures.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (f, slot) in futures.iter_mut().zip(done.iter_mut()) {
            if slot.is_none() {
                match f.as_mut().poll(cx) {
                    std::task::Poll::Ready(v) => *slot = Some(v),
                    std::task::Poll::Pending => pending = true,
                }
            }
        }
        if pending {
            std::task::Poll::Pending
        } else {
            std::task::Poll::Ready(())
        }
    })
    .await;
    done.into_iter().flatten().collect()
}
