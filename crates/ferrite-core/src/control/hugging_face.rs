//! A Hugging Face / sentence-transformers model directory served as it is, as TEI serves one:
//! `config.json` and `tokenizer.json` beside `model.onnx` (or `onnx/model.onnx`), and no version
//! directories. Its text pipeline is found from its files, by TEI's rules:
//!
//! - the task from `config.json`'s `architectures`: `*ForSequenceClassification` with one label
//!   re-ranks (a cross-encoder, reading (query, text) pairs), with several classifies (labels from
//!   `id2label`); any other encoder (`BertModel`, `XLMRobertaModel`, ...) embeds;
//!   `*ForMaskedLM` embeds with SPLADE's pooling of its `logits` (TEI's `--pooling splade`, the
//!   one it serves such a model with), sparse vectors for `/embed_sparse`;
//! - the max input length from `sentence_bert_config.json`'s `max_seq_length`, else the model's
//!   `max_position_embeddings` (less RoBERTa's two offset positions);
//! - an embedder's pooling from `1_Pooling/config.json` (mean, cls, max, last token); one without
//!   that file is refused, as TEI refuses it without `--pooling`. Vectors are normalized by the
//!   routes (TEI's `normalize`, on by default), not by the pipeline.
//!
//! A `config.toml` beside the files overrides: its `task`, batching, cache and ONNX Runtime
//! settings apply; with `[[steps]]` of its own it is an ordinary pipeline.

use std::path::Path;

use serde::Deserialize;

use crate::{
    control::{
        config::{ModelConfig, TensorConfig},
        repository::PIPELINE_MAX_BATCH_SIZE,
    },
    engine::spec::Task,
    pipeline::{ModelStepConfig, PoolConfig, Pooling, StepConfig, TokenizeConfig},
    Error, Result,
};

/// Whether `dir` holds a Hugging Face model: `config.json` and `tokenizer.json`, and no version
/// directory.
pub fn is_layout(dir: &Path) -> bool {
    let versioned =
        std::fs::read_dir(dir).into_iter().flatten().flatten().any(|e| {
            e.path().is_dir() && e.file_name().to_str().is_some_and(|n| n.parse::<u64>().is_ok_and(|v| v > 0))
        });
    dir.join("config.json").is_file() && dir.join("tokenizer.json").is_file() && !versioned
}

#[derive(Deserialize, Default)]
struct HfConfig {
    #[serde(default)]
    architectures: Vec<String>,
    model_type: Option<String>,
    max_position_embeddings: Option<usize>,
    vocab_size: Option<usize>,
    #[serde(default)]
    id2label: std::collections::BTreeMap<String, String>,
}

/// The most bytes of logits a SPLADE model's batch may make (`[rows, tokens, vocabulary]` FP32:
/// a row of 512 tokens of BERT's 30,522 entries is 62.5 MB), which bounds its batches' rows.
const SPLADE_BATCH_BYTES: usize = 256 << 20;

#[derive(Deserialize)]
struct SentenceBert {
    max_seq_length: Option<usize>,
}

#[derive(Deserialize, Default)]
struct PoolingFile {
    #[serde(default)]
    pooling_mode_cls_token: bool,
    #[serde(default)]
    pooling_mode_mean_tokens: bool,
    #[serde(default)]
    pooling_mode_max_tokens: bool,
    #[serde(default)]
    pooling_mode_lasttoken: bool,
    #[serde(default)]
    pooling_mode_mean_sqrt_len_tokens: bool,
    #[serde(default)]
    pooling_mode_weightedmean_tokens: bool,
}

