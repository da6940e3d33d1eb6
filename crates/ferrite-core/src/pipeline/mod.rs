//! Pipelines: a model directory whose config declares `[[steps]]` — native operations (decode and
//! prepare images, tokenize text, pool, top-k, NMS) and calls to other models of the repository —
//! with named values flowing between them. A pipeline is served as a model like any other: it has
//! a spec, a batcher and statistics; its instances are the worker threads its native steps run on
//! (sized from the CPU budget, never the async runtime's), and each model step goes through that
//! model's own batcher, so rows of many pipeline requests batch together there.
//!
//! Values are held per row (one tensor or image for each row of the batch), so rows whose
//! images differ in size still share a pipeline batch; a model step groups rows of equal shapes
//! into its calls. A step that fails for some rows names them (`Instance::failed_rows`): the batch
//! goes on without their requests' rows, and the batcher fails those requests and answers the
//! others from the same run. A corrupt image fails its own request alone, and the others' work is
//! not done twice.

mod image;
mod post;
mod text;

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    sync::{Arc, Weak},
    time::Instant,
};

use serde::Deserialize;

use crate::{
    engine::{
        backend::{BatchInput, Cost, Instance, Live},
        spec::TensorSpec,
    },
    Backend, DataType, Error, InferRequest, Result, Tensor, TensorData,
};

pub use self::image::{CropConfig, DecodeConfig, NormalizeConfig, PadConfig, ResizeConfig};
pub(crate) use post::{sigmoid, softmax};
pub use post::{NmsConfig, PoolConfig, Pooling, TopkConfig, UnaryConfig};
pub(crate) use text::encode;
pub use text::TokenizeConfig;

/// One `[[steps]]` entry of a config: `op` names the operation; every op takes an optional
/// `name` (for errors and metrics; default the op, with its position where the op repeats).
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum StepConfig {
    DecodeImage(DecodeConfig),
    Resize(ResizeConfig),
    Pad(PadConfig),
    Crop(CropConfig),
    Normalize(NormalizeConfig),
    Tokenize(TokenizeConfig),
    Model(ModelStepConfig),
    Pool(PoolConfig),
    Softmax(UnaryConfig),
    Sigmoid(UnaryConfig),
    Argmax(UnaryConfig),
    Topk(TopkConfig),
    Nms(NmsConfig),
}

impl StepConfig {
    fn op(&self) -> &'static str {
        match self {
            StepConfig::DecodeImage(_) => "decode_image",
            StepConfig::Resize(_) => "resize",
            StepConfig::Pad(_) => "pad",
            StepConfig::Crop(_) => "crop",
            StepConfig::Normalize(_) => "normalize",
            StepConfig::Tokenize(_) => "tokenize",
            StepConfig::Model(_) => "model",
            StepConfig::Pool(_) => "pool",
            StepConfig::Softmax(_) => "softmax",
            StepConfig::Sigmoid(_) => "sigmoid",
            StepConfig::Argmax(_) => "argmax",
            StepConfig::Topk(_) => "topk",
            StepConfig::Nms(_) => "nms",
        }
    }

    fn name(&self) -> Option<&str> {
        match self {
            StepConfig::DecodeImage(c) => c.name.as_deref(),
            StepConfig::Resize(c) => c.name.as_deref(),
            StepConfig::Pad(c) => c.name.as_deref(),
            StepConfig::Crop(c) => c.name.as_deref(),
            StepConfig::Normalize(c) => c.name.as_deref(),
            StepConfig::Tokenize(c) => c.name.as_deref(),
            StepConfig::Model(c) => c.name.as_deref(),
            StepConfig::Pool(c) => c.name.as_deref(),
            StepConfig::Softmax(c) | StepConfig::Sigmoid(c) | StepConfig::Argmax(c) => c.name.as_deref(),
            StepConfig::Topk(c) => c.name.as_deref(),
            StepConfig::Nms(c) => c.name.as_deref(),
        }
    }
}

/// `op = "model"`: runs another model of the repository through its own batcher. Its inputs are
/// taken from the values of the same names, its outputs written under their names; `inputs` and
/// `outputs` map a model tensor name to another value name.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ModelStepConfig {
    pub name: Option<String>,
    /// The model of the repository it calls (or, with `file`, the name its own model serves as).
    #[serde(default)]
    pub model: String,
    /// An ONNX file of the pipeline's own directory, run as the pipeline's own model (a Hugging
    /// Face directory's `onnx/model.onnx`) instead of a model of the repository.
    pub file: Option<String>,
    /// A version to pin; default the one the model serves (a reload is picked up at once).
    pub version: Option<u64>,
    #[serde(default)]
    pub inputs: BTreeMap<String, String>,
    #[serde(default)]
    pub outputs: BTreeMap<String, String>,
}

/// A step's enum value in any case (`bgr` or `BGR`, `Bilinear` or `bilinear`): tried as written,
/// then in lower and in upper case; the error is the one for the value as written.
fn any_case<'de, D: serde::Deserializer<'de>, T: serde::de::DeserializeOwned>(
    d: D,
) -> std::result::Result<T, D::Error> {
    use serde::de::{value::StringDeserializer, Error as _};
    let written = String::deserialize(d)?;
    let parse = |v: String| T::deserialize(StringDeserializer::<serde::de::value::Error>::new(v));
    parse(written.clone())
        .or_else(|e| parse(written.to_lowercase()).or_else(|_| parse(written.to_uppercase())).map_err(|_| e))
        .map_err(D::Error::custom)
}

/// What flows between steps: for each row, a tensor (without the batch dim) or a decoded image.
#[derive(Clone)]
pub(crate) enum Value {
    Rows(Vec<Tensor>),
    Images(Vec<image::Picture>),
}

/// What a value is while a pipeline is built (its type, for the checks and the metadata).
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Kind {
    /// A tensor per row: datatype and dims (-1 where rows may differ).
    Tensor(DataType, Vec<i64>),
    /// An image per row, with its size when every row's is known.
    Image(Option<(u32, u32)>),
}

/// Why a step failed: the whole batch (a fault that is no row's), or some of its rows, each with
/// its error (the rest of the batch is sound: the step runs again without their requests' rows).
/// A step that fails some rows writes nothing (tokenize, which writes the others, returns its
/// failed rows instead).
pub(crate) enum StepError {
    Batch(Error),
    Rows(Vec<(usize, Error)>),
}

impl StepError {
    /// The error as step `step`'s.
    fn named(self, step: &Step) -> StepError {
        match self {
            StepError::Batch(e) => StepError::Batch(named(step, e)),
            StepError::Rows(rows) => StepError::Rows(rows.into_iter().map(|(r, e)| (r, named(step, e))).collect()),
        }
    }
}

/// How often a model step waiting on another model checks whether its rows' clients are still there.
const CLIENT_CHECK: std::time::Duration = std::time::Duration::from_millis(10);

/// Decoded pixels past which a pipeline request is heavy (about a 2,300 x 1,700 image): it never
/// keeps a light request waiting for a worker (the batcher's reserve takes that), so a small image
/// is never stuck behind large ones.
const HEAVY_PIXELS: u64 = 4_000_000;
/// Bytes of text read past which a pipeline request is heavy, likewise (32 texts of about a
/// hundred words; a batch of 32 texts of 200 words held a worker of the bundled text pipeline
/// 90 ms on two busy cores, one short text 1 ms).
const HEAVY_TEXT_BYTES: u64 = 16 << 10;

/// A built step: its name for errors and metrics, and what it does.
struct Step {
    name: String,
    op: Op,
    /// The values it writes.
    wrote: Vec<(String, Kind)>,
}

