//! Post-steps on a model's outputs, per row: `pool` (mean over the attention mask, CLS, max;
//! optional L2 normalization), `softmax`, `sigmoid` and `argmax` over the last axis, `topk` with
//! labels (Triton's classification format) and `nms` for detectors, whose boxes are mapped back
//! through every pad and resize to the pixels of the image as sent.

use std::{collections::BTreeMap, path::Path};

use serde::Deserialize;

use super::{floats, per_row, read_labels, rows_of, Kind, Op, StepError, Value};
use crate::{DataType, Element, Error, Result, Tensor, TensorData};

type Built = (Op, Vec<(String, Kind)>);

#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq)]
#[serde(rename_all = "lowercase")]
pub enum Pooling {
    #[default]
    Mean,
    Cls,
    Max,
    /// The last token the mask marks (decoder-style embedders: Qwen, Mistral).
    #[serde(alias = "last_token", alias = "lasttoken")]
    Last,
    /// SPLADE's: of a masked language model's logits `[tokens, vocabulary]`, the largest
    /// `log(1 + relu(x))` over the tokens the mask marks, per vocabulary entry (a sparse vector).
    Splade,
}

impl Pooling {
    /// The name TEI's `/info` reports.
    pub fn as_str(self) -> &'static str {
        match self {
            Pooling::Mean => "mean",
            Pooling::Cls => "cls",
            Pooling::Max => "max",
            Pooling::Last => "last_token",
            Pooling::Splade => "splade",
        }
    }
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct PoolConfig {
    pub name: Option<String>,
    /// The token embeddings `[tokens, hidden]` per row (default `last_hidden_state`, or
    /// `token_embeddings` when no step writes that: sentence-transformers' ONNX exports).
    pub input: Option<String>,
    /// The mask that says which tokens are text (default `attention_mask`).
    pub mask: Option<String>,
    pub output: Option<String>,
    #[serde(default, deserialize_with = "super::any_case")]
    pub mode: Pooling,
    /// L2-normalize the pooled vector (what cosine similarity wants).
    #[serde(default)]
    pub normalize: bool,
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct UnaryConfig {
    pub name: Option<String>,
    pub input: String,
    /// Default: the input's name (the value is replaced).
    pub output: Option<String>,
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct TopkConfig {
    pub name: Option<String>,
    pub input: String,
    pub output: Option<String>,
    pub k: usize,
    /// One class name per line, in the model's order.
    pub labels: Option<String>,
}

#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq)]
#[serde(rename_all = "lowercase")]
pub enum DetectorLayout {
    /// `[4 + classes, anchors]`: cx, cy, w, h, then a score per class (YOLOv8 and later).
    #[default]
    Yolov8,
    /// `[anchors, 5 + classes]`: cx, cy, w, h, objectness, then a probability per class (YOLOv5).
    Yolov5,
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct NmsConfig {
    pub name: Option<String>,
    /// The detector's output (default `output0`).
    pub input: Option<String>,
    /// The image the detector saw, whose geometry maps the boxes back (default `image`).
    pub image: Option<String>,
    #[serde(default, deserialize_with = "super::any_case")]
    pub layout: DetectorLayout,
    pub score_threshold: Option<f32>,
    pub iou_threshold: Option<f32>,
    /// Suppress across classes too (default: only boxes of the same class suppress each other).
    #[serde(default)]
    pub class_agnostic: bool,
    /// Detections per row; outputs are padded to it (default 100).
    pub max_detections: Option<usize>,
    /// One class name per line: adds a BYTES output `labels`.
    pub labels: Option<String>,
    /// How `boxes` are written (default `xyxy`).
    #[serde(default, deserialize_with = "super::any_case")]
    pub box_format: BoxFormat,
    /// Boxes as fractions of the image as sent (ultralytics' `xyxyn`/`xywhn`), not pixels.
    #[serde(default)]
    pub normalized: bool,
    /// Boxes as whole pixels, INT64, each number cut toward zero as Python's `int()`, NumPy's
    /// `astype(int)` and torch's `.int()` do (what nudenet and most drawing code take).
    #[serde(default)]
    pub integer: bool,
}

/// The four numbers of a box in `boxes`.
#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq)]
#[serde(rename_all = "lowercase")]
pub enum BoxFormat {
    /// Corners: x1, y1, x2, y2 (ultralytics' `xyxy`, torchvision).
    #[default]
    Xyxy,
    /// Top-left corner and size: x, y, w, h (COCO, nudenet).
    Xywh,
    /// Centre and size: cx, cy, w, h (ultralytics' `xywh`, YOLO labels).
    Cxcywh,
}

impl BoxFormat {
    /// `xyxy` (in pixels of an image `w` x `h`) in this format, as fractions of it if `normalized`.
    fn write(self, [x1, y1, x2, y2]: [f32; 4], normalized: bool, (w, h): (u32, u32)) -> [f32; 4] {
        let b = match self {
            BoxFormat::Xyxy => [x1, y1, x2, y2],
            BoxFormat::Xywh => [x1, y1, x2 - x1, y2 - y1],
            BoxFormat::Cxcywh => [(x1 + x2) / 2.0, (y1 + y2) / 2.0, x2 - x1, y2 - y1],
        };
        if !normalized {
            return b;
        }
        let (w, h) = (w.max(1) as f32, h.max(1) as f32);
        [b[0] / w, b[1] / h, b[2] / w, b[3] / h]
    }
}

pub(crate) enum Unary {
    Softmax,
    Sigmoid,
    Argmax,
}

pub(crate) enum Post {
    Pool { input: String, mask: String, output: String, mode: Pooling, normalize: bool },
    Unary { op: Unary, input: String, output: String },
    Topk { input: String, output: String, k: usize, labels: Option<Vec<String>> },
    Nms(Box<Nms>),
}

pub(crate) struct Nms {
    input: String,
    image: String,
    layout: DetectorLayout,
    score: f32,
    iou: f32,
    agnostic: bool,
    max: usize,
    labels: Option<Vec<String>>,
    format: BoxFormat,
    normalized: bool,
    integer: bool,
}

fn tensor_dims(kind: Kind, name: &str) -> Result<Vec<i64>> {
    match kind {
        Kind::Tensor(DataType::Fp32 | DataType::Fp16 | DataType::Fp64, dims) => Ok(dims),
        other => Err(Error::invalid(format!("'{name}' must be a float tensor, not {other:?}"))),
    }
}

impl Post {
    pub fn pool(c: &PoolConfig, known: &mut super::Known) -> Result<Built> {
        let input = c.input.clone().unwrap_or_else(|| {
            let written = |n: &str| known.values.contains_key(n);
            if !written("last_hidden_state") && written("token_embeddings") {
                "token_embeddings"
            } else {
                "last_hidden_state"
            }
            .into()
        });
        let mask = c.mask.clone().unwrap_or_else(|| "attention_mask".into());
        let dims = tensor_dims(known.need(&input, Kind::Tensor(DataType::Fp32, vec![-1, -1]))?, &input)?;
        let [_, hidden] = dims.as_slice() else {
            return Err(Error::invalid(format!("'{input}' must be [tokens, hidden] per row, not {dims:?}")));
        };
        if c.mode != Pooling::Cls {
            known.need(&mask, Kind::Tensor(DataType::Int64, vec![-1]))?;
        }
        let output = c.output.clone().unwrap_or_else(|| "embedding".into());
        let written = vec![(output.clone(), Kind::Tensor(DataType::Fp32, vec![*hidden]))];
        Ok((Op::Post(Post::Pool { input, mask, output, mode: c.mode, normalize: c.normalize }), written))
    }

    pub fn unary(op: Unary, c: &UnaryConfig, known: &mut super::Known) -> Result<Built> {
        let dims = tensor_dims(known.need(&c.input, Kind::Tensor(DataType::Fp32, vec![-1]))?, &c.input)?;
        if dims.is_empty() {
            return Err(Error::invalid(format!("'{}' has no axis to work along", c.input)));
        }
        let output = c.output.clone().unwrap_or_else(|| c.input.clone());
        let kind = match op {
            Unary::Argmax => Kind::Tensor(DataType::Int64, dims[..dims.len() - 1].to_vec()),
            _ => Kind::Tensor(DataType::Fp32, dims),
        };
        Ok((Op::Post(Post::Unary { op, input: c.input.clone(), output: output.clone() }), vec![(output, kind)]))
    }

    pub fn topk(dir: &Path, c: &TopkConfig, known: &mut super::Known) -> Result<Built> {
        let dims = tensor_dims(known.need(&c.input, Kind::Tensor(DataType::Fp32, vec![-1]))?, &c.input)?;
        if dims.len() != 1 || !(1..=10_000).contains(&c.k) {
            return Err(Error::invalid(format!("topk takes one axis per row (got {dims:?}) and k in 1..=10000")));
        }
        let labels = c.labels.as_deref().map(|f| read_labels(dir, f)).transpose()?;
        let k = match dims[0] {
            d if d > 0 => c.k.min(d as usize),
            _ => c.k,
        };
        let output = c.output.clone().unwrap_or_else(|| c.input.clone());
        let written = vec![(output.clone(), Kind::Tensor(DataType::Bytes, vec![k as i64]))];
        Ok((Op::Post(Post::Topk { input: c.input.clone(), output, k: c.k, labels }), written))
    }

    pub fn nms(dir: &Path, c: &NmsConfig, known: &mut super::Known) -> Result<Built> {
        let input = c.input.clone().unwrap_or_else(|| "output0".into());
        let image = c.image.clone().unwrap_or_else(|| "image".into());
        let dims = tensor_dims(known.need(&input, Kind::Tensor(DataType::Fp32, vec![-1, -1]))?, &input)?;
        if dims.len() != 2 {
            return Err(Error::invalid(format!("'{input}' must be 2-D per row, not {dims:?}")));
        }
        let Kind::Image(_) = known.need(&image, Kind::Image(None))? else {
            return Err(Error::invalid(format!("'{image}' is not an image")));
        };
        let max = c.max_detections.unwrap_or(100);
        let (score, iou) = (c.score_threshold.unwrap_or(0.25), c.iou_threshold.unwrap_or(0.45));
        if !(1..=10_000).contains(&max) || !(0.0..=1.0).contains(&score) || !(0.0..=1.0).contains(&iou) {
            return Err(Error::invalid("max_detections must be 1..=10000 and the thresholds 0..=1"));
        }
        if c.integer && c.normalized {
            return Err(Error::invalid("integer boxes cannot be normalized (fractions of the image): choose one"));
        }
        let labels = c.labels.as_deref().map(|f| read_labels(dir, f)).transpose()?;
        let d = max as i64;
        let box_type = if c.integer { DataType::Int64 } else { DataType::Fp32 };
        let mut written = vec![
            ("boxes".to_string(), Kind::Tensor(box_type, vec![d, 4])),
            ("scores".to_string(), Kind::Tensor(DataType::Fp32, vec![d])),
            ("classes".to_string(), Kind::Tensor(DataType::Int64, vec![d])),
            ("num_detections".to_string(), Kind::Tensor(DataType::Int64, vec![])),
        ];
        if labels.is_some() {
            written.push(("labels".to_string(), Kind::Tensor(DataType::Bytes, vec![d])));
        }
        let nms = Nms {
            input,
            image,
            layout: c.layout,
            score,
            iou,
            agnostic: c.class_agnostic,
            max,
            labels,
            format: c.box_format,
            normalized: c.normalized,
            integer: c.integer,
        };
        Ok((Op::Post(Post::Nms(Box::new(nms))), written))
    }

    pub fn run(&self, values: &mut BTreeMap<String, Value>) -> Result<(), StepError> {
        match self {
            Post::Pool { input, mask, output, mode, normalize } => {
                let hidden = rows_of(values, input)?;
                let masks = match mode {
                    Pooling::Cls => None,
                    _ => Some(rows_of(values, mask)?),
                };
                let index: Vec<usize> = (0..hidden.len()).collect();
                let rows = per_row(&index, |&i| {
                    let h = &hidden[i];
                    let m = masks.map(|m| floats(&m[i])).transpose()?;
                    pool(h, m.as_deref(), *mode, *normalize)
                        .map(|v| Tensor::from_le(output, DataType::Fp32, vec![v.len()], &v))
                })?;
                values.insert(output.clone(), Value::Rows(rows));
            }
            Post::Unary { op, input, output } => {
                let rows = per_row(rows_of(values, input)?, |t| unary(op, t, output))?;
                values.insert(output.clone(), Value::Rows(rows));
            }
            Post::Topk { input, output, k, labels } => {
                let rows = per_row(rows_of(values, input)?, |t| {
                    let mut top = crate::engine::classify::top_k(t, *k, false, labels.as_deref())?;
                    top.name = output.clone();
                    Ok(top)
                })?;
                values.insert(output.clone(), Value::Rows(rows));
            }
            Post::Nms(n) => {
                let outputs = rows_of(values, &n.input)?;
                let Some(Value::Images(pictures)) = values.get(&n.image) else {
                    return Err(StepError::Batch(Error::internal(format!("'{}' is not an image", n.image))));
                };
                let index: Vec<usize> = (0..outputs.len()).collect();
                let found = per_row(&index, |&i| n.detect(&outputs[i], &pictures[i].geometry))?;
                let sent: Vec<(u32, u32)> = pictures.iter().map(|p| p.geometry.sent).collect();
                let d = n.max;
                let mut columns: [Vec<Tensor>; 5] = Default::default();
                for (dets, &sent) in found.iter().zip(&sent) {
                    let mut boxes = vec![0f32; d * 4];
                    let mut scores = vec![0f32; d];
                    let mut classes = vec![-1i64; d];
                    let mut names = vec![bytes::Bytes::new(); d];
                    for (j, det) in dets.iter().enumerate() {
                        boxes[j * 4..j * 4 + 4].copy_from_slice(&n.format.write(det.bbox, n.normalized, sent));
                        scores[j] = det.score;
                        classes[j] = det.class as i64;
                        if let Some(l) = &n.labels {
                            names[j] = bytes::Bytes::from(l.get(det.class).cloned().unwrap_or_default());
                        }
                    }
                    columns[0].push(if n.integer {
                        let whole: Vec<i64> = boxes.iter().map(|&v| v.trunc() as i64).collect();
                        Tensor::from_le("boxes", DataType::Int64, vec![d, 4], &whole)
                    } else {
                        Tensor::from_le("boxes", DataType::Fp32, vec![d, 4], &boxes)
                    });
                    columns[1].push(Tensor::from_le("scores", DataType::Fp32, vec![d], &scores));
                    columns[2].push(Tensor::from_le("classes", DataType::Int64, vec![d], &classes));
                    columns[3].push(Tensor::from_le("num_detections", DataType::Int64, vec![], &[dets.len() as i64]));
                    columns[4].push(Tensor::new("labels", DataType::Bytes, vec![d], TensorData::Strings(names)));
                }
                let [boxes, scores, classes, count, labels] = columns;
                values.insert("boxes".into(), Value::Rows(boxes));
                values.insert("scores".into(), Value::Rows(scores));
                values.insert("classes".into(), Value::Rows(classes));
                values.insert("num_detections".into(), Value::Rows(count));
                if n.labels.is_some() {
                    values.insert("labels".into(), Value::Rows(labels));
                }
            }
        }
        Ok(())
    }
}

/// Pools a row's token embeddings `h` (`[tokens, hidden]` FP32), read where they lie: a copy of
/// them first cost as much as the pooling (a SPLADE row of 512 tokens of 30,522 logits is 62.5 MB).
fn pool(h: &Tensor, mask: Option<&[f32]>, mode: Pooling, normalize: bool) -> Result<Vec<f32>> {
    let [tokens, hidden] = h.shape[..] else {
        return Err(Error::invalid(format!("'{}' must be [tokens, hidden], not {:?}", h.name, h.shape)));
    };
    let bytes = match &h.data {
        TensorData::Fixed(b) if h.datatype == DataType::Fp32 && b.len() == tokens * hidden * 4 && tokens > 0 => b,
        _ => return Err(Error::invalid(format!("'{}' must be FP32 [tokens, hidden] with a token", h.name))),
    };
    let token = |t: usize| bytes[t * hidden * 4..(t + 1) * hidden * 4].chunks_exact(4).map(f32::read_le);
    let mut out = vec![0f32; hidden];
    match mode {
        Pooling::Cls => out.iter_mut().zip(token(0)).for_each(|(o, v)| *o = v),
        Pooling::Last => {
            let mask = mask.unwrap_or_default();
            let last = mask.iter().rposition(|&m| m != 0.0).filter(|_| mask.len() == tokens);
            let t = last.ok_or_else(|| Error::invalid("no token is marked in the attention mask"))?;
            out.iter_mut().zip(token(t)).for_each(|(o, v)| *o = v);
        }
        Pooling::Mean | Pooling::Max | Pooling::Splade => {
            let mask = mask.unwrap_or_default();
            if mask.len() != tokens {
                return Err(Error::invalid(format!("the mask has {} tokens, the embeddings {tokens}", mask.len())));
            }
            let max = mode != Pooling::Mean;
            if max {
                out.fill(f32::NEG_INFINITY);
            }
            let mut count = 0f32;
            for (t, &m) in mask.iter().enumerate() {
                if m == 0.0 {
                    continue;
                }
                count += m;
                for (o, v) in out.iter_mut().zip(token(t)) {
                    *o = if max { o.max(v) } else { *o + v * m };
                }
            }
            if count == 0.0 {
                return Err(Error::invalid("no token is marked in the attention mask"));
            }
            match mode {
                Pooling::Mean => out.iter_mut().for_each(|o| *o /= count.max(1e-9)),
                // log(1 + relu(x)) grows with x: of the largest logit, once per entry.
                Pooling::Splade => out.iter_mut().for_each(|o| *o = o.max(0.0).ln_1p()),
                _ => {}
            }
        }
    }
    if normalize {
        let norm = out.iter().map(|v| v * v).sum::<f32>().sqrt().max(1e-12);
        out.iter_mut().for_each(|o| *o /= norm);
    }
    Ok(out)
}

pub(crate) fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// Scores to probabilities, in place (the largest subtracted first, so none overflows).
pub(crate) fn softmax(row: &mut [f32]) {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0;
    for x in row.iter_mut() {
        *x = (*x - max).exp();
        sum += *x;
    }
    row.iter_mut().for_each(|x| *x /= sum);
}

fn unary(op: &Unary, t: &Tensor, output: &str) -> Result<Tensor> {
    let values = floats(t)?;
    let last = t.shape.last().copied().unwrap_or(1).max(1);
    match op {
        Unary::Sigmoid => {
            let v: Vec<f32> = values.iter().map(|&x| sigmoid(x)).collect();
            Ok(Tensor::from_le(output, DataType::Fp32, t.shape.clone(), &v))
        }
        Unary::Softmax => {
            let mut v = values;
            v.chunks_mut(last).for_each(softmax);
            Ok(Tensor::from_le(output, DataType::Fp32, t.shape.clone(), &v))
        }
        Unary::Argmax => {
            // The first of equal maxima, as NumPy's argmax.
            let v: Vec<i64> = values
                .chunks(last)
                .map(|row| {
                    row.iter().enumerate().fold((0, f32::NEG_INFINITY), |b, (i, &x)| if x > b.1 { (i, x) } else { b }).0
                        as i64
                })
                .collect();
            Ok(Tensor::from_le(output, DataType::Int64, t.shape[..t.shape.len() - 1].to_vec(), &v))
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Detection {
    /// x1, y1, x2, y2 in the pixels of the image as sent.
    pub bbox: [f32; 4],
    pub score: f32,
    pub class: usize,
}

/// Candidates considered per row at most (the best-scored), as ultralytics' `max_nms`.
const MAX_CANDIDATES: usize = 30_000;

impl Nms {
    fn detect(&self, output: &Tensor, geometry: &super::image::Geometry) -> Result<Vec<Detection>> {
        let v = floats(output)?;
        let [a, b] = output.shape[..] else { return Err(Error::invalid("the detector's output must be 2-D per row")) };
        // (anchors, fields per anchor, how to read field f of anchor i)
        let (anchors, fields) = match self.layout {
            DetectorLayout::Yolov8 => (b, a),
            DetectorLayout::Yolov5 => (a, b),
        };
        let first_class = if self.layout == DetectorLayout::Yolov8 { 4 } else { 5 };
        if fields <= first_class {
            return Err(Error::invalid(format!("the detector's output {:?} has no class scores", output.shape)));
        }
        let at = |i: usize, f: usize| match self.layout {
            DetectorLayout::Yolov8 => v[f * anchors + i],
            DetectorLayout::Yolov5 => v[i * fields + f],
        };
        let mut candidates = Vec::new();
        for i in 0..anchors {
            let (mut class, mut best) = (0, f32::NEG_INFINITY);
            for f in first_class..fields {
                if at(i, f) > best {
                    (class, best) = (f - first_class, at(i, f));
                }
            }
            let score = if self.layout == DetectorLayout::Yolov5 { best * at(i, 4) } else { best };
            if score > self.score && score.is_finite() {
                let (cx, cy, w, h) = (at(i, 0), at(i, 1), at(i, 2), at(i, 3));
                candidates.push(Detection {
                    bbox: [cx - w / 2.0, cy - h / 2.0, cx + w / 2.0, cy + h / 2.0],
                    score,
                    class,
                });
            }
        }
        candidates.sort_by(|x, y| y.score.total_cmp(&x.score));
        candidates.truncate(MAX_CANDIDATES);
        let mut kept: Vec<Detection> = Vec::new();
        for c in candidates {
            if kept.len() == self.max {
                break;
            }
            let suppressed =
                kept.iter().any(|k| (self.agnostic || k.class == c.class) && iou(&k.bbox, &c.bbox) > self.iou);
            if !suppressed {
                kept.push(c);
            }
        }
        for k in &mut kept {
            let (x1, y1) = geometry.back(k.bbox[0], k.bbox[1]);
            let (x2, y2) = geometry.back(k.bbox[2], k.bbox[3]);
            k.bbox = [x1, y1, x2, y2];
        }
        Ok(kept)
    }
}

fn iou(a: &[f32; 4], b: &[f32; 4]) -> f32 {
    let w = (a[2].min(b[2]) - a[0].max(b[0])).max(0.0);
    let h = (a[3].min(b[3]) - a[1].max(b[1])).max(0.0);
    let inter = w * h;
    let area = |r: &[f32; 4]| (r[2] - r[0]).max(0.0) * (r[3] - r[1]).max(0.0);
    let union = area(a) + area(b) - inter;
    if union <= 0.0 {
        0.0
    } else {
        inter / union
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipeline::image::Geometry;

    fn nms(layout: DetectorLayout, agnostic: bool, max: usize) -> Nms {
        Nms {
            input: "o".into(),
            image: "i".into(),
            layout,
            score: 0.25,
            iou: 0.45,
            agnostic,
            max,
            labels: None,
            format: BoxFormat::Xyxy,
            normalized: false,
            integer: false,
        }
    }

    /// YOLOv8's layout from (cx, cy, w, h, scores per class) per anchor.
    fn v8(anchors: &[[f32; 6]]) -> Tensor {
        let n = anchors.len();
        let mut v = vec![0f32; 6 * n];
        for (i, a) in anchors.iter().enumerate() {
            for f in 0..6 {
                v[f * n + i] = a[f];
            }
        }
        Tensor::from_le("o", DataType::Fp32, vec![6, n], &v)
    }

    const SAME: Geometry = Geometry { sent: (100, 100), scale: (1.0, 1.0), offset: (0.0, 0.0) };

    #[test]
    fn overlapping_boxes_of_one_class_keep_the_best_and_other_classes_survive() {
        let out = v8(&[
            [20.0, 20.0, 10.0, 10.0, 0.9, 0.0],
            [21.0, 20.0, 10.0, 10.0, 0.8, 0.0], // IoU 0.82 with the first: suppressed
            [21.0, 21.0, 10.0, 10.0, 0.0, 0.7], // another class: kept
            [70.0, 70.0, 10.0, 10.0, 0.2, 0.1], // under the threshold
        ]);
        let kept = nms(DetectorLayout::Yolov8, false, 10).detect(&out, &SAME).unwrap();
        assert_eq!(kept.iter().map(|d| (d.class, d.score)).collect::<Vec<_>>(), vec![(0, 0.9), (1, 0.7)]);
        assert_eq!(kept[0].bbox, [15.0, 15.0, 25.0, 25.0]);
        let agnostic = nms(DetectorLayout::Yolov8, true, 10).detect(&out, &SAME).unwrap();
        assert_eq!(agnostic.len(), 1);
        assert_eq!(nms(DetectorLayout::Yolov8, false, 1).detect(&out, &SAME).unwrap().len(), 1);
    }

    #[test]
    fn yolov5_scores_are_class_times_objectness_and_boxes_map_back_through_letterbox() {
        // One anchor: cx, cy, w, h, objectness, two classes.
        let out = Tensor::from_le("o", DataType::Fp32, vec![1, 7], &[32.0f32, 32.0, 16.0, 8.0, 0.5, 0.2, 0.9]);
        // The image was 200x100, resized to 64x32, padded 16 above: x_now = x * 0.32, y_now = y * 0.32 + 16.
        let g = Geometry { sent: (200, 100), scale: (0.32, 0.32), offset: (0.0, 16.0) };
        let kept = nms(DetectorLayout::Yolov5, false, 10).detect(&out, &g).unwrap();
        assert_eq!(kept.len(), 1);
        assert_eq!(kept[0].class, 1);
        assert!((kept[0].score - 0.45).abs() < 1e-6);
        let want = [75.0, 37.5, 125.0, 62.5];
        for (got, want) in kept[0].bbox.iter().zip(want) {
            assert!((got - want).abs() < 1e-3, "{:?}", kept[0].bbox);
        }
    }

    #[test]
    fn mean_pooling_counts_only_masked_tokens_and_normalizes() {
        let h = Tensor::from_le("h", DataType::Fp32, vec![3, 2], &[1.0f32, 2.0, 3.0, 4.0, 100.0, 100.0]);
        let mean = pool(&h, Some(&[1.0, 1.0, 0.0]), Pooling::Mean, false).unwrap();
        assert_eq!(mean, vec![2.0, 3.0]);
        assert_eq!(pool(&h, Some(&[1.0, 1.0, 0.0]), Pooling::Max, false).unwrap(), vec![3.0, 4.0]);
        // SPLADE: log(1 + relu) of the largest marked logit; an entry no token raises above 0 is 0.
        let logits =
            Tensor::from_le("l", DataType::Fp32, vec![3, 3], &[-1.0f32, 2.0, -5.0, -2.0, 0.5, -3.0, 9.0, 9.0, 9.0]);
        let splade = pool(&logits, Some(&[1.0, 1.0, 0.0]), Pooling::Splade, false).unwrap();
        assert_eq!(splade[0], 0.0);
        assert!((splade[1] - 3f32.ln()).abs() < 1e-6 && splade[2] == 0.0, "{splade:?}");
        assert_eq!(pool(&h, None, Pooling::Cls, false).unwrap(), vec![1.0, 2.0]);
        assert_eq!(pool(&h, Some(&[1.0, 1.0, 0.0]), Pooling::Last, false).unwrap(), vec![3.0, 4.0]);
        assert!(pool(&h, Some(&[0.0, 0.0, 0.0]), Pooling::Last, false).is_err());
        let unit = pool(&h, Some(&[1.0, 1.0, 0.0]), Pooling::Mean, true).unwrap();
        assert!((unit[0] * unit[0] + unit[1] * unit[1] - 1.0).abs() < 1e-6);
        assert!(pool(&h, Some(&[0.0, 0.0, 0.0]), Pooling::Mean, false).is_err());
    }

    #[test]
    fn softmax_sigmoid_and_argmax_work_along_the_last_axis() {
        let t = Tensor::from_le("t", DataType::Fp32, vec![2, 2], &[0.0f32, 0.0, 1.0, 3.0]);
        let s = floats(&unary(&Unary::Softmax, &t, "s").unwrap()).unwrap();
        assert_eq!(&s[..2], &[0.5, 0.5]);
        assert!((s[2] + s[3] - 1.0).abs() < 1e-6 && s[3] > s[2]);
        let a = unary(&Unary::Argmax, &t, "a").unwrap();
        assert_eq!(a.shape, vec![2]);
        assert_eq!(a.data, TensorData::Fixed([0i64.to_le_bytes(), 1i64.to_le_bytes()].concat().into()));
        let g = floats(&unary(&Unary::Sigmoid, &t, "g").unwrap()).unwrap();
        assert_eq!(g[0], 0.5);
    }

    #[test]
    fn boxes_are_written_in_the_format_asked() {
        let b = [10.0, 20.0, 50.0, 100.0];
        assert_eq!(BoxFormat::Xyxy.write(b, false, (200, 100)), b);
        assert_eq!(BoxFormat::Xywh.write(b, false, (200, 100)), [10.0, 20.0, 40.0, 80.0]);
        assert_eq!(BoxFormat::Cxcywh.write(b, true, (200, 100)), [0.15, 0.6, 0.2, 0.8]);
    }
}
