//! `tokenize`: a Hugging Face `tokenizer.json` (the `tokenizers` crate) turns one text per row
//! (and a second one, for pair inputs) into `input_ids`, `attention_mask` and `token_type_ids`,
//! padded to the longest row of the batch. The step's `max_length` and `truncation` replace what
//! the file says (sentence-transformers files truncate to 128 where the model takes 256).

use std::collections::BTreeMap;

use serde::Deserialize;
use tokenizers::{Tokenizer, TruncationParams};

use super::{model_file, per_row, Kind, StepError, Value};
use crate::{DataType, Error, Result, Tensor, TensorData};

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

    pub fn run(&self, values: &mut BTreeMap<String, Value>) -> Result<(), StepError> {
        let texts = super::rows_of(values, &self.input)?;
        let pairs = match &self.pair {
            Some(p) => Some(super::rows_of(values, p)?),
            None => None,
        };
        let index: Vec<usize> = (0..texts.len()).collect();
        let encodings = per_row(&index, |&i| {
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
        })?;
        let longest = encodings.iter().map(|e| e.get_ids().len()).max().unwrap_or(0).max(1);
        let counts = encodings
            .iter()
            .map(|e| Tensor::from_le("token_count", DataType::Int64, vec![], &[e.get_ids().len() as i64]));
        values.insert("token_count".into(), Value::Rows(counts.collect()));
        for name in &self.outputs {
            let rows = encodings
                .iter()
                .map(|e| {
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
        Ok(())
    }
}

impl Tokenize {
    /// The encoding of `text` (and `pair`), paying for the tokens kept rather than the text's
    /// whole length: each text is cut at a word boundary to a prefix of `8 x max_length` bytes,
    /// which is taken when it holds more tokens than are kept (the rest would be cut anyway), and
    /// grown fourfold until it does or is the whole text. So 1 MB of text costs a few kilobytes.
    fn encode(&self, text: &str, pair: Option<&str>) -> Result<tokenizers::Encoding> {
        let failed = |e: tokenizers::Error| Error::invalid(format!("cannot tokenize: {e}"));
        let mut budget = self.max_length.saturating_mul(8).max(256);
        loop {
            let (a, b) = (prefix(text, budget), pair.map(|p| prefix(p, budget)));
            let whole = a.len() == text.len() && pair.zip(b).is_none_or(|(p, b)| b.len() == p.len());
            let encoding = match b {
                Some(b) => self.tokenizer.encode((a, b), self.special),
                None => self.tokenizer.encode(a, self.special),
            }
            .map_err(failed)?;
            if whole {
                return Ok(encoding);
            }
            // Over the limit with what was read: the rest of the text could not have been kept.
            let over = |t: &str| -> Result<bool> {
                let e = self.tokenizer.encode(t, false).map_err(failed)?;
                Ok(!e.get_overflowing().is_empty() || e.get_ids().len() > self.max_length)
            };
            let enough = match b {
                // Each cut side alone must be over the limit (longest-first truncation takes from both).
                Some(b) => {
                    (a.len() == text.len() || over(a)?) && (pair.is_some_and(|p| b.len() == p.len()) || over(b)?)
                }
                None => !encoding.get_overflowing().is_empty() || encoding.get_ids().len() > self.max_length,
            };
            if enough {
                return Ok(encoding);
            }
            budget = budget.saturating_mul(4);
        }
    }
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
