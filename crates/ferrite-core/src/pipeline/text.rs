//! `tokenize`: a Hugging Face `tokenizer.json` (the `tokenizers` crate) turns one text per row
//! (and a second one, for pair inputs) into `input_ids`, `attention_mask` and `token_type_ids`,
//! each row padded to the longest row of its group of requests of near lengths (`padded_lengths`),
//! so a model step calls the model once a group and a request's rows agree in length. The step's
//! `max_length` and `truncation` replace what the file says (sentence-transformers files truncate
//! to 128 where the model takes 256).

use std::collections::BTreeMap;

use serde::Deserialize;
use tokenizers::{Encoding, Tokenizer, TruncationParams};

use super::{model_file, post::Pooling, Kind, StepError, Value};
use crate::{
    engine::spec::{Task, TensorSpec, TextSpec},
    DataType, Error, Result, Tensor, TensorData,
};

fn default_text() -> String {
    "text".into()
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct TokenizeConfig {
    pub name: Option<String>,
    /// The BYTES input holding one UTF-8 text per row (default `text`).
    #[serde(default = "default_text")]
    pub input: String,
    /// A second BYTES input for pair inputs (question and passage, say).
    pub pair: Option<String>,
    /// The tokenizer file in the model's directory (default `tokenizer.json`).
    pub tokenizer: Option<String>,
    /// Tokens per row at most, special tokens included (default: the file's, else 512).
    pub max_length: Option<usize>,
    /// `false`: a text longer than `max_length` fails its request instead of being cut.
    pub truncation: Option<bool>,
    /// Whether to add the model's special tokens (`[CLS]`, `[SEP]`); default true.
    pub add_special_tokens: Option<bool>,
    /// INT64 (default) or INT32.
    pub dtype: Option<String>,
    /// Which tensors to write, of `input_ids`, `attention_mask`, `token_type_ids` (default all).
    pub outputs: Option<Vec<String>>,
}

impl TokenizeConfig {
    pub(crate) fn input(&self) -> &str {
        &self.input
    }
}

pub(crate) struct Tokenize {
    input: String,
    pair: Option<String>,
    tokenizer: Tokenizer,
    max_length: usize,
    truncation: bool,
    special: bool,
    pad_id: u32,
    dtype: DataType,
    outputs: Vec<String>,
}

const NAMES: [&str; 3] = ["input_ids", "attention_mask", "token_type_ids"];

impl Tokenize {
    pub fn new(dir: &std::path::Path, c: &TokenizeConfig) -> Result<Tokenize> {
        let path = model_file(dir, c.tokenizer.as_deref().unwrap_or("tokenizer.json"), "tokenizer")?;
        let mut tokenizer = Tokenizer::from_file(&path)
            .map_err(|e| Error::invalid(format!("cannot read tokenizer {}: {e}", path.display())))?;
        let max_length = c.max_length.or(tokenizer.get_truncation().map(|t| t.max_length)).unwrap_or(512);
        if !(2..=65536).contains(&max_length) {
            return Err(Error::invalid("max_length must be 2..=65536"));
        }
        let truncation = c.truncation.unwrap_or(true);
        let pad_id = tokenizer
            .get_padding()
            .map(|p| p.pad_id)
            .or_else(|| tokenizer.token_to_id("[PAD]"))
            .or_else(|| tokenizer.token_to_id("<pad>"))
            .unwrap_or(0);
        // The step pads (to the batch's longest row) and truncates; the file's settings go.
        tokenizer.with_padding(None);
        let limit = if truncation { max_length } else { usize::MAX / 2 };
        let params = TruncationParams { max_length: limit, ..Default::default() };
        tokenizer.with_truncation(Some(params)).map_err(|e| Error::invalid(format!("truncation: {e}")))?;
        let dtype = match c.dtype.as_deref().unwrap_or("INT64").to_ascii_uppercase().as_str() {
            "INT64" => DataType::Int64,
            "INT32" => DataType::Int32,
            other => return Err(Error::invalid(format!("dtype '{other}': INT64 or INT32"))),
        };
        let outputs = c.outputs.clone().unwrap_or_else(|| NAMES.iter().map(|s| s.to_string()).collect());
        if let Some(o) = outputs.iter().find(|o| !NAMES.contains(&o.as_str())) {
            return Err(Error::invalid(format!("output '{o}' is not one of {NAMES:?}")));
        }
        Ok(Tokenize {
            input: c.input.clone(),
            pair: c.pair.clone(),
            tokenizer,
            max_length,
            truncation,
            special: c.add_special_tokens.unwrap_or(true),
            pad_id,
            dtype,
            outputs,
        })
    }

    /// What it writes: the tensors asked for, and `token_count` (INT64, one per row: the row's
    /// tokens before padding, special tokens included; what OpenAI's `usage` counts).
    pub fn outputs(&self) -> Vec<(String, Kind)> {
        let mut out: Vec<_> = self.outputs.iter().map(|o| (o.clone(), Kind::Tensor(self.dtype, vec![-1]))).collect();
        out.push(("token_count".into(), Kind::Tensor(DataType::Int64, vec![])));
        out
    }

    /// Tokenizes every row; `request_of(row)` is the request a row belongs to, whose rows are
    /// padded alike (so values of a text's length stack into its answer; a pipeline whose answers
    /// have fixed shapes gives each row a request of its own). The rows that failed, with their
    /// errors (their rows are written, empty); every row failing fails the step.
    pub fn run(
        &self,
        values: &mut BTreeMap<String, Value>,
        request_of: &dyn Fn(usize) -> usize,
    ) -> Result<Vec<(usize, Error)>, StepError> {
        let texts = super::rows_of(values, &self.input)?;
        let pairs = match &self.pair {
            Some(p) => Some(super::rows_of(values, p)?),
            None => None,
        };
        let one = |i: usize| {
            let pair = match pairs {
                Some(p) => Some(one_text(&p[i])?),
                None => None,
            };
            let encoding = self.encode(one_text(&texts[i])?, pair)?;
            if !self.truncation && encoding.get_ids().len() > self.max_length {
                return Err(Error::invalid(format!(
                    "the text has more than max_length {} tokens (truncation is off)",
                    self.max_length
                )));
            }
            Ok(encoding)
        };
        // A row that fails gets no tokens here and is returned, so its request's rows go after
        // this step and the others' are not tokenized again.
        let mut failed = Vec::new();
        let encodings: Vec<Encoding> = (0..texts.len())
            .map(|i| {
                one(i).unwrap_or_else(|e| {
                    failed.push((i, e));
                    Encoding::default()
                })
            })
            .collect();
        if failed.len() == texts.len() {
            return Err(StepError::Rows(failed));
        }
        let own: Vec<usize> = encodings.iter().map(|e| e.get_ids().len()).collect();
        let lengths = padded_lengths(&own, &(0..own.len()).map(request_of).collect::<Vec<_>>());
        let counts = encodings
            .iter()
            .map(|e| Tensor::from_le("token_count", DataType::Int64, vec![], &[e.get_ids().len() as i64]));
        values.insert("token_count".into(), Value::Rows(counts.collect()));
        for name in &self.outputs {
            let rows = encodings
                .iter()
                .zip(&lengths)
                .map(|(e, &longest)| {
                    let (values, pad): (&[u32], u32) = match name.as_str() {
                        "input_ids" => (e.get_ids(), self.pad_id),
                        "attention_mask" => (e.get_attention_mask(), 0),
                        _ => (e.get_type_ids(), 0),
                    };
                    let padded = values.iter().copied().chain(std::iter::repeat(pad)).take(longest);
                    match self.dtype {
                        DataType::Int32 => Tensor::from_le(
                            name,
                            DataType::Int32,
                            vec![longest],
                            &padded.map(|v| v as i32).collect::<Vec<_>>(),
                        ),
                        _ => Tensor::from_le(
                            name,
                            DataType::Int64,
                            vec![longest],
                            &padded.map(i64::from).collect::<Vec<_>>(),
                        ),
                    }
                })
                .collect();
            values.insert(name.clone(), Value::Rows(rows));
        }
        Ok(failed)
    }
}

/// Padding a group may add, as a share of its rows' own tokens. Measured in-process
/// (`bench/results/text-lengths.md`: texts of 5 to 150 tokens, median 22) on an encoder of
/// all-MiniLM-L6-v2's size: batches of 8 and 32 padded to their longest ran at 0.60 and 0.39 of
/// one text at a time; grouped within 0%, 10%, 25%, 50% and 100% of padding at 1.03, 1.04, 1.01,
/// 0.99, 0.89 (8 rows) and 1.11, 1.18, 1.17, 1.04, 0.91 (32 rows). On the bundled small encoder,
/// whose runs cost little beside tokenizing: 0.78 and 0.64 padded whole, 0.89-0.96 and
/// 0.91-1.00 grouped, 1.00 at 25% for 32 rows.
const PAD_WASTE: f64 = 0.25;

/// The length each row is padded to, given each row's own and its request: requests in order of
/// their longest row, each group as long as padding its rows to its longest adds at most
/// `PAD_WASTE` of their own tokens, every row the length of its group's longest (at least 1). A
/// request's rows are one group's; rows of one length are one group; a lone request keeps its own
/// longest, so a text sent alone is run as it was alone.
fn padded_lengths(lengths: &[usize], requests: &[usize]) -> Vec<usize> {
    // Per request: its longest row, its rows' own tokens, its rows.
    let mut by_request: BTreeMap<usize, (usize, usize, Vec<usize>)> = BTreeMap::new();
    for (row, (&len, &request)) in lengths.iter().zip(requests).enumerate() {
        let r = by_request.entry(request).or_default();
        r.0 = r.0.max(len.max(1));
        r.1 += len.max(1);
        r.2.push(row);
    }
    let mut order: Vec<_> = by_request.into_values().collect();
    order.sort_by_key(|r| r.0);
    let mut out = vec![0; lengths.len()];
    let mut group: Vec<usize> = Vec::new();
    let (mut tokens, mut longest) = (0, 0);
    for (request_longest, request_tokens, rows) in order {
        let padded = (group.len() + rows.len()) * request_longest;
        if !group.is_empty() && padded as f64 > (1.0 + PAD_WASTE) * (tokens + request_tokens) as f64 {
            for r in group.drain(..) {
                out[r] = longest;
            }
            tokens = 0;
        }
        group.extend(rows);
        tokens += request_tokens;
        longest = request_longest;
    }
    for r in group {
        out[r] = longest;
    }
    out
}

impl Tokenize {
    fn encode(&self, text: &str, pair: Option<&str>) -> Result<tokenizers::Encoding> {
        encode(&self.tokenizer, text, pair, self.special, self.max_length)
    }

    /// The bytes of a request's texts this step reads at most (`encode`'s first prefix of each):
    /// what its tokenizing costs, known before it queues.
    pub(crate) fn read_bytes(&self, inputs: &[Tensor]) -> u64 {
        let most = first_prefix(self.max_length) as u64;
        let texts = |name: &String| match inputs.iter().find(|t| &t.name == name).map(|t| &t.data) {
            Some(TensorData::Strings(texts)) => texts.iter().map(|t| (t.len() as u64).min(most)).sum(),
            _ => 0,
        };
        std::iter::once(&self.input).chain(&self.pair).map(texts).sum()
    }

    /// What the text routes read of the step: its inputs, its limit, and its tokenizer without
    /// truncation (TEI's `/tokenize` never cuts; a length check must see past the limit).
    pub(crate) fn parts(&self) -> (String, Option<String>, usize, bool, Tokenizer) {
        let mut plain = self.tokenizer.clone();
        // Infallible without a stride; None has no stride at all.
        let _ = plain.with_truncation(None);
        (self.input.clone(), self.pair.clone(), self.max_length, self.special, plain)
    }
}

/// The bytes of a text `encode` reads first: `8 x max_length`, at least 256.
fn first_prefix(max_length: usize) -> usize {
    max_length.saturating_mul(8).max(256)
}

/// The encoding of `text` (and `pair`) by `tokenizer`, paying for the tokens kept rather than the
/// text's whole length: each text is cut at a word boundary to a prefix of `8 x max_length`
/// bytes, which is taken when it holds more tokens than are kept (the rest would be cut anyway,
/// or, without truncation, the text is over the limit whatever follows), and grown fourfold
/// until it does or is the whole text. So 1 MB of text costs a few kilobytes.
pub(crate) fn encode(
    tokenizer: &Tokenizer,
    text: &str,
    pair: Option<&str>,
    special: bool,
    max_length: usize,
) -> Result<tokenizers::Encoding> {
    let failed = |e: tokenizers::Error| Error::invalid(format!("cannot tokenize: {e}"));
    let mut budget = first_prefix(max_length);
    loop {
        let (a, b) = (prefix(text, budget), pair.map(|p| prefix(p, budget)));
        let whole = a.len() == text.len() && pair.zip(b).is_none_or(|(p, b)| b.len() == p.len());
        let encoding = match b {
            Some(b) => tokenizer.encode((a, b), special),
            None => tokenizer.encode(a, special),
        }
        .map_err(failed)?;
        if whole {
            return Ok(encoding);
        }
        // Over the limit with what was read: the rest of the text could not have been kept.
        let over = |t: &str| -> Result<bool> {
            let e = tokenizer.encode(t, false).map_err(failed)?;
            Ok(!e.get_overflowing().is_empty() || e.get_ids().len() > max_length)
        };
        let enough = match b {
            // Each cut side alone must be over the limit (longest-first truncation takes from both).
            Some(b) => (a.len() == text.len() || over(a)?) && (pair.is_some_and(|p| b.len() == p.len()) || over(b)?),
            None => !encoding.get_overflowing().is_empty() || encoding.get_ids().len() > max_length,
        };
        if enough {
            return Ok(encoding);
        }
        budget = budget.saturating_mul(4);
    }
}

/// The text routes' view of a pipeline whose first tokenize step is `tokenize` and whose pool
/// step (if any) writes `pool`: for the task its config declares or, with none declared, `embed`
/// when it tokenizes one text and pools; `None` for a pipeline that is no text model. `outputs`
/// are the pipeline's (without the batch dim), `labels` a classifier's by output.
pub(crate) fn text_spec(
    dir: &std::path::Path,
    task: Option<Task>,
    tokenize: Option<&Tokenize>,
    pool: Option<(&str, Pooling, bool)>,
    inputs: &[TensorSpec],
    outputs: &[TensorSpec],
    labels: &BTreeMap<String, Vec<String>>,
) -> Result<Option<TextSpec>> {
    let Some(tokenize) = tokenize else {
        return match task {
            Some(t) => Err(Error::invalid(format!("task '{}' needs a tokenize step", t.as_str()))),
            None => Ok(None),
        };
    };
    let (input, pair, max_length, special_tokens, tokenizer) = tokenize.parts();
    let Some(task) = task.or((pool.is_some() && pair.is_none()).then_some(Task::Embed)) else { return Ok(None) };
    let fail = |m: String| Error::invalid(format!("task '{}': {m}", task.as_str()));
    if let Some(other) = inputs.iter().find(|t| t.name != input && Some(&t.name) != pair.as_ref()) {
        return Err(fail(format!("the pipeline also takes '{}', which its text routes cannot send", other.name)));
    }
    let floats = |rank: &dyn Fn(&[i64]) -> bool| -> Vec<&TensorSpec> {
        outputs.iter().filter(|o| o.datatype == DataType::Fp32 && rank(&o.dims)).collect()
    };
    let named = |found: Vec<&TensorSpec>, names: &[&str]| -> Option<String> {
        let by_name = names.iter().find_map(|n| found.iter().find(|o| o.name == *n));
        by_name.or(found.first()).map(|o| o.name.clone())
    };
    let vector = |d: &[i64]| d.len() == 1;
    let (output, normalized) = match task {
        Task::Embed => {
            if pair.is_some() {
                return Err(fail("an embedder takes one text; its tokenize step has a pair".into()));
            }
            let output = pool
                .filter(|(o, ..)| outputs.iter().any(|t| t.name == *o))
                .map(|(o, ..)| o.to_string())
                .or_else(|| named(floats(&vector), &["embedding", "sentence_embedding"]))
                .ok_or_else(|| fail("the pipeline answers no vector (an FP32 output of one dim)".into()))?;
            let normalized = pool.is_some_and(|(o, _, n)| o == output && n);
            (output, normalized)
        }
        Task::Rerank => {
            if pair.is_none() {
                return Err(fail("a re-ranker reads (query, text) pairs: give its tokenize step a `pair`".into()));
            }
            let one = |d: &[i64]| d.is_empty() || d == [1];
            let output = named(floats(&one), &["logits", "scores", "score"])
                .ok_or_else(|| fail("the pipeline answers no score (an FP32 output of one value per row)".into()))?;
            (output, false)
        }
        Task::Classify => {
            let output = named(floats(&vector), &["logits", "scores", "probabilities"])
                .ok_or_else(|| fail("the pipeline answers no scores (an FP32 output of one per class)".into()))?;
            (output, false)
        }
    };
    let labels = labels.get(&output).cloned().unwrap_or_default();
    let width = outputs.iter().find(|o| o.name == output).and_then(|o| o.dims.first().copied()).unwrap_or(-1);
    if task == Task::Classify && !labels.is_empty() && width >= 0 && labels.len() as i64 != width {
        return Err(fail(format!("{} labels for {width} scores", labels.len())));
    }
    let (prompts, default_prompt) = prompts(dir)?;
    Ok(Some(TextSpec {
        task,
        input,
        pair,
        output,
        count: outputs.iter().find(|o| o.name == "token_count").map(|o| o.name.clone()),
        max_length,
        special_tokens,
        pooling: pool.map(|(_, mode, _)| mode.as_str().to_string()),
        normalized,
        labels,
        prompts,
        default_prompt,
        tokenizer: std::sync::Arc::new(tokenizer),
    }))
}

/// sentence-transformers' prompts, from `config_sentence_transformers.json` when the directory
/// has one: `{"prompts": {"query": "query: "}, "default_prompt_name": "query"}`.
fn prompts(dir: &std::path::Path) -> Result<(BTreeMap<String, String>, Option<String>)> {
    #[derive(Deserialize, Default)]
    struct File {
        #[serde(default)]
        prompts: BTreeMap<String, String>,
        default_prompt_name: Option<String>,
    }
    let path = dir.join("config_sentence_transformers.json");
    let file: File = match std::fs::read(&path) {
        Ok(bytes) => serde_json::from_slice(&bytes)
            .map_err(|e| Error::invalid(format!("cannot read {}: {e}", path.display())))?,
        Err(_) => File::default(),
    };
    if let Some(name) = file.default_prompt_name.as_ref().filter(|n| !file.prompts.contains_key(*n)) {
        return Err(Error::invalid(format!("{}: default_prompt_name '{name}' is not a prompt", path.display())));
    }
    Ok((file.prompts, file.default_prompt_name))
}

/// The longest prefix of `text` of at most `budget` bytes that ends at a word boundary (at a
/// character boundary when its first `budget` bytes hold no space).
fn prefix(text: &str, budget: usize) -> &str {
    if text.len() <= budget {
        return text;
    }
    let mut end = budget;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    match text[..end].rfind(char::is_whitespace) {
        Some(at) if at > 0 => &text[..at],
        _ => &text[..end],
    }
}

/// The one UTF-8 text of a row; an empty one is refused (it has nothing to embed).
fn one_text(t: &Tensor) -> Result<&str> {
    let TensorData::Strings(items) = &t.data else { return Err(Error::invalid("the text is not BYTES")) };
    let [bytes] = items.as_slice() else {
        return Err(Error::invalid(format!("one text per row expected, got {} elements", items.len())));
    };
    let text = std::str::from_utf8(bytes).map_err(|_| Error::invalid("the text is not UTF-8"))?;
    if text.trim().is_empty() {
        return Err(Error::invalid("the text is empty"));
    }
    Ok(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokenize(max_length: usize, truncation: bool) -> Tokenize {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/text_embedder");
        let config = TokenizeConfig {
            name: None,
            input: "text".into(),
            pair: None,
            tokenizer: None,
            max_length: Some(max_length),
            truncation: Some(truncation),
            add_special_tokens: None,
            dtype: None,
            outputs: None,
        };
        Tokenize::new(&dir, &config).unwrap()
    }

    #[test]
    fn rows_are_padded_within_groups_of_near_lengths() {
        // Each row its own request.
        let alone = |lengths: &[usize]| padded_lengths(lengths, &(0..lengths.len()).collect::<Vec<_>>());
        assert_eq!(alone(&[]), Vec::<usize>::new());
        assert_eq!(alone(&[7]), [7], "a lone row keeps its length");
        assert_eq!(alone(&[0]), [1]);
        assert_eq!(alone(&[9, 9, 9]), [9, 9, 9]);
        // 5 and 6 share a group (12 padded tokens for 11 of their own); 100 does not join them.
        assert_eq!(alone(&[100, 5, 6]), [100, 6, 6]);
        // Order kept, each row its group's longest: {10, 11, 12} and {40, 45}.
        assert_eq!(alone(&[40, 10, 45, 12, 11]), [45, 12, 45, 12, 12]);
        // The bound holds for every group of a long spread of lengths.
        let lengths: Vec<usize> = (0..200).map(|i| 5 + (i * 37) % 120).collect();
        let padded = alone(&lengths);
        let mut groups: BTreeMap<usize, (usize, usize)> = BTreeMap::new();
        for (&own, &to) in lengths.iter().zip(&padded) {
            assert!(to >= own);
            let g = groups.entry(to).or_default();
            g.0 += own;
            g.1 += to;
        }
        for (own, padded) in groups.values() {
            assert!(*padded as f64 <= (1.0 + PAD_WASTE) * *own as f64 + 1e-9, "{padded} for {own}");
        }
    }

    #[test]
    fn a_requests_rows_share_one_length() {
        // Request 0 has rows of 5 and 100 tokens: both 100, whatever the bound; request 1 alone.
        assert_eq!(padded_lengths(&[5, 6, 100], &[0, 1, 0]), [100, 6, 100]);
        // One request (a batch of texts sent together): every row its longest.
        assert_eq!(padded_lengths(&[5, 60, 9], &[0, 0, 0]), [60, 60, 60]);
        // Requests of near lengths still share a group: {7, 8} and {8}.
        assert_eq!(padded_lengths(&[7, 8, 8], &[0, 0, 1]), [8, 8, 8]);
    }

    #[test]
    fn a_batch_of_texts_is_padded_per_group_and_the_mask_marks_each_texts_own_tokens() {
        let t = tokenize(128, true);
        let texts = ["a cat", "a dog", "the quick brown fox jumps over the lazy dog near the river bank today"];
        let mut values = rows_of_texts(&texts);
        // Each text its own request, as TEI's clients send them.
        assert!(t.run(&mut values, &|r| r).is_ok());
        let Some(Value::Rows(ids)) = values.get("input_ids") else { panic!("no input_ids") };
        let Some(Value::Rows(mask)) = values.get("attention_mask") else { panic!("no attention_mask") };
        let own: Vec<usize> = texts.iter().map(|x| t.encode(x, None).unwrap().get_ids().len()).collect();
        assert_eq!(ids[0].shape, vec![own[0]]);
        assert_eq!(ids[1].shape, vec![own[1]], "the two short texts are one group, unpadded");
        assert_eq!(ids[2].shape, vec![own[2]], "the long one is not padded to, nor pads them");
        for (m, n) in mask.iter().zip(&own) {
            assert_eq!(m.shape, vec![*n]);
        }
    }

    /// A `text` value of one row per text.
    fn rows_of_texts(texts: &[&'static str]) -> BTreeMap<String, Value> {
        let rows = texts
            .iter()
            .map(|x| {
                let data = TensorData::Strings(vec![bytes::Bytes::from_static(x.as_bytes())]);
                Tensor::new("text", DataType::Bytes, vec![1], data)
            })
            .collect();
        BTreeMap::from([("text".to_string(), Value::Rows(rows))])
    }

    #[test]
    fn rows_that_fail_are_returned_and_the_others_tokenized_once() {
        let t = tokenize(8, false);
        let mut values = rows_of_texts(&["a cat", " ", "a dog", "one two three four five six seven eight nine"]);
        let Ok(failed) = t.run(&mut values, &|r| r) else { panic!("the good rows are written") };
        let failed: Vec<(usize, String)> = failed.into_iter().map(|(r, e)| (r, e.to_string())).collect();
        assert_eq!(failed.len(), 2, "{failed:?}");
        assert!(failed[0].0 == 1 && failed[0].1.contains("empty"), "{failed:?}");
        assert!(failed[1].0 == 3 && failed[1].1.contains("max_length"), "{failed:?}");
        let Some(Value::Rows(ids)) = values.get("input_ids") else { panic!("no input_ids") };
        assert_eq!(ids.len(), 4, "every row written, the batch's rows stay aligned");
        let own = t.encode("a cat", None).unwrap().get_ids().len();
        assert_eq!((ids[0].shape[0], ids[2].shape[0]), (own, own));
        // Every row failing fails the step.
        assert!(matches!(t.run(&mut rows_of_texts(&["", " "]), &|r| r), Err(StepError::Rows(rows)) if rows.len() == 2));
    }

    #[test]
    fn a_prefix_ends_at_a_word_or_a_character() {
        assert_eq!(prefix("hello world", 100), "hello world");
        assert_eq!(prefix("hello world again", 13), "hello world");
        assert_eq!(prefix("aaaaaaaa", 3), "aaa");
        assert_eq!(prefix("ééé", 3), "é");
    }

    #[test]
    fn long_texts_encode_as_if_read_whole() {
        let t = tokenize(16, true);
        let long: String = (0..5000).map(|i| format!("word{} ", i % 7)).collect();
        let cut = t.encode(&long, None).unwrap();
        let whole = t.tokenizer.encode(long.as_str(), true).unwrap();
        assert_eq!(cut.get_ids(), whole.get_ids());
        let pair = t.encode(&long, Some("a short question")).unwrap();
        let whole = t.tokenizer.encode((long.as_str(), "a short question"), true).unwrap();
        assert_eq!(pair.get_ids(), whole.get_ids());
        // One long word is read until it is whole (WordPiece makes it one [UNK], as read whole).
        let word = "x".repeat(1 << 16);
        assert_eq!(
            t.encode(&word, None).unwrap().get_ids(),
            t.tokenizer.encode(word.as_str(), true).unwrap().get_ids()
        );
        // Without truncation, a long text is over the limit whatever part of it was read.
        let strict = tokenize(16, false);
        assert!(strict.encode(&long, None).unwrap().get_ids().len() > 16);
    }
}