enum Op {
    Decode(image::Decode),
    Image(image::ImageOp),
    Normalize(image::Normalize),
    Tokenize(Box<text::Tokenize>),
    Model(ModelStepConfig),
    Post(post::Post),
}

pub use crate::engine::model::Models;

/// A pipeline as a backend: its inputs and outputs as clients see them (dims without the batch
/// dim), and its built steps, shared by its worker instances.
pub struct Pipeline {
    inputs: Vec<TensorSpec>,
    outputs: Vec<TensorSpec>,
    steps: Arc<Vec<Step>>,
    /// How many of `steps` it runs: all, or the first few (`prefix`).
    run: usize,
    registry: Weak<dyn Models>,
    /// The models of its own files (`file` steps), by file.
    own: BTreeMap<String, Arc<crate::Model>>,
    /// The models of the repository its steps call.
    pub uses: Vec<String>,
    label: String,
}

/// Reads a file a step names: a plain name or path inside the model's directory, never outside.
pub(crate) fn model_file(dir: &Path, file: &str, what: &str) -> Result<PathBuf> {
    let rel = Path::new(file);
    if rel.is_absolute() || rel.components().any(|c| !matches!(c, std::path::Component::Normal(_))) {
        return Err(Error::invalid(format!("{what} '{file}' must name a file in the model's directory")));
    }
    Ok(dir.join(rel))
}

/// The class labels in `file` of the model's directory, one per line (a `labels` parameter, a
/// config's `label_filename`).
pub(crate) fn read_labels(dir: &Path, file: &str) -> Result<Vec<String>> {
    let path = model_file(dir, file, "labels")?;
    let text = std::fs::read_to_string(&path)
        .map_err(|e| Error::invalid(format!("cannot read labels {}: {e}", path.display())))?;
    Ok(text.lines().map(str::to_string).collect())
}

impl Pipeline {
    /// Builds the pipeline `label` of `dir` from its `steps`; `models` is what serves (for the
    /// model steps' tensors, checked now), `registry` where model steps find their model at run
    /// time. `inputs`: the values clients send, when the config declares them (otherwise found
    /// from the steps); `outputs`: the values it answers with (default: what the last step wrote).
    #[allow(clippy::too_many_arguments)]
    pub fn build(
        label: &str,
        dir: &Path,
        steps: &[StepConfig],
        inputs: &[String],
        outputs: &[String],
        models: &dyn Models,
        registry: Arc<dyn Models>,
        own: BTreeMap<String, Arc<crate::Model>>,
    ) -> Result<Pipeline> {
        if steps.is_empty() {
            return Err(Error::invalid("a pipeline needs at least one step"));
        }
        let mut known = Known { declared: inputs.to_vec(), ..Known::default() };
        let mut built = Vec::new();
        let mut uses = Vec::new();
        let mut last_written = Vec::new();
        for (i, cfg) in steps.iter().enumerate() {
            // Named by its op, or op and position where the op repeats.
            let name = match cfg.name() {
                Some(n) => n.to_string(),
                None if steps.iter().filter(|s| s.op() == cfg.op()).count() > 1 => format!("{}{i}", cfg.op()),
                None => cfg.op().to_string(),
            };
            if built.iter().any(|s: &Step| s.name == name) {
                return Err(Error::invalid(format!("two steps are named '{name}'")));
            }
            let fail = |e: Error| Error::invalid(format!("step '{name}' ({}): {e}", cfg.op()));
            let (op, written) = (|| -> Result<(Op, Vec<(String, Kind)>)> {
                Ok(match cfg {
                    StepConfig::DecodeImage(c) => {
                        known.need_input(c.input(), Kind::Tensor(DataType::Bytes, vec![]))?;
                        (Op::Decode(image::Decode::new(c)?), vec![(c.output().to_string(), Kind::Image(None))])
                    }
                    StepConfig::Resize(c) => {
                        let (input, output) = (c.input.as_deref(), c.output.as_deref());
                        image_step(&mut known, input, output, |size| image::ImageOp::resize(c, size))?
                    }
                    StepConfig::Pad(c) => {
                        let (input, output) = (c.input.as_deref(), c.output.as_deref());
                        image_step(&mut known, input, output, |size| image::ImageOp::pad(c, size))?
                    }
                    StepConfig::Crop(c) => {
                        let (input, output) = (c.input.as_deref(), c.output.as_deref());
                        image_step(&mut known, input, output, |size| image::ImageOp::crop(c, size))?
                    }
                    StepConfig::Normalize(c) => {
                        let input = c.input.as_deref().unwrap_or("image");
                        let Kind::Image(size) = known.need(input, Kind::Image(None))? else {
                            return Err(Error::invalid(format!("'{input}' is not an image")));
                        };
                        let n = image::Normalize::new(c)?;
                        let kind = n.kind(size);
                        (Op::Normalize(n), vec![(c.output.clone().unwrap_or_else(|| "pixels".into()), kind)])
                    }
                    StepConfig::Tokenize(c) => {
                        known.need_input(c.input(), Kind::Tensor(DataType::Bytes, vec![]))?;
                        if let Some(pair) = &c.pair {
                            known.need_input(pair, Kind::Tensor(DataType::Bytes, vec![]))?;
                        }
                        let t = text::Tokenize::new(dir, c)?;
                        let written = t.outputs();
                        (Op::Tokenize(Box::new(t)), written)
                    }
                    StepConfig::Model(c) => {
                        if c.model.is_empty() && c.file.is_none() {
                            return Err(Error::invalid(
                                "a model step names a `model` of the repository or a `file` of its own",
                            ));
                        }
                        let model = match &c.file {
                            Some(f) => {
                                own.get(f).cloned().ok_or_else(|| Error::internal(format!("'{f}' is not loaded")))?
                            }
                            None => called(c, models)?,
                        };
                        let written = model_step(c, &model, &mut known)?;
                        if c.file.is_none() {
                            uses.push(c.model.clone());
                        }
                        (Op::Model(c.clone()), written)
                    }
                    StepConfig::Pool(c) => post::Post::pool(c, &mut known)?,
                    StepConfig::Softmax(c) => post::Post::unary(post::Unary::Softmax, c, &mut known)?,
                    StepConfig::Sigmoid(c) => post::Post::unary(post::Unary::Sigmoid, c, &mut known)?,
                    StepConfig::Argmax(c) => post::Post::unary(post::Unary::Argmax, c, &mut known)?,
                    StepConfig::Topk(c) => post::Post::topk(dir, c, &mut known)?,
                    StepConfig::Nms(c) => post::Post::nms(dir, c, &mut known)?,
                })
            })()
            .map_err(fail)?;
            last_written = written.iter().map(|(n, _)| n.clone()).collect();
            known.written |= !written.is_empty();
            known.values.extend(written.iter().cloned());
            built.push(Step { name, op, wrote: written });
        }
        let wanted = if outputs.is_empty() { last_written } else { outputs.to_vec() };
        let outputs =
            wanted.iter().map(|name| output_spec(name, known.values.get(name))).collect::<Result<Vec<_>>>()?;
        uses.sort();
        uses.dedup();
        let registry = Arc::downgrade(&registry);
        Ok(Pipeline {
            inputs: known.inputs,
            outputs,
            run: built.len(),
            steps: Arc::new(built),
            registry,
            own,
            uses,
            label: label.to_string(),
        })
    }
}

/// The spec of output `name`, a value of `kind` (`None`: no step writes it).
fn output_spec(name: &str, kind: Option<&Kind>) -> Result<TensorSpec> {
    match kind {
        Some(Kind::Tensor(datatype, dims)) => {
            Ok(TensorSpec { name: name.to_string(), datatype: *datatype, dims: dims.clone() })
        }
        Some(Kind::Image(_)) => {
            Err(Error::invalid(format!("output '{name}' is an image; a normalize step makes it a tensor")))
        }
        None => Err(Error::invalid(format!("output '{name}' is written by no step"))),
    }
}

