//! `ferrite check`: every model of a repository loaded and validated as `serve` would (config,
//! ONNX file, warm-up), one row per model version, and whether all passed. A gate before a
//! rollout; no listener is opened.

use ferrite_core::{
    control::registry::State,
    engine::spec::{ModelSpec, TensorSpec},
    Core,
};

/// The report's rows as text (a header, then one line per model version), and whether every
/// model is ready.
pub fn report(core: &Core) -> (String, bool) {
    let mut rows =
        vec![["MODEL", "VERSION", "STATE", "INPUTS", "OUTPUTS", "BATCHING", "INSTANCES", "TASK", "REASON"]
            .map(String::from)];
    let mut ok = true;
    for entry in core.index() {
        let version = entry.version.map(|v| v.to_string()).unwrap_or_else(|| "-".into());
        let model = entry.version.and_then(|v| core.model(&entry.name, Some(&v.to_string())).ok());
        let ready = entry.state == State::Ready && model.is_some();
        ok &= ready;
        let task = model.as_ref().and_then(|m| m.spec.text.as_deref()).map(task).unwrap_or_else(|| "-".into());
        let (inputs, outputs, batching, instances) = match &model {
            Some(m) => {
                let s = &m.spec;
                let batching = match (s.batched(), s.batch.dynamic) {
                    (false, _) => "none".to_string(),
                    (true, false) => format!("max {}", s.batch.max_batch_size),
                    (true, true) => {
                        let b = &s.batch;
                        match b.merge_at {
                            0 => format!("max {}, dynamic, merge <= {}", b.max_batch_size, b.merge_limit),
                            at => format!(
                                "max {}, dynamic, merge <= {} at rows of {at} elements (scaled to others)",
                                b.max_batch_size, b.merge_limit
                            ),
                        }
                    }
                };
                let mut instances = match s.backend {
                    "python" => format!("{} x Python worker", s.instance_count),
                    _ => format!("{} x {} threads", s.instance_count, s.onnx.intra_threads),
                };
                if s.solo_threads > 0 {
                    instances.push_str(&format!(" + solo x {}", s.solo_threads));
                }
                (tensors(s, &s.inputs), tensors(s, &s.outputs), batching, instances)
            }
            None => Default::default(),
        };
        let reason = if ready { String::new() } else { entry.reason.clone() };
        rows.push([
            entry.name,
            version,
            entry.state.as_str().to_string(),
            inputs,
            outputs,
            batching,
            instances,
            task,
            reason,
        ]);
    }
    let widths: Vec<usize> = (0..9).map(|c| rows.iter().map(|r| r[c].chars().count()).max().unwrap_or(0)).collect();
    let mut text = String::new();
    for r in &rows {
        let line: Vec<String> = r.iter().zip(&widths).map(|(cell, w)| format!("{cell:<w$}")).collect();
        text.push_str(line.join("  ").trim_end());
        text.push('\n');
    }
    (text, ok)
}

/// A text pipeline's task as it was declared or found (a Hugging Face directory's): `embed
/// (mean, 256 tokens)`, `rerank (512 tokens)`, `classify (negative,positive; 512 tokens)`.
fn task(t: &ferrite_core::engine::spec::TextSpec) -> String {
    let tokens = format!("{} tokens", t.max_length);
    let detail = match (t.pooling.as_deref(), t.labels.is_empty()) {
        (Some(p), _) if t.task == ferrite_core::engine::spec::Task::Embed => format!("{p}, {tokens}"),
        (_, false) if t.task == ferrite_core::engine::spec::Task::Classify => {
            format!("{}; {tokens}", t.labels.join(","))
        }
        _ => tokens,
    };
    format!("{} ({detail})", t.task.as_str())
}

/// `name:DTYPE[d0,d1]` for each tensor with its shape as clients see it (`-1`: variable).
fn tensors(spec: &ModelSpec, tensors: &[TensorSpec]) -> String {
    let one = |t: &TensorSpec| {
        let dims: Vec<String> = spec.wire_shape(t).iter().map(i64::to_string).collect();
        format!("{}:{}[{}]", t.name, t.datatype.as_str(), dims.join(","))
    };
    tensors.iter().map(one).collect::<Vec<_>>().join(" ")
}