fn read<T: serde::de::DeserializeOwned>(dir: &Path, file: &str) -> Result<Option<T>> {
    let path = dir.join(file);
    match std::fs::read(&path) {
        Ok(bytes) => {
            serde_json::from_slice(&bytes).map(Some).map_err(|e| Error::invalid(format!("cannot read {file}: {e}")))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(Error::invalid(format!("cannot read {file}: {e}"))),
    }
}

/// The ONNX file: `default_model_filename` (default `model.onnx`) at the top or under `onnx/`.
fn onnx_file(dir: &Path, config: &ModelConfig) -> Result<String> {
    let name = config.default_model_filename.as_deref().unwrap_or(super::repository::DEFAULT_MODEL_FILENAME);
    [name.to_string(), format!("onnx/{name}")].into_iter().find(|f| dir.join(f).is_file()).ok_or_else(|| {
        Error::invalid(format!(
            "a Hugging Face directory without an ONNX file: neither {name} nor onnx/{name} (export one with optimum)"
        ))
    })
}

/// `config` with the pipeline of the Hugging Face directory `dir` (see the module's text): its
/// steps, outputs, task and labels.
pub fn pipeline(dir: &Path, mut config: ModelConfig) -> Result<ModelConfig> {
    let hf: HfConfig = read(dir, "config.json")?.unwrap_or_default();
    let file = onnx_file(dir, &config)?;
    let arch = hf.architectures.first().cloned().unwrap_or_default();
    let splade = arch.ends_with("ForMaskedLM");
    let mut labels: Vec<(usize, String)> = hf
        .id2label
        .iter()
        .map(|(k, v)| k.parse().map(|i| (i, v.clone())).map_err(|_| Error::invalid(format!("id2label key '{k}'"))))
        .collect::<Result<_>>()?;
    labels.sort();
    let found = if arch.ends_with("ForSequenceClassification") {
        if labels.len() <= 1 {
            Task::Rerank
        } else {
            Task::Classify
        }
    } else if arch.contains("For") && !splade {
        return Err(Error::Unsupported(format!("{arch}: only embedders and sequence classifiers are served")));
    } else {
        Task::Embed
    };
    let task = *config.task.get_or_insert(found);
    let offset = match hf.model_type.as_deref() {
        Some("roberta" | "xlm-roberta" | "camembert") => 2,
        _ => 0,
    };
    let max_length = read::<SentenceBert>(dir, "sentence_bert_config.json")?
        .and_then(|s| s.max_seq_length)
        .or(hf.max_position_embeddings.map(|p| p.saturating_sub(offset)))
        .unwrap_or(512);
    let tokenize = TokenizeConfig {
        name: None,
        input: "text".into(),
        pair: (task == Task::Rerank).then(|| "pair".into()),
        tokenizer: None,
        max_length: Some(max_length),
        truncation: None,
        add_special_tokens: None,
        dtype: None,
        outputs: None,
    };
    let model = ModelStepConfig {
        name: None,
        model: String::new(),
        file: Some(file),
        version: None,
        inputs: Default::default(),
        outputs: Default::default(),
    };
    let mut steps = vec![StepConfig::Tokenize(tokenize), StepConfig::Model(model)];
    let output = |name: &str| TensorConfig { name: name.into(), ..Default::default() };
    if task == Task::Embed && splade {
        // Its batches hold at most SPLADE_BATCH_BYTES of logits at the longest texts.
        let row = max_length.max(1).saturating_mul(hf.vocab_size.unwrap_or(30_522)).saturating_mul(4);
        config.max_batch_size.get_or_insert((SPLADE_BATCH_BYTES / row).clamp(1, PIPELINE_MAX_BATCH_SIZE));
        steps.push(StepConfig::Pool(PoolConfig {
            name: None,
            input: Some("logits".into()),
            mask: None,
            output: None,
            mode: Pooling::Splade,
            normalize: false,
        }));
        if config.output.is_empty() {
            config.output = vec![output("embedding"), output("token_count")];
        }
    } else if task == Task::Embed {
        let p: PoolingFile = read(dir, "1_Pooling/config.json")?.ok_or_else(|| {
            Error::invalid("an embedder's directory needs 1_Pooling/config.json (its pooling), as TEI does")
        })?;
        let mode = match (
            p.pooling_mode_cls_token,
            p.pooling_mode_mean_tokens,
            p.pooling_mode_max_tokens,
            p.pooling_mode_lasttoken,
        ) {
            (true, false, false, false) => Pooling::Cls,
            (false, true, false, false) => Pooling::Mean,
            (false, false, true, false) => Pooling::Max,
            (false, false, false, true) => Pooling::Last,
            _ if p.pooling_mode_mean_sqrt_len_tokens || p.pooling_mode_weightedmean_tokens => {
                return Err(Error::Unsupported(
                    "1_Pooling/config.json: mean-sqrt-len and weighted-mean pooling are not served".into(),
                ))
            }
            _ => return Err(Error::invalid("1_Pooling/config.json names no pooling mode, or several")),
        };
        steps.push(StepConfig::Pool(PoolConfig {
            name: None,
            input: None,
            mask: None,
            output: None,
            mode,
            normalize: false,
        }));
        if config.output.is_empty() {
            config.output = vec![output("embedding"), output("token_count")];
        }
    } else if config.output.is_empty() {
        config.output = vec![output("logits"), output("token_count")];
        config.labels.insert("logits".into(), labels.into_iter().map(|(_, l)| l).collect());
    }
    config.steps = steps;
    Ok(config)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(files: &[(&str, &str)]) -> tempfile::TempDir {
        let d = tempfile::tempdir().unwrap();
        for (name, text) in files {
            let path = d.path().join(name);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, text).unwrap();
        }
        d
    }

    const POOL_MEAN: (&str, &str) = ("1_Pooling/config.json", r#"{"pooling_mode_mean_tokens": true}"#);

    fn found(files: &[(&str, &str)]) -> Result<ModelConfig> {
        let mut all = vec![("tokenizer.json", "{}"), ("onnx/model.onnx", "")];
        all.extend_from_slice(files);
        let d = dir(&all);
        assert!(is_layout(d.path()));
        pipeline(d.path(), ModelConfig::default())
    }

    fn max_length(c: &ModelConfig) -> Option<usize> {
        c.steps.iter().find_map(|s| match s {
            StepConfig::Tokenize(t) => t.max_length,
            _ => None,
        })
    }

    #[test]
    fn the_task_and_the_length_follow_teis_rules() {
        let c =
            found(&[("config.json", r#"{"architectures": ["BertModel"], "max_position_embeddings": 512}"#), POOL_MEAN])
                .unwrap();
        assert_eq!((c.task, max_length(&c)), (Some(Task::Embed), Some(512)));
        // sentence_bert_config.json first; RoBERTa's positions less its offset otherwise.
        let st = ("sentence_bert_config.json", r#"{"max_seq_length": 256}"#);
        assert_eq!(
            max_length(&found(&[("config.json", r#"{"architectures": ["BertModel"]}"#), POOL_MEAN, st]).unwrap()),
            Some(256)
        );
        let roberta =
            r#"{"architectures": ["XLMRobertaModel"], "model_type": "xlm-roberta", "max_position_embeddings": 514}"#;
        assert_eq!(max_length(&found(&[("config.json", roberta), POOL_MEAN]).unwrap()), Some(512));
        let one = r#"{"architectures": ["BertForSequenceClassification"], "id2label": {"0": "LABEL_0"}}"#;
        assert_eq!(found(&[("config.json", one)]).unwrap().task, Some(Task::Rerank));
        let three =
            r#"{"architectures": ["BertForSequenceClassification"], "id2label": {"2": "c", "0": "a", "1": "b"}}"#;
        let c = found(&[("config.json", three)]).unwrap();
        assert_eq!(
            (c.task, c.labels["logits"].clone()),
            (Some(Task::Classify), vec!["a".into(), "b".into(), "c".into()])
        );
    }

    #[test]
    fn a_masked_language_model_embeds_with_splade_in_batches_bounded_by_its_logits() {
        let mlm = r#"{"architectures": ["BertForMaskedLM"], "vocab_size": 30522, "max_position_embeddings": 512}"#;
        let c = found(&[("config.json", mlm)]).unwrap();
        assert_eq!(c.task, Some(Task::Embed));
        let pool = c.steps.iter().find_map(|s| match s {
            StepConfig::Pool(p) => Some(p.clone()),
            _ => None,
        });
        assert_eq!(pool.map(|p| (p.input, p.mode)), Some((Some("logits".into()), Pooling::Splade)));
        // 512 tokens of 30,522 FP32 logits are 62.5 MB a row: 4 rows to 256 MB.
        assert_eq!(c.max_batch_size, Some(4));
        let st = ("sentence_bert_config.json", r#"{"max_seq_length": 64}"#);
        assert_eq!(found(&[("config.json", mlm), st]).unwrap().max_batch_size, Some(32));
    }

    #[test]
    fn what_is_not_served_is_refused_by_name() {
        let no_pool = found(&[("config.json", r#"{"architectures": ["BertModel"]}"#)]).unwrap_err();
        assert!(no_pool.to_string().contains("1_Pooling/config.json"), "{no_pool}");
        let weighted = ("1_Pooling/config.json", r#"{"pooling_mode_weightedmean_tokens": true}"#);
        assert!(found(&[("config.json", r#"{"architectures": ["BertModel"]}"#), weighted]).is_err());
        let d = dir(&[("config.json", "{}"), ("tokenizer.json", "{}")]);
        let e = pipeline(d.path(), ModelConfig::default()).unwrap_err();
        assert!(e.to_string().contains("onnx/model.onnx"), "{e}");
        // Version directories make it a model repository's model, not a Hugging Face directory.
        let d = dir(&[("config.json", "{}"), ("tokenizer.json", "{}"), ("1/model.onnx", "")]);
        assert!(!is_layout(d.path()));
    }
}