impl Pipeline {
    /// The pipeline of its first `at` steps, named `label`, answering `outputs` (values those
    /// steps write): the same built steps (no tokenizer is read again), inputs and models.
    pub fn prefix(&self, label: &str, at: usize, outputs: &[String]) -> Result<Pipeline> {
        let steps = &self.steps[..at.min(self.run)];
        let written = |name: &str| steps.iter().rev().flat_map(|s| &s.wrote).find(|(n, _)| n == name).map(|(_, k)| k);
        Ok(Pipeline {
            inputs: self.inputs.clone(),
            outputs: outputs.iter().map(|name| output_spec(name, written(name))).collect::<Result<_>>()?,
            steps: self.steps.clone(),
            run: steps.len(),
            registry: self.registry.clone(),
            own: self.own.clone(),
            uses: self.uses.clone(),
            label: label.to_string(),
        })
    }

    /// Where its token embeddings are pooled: the first pool step's position and the value it
    /// reads. `None` without a pool step, or for SPLADE's, which pools the vocabulary's logits.
    pub fn pooled(&self) -> Option<(usize, &str)> {
        self.steps[..self.run].iter().enumerate().find_map(|(at, s)| match &s.op {
            Op::Post(post::Post::Pool { mode, .. }) if *mode == post::Pooling::Splade => Some(None),
            Op::Post(post::Post::Pool { input, .. }) => Some(Some((at, input.as_str()))),
            _ => None,
        })?
    }

    /// The text routes' view of it (see `text::text_spec`), for the `task` its config declares;
    /// `labels` a classifier's, by output.
    pub fn text_spec(
        &self,
        dir: &Path,
        task: Option<crate::engine::spec::Task>,
        labels: &BTreeMap<String, Vec<String>>,
    ) -> Result<Option<crate::engine::spec::TextSpec>> {
        let tokenize = self.steps[..self.run].iter().find_map(|s| match &s.op {
            Op::Tokenize(t) => Some(&**t),
            _ => None,
        });
        let pool = self.steps[..self.run].iter().find_map(|s| match &s.op {
            Op::Post(post::Post::Pool { output, mode, normalize, .. }) => Some((output.as_str(), *mode, *normalize)),
            _ => None,
        });
        text::text_spec(dir, task, tokenize, pool, &self.inputs, &self.outputs, labels)
    }
}

/// What a build knows: the values written so far, and the pipeline's inputs found.
#[derive(Default)]
struct Known {
    values: BTreeMap<String, Kind>,
    inputs: Vec<TensorSpec>,
    /// The inputs the config declares (`[[input]]`, or an ensemble's `input`); when there are
    /// any, every value a step reads that no earlier step writes must be one of them.
    declared: Vec<String>,
    /// Whether an earlier step has written anything.
    written: bool,
}

impl Known {
    /// The kind of `value`, read by a step that takes what clients send (a decoder, a
    /// tokenizer): one no earlier step wrote is a pipeline input, of the kind the step takes.
    fn need_input(&mut self, value: &str, kind: Kind) -> Result<Kind> {
        self.read(value, kind, true)
    }

    /// The kind of `value`, read by any other step: one no earlier step wrote is a pipeline input
    /// only when the config declares it, or when no step before has written anything (the
    /// pipeline starts with this step). Anything else is a name that matches nothing (a step's
    /// `output` left at its default, a typo) and is refused, with the nearest name written.
    fn need(&mut self, value: &str, kind: Kind) -> Result<Kind> {
        self.read(value, kind, false)
    }

    fn read(&mut self, value: &str, kind: Kind, entry: bool) -> Result<Kind> {
        if let Some(k) = self.values.get(value) {
            return Ok(k.clone());
        }
        let input =
            if self.declared.is_empty() { entry || !self.written } else { self.declared.iter().any(|d| d == value) };
        match &kind {
            Kind::Tensor(datatype, dims) if input => {
                self.inputs.push(TensorSpec { name: value.to_string(), datatype: *datatype, dims: dims.clone() });
                self.values.insert(value.to_string(), kind.clone());
                Ok(kind)
            }
            _ => Err(self.unwritten(value, &kind)),
        }
    }

    fn unwritten(&self, value: &str, kind: &Kind) -> Error {
        let image = matches!(kind, Kind::Image(_));
        // Suggested from values of the same kind (a tensor for a tensor, an image for an image);
        // declared inputs are tensors.
        let mut names: Vec<&str> =
            self.values.iter().filter(|(_, k)| matches!(k, Kind::Image(_)) == image).map(|(n, _)| n.as_str()).collect();
        if !image {
            names.extend(self.declared.iter().map(String::as_str).filter(|d| !self.values.contains_key(*d)));
        }
        // Near enough to be what was meant: at most half its letters differ.
        let nearest = names
            .iter()
            .map(|n| (strsim::levenshtein(n, value), n))
            .min()
            .filter(|(d, n)| *d <= value.len().max(n.len()) / 2);
        let mut e = format!("no earlier step writes {}'{value}'", if image { "the image " } else { "" });
        if !self.declared.is_empty() {
            e.push_str(", and it is not a declared input");
        }
        match nearest {
            Some((_, n)) => e.push_str(&format!("; did you mean '{n}'?")),
            None => {
                if !names.is_empty() {
                    e.push_str(&format!(" (written so far: {})", names.join(", ")));
                }
                if self.declared.is_empty() && !image {
                    e.push_str("; a value clients send to a later step is declared as an [[input]]");
                }
            }
        }
        Error::invalid(e)
    }
}

/// The build of a model step: the model it calls must serve and batch, the inputs and outputs it
/// maps must be the model's, and each input must be written before it as the type the model takes.
/// The model of the repository a model step calls, as it serves while the pipeline is built.
fn called(c: &ModelStepConfig, models: &dyn Models) -> Result<Arc<crate::Model>> {
    models.model(&c.model, c.version.map(|v| v.to_string()).as_deref()).map_err(|e| match e {
        // Its reason is its own (a chain of pipelines would nest each one's).
        Error::Unavailable { .. } => {
            Error::invalid(format!("model '{}', which it calls, is not available (its own reason says why)", c.model))
        }
        e => Error::invalid(format!("{e} (a pipeline loads after the models its steps call)")),
    })
}

/// A model step's values: what it reads of `known` (checked against the model's inputs) and
/// what it writes.
fn model_step(c: &ModelStepConfig, model: &crate::Model, known: &mut Known) -> Result<Vec<(String, Kind)>> {
    let spec = &model.spec;
    if !spec.batched() {
        return Err(Error::invalid(format!(
            "model '{}' does not batch (max_batch_size 0); a pipeline's model steps take rows",
            c.model
        )));
    }
    if let Some(unknown) = c.inputs.keys().find(|k| !spec.inputs.iter().any(|t| &&t.name == k)) {
        return Err(Error::invalid(format!("model '{}' has no input '{unknown}'", c.model)));
    }
    if let Some(unknown) = c.outputs.keys().find(|k| !spec.outputs.iter().any(|t| &&t.name == k)) {
        return Err(Error::invalid(format!("model '{}' has no output '{unknown}'", c.model)));
    }
    for t in &spec.inputs {
        let value = c.inputs.get(&t.name).unwrap_or(&t.name);
        if !known.values.contains_key(value) && spec.optional.contains(&t.name) {
            continue;
        }
        match known.need(value, Kind::Tensor(t.datatype, t.dims.clone()))? {
            Kind::Tensor(d, _) if d == t.datatype => {}
            other => {
                return Err(Error::invalid(format!(
                    "model '{}' input '{}' takes {}, but '{value}' is {other:?}",
                    c.model, t.name, t.datatype
                )))
            }
        }
    }
    let written = spec
        .outputs
        .iter()
        .map(|t| (c.outputs.get(&t.name).unwrap_or(&t.name).clone(), Kind::Tensor(t.datatype, t.dims.clone())))
        .collect();
    Ok(written)
}

/// The build of a resize, pad or crop step: image in, image out (default both `image`).
fn image_step(
    known: &mut Known,
    input: Option<&str>,
    output: Option<&str>,
    make: impl FnOnce(Option<(u32, u32)>) -> Result<(image::ImageOp, Option<(u32, u32)>)>,
) -> Result<(Op, Vec<(String, Kind)>)> {
    let input = input.unwrap_or("image");
    let Kind::Image(size) = known.need(input, Kind::Image(None))? else {
        return Err(Error::invalid(format!("'{input}' is not an image")));
    };
    let (op, size) = make(size)?;
    Ok((Op::Image(op.with_input(input)), vec![(output.unwrap_or(input).to_string(), Kind::Image(size))]))
}

impl Backend for Pipeline {
    fn inputs(&self) -> &[TensorSpec] {
        &self.inputs
    }

    fn outputs(&self) -> &[TensorSpec] {
        &self.outputs
    }

    /// The pixels a request's images declare in their headers, against each decode step's
    /// `max_request_pixels` (refused at admission, before the request queues), and the bytes its
    /// tokenize steps read of its texts. A request of more than a few megapixels, or of more text
    /// than 32 texts of about a hundred words, is heavy (each counted as its share of those, added
    /// up): heavy requests never keep light ones waiting for a worker (the batcher's reserve).
    fn cost(&self) -> Option<Cost> {
        if !self.steps[..self.run].iter().any(|s| matches!(s.op, Op::Decode(_) | Op::Tokenize(_))) {
            return None;
        }
        let (steps, run) = (self.steps.clone(), self.run);
        let of = move |inputs: &[Tensor]| -> Result<u64> {
            let mut total = 0u64;
            for step in &steps[..run] {
                if let Op::Tokenize(t) = &step.op {
                    total = total.saturating_add(t.read_bytes(inputs).saturating_mul(HEAVY_PIXELS));
                }
                let Op::Decode(d) = &step.op else { continue };
                let Some(TensorData::Strings(images)) = inputs.iter().find(|t| t.name == d.input()).map(|t| &t.data)
                else {
                    continue;
                };
                let mut pixels = 0u64;
                // An image whose header does not read costs nothing here; its row fails at decode.
                for (w, h) in images.iter().filter_map(|b| d.declared(b).ok()) {
                    pixels += u64::from(w) * u64::from(h);
                }
                if pixels > d.max_request_pixels {
                    return Err(Error::invalid(format!(
                        "step '{}': the request's images decode to {pixels} pixels together, more than {} \
                         (decode_image max_request_pixels)",
                        step.name, d.max_request_pixels
                    )));
                }
                total = total.saturating_add(pixels.saturating_mul(HEAVY_TEXT_BYTES));
            }
            Ok(total)
        };
        Some(Cost { of: Arc::new(of), heavy: HEAVY_PIXELS * HEAVY_TEXT_BYTES })
    }

    /// Answers of a size of their own (a text's ids, an image's pixels) do not stack across
    /// requests: each request is answered apart (a batch of several sizes ran again in halves).
    fn answers_each(&self) -> bool {
        !fixed(&self.outputs)
    }

    fn instance(&self) -> Result<Box<dyn Instance>> {
        // Each worker waits for its model steps on a runtime of its own (timers for the steps'
        // queue timeouts), never on the server's.
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .map_err(|e| Error::internal(format!("cannot start a pipeline worker's runtime: {e}")))?;
        Ok(Box::new(Worker {
            steps: self.steps.clone(),
            run: self.run,
            registry: self.registry.clone(),
            own: self.own.clone(),
            outputs: self.outputs.iter().map(|t| t.name.clone()).collect(),
            // Answers of fixed shapes (an embedding, scores) stack whatever length each row ran
            // at; a value of a text's length (its ids, say) must agree across a request's rows.
            rows_apart: fixed(&self.outputs),
            runtime,
            failed: Vec::new(),
            label: self.label.clone(),
        }))
    }
}

struct Worker {
    steps: Arc<Vec<Step>>,
    /// How many of `steps` it runs.
    run: usize,
    /// Weak: the registry holds this pipeline, whose workers must not keep it alive.
    registry: Weak<dyn Models>,
    own: BTreeMap<String, Arc<crate::Model>>,
    outputs: Vec<String>,
    /// Every output's shape is fixed: a tokenize step may pad each row apart from its request's
    /// others (a re-ranker's short passages are not run at its longest one's length).
    rows_apart: bool,
    runtime: tokio::runtime::Runtime,
    failed: Vec<(usize, Error)>,
    label: String,
}

impl Instance for Worker {
    fn run(&mut self, inputs: &[BatchInput<'_>]) -> Result<Vec<Tensor>> {
        self.run_live(inputs, &Live::everyone())
    }

    fn run_live(&mut self, inputs: &[BatchInput<'_>], live: &Live<'_>) -> Result<Vec<Tensor>> {
        let (mut values, index, rows) = self.run_steps(inputs, live)?;
        if index.is_empty() {
            return Err(self.failed[0].1.clone());
        }
        self.outputs
            .iter()
            .map(|name| match values.remove(name) {
                Some(Value::Rows(r)) => stack(name, refill(r, &index, rows)),
                _ => Err(Error::internal(format!("pipeline output '{name}' was not written"))),
            })
            .collect()
    }

    /// For a pipeline whose answers have a size of their own (a text's ids, an image's pixels),
    /// which do not stack into one batch: each request gets its own rows' answers, or its error.
    fn run_each(&mut self, inputs: &[BatchInput<'_>], live: &Live<'_>) -> Result<Vec<Result<Vec<Tensor>>>> {
        let requests = inputs.first().map_or(1, |i| i.parts.len());
        let (mut values, index, rows) = self.run_steps(inputs, live)?;
        let outputs = self
            .outputs
            .iter()
            .map(|name| match values.remove(name) {
                Some(Value::Rows(r)) => Ok((name, r)),
                _ if index.is_empty() => Ok((name, Vec::new())),
                _ => Err(Error::internal(format!("pipeline output '{name}' was not written"))),
            })
            .collect::<Result<Vec<_>>>()?;
        let mut failed = std::mem::take(&mut self.failed);
        failed.sort_by_key(|(row, _)| *row);
        // Each request's first batch row and row count (its rows are consecutive), and where its
        // rows that went to the end are among the values'.
        let mut spans = vec![(rows, 0); requests];
        for row in 0..rows {
            if let Some(span) = spans.get_mut(live.request_of(row)) {
                *span = (span.0.min(row), span.1 + 1);
            }
        }
        let mut kept = vec![Vec::new(); requests];
        for (k, &row) in index.iter().enumerate() {
            if let Some(mine) = kept.get_mut(live.request_of(row)) {
                mine.push(k);
            }
        }
        let answer = |(&(first, count), mine): (&(usize, usize), &Vec<usize>)| {
            if let Some(e) = crate::engine::batcher::request_error(first, count, &failed) {
                return Err(e);
            }
            if mine.is_empty() {
                return Err(Error::unavailable("the client left", None));
            }
            outputs.iter().map(|(name, r)| stack(name, mine.iter().map(|&k| r[k].clone()).collect())).collect()
        };
        Ok(spans.iter().zip(&kept).map(answer).collect())
    }

    fn failed_rows(&mut self) -> Vec<(usize, Error)> {
        std::mem::take(&mut self.failed)
    }
}

/// Whether every one of `outputs` has a fixed shape (an embedding, scores).
fn fixed(outputs: &[TensorSpec]) -> bool {
    outputs.iter().all(|t| t.dims.iter().all(|&d| d >= 0))
}

/// Keeps the rows of every value whose batch row (`index`) passes `keep`, and their index.
fn keep_rows(values: &mut BTreeMap<String, Value>, index: &mut Vec<usize>, keep: impl Fn(usize) -> bool) {
    // Nearly always every row is kept: nothing is allocated then.
    if index.iter().all(|&row| keep(row)) {
        return;
    }
    let kept: Vec<bool> = index.iter().map(|&row| keep(row)).collect();
    fn retain<T>(v: &mut Vec<T>, kept: &[bool]) {
        let mut k = kept.iter();
        v.retain(|_| k.next().copied().unwrap_or(false));
    }
    for v in values.values_mut() {
        match v {
            Value::Rows(r) => retain(r, &kept),
            Value::Images(p) => retain(p, &kept),
        }
    }
    retain(index, &kept);
}

/// The rows of a whole batch of `rows` from those held for `index`: a row dropped (its client
/// left) gets a copy of one held, so the batch keeps its shape; nobody reads it.
fn refill(held: Vec<Tensor>, index: &[usize], rows: usize) -> Vec<Tensor> {
    if index.len() == rows {
        return held;
    }
    let mut out: Vec<Option<Tensor>> = vec![None; rows];
    for (&row, t) in index.iter().zip(&held) {
        out[row] = Some(t.clone());
    }
    let filler = held[0].clone();
    out.into_iter().map(|t| t.unwrap_or_else(|| filler.clone())).collect()
}

/// `e` as step `step`'s error.
fn named(step: &Step, e: Error) -> Error {
    let text = format!("step '{}': {e}", step.name);
    match e {
        Error::InvalidInput(_) => Error::InvalidInput(text),
        Error::Internal(_) => Error::Internal(text),
        other => other,
    }
}

impl Worker {
    /// Runs the steps over a batch: its values at the end, the batch row each of their rows is,
    /// and the batch's rows. Rows that failed on their own (`self.failed`) are not among them;
    /// where every row failed, none is (the steps stop there).
    fn run_steps(
        &mut self,
        inputs: &[BatchInput<'_>],
        live: &Live<'_>,
    ) -> Result<(BTreeMap<String, Value>, Vec<usize>, usize)> {
        self.failed.clear();
        let mut values: BTreeMap<String, Value> = BTreeMap::new();
        let mut rows = 0;
        for i in inputs {
            let r = split_rows(i)?;
            rows = r.len();
            values.insert(i.name.to_string(), Value::Rows(r));
        }
        // The batch's row that each row held now is: rows whose client left are dropped between
        // steps (and skipped within an image chain), so no further work is paid for them.
        let mut index: Vec<usize> = (0..rows).collect();
        let mut i = 0;
        while i < self.run {
            keep_rows(&mut values, &mut index, |row| live.awaited(row));
            if index.is_empty() {
                return Err(Error::unavailable("every client of the batch left", None));
            }
            // A decode and the image steps right after it run row by row, so one image at its
            // sent size is held at a time (not a batch of them: 32 rows of 40-megapixel images
            // would be 3.8 GB); what the batch keeps is what the chain leaves.
            let chain = match self.steps[i].op {
                Op::Decode(_) => {
                    1 + self.steps[i + 1..self.run].iter().take_while(|s| matches!(s.op, Op::Image(_))).count()
                }
                _ => 1,
            };
            let result = if matches!(self.steps[i].op, Op::Decode(_)) {
                self.image_chain(&self.steps[i..i + chain], &mut values, &mut index, live)
            } else {
                let step = &self.steps[i];
                let start = Instant::now();
                let result = match &step.op {
                    Op::Decode(_) => Err(StepError::Batch(Error::internal("a decode runs in an image chain"))),
                    Op::Image(op) => op.run(&mut values).map(|()| Vec::new()),
                    Op::Normalize(n) => n.run(&mut values).map(|()| Vec::new()),
                    // Writes the rows that did not fail: tokenizing the others again would cost
                    // as much as the step itself.
                    Op::Tokenize(t) => {
                        let rows_apart = self.rows_apart;
                        t.run(&mut values, &|r| if rows_apart { r } else { live.request_of(index[r]) })
                            .map(|failed| failed.into_iter().map(|(r, e)| (index[r], named(step, e))).collect())
                    }
                    Op::Model(m) => {
                        let awaited = |r: usize| live.awaited(index[r]);
                        let share = |r: usize| live.share(index[r]).cloned();
                        self.model_step(m, &mut values, index.len(), &awaited, &share)
                            .map(|()| Vec::new())
                            .map_err(StepError::Batch)
                    }
                    Op::Post(p) => p.run(&mut values).map(|()| Vec::new()),
                };
                self.observe(step, start.elapsed());
                result.map_err(|e| e.named(step))
            };
            // Rows that failed on their own fail their requests (the batcher answers them so), and
            // the batch goes on without those requests' rows: the others' work is not done again.
            let failed = match result {
                Ok(failed) => {
                    i += chain;
                    failed
                }
                // A failure of the whole batch (a model step's) is not a row's.
                Err(StepError::Batch(e)) => return Err(e),
                // A step that fails some rows writes nothing: it runs again for the others.
                Err(StepError::Rows(rows)) => rows.into_iter().map(|(r, e)| (index[r], e)).collect(),
            };
            if !failed.is_empty() {
                let requests: Vec<usize> = failed.iter().map(|&(row, _)| live.request_of(row)).collect();
                self.failed.extend(failed);
                keep_rows(&mut values, &mut index, |row| !requests.contains(&live.request_of(row)));
                if index.is_empty() {
                    return Ok((values, index, rows));
                }
            }
        }
        // Rows whose clients left during the last step (a model call skipped for them) go too.
        keep_rows(&mut values, &mut index, |row| live.awaited(row));
        if index.is_empty() {
            return Err(Error::unavailable("every client of the batch left", None));
        }
        Ok((values, index, rows))
    }

    fn observe(&self, step: &Step, took: std::time::Duration) {
        let m = &crate::telemetry::metrics::global().pipeline_step_duration;
        m.with_label_values(&[&self.label, &step.name]).observe(took.as_secs_f64());
    }

    /// Runs `chain` (a decode and image steps) row by row; the batch gets the images each value
    /// ends with. A row that fails, or whose client has left (skipped), is dropped (from `values`
    /// and `index`); the rows that failed are returned, as batch rows, with their errors. (A
    /// request's decoded pixels were charged at admission, by `Backend::cost`.)
    fn image_chain(
        &self,
        chain: &[Step],
        values: &mut BTreeMap<String, Value>,
        index: &mut Vec<usize>,
        live: &Live<'_>,
    ) -> Result<Vec<(usize, Error)>, StepError> {
        let mut took = vec![std::time::Duration::ZERO; chain.len()];
        let mut written: BTreeMap<String, Vec<image::Picture>> = BTreeMap::new();
        let mut errors = Vec::new();
        let mut gone = Vec::new();
        'rows: for (r, &row) in index.iter().enumerate() {
            if !live.awaited(row) {
                gone.push(row);
                continue;
            }
            let mut one: BTreeMap<String, Value> = values
                .iter()
                .filter_map(|(k, v)| match v {
                    Value::Rows(t) => Some((k.clone(), Value::Rows(vec![t[r].clone()]))),
                    Value::Images(_) => None,
                })
                .collect();
            for (k, step) in chain.iter().enumerate() {
                let start = Instant::now();
                let result = match &step.op {
                    Op::Decode(d) => d.run(&mut one),
                    Op::Image(op) => op.run(&mut one),
                    _ => Err(StepError::Batch(Error::internal("not an image step"))),
                };
                took[k] += start.elapsed();
                match result.map_err(|e| e.named(step)) {
                    Ok(()) => {}
                    Err(StepError::Batch(e)) => return Err(StepError::Batch(e)),
                    Err(StepError::Rows(mut failed)) => {
                        let e = failed.pop().map_or_else(|| Error::internal("a step failed"), |(_, e)| e);
                        errors.push((row, e));
                        continue 'rows;
                    }
                }
            }
            for (name, v) in one {
                if let Value::Images(mut p) = v {
                    written.entry(name).or_default().extend(p.pop());
                }
            }
        }
        for (step, t) in chain.iter().zip(took) {
            self.observe(step, t);
        }
        keep_rows(values, index, |row| !gone.contains(&row) && !errors.iter().any(|(failed, _)| *failed == row));
        values.extend(written.into_iter().map(|(name, pictures)| (name, Value::Images(pictures))));
        Ok(errors)
    }

    /// Runs rows through another model's batcher: rows whose inputs have equal shapes go
    /// together, in calls of at most its max batch size. A call whose rows' clients have all left
    /// is not made, or is dropped from that model's queue while it waits there; the batch's other
    /// rows go on.
    fn model_step(
        &self,
        c: &ModelStepConfig,
        values: &mut BTreeMap<String, Value>,
        rows: usize,
        awaited: &dyn Fn(usize) -> bool,
        share: &dyn Fn(usize) -> Option<Arc<str>>,
    ) -> Result<()> {
        let model = match c.file.as_ref().and_then(|f| self.own.get(f)) {
            Some(own) => own.clone(),
            None => {
                let registry =
                    self.registry.upgrade().ok_or_else(|| Error::unavailable("the server is shutting down", None))?;
                let model = registry.model(&c.model, c.version.map(|v| v.to_string()).as_deref());
                drop(registry);
                // A model unloaded under a pipeline that calls it: the pipeline cannot serve for now.
                model.map_err(|e| match e {
                    Error::NotFound(m) => Error::unavailable(format!("{m}, which this pipeline calls"), None),
                    other => other,
                })?
            }
        };
        let spec = &model.spec;
        let mut given: Vec<(&str, &Vec<Tensor>)> = Vec::new();
        for t in &spec.inputs {
            let value = c.inputs.get(&t.name).unwrap_or(&t.name);
            match values.get(value) {
                Some(Value::Rows(r)) => given.push((&t.name, r)),
                Some(Value::Images(_)) => return Err(Error::invalid(format!("'{value}' is an image, not a tensor"))),
                None if spec.optional.contains(&t.name) => {}
                None => return Err(Error::internal(format!("value '{value}' was not written"))),
            }
        }
        let mut groups: BTreeMap<Vec<Vec<usize>>, Vec<usize>> = BTreeMap::new();
        for row in 0..rows {
            groups.entry(given.iter().map(|(_, r)| r[row].shape.clone()).collect()).or_default().push(row);
        }
        let mut answers: Vec<Option<Vec<Tensor>>> = vec![None; rows];
        for members in groups.values() {
            for chunk in members.chunks(spec.batch.max_batch_size.max(1)) {
                let gone = || !chunk.iter().any(|&r| awaited(r));
                if gone() {
                    continue;
                }
                let inputs = given
                    .iter()
                    .map(|(name, r)| stack(name, chunk.iter().map(|&i| r[i].clone()).collect()))
                    .collect::<Result<Vec<_>>>()?;
                let share = call_share(chunk, share);
                let req =
                    InferRequest { model_name: c.model.clone(), inputs, skip_cache: true, share, ..Default::default() };
                // One call at a time: several at once on the model's instances (a group each)
                // served requests of 16 texts of many lengths 0.88x as fast at one client, and
                // level under load (`bench/results/step-calls-ab.md`).
                let resp = self.runtime.block_on(async {
                    let mut call = std::pin::pin!(model.infer(req, crate::wire::DEFAULT_MAX_ELEMENTS));
                    loop {
                        match tokio::time::timeout(CLIENT_CHECK, call.as_mut()).await {
                            Ok(answer) => return answer.map(Some),
                            // Dropping the call drops its place in the model's queue; its rows
                            // answer nothing and go after the step, the batch's others go on (a
                            // client that left used to fail the batch, run again without it).
                            Err(_) if gone() => return Ok(None),
                            Err(_) => {}
                        }
                    }
                })?;
                let Some(resp) = resp else { continue };
                for (k, &row) in chunk.iter().enumerate() {
                    answers[row] = Some(resp.outputs.iter().map(|o| unstack(o, k)).collect());
                }
            }
        }
        for (j, t) in spec.outputs.iter().enumerate() {
            let rows = answers.iter().map(|a| a.as_ref().map(|o| o[j].clone()).unwrap_or_else(|| empty(t))).collect();
            values.insert(c.outputs.get(&t.name).unwrap_or(&t.name).clone(), Value::Rows(rows));
        }
        // A version unloaded meanwhile is freed off this thread.
        crate::engine::model::release(model);
        Ok(())
    }
}

/// The share a model step's call of `rows` takes its turns as in the model's queue: theirs where
/// they are one share's (so a tenant's call of long texts does not go ahead of another's short one
/// there, as its requests do not in the pipeline's queue), else none.
fn call_share(rows: &[usize], share: &dyn Fn(usize) -> Option<Arc<str>>) -> Option<String> {
    let first = share(*rows.first()?);
    rows.iter().all(|&r| share(r) == first).then(|| first.map(|s| s.to_string())).flatten()
}

fn empty(t: &TensorSpec) -> Tensor {
    Tensor::new(&t.name, t.datatype, vec![0], TensorData::Fixed(Default::default()))
}

/// One input of the batch as a tensor per row (without the batch dim).
fn split_rows(input: &BatchInput<'_>) -> Result<Vec<Tensor>> {
    let rows = input.shape.first().copied().unwrap_or(1);
    let row_shape = input.shape.get(1..).unwrap_or_default().to_vec();
    let per_row: usize = row_shape.iter().product();
    let mut out = Vec::with_capacity(rows);
    for part in &input.parts {
        match part {
            TensorData::Strings(items) => {
                for chunk in items.chunks(per_row.max(1)) {
                    out.push(Tensor::new(
                        input.name,
                        input.datatype,
                        row_shape.clone(),
                        TensorData::Strings(chunk.to_vec()),
                    ));
                }
            }
            TensorData::Fixed(b) => {
                let size = per_row * input.datatype.size().unwrap_or(1);
                for start in (0..b.len()).step_by(size.max(1)) {
                    let data = TensorData::Fixed(b.slice(start..start + size));
                    out.push(Tensor::new(input.name, input.datatype, row_shape.clone(), data));
                }
            }
        }
    }
    if out.len() != rows {
        return Err(Error::internal(format!("input '{}': {} rows found, {rows} expected", input.name, out.len())));
    }
    Ok(out)
}

/// Rows (each without the batch dim) as one tensor `[rows, ...]`; they must agree in shape.
pub(crate) fn stack(name: &str, rows: Vec<Tensor>) -> Result<Tensor> {
    let Some(first) = rows.first() else { return Err(Error::internal(format!("'{name}' has no rows"))) };
    let (datatype, shape) = (first.datatype, first.shape.clone());
    if let Some(r) = rows.iter().find(|r| r.shape != shape || r.datatype != datatype) {
        return Err(Error::invalid(format!(
            "'{name}' differs between rows ({datatype} {shape:?} and {} {:?}); a request's rows must agree",
            r.datatype, r.shape
        )));
    }
    let n = rows.len();
    let data = if datatype == DataType::Bytes {
        TensorData::Strings(
            rows.into_iter()
                .flat_map(|r| match r.data {
                    TensorData::Strings(v) => v,
                    TensorData::Fixed(_) => Vec::new(),
                })
                .collect(),
        )
    } else if n == 1 {
        rows.into_iter().next().map(|r| r.data).unwrap_or(TensorData::Fixed(Default::default()))
    } else {
        let mut buf = Vec::new();
        for r in &rows {
            if let TensorData::Fixed(b) = &r.data {
                buf.extend_from_slice(b);
            }
        }
        TensorData::Fixed(crate::data::tensor::aligned_bytes(&buf))
    };
    Ok(Tensor::new(name, datatype, std::iter::once(n).chain(shape).collect(), data))
}

/// Row `k` of `t` without the batch dim.
fn unstack(t: &Tensor, k: usize) -> Tensor {
    let mut r = t.rows(k, 1);
    r.shape.remove(0);
    r
}

/// Each element of a row tensor as f32 (any numeric datatype).
pub(crate) fn floats(t: &Tensor) -> Result<Vec<f32>> {
    crate::engine::classify::elements(t, |v| v as f32)
        .map_err(|_| Error::invalid(format!("'{}' is {}, which this step does not take", t.name, t.datatype)))
}

/// The rows of value `name`, which must be tensors.
pub(crate) fn rows_of<'v>(values: &'v BTreeMap<String, Value>, name: &str) -> Result<&'v Vec<Tensor>, StepError> {
    match values.get(name) {
        Some(Value::Rows(r)) => Ok(r),
        _ => Err(StepError::Batch(Error::internal(format!("value '{name}' is not a tensor")))),
    }
}

/// Runs `f` on every row, collecting the rows that fail.
pub(crate) fn per_row<T, U>(items: &[T], mut f: impl FnMut(&T) -> Result<U>) -> Result<Vec<U>, StepError> {
    let mut out = Vec::with_capacity(items.len());
    let mut errors = Vec::new();
    for (i, item) in items.iter().enumerate() {
        match f(item) {
            Ok(v) => out.push(v),
            Err(e) => errors.push((i, e)),
        }
    }
    if errors.is_empty() {
        Ok(out)
    } else {
        Err(StepError::Rows(errors))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Registry;

    fn steps(toml_text: &str) -> Result<Vec<StepConfig>> {
        crate::control::repository::parse_config(toml_text).map(|c| c.steps)
    }

    #[test]
    fn step_errors_name_the_step_and_the_line_in_one_line_and_values_take_any_case() {
        let text =
            "max_batch_size = 8\n[[steps]]\nop = \"decode_image\"\n[[steps]]\nname = \"letterbox\"\nop = \"pad\"\n\
                    value = 114\nanchor = \"middle\"\n";
        let e = steps(text).unwrap_err().to_string();
        assert!(e.starts_with("config.toml line 8: step 2 'letterbox' (pad): unknown variant `middle`"), "{e}");
        assert!(!e.contains('\n'), "{e}");
        let e = steps("[[steps]]\nop = \"resize\"\nsize = [4, 4]\nantialiasing = false\n").unwrap_err().to_string();
        assert!(e.starts_with("config.toml line 4: step 1 (resize): unknown field `antialiasing`"), "{e}");
        let e = steps("max_batch_size = \"eight\"\n").unwrap_err().to_string();
        assert!(e.starts_with("config.toml line 1: invalid type"), "{e}");
        let s = steps(
            "[[steps]]\nop = \"resize\"\nsize = [4]\nmode = \"Shorter_Side\"\nfilter = \"BICUBIC\"\n\
             [[steps]]\nop = \"normalize\"\nchannels = \"bgr\"\nlayout = \"nhwc\"\ndtype = \"fp16\"\n\
             [[steps]]\nop = \"pool\"\nmode = \"MEAN\"\n",
        )
        .unwrap();
        assert!(
            matches!(&s[0], StepConfig::Resize(r) if r.mode == image::ResizeMode::ShorterSide && r.filter == image::Filter::Bicubic)
        );
        assert!(
            matches!(&s[1], StepConfig::Normalize(n) if n.channels == image::Channels::Bgr && n.layout == image::Layout::Nhwc)
        );
        assert!(matches!(&s[2], StepConfig::Pool(p) if p.mode == post::Pooling::Mean));
        assert!(image::Normalize::new(match &s[1] {
            StepConfig::Normalize(n) => n,
            _ => unreachable!(),
        })
        .is_ok());
    }

    #[test]
    fn steps_parse_by_op_and_unknown_ops_or_fields_are_named() {
        let s = steps("[[steps]]\nop = \"decode_image\"\n[[steps]]\nop = \"resize\"\nsize = [4, 4]\n").unwrap();
        assert!(matches!(&s[1], StepConfig::Resize(r) if r.size == vec![4, 4]));
        let e = steps("[[steps]]\nop = \"blur\"\n").unwrap_err().to_string();
        assert!(e.contains("blur"), "{e}");
        let e = steps("[[steps]]\nop = \"crop\"\nsize = [2, 2]\nradius = 3\n").unwrap_err().to_string();
        assert!(e.contains("radius"), "{e}");
    }

    #[test]
    fn a_build_names_the_step_that_cannot_be_built() {
        let registry: Arc<dyn Models> = Arc::new(arc_swap::ArcSwap::from_pointee(Registry::default()));
        let dir = std::env::temp_dir();
        // The build's error, with `inputs` declared.
        let declared = |text: &str, inputs: &[&str]| {
            let inputs: Vec<String> = inputs.iter().map(|s| s.to_string()).collect();
            let (none, registry) = (Registry::default(), registry.clone());
            Pipeline::build("p", &dir, &steps(text).unwrap(), &inputs, &[], &none, registry, Default::default())
                .err()
                .map(|e| e.to_string())
        };
        let build = |text: &str| declared(text, &[]);
        let e = build("[[steps]]\nop = \"resize\"\nsize = [4, 4]\n").unwrap();
        assert!(e.contains("step 'resize' (resize): no earlier step writes the image 'image'"), "{e}");
        let e = build("[[steps]]\nop = \"decode_image\"\n[[steps]]\nop = \"model\"\nmodel = \"m\"\n").unwrap();
        assert!(e.contains("step 'model' (model): unknown model 'm'"), "{e}");
        let e = build("[[steps]]\nop = \"decode_image\"\n").unwrap();
        assert!(e.contains("output 'image' is an image"), "{e}");
        // A name no step writes is refused after the first step, not made a client input.
        let detector = "[[steps]]\nop = \"decode_image\"\n[[steps]]\nop = \"resize\"\nsize = [8, 8]\n\
                        [[steps]]\nop = \"normalize\"\n[[steps]]\nop = \"softmax\"\ninput = \"images\"\n";
        let e = build(detector).unwrap();
        assert!(e.contains("step 'softmax' (softmax): no earlier step writes 'images'"), "{e}");
        assert!(
            e.contains("'images' (written so far: pixels); a value clients send to a later step is declared"),
            "{e}"
        );
        let e = build(&detector.replace("\"images\"", "\"pixel\"")).unwrap();
        assert!(e.ends_with("did you mean 'pixels'?"), "{e}");
        let e = build(&detector.replace("op = \"resize\"", "op = \"resize\"\ninput = \"imagee\"")).unwrap();
        assert!(e.contains("no earlier step writes the image 'imagee'; did you mean 'image'?"), "{e}");
        // Declared inputs are the only ones: a typo in a tokenizer's input is caught too.
        let two = "[[steps]]\nop = \"decode_image\"\n[[steps]]\nop = \"resize\"\nsize = [8, 8]\n\
                   [[steps]]\nop = \"normalize\"\n[[steps]]\nop = \"softmax\"\ninput = \"scores\"\n";
        assert_eq!(declared(two, &["image", "scores"]), None, "a declared input read by a later step");
        let e = declared(two, &["image", "score"]).unwrap();
        assert!(
            e.contains("no earlier step writes 'scores', and it is not a declared input; did you mean 'score'?"),
            "{e}"
        );
        let e = declared("[[steps]]\nop = \"decode_image\"\ninput = \"img\"\n", &["image"]).unwrap();
        assert!(e.contains("'img', and it is not a declared input; did you mean 'image'?"), "{e}");
        let ok = Pipeline::build(
            "p",
            &dir,
            &steps("[[steps]]\nop = \"decode_image\"\n[[steps]]\nop = \"crop\"\nsize = [8, 6]\n[[steps]]\nop = \"normalize\"\n").unwrap(),
            &[],
            &[],
            &Registry::default(),
            registry,
            Default::default(),
        )
        .unwrap();
        assert_eq!(ok.inputs()[0], TensorSpec { name: "image".into(), datatype: DataType::Bytes, dims: vec![] });
        assert_eq!(
            ok.outputs()[0],
            TensorSpec { name: "pixels".into(), datatype: DataType::Fp32, dims: vec![3, 6, 8] }
        );
    }

    #[test]
    fn a_request_of_much_text_is_heavy_counting_what_is_read_of_each() {
        let registry: Arc<dyn Models> = Arc::new(arc_swap::ArcSwap::from_pointee(Registry::default()));
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/text_embedder");
        let config = steps("[[steps]]\nop = \"tokenize\"\nmax_length = 256\n").unwrap();
        let p =
            Pipeline::build("p", &dir, &config, &[], &[], &Registry::default(), registry, Default::default()).unwrap();
        let cost = p.cost().expect("a text pipeline tells its requests' costs");
        let heavy = |texts: Vec<String>| {
            let items = texts.into_iter().map(bytes::Bytes::from).collect::<Vec<_>>();
            let t = Tensor::new("text", DataType::Bytes, vec![items.len()], TensorData::Strings(items));
            (cost.of)(&[t]).unwrap() > cost.heavy
        };
        let words = |n: usize| vec!["word"; n].join(" ");
        assert!(!heavy(vec!["a short text to embed".into()]));
        assert!(!heavy(vec![words(20); 32]), "32 sentences");
        assert!(heavy(vec![words(200); 32]), "32 texts of 200 words");
        // What is read of a text: 8 x max_length bytes at first (the rest is cut).
        assert!(!heavy(vec!["x".repeat(1 << 20)]), "one text of a megabyte");
        assert!(!heavy(vec!["x".repeat(1 << 20); 8]), "eight: 16 KiB read");
        assert!(heavy(vec!["x".repeat(1 << 20); 9]));
    }

    #[test]
    fn token_embeddings_are_what_the_first_pool_step_reads_unless_it_is_splades() {
        let registry: Arc<dyn Models> = Arc::new(arc_swap::ArcSwap::from_pointee(Registry::default()));
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/text_embedder");
        let pooled = |pool: &str| {
            let text = format!("[[steps]]\nop = \"tokenize\"\n{pool}");
            let inputs = ["text".to_string(), "hidden".to_string()];
            let p = Pipeline::build(
                "p",
                &dir,
                &steps(&text).unwrap(),
                &inputs,
                &[],
                &Registry::default(),
                registry.clone(),
                Default::default(),
            )
            .unwrap();
            // Its first steps answer what they write, on the same built steps.
            let first = p.prefix("p/embed_all", 1, &["token_count".into(), "attention_mask".into()]).unwrap();
            assert_eq!((first.run, first.inputs()), (1, p.inputs()));
            assert_eq!(
                first.outputs()[0],
                TensorSpec { name: "token_count".into(), datatype: DataType::Int64, dims: vec![] }
            );
            assert_eq!(first.outputs()[1].dims, vec![-1]);
            let e = p.prefix("p/embed_all", 1, &["embedding".into()]).err().map(|e| e.to_string());
            assert_eq!(e.as_deref(), Some("output 'embedding' is written by no step"), "written by a later step");
            p.pooled().map(|(at, input)| (at, input.to_string()))
        };
        let pool = "[[steps]]\nop = \"pool\"\ninput = \"hidden\"\n";
        assert_eq!(pooled(pool), Some((1, "hidden".into())));
        assert_eq!(
            pooled(&format!("{pool}[[steps]]\nop = \"softmax\"\ninput = \"embedding\"\n")),
            Some((1, "hidden".into()))
        );
        assert_eq!(pooled(&format!("{pool}mode = \"splade\"\n")), None, "SPLADE pools logits");
        assert_eq!(pooled(""), None);
    }

    #[test]
    fn rows_of_clients_that_left_are_dropped_and_refilled_in_place() {
        let row = |v: f32| Tensor::from_le("a", DataType::Fp32, vec![1], &[v]);
        let mut values: BTreeMap<String, Value> =
            [("a".to_string(), Value::Rows((0..4).map(|v| row(v as f32)).collect()))].into();
        let mut index: Vec<usize> = (0..4).collect();
        keep_rows(&mut values, &mut index, |r| r != 1 && r != 2);
        assert_eq!(index, vec![0, 3]);
        let Some(Value::Rows(held)) = values.remove("a") else { panic!() };
        let full = refill(held, &index, 4);
        let firsts: Vec<f32> = full.iter().map(|t| floats(t).unwrap()[0]).collect();
        assert_eq!(firsts, vec![0.0, 0.0, 0.0, 3.0]);
    }

    #[test]
    fn a_model_steps_call_takes_the_turns_of_its_rows_share_when_they_have_one() {
        // Requests of 2, 1 and 2 rows, of shares a, b and none.
        let awaited = |_| true;
        let live = Live::new([2, 1, 2], &awaited).with_shares(vec![Some("a".into()), Some("b".into()), None]);
        let share = |r: usize| live.share(r).cloned();
        assert_eq!(call_share(&[0, 1], &share).as_deref(), Some("a"));
        assert_eq!(call_share(&[2], &share).as_deref(), Some("b"));
        assert_eq!(call_share(&[1, 2], &share), None, "rows of two shares: none's turns");
        assert_eq!(call_share(&[3, 4], &share), None);
        let unshared = Live::new([2], &awaited);
        assert_eq!(call_share(&[0, 1], &|r| unshared.share(r).cloned()), None);
    }

    #[test]
    fn live_rows_belong_to_their_requests() {
        let awaited = |i: usize| i != 1;
        let live = Live::new([2, 3, 1], &awaited);
        assert_eq!((0..6).map(|r| live.request_of(r)).collect::<Vec<_>>(), vec![0, 0, 1, 1, 1, 2]);
        assert_eq!((0..6).map(|r| live.awaited(r)).collect::<Vec<_>>(), vec![true, true, false, false, false, true]);
        assert!(Live::everyone().awaited(7));
    }

    #[test]
    fn rows_that_differ_in_shape_do_not_stack() {
        let a = Tensor::from_le("a", DataType::Fp32, vec![2], &[1.0f32, 2.0]);
        let b = Tensor::from_le("a", DataType::Fp32, vec![3], &[1.0f32, 2.0, 3.0]);
        assert_eq!(stack("a", vec![a.clone(), a.clone()]).unwrap().shape, vec![2, 2]);
        assert!(stack("a", vec![a, b]).unwrap_err().to_string().contains("differs between rows"));
    }
}
