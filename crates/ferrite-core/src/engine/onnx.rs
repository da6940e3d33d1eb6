//! The ONNX Runtime adapter, through the `ort` crate with the library loaded at run time.

use std::{
    path::{Path, PathBuf},
    process::Command,
    sync::{
        atomic::{AtomicUsize, Ordering::Relaxed},
        Mutex, OnceLock,
    },
    time::{Duration, Instant},
};

use ort::{
    environment::Environment,
    memory::{Allocator, MemoryInfo},
    session::{
        builder::GraphOptimizationLevel, HasSelectedOutputs, RunOptions, Session, SessionInputValue, SessionOutputs,
    },
    value::{
        DynMapValueType, DynSequenceValueType, DynTensor, DynTensorValueType, DynValue, Tensor as OrtTensor,
        TensorElementType, ValueType,
    },
    AsPointer,
};

use crate::{
    data::tensor::{aligned_bytes, Reused, REUSED_FROM},
    engine::{
        backend::{Backend, BatchInput, Instance, Live},
        spec::TensorSpec,
    },
    DataType, Error, Result, Tensor, TensorData,
};

/// How to install the runtime, for the one line printed when it cannot be found.
pub const INSTALL_HINT: &str =
    "ONNX Runtime not found: run `python3 -m pip install onnxruntime==1.31.*` or pass --onnxruntime-lib PATH (env ORT_DYLIB_PATH)";

/// The ONNX Runtime releases Ferrite is built for (the `ort` crate's API 31; the pinned wheel is
/// `onnxruntime==1.31.*`): 1.31 and later 1.x, older ones refused.
pub const SUPPORTED_MINOR: u32 = 31;

/// The loaded library: its path, its version, and the environment every session shares.
struct Runtime {
    path: PathBuf,
    version: String,
    env: Environment,
}

static RUNTIME: OnceLock<std::result::Result<Runtime, String>> = OnceLock::new();

/// The version `libonnxruntime` at `path` says it is (`OrtGetApiBase()->GetVersionString()`),
/// checked against the supported range: an error says what was found, what is needed and how to
/// install it, rather than fail later inside the library.
pub fn library_version(path: &Path) -> std::result::Result<String, String> {
    // SAFETY: opening the library runs its initialisers, as loading it for use does right after;
    // OrtGetApiBase takes nothing and returns a pointer to a static table whose GetVersionString
    // returns a static NUL-terminated string.
    let version = unsafe {
        let lib = libloading::Library::new(path)
            .map_err(|e| format!("cannot load ONNX Runtime from {}: {e}. {INSTALL_HINT}", path.display()))?;
        let get: libloading::Symbol<unsafe extern "C" fn() -> *const ort::sys::OrtApiBase> =
            lib.get(b"OrtGetApiBase").map_err(|_| {
                format!("{} is not an ONNX Runtime library (no OrtGetApiBase). {INSTALL_HINT}", path.display())
            })?;
        let base = get();
        if base.is_null() {
            return Err(format!("{} returned no ONNX Runtime API", path.display()));
        }
        std::ffi::CStr::from_ptr(((*base).GetVersionString)()).to_string_lossy().into_owned()
    };
    let mut parts = version.split('.').map(|p| p.parse::<u32>().ok());
    match (parts.next().flatten(), parts.next().flatten()) {
        (Some(1), Some(minor)) if minor >= SUPPORTED_MINOR => Ok(version),
        _ => Err(format!(
            "ONNX Runtime {version} found at {}; Ferrite needs 1.{SUPPORTED_MINOR} or a later 1.x: run \
             `python3 -m pip install onnxruntime==1.{SUPPORTED_MINOR}.*` or pass --onnxruntime-lib PATH",
            path.display()
        )),
    }
}

/// The version of the ONNX Runtime library loaded at start-up, if one is.
pub fn runtime_version() -> Option<&'static str> {
    RUNTIME.get().and_then(|r| r.as_ref().ok()).map(|r| r.version.as_str())
}

/// Finds `libonnxruntime`: `explicit`, then `ORT_DYLIB_PATH`, then the `onnxruntime` package of the
/// `python3` on PATH (`capi/libonnxruntime.so.*`).
pub fn find_library(explicit: Option<&Path>) -> Option<PathBuf> {
    if let Some(p) = explicit {
        return Some(p.to_path_buf());
    }
    if let Some(p) = std::env::var_os("ORT_DYLIB_PATH").filter(|p| !p.is_empty()) {
        return Some(PathBuf::from(p));
    }
    let out = Command::new("python3")
        .args(["-c", "import onnxruntime, os; print(os.path.dirname(onnxruntime.__file__))"])
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    let capi = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()).join("capi");
    let mut libs: Vec<PathBuf> = std::fs::read_dir(capi)
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("libonnxruntime.so")))
        .collect();
    libs.sort();
    libs.pop()
}

/// Finds (see `find_library`) and loads ONNX Runtime once per process, and returns the library's
/// path. Called at start-up; later calls return the first outcome.
pub fn init_runtime(explicit: Option<&Path>) -> Result<PathBuf> {
    runtime(explicit).map(|r| r.path.clone())
}

/// The process's ONNX Runtime environment. The binary and the Python package load the library
/// once at start-up (`init_runtime`); model loading never searches for it.
fn environment() -> Result<&'static Environment> {
    match RUNTIME.get() {
        Some(r) => r.as_ref().map(|r| &r.env).map_err(|e| Error::Internal(e.clone())),
        None => Err(Error::Internal(format!("ONNX Runtime was not loaded at start-up. {INSTALL_HINT}"))),
    }
}

fn runtime(explicit: Option<&Path>) -> Result<&'static Runtime> {
    RUNTIME
        .get_or_init(|| {
            let path = find_library(explicit).ok_or_else(|| INSTALL_HINT.to_string())?;
            if !path.exists() {
                return Err(format!("ONNX Runtime library {} does not exist. {INSTALL_HINT}", path.display()));
            }
            let version = library_version(&path)?;
            if !version.starts_with(&format!("1.{SUPPORTED_MINOR}.")) {
                tracing::warn!(%version, tested = %format!("1.{SUPPORTED_MINOR}"), "ONNX Runtime is newer than the release Ferrite is tested with");
            }
            let builder =
                ort::init_from(&path).map_err(|e| format!("cannot load ONNX Runtime from {}: {e}", path.display()))?;
            let env = builder.with_name("ferrite").build().map_err(|e| format!("cannot start ONNX Runtime: {e}"))?;
            Ok(Runtime { path, version, env })
        })
        .as_ref()
        .map_err(|e| Error::Internal(e.clone()))
}

fn ort_err(e: impl std::fmt::Display) -> Error {
    Error::Internal(format!("onnxruntime: {e}"))
}

/// A failed run: ONNX Runtime's INVALID_ARGUMENT means the request's data did not fit the model
/// (an index out of a table's range, sizes a graph cannot take): the client's error, a 400.
fn run_err(e: ort::Error) -> Error {
    match e.code() {
        ort::error::ErrorCode::InvalidArgument => {
            Error::invalid(format!("the model refused the input: {}", e.message()))
        }
        _ => ort_err(e),
    }
}

fn to_ort(dt: DataType) -> TensorElementType {
    match dt {
        DataType::Bool => TensorElementType::Bool,
        DataType::Uint8 => TensorElementType::Uint8,
        DataType::Uint16 => TensorElementType::Uint16,
        DataType::Uint32 => TensorElementType::Uint32,
        DataType::Uint64 => TensorElementType::Uint64,
        DataType::Int8 => TensorElementType::Int8,
        DataType::Int16 => TensorElementType::Int16,
        DataType::Int32 => TensorElementType::Int32,
        DataType::Int64 => TensorElementType::Int64,
        DataType::Fp16 => TensorElementType::Float16,
        DataType::Bf16 => TensorElementType::Bfloat16,
        DataType::Fp32 => TensorElementType::Float32,
        DataType::Fp64 => TensorElementType::Float64,
        DataType::Bytes => TensorElementType::String,
    }
}

fn from_ort(t: TensorElementType) -> Option<DataType> {
    DataType::ALL.into_iter().find(|&d| to_ort(d) == t)
}

fn spec(name: &str, ty: &ValueType, zipmaps: &ZipMaps) -> Result<TensorSpec> {
    match ty {
        ValueType::Tensor { ty, shape, .. } => Ok(TensorSpec {
            name: name.to_string(),
            datatype: from_ort(*ty).ok_or_else(|| Error::Unsupported(format!("tensor '{name}' has type {ty:?}")))?,
            dims: shape.iter().map(|&d| if d < 0 { -1 } else { d }).collect(),
        }),
        // skl2onnx's and onnxmltools' default for classifiers: probabilities as a list of
        // {class: probability}, served as the tensor FP32[N, classes] it was made from.
        ValueType::Sequence(inner) if matches!(**inner, ValueType::Map { .. }) => match zipmaps.get(name) {
            Some(_) if !matches!(**inner, ValueType::Map { value: TensorElementType::Float32, .. }) => {
                Err(Error::Unsupported(format!("'{name}' is a {ty:?}; a ZipMap is served only with FP32 probabilities")))
            }
            Some(z) => Ok(TensorSpec { name: name.to_string(), datatype: DataType::Fp32, dims: vec![-1, z.labels.len() as i64] }),
            None => Err(Error::Unsupported(format!(
                "'{name}' is a {ty:?} not written by a ZipMap node with class labels; only tensors are supported: \
                 convert with options={{id(model): {{'zipmap': False}}}} (skl2onnx) or zipmap=False (onnxmltools) to get \
                 the probabilities as a tensor"
            ))),
        },
        other => Err(Error::Unsupported(format!("'{name}' is a {other:?}; only tensors are supported"))),
    }
}

/// ZipMap outputs by name: their class labels in the order of the probabilities ZipMap was given.
type ZipMaps = std::collections::BTreeMap<String, ZipMap>;

#[derive(Debug, Clone)]
struct ZipMap {
    labels: Vec<String>,
    /// Integer class labels (`classlabels_int64s`) rather than strings.
    int_keys: bool,
}

/// Just the parts of ONNX's protobuf messages that name a ZipMap's outputs and class labels, and
/// the main graph's initializers (the weights); everything else is skipped by the decoder.
mod proto {
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Model {
        #[prost(message, optional, tag = "7")]
        pub graph: Option<Graph>,
    }
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Graph {
        #[prost(message, repeated, tag = "1")]
        pub node: Vec<Node>,
        #[prost(message, repeated, tag = "5")]
        pub initializer: Vec<TensorProto>,
    }
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct TensorProto {
        #[prost(int64, repeated, tag = "1")]
        pub dims: Vec<i64>,
        #[prost(int32, tag = "2")]
        pub data_type: i32,
        #[prost(string, tag = "8")]
        pub name: String,
        /// Sliced from the file's bytes, not copied.
        #[prost(bytes = "bytes", tag = "9")]
        pub raw_data: bytes::Bytes,
        /// 1: the data lives in another file.
        #[prost(int32, tag = "14")]
        pub data_location: i32,
    }
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Node {
        #[prost(string, repeated, tag = "1")]
        pub input: Vec<String>,
        #[prost(string, repeated, tag = "2")]
        pub output: Vec<String>,
        #[prost(string, tag = "4")]
        pub op_type: String,
        #[prost(message, repeated, tag = "5")]
        pub attribute: Vec<Attribute>,
    }
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Attribute {
        #[prost(string, tag = "1")]
        pub name: String,
        #[prost(int64, repeated, tag = "8")]
        pub ints: Vec<i64>,
        #[prost(bytes = "vec", repeated, tag = "9")]
        pub strings: Vec<Vec<u8>>,
    }
}

/// What Ferrite reads of a model file itself: its ZipMaps, and its weights to share.
struct FileParts {
    zipmaps: ZipMaps,
    weights: Weights,
    /// Some initializer's data lives in another file.
    external: bool,
}

/// Reads the model file `bytes` (from `path`): the ZipMap nodes of its main graph, by output name,
/// and (with `weights`) its large initializers as tensors.
fn read_parts(path: &Path, bytes: Vec<u8>, weights: bool) -> Result<FileParts> {
    use prost::Message;
    let model = proto::Model::decode(bytes::Bytes::from(bytes))
        .map_err(|e| Error::invalid(format!("{} is not an ONNX model: {e}", path.display())))?;
    let graph = model.graph.unwrap_or_default();
    let mut zipmaps = ZipMaps::new();
    for node in graph.node.iter().filter(|n| n.op_type == "ZipMap") {
        let attr = |name: &str| node.attribute.iter().find(|a| a.name == name);
        let zipmap = if let Some(a) = attr("classlabels_int64s").filter(|a| !a.ints.is_empty()) {
            ZipMap { labels: a.ints.iter().map(i64::to_string).collect(), int_keys: true }
        } else if let Some(a) = attr("classlabels_strings") {
            ZipMap {
                labels: a.strings.iter().map(|s| String::from_utf8_lossy(s).into_owned()).collect(),
                int_keys: false,
            }
        } else {
            continue;
        };
        if let Some(out) = node.output.first() {
            zipmaps.insert(out.clone(), zipmap);
        }
    }
    let external = graph.initializer.iter().any(|t| t.data_location == 1);
    let mut values = Vec::new();
    // Consumers by initializer; shared are the weights whose every consumer is a MatMul, a Gemm or
    // a Gather (an embedding table): their sessions keep one pre-packed copy between them, or use
    // ours as it is. A convolution's weights are laid out anew by each session's optimizer, so a
    // shared copy of those only adds to the copies (tried, 3 sessions: ResNet-style CNN +11 MB, detector +3 MB).
    let mut consumers: std::collections::HashMap<&str, bool> = std::collections::HashMap::new();
    for n in &graph.node {
        let shareable = matches!(n.op_type.as_str(), "MatMul" | "Gemm" | "Gather");
        for input in &n.input {
            *consumers.entry(input.as_str()).or_insert(true) &= shareable;
        }
    }
    let shared = graph.initializer.iter().filter(|t| {
        weights
            && t.raw_data.len() >= SHARED_WEIGHT_BYTES
            && t.data_location != 1
            && consumers.get(t.name.as_str()) == Some(&true)
    });
    for t in shared {
        let Ok(shape) = t.dims.iter().map(|&d| usize::try_from(d)).collect::<std::result::Result<Vec<_>, _>>() else {
            continue;
        };
        let fits = |size: usize| shape.iter().product::<usize>().checked_mul(size) == Some(t.raw_data.len());
        // Not what its dims say, or a type not shared: left to ONNX Runtime, which loads it itself.
        let value = match onnx_type(t.data_type) {
            Some(DataType::Fp32) if fits(4) => owned::<f32>(shape, &t.raw_data)?,
            Some(DataType::Fp64) if fits(8) => owned::<f64>(shape, &t.raw_data)?,
            Some(DataType::Int8) if fits(1) => owned::<i8>(shape, &t.raw_data)?,
            Some(DataType::Uint8) if fits(1) => owned::<u8>(shape, &t.raw_data)?,
            Some(DataType::Int32) if fits(4) => owned::<i32>(shape, &t.raw_data)?,
            Some(DataType::Int64) if fits(8) => owned::<i64>(shape, &t.raw_data)?,
            _ => continue,
        };
        values.push((t.name.clone(), std::sync::Arc::new(value)));
    }
    Ok(FileParts { zipmaps, weights: Weights::new(values), external })
}

/// A tensor over a buffer Ferrite owns (ONNX Runtime shares an initializer only on such memory).
fn owned<T: crate::data::dtype::Element + ort::value::PrimitiveTensorElementType + std::fmt::Debug>(
    shape: Vec<usize>,
    raw: &[u8],
) -> Result<DynValue> {
    let values: Vec<T> = raw.chunks_exact(std::mem::size_of::<T>()).map(T::read_le).collect();
    Ok(OrtTensor::from_array((shape, values)).map_err(ort_err)?.into_dyn())
}

/// ONNX's `TensorProto.DataType` codes.
fn onnx_type(code: i32) -> Option<DataType> {
    Some(match code {
        1 => DataType::Fp32,
        2 => DataType::Uint8,
        3 => DataType::Int8,
        4 => DataType::Uint16,
        5 => DataType::Int16,
        6 => DataType::Int32,
        7 => DataType::Int64,
        8 => DataType::Bytes,
        9 => DataType::Bool,
        10 => DataType::Fp16,
        11 => DataType::Fp64,
        12 => DataType::Uint32,
        13 => DataType::Uint64,
        16 => DataType::Bf16,
        _ => return None,
    })
}

/// Initializers this large are shared between sessions; smaller ones (shapes, scalars, which
/// shape inference and constant folding read) stay in each session's graph.
const SHARED_WEIGHT_BYTES: usize = 1024;

/// A model's weights, read once from its file and given to every session opened on it (its
/// instances and the solo one), with one container for the forms ONNX Runtime pre-packs them
/// into: one copy of each in the process instead of one per session.
struct Weights {
    values: Vec<(String, std::sync::Arc<DynValue>)>,
    prepacked: ort::session::builder::PrepackedWeights,
}

impl Weights {
    fn new(values: Vec<(String, std::sync::Arc<DynValue>)>) -> Weights {
        Weights { values, prepacked: ort::session::builder::PrepackedWeights::new() }
    }
}

/// A ZipMap's output (one {class: probability} map per row) as FP32[rows, classes], each row's
/// probabilities in the order of `z.labels`.
fn zipmap_tensor(name: &str, value: DynValue, z: &ZipMap) -> Result<Tensor> {
    let rows = value
        .downcast::<DynSequenceValueType>()
        .and_then(|s| s.try_extract_sequence::<DynMapValueType>())
        .map_err(|e| Error::internal(format!("output '{name}': {e}")))?;
    let shape = vec![rows.len(), z.labels.len()];
    let mut out = Vec::with_capacity(rows.len() * z.labels.len() * 4);
    for row in rows {
        let pairs: Vec<(String, f32)> = if z.int_keys {
            row.try_extract_key_values::<i64, f32>().map(|kv| kv.into_iter().map(|(k, v)| (k.to_string(), v)).collect())
        } else {
            row.try_extract_key_values::<String, f32>()
        }
        .map_err(|e| Error::internal(format!("output '{name}': {e}")))?;
        for label in &z.labels {
            let p = pairs.iter().find(|(k, _)| k == label).map_or(0.0, |(_, v)| *v);
            out.extend_from_slice(&p.to_le_bytes());
        }
    }
    Ok(Tensor { name: name.to_string(), datatype: DataType::Fp32, shape, data: TensorData::Fixed(aligned_bytes(&out)) })
}

/// Session options for one instance: ONNX Runtime's own settings, per model (config.toml's
/// `[onnxruntime]` table; the onnxruntime backend's `parameters` names where they exist).
#[derive(Debug, Clone, PartialEq)]
pub struct OnnxOptions {
    pub intra_threads: usize,
    pub inter_threads: usize,
    /// Let idle intra-op threads spin (faster hand-off, burns CPU on a shared host).
    pub spinning: bool,
    /// Let idle intra-op threads spin within a run only, between its operators, and sleep between
    /// runs (`session.force_spinning_stop`): a slow model's run no longer waits for a sleeping
    /// thread at each operator, and no core burns while the model is idle.
    pub spin_in_run: bool,
    /// Run independent nodes in parallel (`execution_mode = "parallel"`) rather than in order.
    pub parallel: bool,
    /// 0 disabled, 1 basic, 2 extended, 3 all (ONNX Runtime's graph optimization levels).
    pub optimization_level: u8,
    pub mem_arena: bool,
    pub mem_pattern: bool,
    /// Give the arena's growth back after each run (`memory.enable_memory_arena_shrinkage`), so a
    /// large batch does not leave it grown.
    pub arena_shrinkage: bool,
    /// `session.intra_op_thread_affinities`: one group of logical CPUs per intra-op thread but
    /// the caller's, e.g. "1;2" or "1,2;3,4".
    pub intra_thread_affinity: Option<String>,
    /// A model served by two sessions or more keeps one copy of its matrix and embedding weights
    /// between them (see `OnnxBackend::sharing_weights`).
    pub share_weights: bool,
}

impl Default for OnnxOptions {
    fn default() -> Self {
        OnnxOptions {
            intra_threads: 1,
            inter_threads: 1,
            spinning: false,
            spin_in_run: false,
            parallel: false,
            optimization_level: 3,
            mem_arena: true,
            mem_pattern: true,
            arena_shrinkage: false,
            intra_thread_affinity: None,
            share_weights: true,
        }
    }
}

pub struct OnnxBackend {
    path: PathBuf,
    options: OnnxOptions,
    inputs: Vec<TensorSpec>,
    outputs: Vec<TensorSpec>,
    /// The session opened to read the model's signature, handed to the first instance.
    first: Mutex<Option<Session>>,
    zipmaps: std::sync::Arc<ZipMaps>,
    /// Shared by every session opened (empty unless `sharing_weights` made this backend).
    weights: std::sync::Arc<Weights>,
    /// Some weight lives in another file: not shared.
    external: bool,
    /// The file's xxh3 hash, as read at load.
    content: Option<u64>,
    /// Shared by every instance of the model, whatever its options.
    sample: std::sync::Arc<Sample>,
}

impl OnnxBackend {
    pub fn load(path: &Path, options: OnnxOptions) -> Result<OnnxBackend> {
        // Read once: for the content hash, the ZipMaps and whether weights live elsewhere. A file
        // Ferrite cannot read as ONNX is left to ONNX Runtime, whose error says why.
        let bytes = std::fs::read(path).ok();
        let content = bytes.as_deref().map(xxhash_rust::xxh3::xxh3_64);
        let parts = bytes.and_then(|b| read_parts(path, b, false).ok()).unwrap_or_else(|| FileParts {
            zipmaps: ZipMaps::new(),
            weights: Weights::new(Vec::new()),
            external: true,
        });
        let session = open(path, &options, &parts.weights)?;
        let none = ZipMaps::new();
        let inputs = session.inputs().iter().map(|o| spec(o.name(), o.dtype(), &none)).collect::<Result<_>>()?;
        let outputs =
            session.outputs().iter().map(|o| spec(o.name(), o.dtype(), &parts.zipmaps)).collect::<Result<_>>()?;
        let (path, first) = (path.to_path_buf(), Mutex::new(Some(session)));
        let (zipmaps, weights) = (std::sync::Arc::new(parts.zipmaps), std::sync::Arc::new(parts.weights));
        let (external, sample) = (parts.external, Default::default());
        Ok(OnnxBackend { path, options, inputs, outputs, first, zipmaps, weights, external, content, sample })
    }

    /// The same model, with one copy of its weights (and of the forms ONNX Runtime pre-packs them
    /// into) for every session opened from now on, rather than one each (see `read_parts` for
    /// which). Worth it for two sessions or more; `None` when nothing can be shared (weights in
    /// external files, or no shareable ones).
    pub fn sharing_weights(&self) -> Option<OnnxBackend> {
        if !self.options.share_weights || self.external || !self.weights.values.is_empty() {
            return None;
        }
        let bytes = std::fs::read(&self.path).ok()?;
        let parts = read_parts(&self.path, bytes, true).ok().filter(|p| !p.weights.values.is_empty())?;
        let first = Mutex::new(Some(open(&self.path, &self.options, &parts.weights).ok()?));
        let (inputs, outputs) = (self.inputs.clone(), self.outputs.clone());
        let (path, zipmaps, weights) = (self.path.clone(), self.zipmaps.clone(), std::sync::Arc::new(parts.weights));
        Some(OnnxBackend {
            path,
            options: self.options.clone(),
            inputs,
            outputs,
            first,
            zipmaps,
            weights,
            external: false,
            content: self.content,
            sample: self.sample.clone(),
        })
    }

    /// The hash of the model file's bytes (xxh3), read once at load; `None` when Ferrite could not
    /// read the file that ONNX Runtime loaded.
    pub fn content(&self) -> Option<u64> {
        self.content
    }

    /// The class labels of outputs that ONNX Runtime gives as a ZipMap, in their columns' order.
    pub fn labels(&self) -> impl Iterator<Item = (&str, &[String])> {
        self.zipmaps.iter().map(|(name, z)| (name.as_str(), z.labels.as_slice()))
    }
}

impl OnnxBackend {
    /// The same model file opened with other session options, sharing the weights.
    pub fn with_options(&self, options: OnnxOptions) -> Result<OnnxBackend> {
        // The signature, the ZipMaps and the weights are the file's, whatever the options.
        let first = Mutex::new(Some(open(&self.path, &options, &self.weights)?));
        let (inputs, outputs) = (self.inputs.clone(), self.outputs.clone());
        let (path, zipmaps, weights) = (self.path.clone(), self.zipmaps.clone(), self.weights.clone());
        let (external, content, sample) = (self.external, self.content, self.sample.clone());
        Ok(OnnxBackend { path, options, inputs, outputs, first, zipmaps, weights, external, content, sample })
    }

    pub fn options(&self) -> &OnnxOptions {
        &self.options
    }
}

/// A session on the model at `path`, with `weights` shared.
fn open(path: &Path, options: &OnnxOptions, weights: &Weights) -> Result<Session> {
    let level = match options.optimization_level {
        0 => GraphOptimizationLevel::Disable,
        1 => GraphOptimizationLevel::Level1,
        2 => GraphOptimizationLevel::Level2,
        _ => GraphOptimizationLevel::Level3,
    };
    let builder = Session::builder(environment()?).map_err(ort_err)?;
    let builder = builder.with_optimization_level(level).map_err(ort_err)?;
    let builder = builder.with_intra_threads(options.intra_threads).map_err(ort_err)?;
    let builder = builder.with_inter_threads(options.inter_threads.max(1)).map_err(ort_err)?;
    let builder = builder.with_parallel_execution(options.parallel).map_err(ort_err)?;
    let builder = builder.with_memory_pattern(options.mem_pattern).map_err(ort_err)?;
    let builder = builder
        .with_execution_providers([ort::ep::CPU::default().with_arena_allocator(options.mem_arena).build()])
        .map_err(ort_err)?;
    let spin_in_run = options.spin_in_run && !options.spinning && options.intra_threads > 1;
    let builder = builder.with_intra_op_spinning(options.spinning || spin_in_run).map_err(ort_err)?;
    let mut builder = builder.with_inter_op_spinning(false).map_err(ort_err)?;
    if spin_in_run {
        builder = builder.with_config_entry("session.force_spinning_stop", "1").map_err(ort_err)?;
    }
    if let Some(affinity) = &options.intra_thread_affinity {
        builder = builder.with_config_entry("session.intra_op_thread_affinities", affinity).map_err(ort_err)?;
    }
    if !weights.values.is_empty() {
        for (name, value) in &weights.values {
            builder = builder.with_initializer(name, value.clone()).map_err(ort_err)?;
        }
        builder = builder.with_prepacked_weights(&weights.prepacked).map_err(ort_err)?;
    }
    builder.commit_from_file(path).map_err(|e| Error::invalid(format!("cannot load {}: {e}", path.display())))
}

impl Backend for OnnxBackend {
    fn inputs(&self) -> &[TensorSpec] {
        &self.inputs
    }

    fn outputs(&self) -> &[TensorSpec] {
        &self.outputs
    }

    fn instance(&self) -> Result<Box<dyn Instance>> {
        let taken = self.first.lock().map_err(|_| Error::internal("poisoned"))?.take();
        let session = match taken {
            Some(s) => s,
            None => open(&self.path, &self.options, &self.weights)?,
        };
        let output_names = self.outputs.iter().map(|o| o.name.clone()).collect();
        let run_options = if self.options.arena_shrinkage { Some(run_options(true)?) } else { None };
        let zipmaps = self.zipmaps.clone();
        Ok(Box::new(OnnxInstance {
            session,
            output_names,
            input_time: Duration::ZERO,
            run_options,
            // An arena kept between runs (the default) is what a burst can leave grown.
            held: (self.options.mem_arena && !self.options.arena_shrinkage).then(Held::default),
            sample: self.sample.clone(),
            zipmaps,
            on_caller: self.options.intra_threads == 1 && !self.options.parallel,
            staging: Vec::new(),
            outputs: Reused::default(),
            staged: None,
        }))
    }
}

/// Options for a run: `shrink`, the arena gives back its growth after it.
fn run_options(shrink: bool) -> Result<RunOptions> {
    let mut o = RunOptions::new().map_err(ort_err)?;
    if shrink {
        o.set("memory.enable_memory_arena_shrinkage", "cpu:0").map_err(ort_err)?;
    }
    Ok(o)
}

impl OnnxInstance {
    /// When the arena's growth is due back (`Held::due` against the model's sample).
    fn arena_due(&self) -> Option<Instant> {
        self.held.as_ref()?.due(self.sample.bytes())
    }
}

struct OnnxInstance {
    session: Session,
    output_names: Vec<String>,
    input_time: Duration,
    /// Set when the arena gives back its growth after each run.
    run_options: Option<RunOptions>,
    /// What the arena holds beyond what recent runs needed; `None` without an arena kept between
    /// runs (none at all, or one that shrinks after each).
    held: Option<Held>,
    sample: std::sync::Arc<Sample>,
    zipmaps: std::sync::Arc<ZipMaps>,
    /// No intra-op pool and nodes in order: a run is all on the caller's thread.
    on_caller: bool,
    /// Per input, the buffer a batch of several requests is gathered into (`input_bytes`): kept
    /// between runs up to `STAGING_KEPT` bytes in all, and given back `GIVE_BACK_AFTER` the last
    /// run that gathered into them (or copied into `outputs`).
    staging: Vec<Vec<Line>>,
    /// The buffers large outputs are copied into: given back with `staging`, and with the arena's
    /// growth after a burst.
    outputs: Reused,
    /// When a run last gathered into `staging` or copied into `outputs`' buffers.
    staged: Option<Instant>,
}

/// A cache line: the staging buffers are aligned as ONNX Runtime aligns its own tensors.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([u8; 64]);

/// The most bytes an instance keeps for gathering batches between runs (a detector's batch of 16
/// images at 640x640 is 79 MB; one of 8 at 320x320, 10 MB).
const STAGING_KEPT: usize = 32 << 20;

/// How long an instance's arena may hold memory that no run has needed since: a burst's growth
/// is given back this long after the last run that used it (after the next batch if traffic goes
/// on, else while idle), and the server's periodic trim hands the freed heap to the system.
const GIVE_BACK_AFTER: Duration = Duration::from_secs(20);

/// The most input bytes kept as the sample that gives an arena back (a detector's one image at
/// 1280x1280 is 19 MB; the arena it frees is many times that).
const SAMPLE_BYTES: usize = 32 << 20;

/// How an arena is given back: the smallest inputs any instance of the model has run, run again
/// with the arena's shrinkage on. ONNX Runtime frees, at the end of such a run, each region of the
/// arena with nothing in use; an output it returns is in use, and pins its region (after a burst,
/// the region the burst grew). So this run's outputs are written into tensors of its own,
/// outside the arena, and nothing of it is left in the arena when it shrinks. Shared by a model's
/// instances: one that served only a burst has nothing smaller of its own.
struct Sample {
    /// The inputs' bytes (`usize::MAX` while there are none).
    bytes: AtomicUsize,
    run: Mutex<Option<SampleRun>>,
}

struct SampleRun {
    inputs: Vec<(String, DynValue)>,
    /// Shrinkage on, and the outputs preallocated.
    options: RunOptions<HasSelectedOutputs>,
}

impl Default for Sample {
    fn default() -> Sample {
        Sample { bytes: AtomicUsize::new(usize::MAX), run: Mutex::default() }
    }
}

impl Sample {
    fn bytes(&self) -> usize {
        self.bytes.load(Relaxed)
    }

    /// Whether inputs of `bytes` would be kept: smaller than the sample, and not too large.
    fn wants(&self, bytes: usize) -> bool {
        bytes <= SAMPLE_BYTES && bytes < self.bytes()
    }

    /// Keeps `inputs`, which gave `outputs`, if it `wants` them; skipped while another instance
    /// runs the sample.
    fn offer(&self, bytes: usize, inputs: Vec<(String, DynValue)>, outputs: &SessionOutputs<'_>, names: &[String]) {
        if !self.wants(bytes) {
            return;
        }
        let Ok(mut kept) = self.run.try_lock() else { return };
        if let Ok(options) = sample_options(outputs, names) {
            *kept = Some(SampleRun { inputs, options });
            self.bytes.store(bytes, Relaxed);
        }
    }
}

/// Run options that shrink the arena after the run and write its outputs into tensors outside
/// the arena, shaped as `outputs` (those of the sample's first run). Outputs no tensor can hold
/// beforehand (strings, maps) are left out, but for a model that has no other.
fn sample_options(outputs: &SessionOutputs<'_>, names: &[String]) -> Result<RunOptions<HasSelectedOutputs>> {
    let mut selector = ort::session::OutputSelector::no_default();
    let mut any = false;
    for name in names {
        let Some(ValueType::Tensor { ty, shape, .. }) = outputs.get(name.as_str()).map(|v| v.dtype()) else {
            continue;
        };
        if *ty == TensorElementType::String {
            continue;
        }
        let shape: Vec<usize> = shape.iter().map(|&d| d.max(0) as usize).collect();
        let tensor = DynTensor::new(&Allocator::default(), *ty, shape).map_err(ort_err)?;
        selector = selector.with(name.as_str()).preallocate(name.as_str(), tensor);
        any = true;
    }
    if !any {
        selector = ort::session::OutputSelector::default();
    }
    let mut options = RunOptions::new().map_err(ort_err)?;
    options.set("memory.enable_memory_arena_shrinkage", "cpu:0").map_err(ort_err)?;
    Ok(options.with_outputs(selector))
}

/// What an ONNX Runtime arena holds, told by the input bytes of the runs that grew it (a proxy:
/// the intermediate tensors it keeps grow with the inputs). It grows to a run's needs and keeps
/// them: a burst of long texts or large images would otherwise hold its memory for good.
#[derive(Debug, Default)]
struct Held {
    /// Input bytes of the largest run since the arena last gave back (0: nothing held).
    bytes: usize,
    /// When a run last needed at least half of that.
    used: Option<Instant>,
    /// A run was larger than the model's batches usually are: give back right after it.
    asked: bool,
}

impl Held {
    /// Records a run of `bytes` inputs at `now`.
    fn run(&mut self, bytes: usize, now: Instant) {
        if bytes.saturating_mul(2) >= self.bytes {
            self.bytes = self.bytes.max(bytes);
            self.used = Some(now);
        }
    }

    /// When the arena should be given back by a run of `sample` bytes: right after a run that
    /// asked for it, else `GIVE_BACK_AFTER` after the last run that needed at least half of what
    /// it holds, when that is several times what the sample needs.
    fn due(&self, sample: usize) -> Option<Instant> {
        let used = self.used?;
        if self.asked {
            return Some(used);
        }
        (self.bytes > sample.saturating_mul(4)).then_some(used + GIVE_BACK_AFTER)
    }

    fn gave_back(&mut self) {
        *self = Held::default();
    }
}

/// Writes the parts of `input` into one ONNX Runtime tensor: the only copy on the way in.
fn input_value(input: &BatchInput<'_>) -> Result<DynValue> {
    if input.datatype == DataType::Bytes {
        // Owned: ort's string tensors take only 'static element types (and copy each again into a
        // C string); text models spend this per token list, not per token.
        let mut strings: Vec<String> = Vec::with_capacity(input.shape.iter().product());
        for part in &input.parts {
            let TensorData::Strings(items) = part else {
                return Err(Error::internal("BYTES input with raw data"));
            };
            for b in items {
                let s = std::str::from_utf8(b)
                    .map_err(|_| Error::invalid(format!("input '{}': BYTES element is not UTF-8", input.name)))?;
                strings.push(s.to_owned());
            }
        }
        let t = OrtTensor::from_string_array((input.shape.clone(), strings.as_slice())).map_err(ort_err)?;
        return Ok(t.into_dyn());
    }
    let mut t = DynTensor::new(&Allocator::default(), to_ort(input.datatype), input.shape.clone()).map_err(ort_err)?;
    let expected = t.size().unwrap_or(0);
    let dst = t.data_ptr_mut().cast::<u8>();
    // SAFETY: ONNX Runtime allocated `expected` writable bytes at `dst` for the tensor.
    let dst = if expected == 0 { &mut [][..] } else { unsafe { std::slice::from_raw_parts_mut(dst, expected) } };
    gather(input, dst)?;
    Ok(t.into_dyn())
}

/// Copies the parts of a fixed-size input, in order, into `dst`, which they must fill exactly.
fn gather(input: &BatchInput<'_>, dst: &mut [u8]) -> Result<()> {
    let total: usize = input.parts.iter().map(|p| if let TensorData::Fixed(b) = p { b.len() } else { 0 }).sum();
    if total != dst.len() {
        return Err(Error::internal(format!("input '{}': {total} bytes for a {}-byte tensor", input.name, dst.len())));
    }
    let mut off = 0;
    for part in &input.parts {
        if let TensorData::Fixed(b) = part {
            dst[off..off + b.len()].copy_from_slice(b);
            off += b.len();
        }
    }
    Ok(())
}

/// A fixed-size input's bytes as ONNX Runtime reads them: the request's own bytes where the batch
/// is one request and they are aligned for their type, else the parts gathered into `staging`, a
/// buffer the instance keeps from run to run. A fresh buffer of a megabyte or more is a fresh
/// mapping, and the page faults of filling one cost more than the copy: a detector's 1.2 MB image
/// took about 800 faults a request between this buffer and the request body. Also says whether
/// they were gathered.
fn input_bytes<'a>(input: &BatchInput<'a>, staging: &'a mut Vec<Line>) -> Result<(&'a [u8], bool)> {
    let size = input.datatype.size().ok_or_else(|| Error::internal("a fixed-size input without an element size"))?;
    let len = input.shape.iter().product::<usize>() * size;
    if let [TensorData::Fixed(b)] = input.parts[..] {
        if b.len() == len && (b.as_ptr() as usize).is_multiple_of(size) {
            return Ok((&b[..], false));
        }
    }
    let lines = len.div_ceil(64);
    if staging.len() < lines {
        staging.resize(lines, Line([0; 64]));
    }
    // SAFETY: `staging` holds at least `len` initialised bytes; u8 has no alignment to meet.
    let dst = unsafe { std::slice::from_raw_parts_mut(staging.as_mut_ptr().cast::<u8>(), len) };
    gather(input, dst)?;
    Ok((dst, true))
}

/// A tensor over `bytes`, which it reads in place and does not own.
///
/// # Safety
/// `bytes` must stay alive and unchanged while the value lives.
unsafe fn tensor_over(bytes: &[u8], datatype: DataType, shape: &[usize]) -> Result<DynValue> {
    let info = MemoryInfo::default();
    let dims: Vec<i64> = shape.iter().map(|&d| d as i64).collect();
    let mut value = std::ptr::null_mut();
    // SAFETY: `bytes` holds the tensor's `bytes.len()` bytes (checked by `input_bytes`); ONNX
    // Runtime only reads an input's data, and the caller keeps it alive while the value lives.
    let status = unsafe {
        (ort::api().CreateTensorWithDataAsOrtValue)(
            info.ptr(),
            bytes.as_ptr().cast_mut().cast(),
            bytes.len(),
            dims.as_ptr(),
            dims.len(),
            to_ort(datatype).into(),
            &mut value,
        )
    };
    // SAFETY: the status is the one the call above returned.
    unsafe { ort::Error::result_from_status(status) }.map_err(ort_err)?;
    let value = std::ptr::NonNull::new(value).ok_or_else(|| Error::internal("ONNX Runtime made no tensor"))?;
    // SAFETY: a tensor value the call above made; releasing it leaves `bytes` to its owner.
    Ok(unsafe { DynValue::from_ptr(value, Some(&Allocator::default())) })
}

impl Instance for OnnxInstance {
    fn input_time(&self) -> Duration {
        self.input_time
    }

    fn runs_on_caller(&self) -> bool {
        self.on_caller
    }

    fn shrink_after_next(&mut self) {
        if let Some(held) = &mut self.held {
            held.asked = true;
        }
    }

    fn give_back_due(&self) -> Option<Instant> {
        let arena = self.arena_due();
        let kept = self.staging.iter().any(|b| !b.is_empty()) || !self.outputs.is_empty();
        let staging = self.staged.filter(|_| kept).map(|at| at + GIVE_BACK_AFTER);
        arena.into_iter().chain(staging).min()
    }

    fn give_back(&mut self) {
        let now = Instant::now();
        if self.staged.is_some_and(|at| at + GIVE_BACK_AFTER <= now) {
            self.staging = Vec::new();
            self.outputs.clear();
            self.staged = None;
        }
        if self.arena_due().is_none_or(|at| at > now) {
            return;
        }
        // The burst's large outputs went into buffers kept for the next ones: they go with it.
        self.outputs.clear();
        let mut kept = self.sample.run.lock().unwrap_or_else(|e| e.into_inner());
        let failed = kept.as_ref().and_then(|sample| {
            let inputs: Vec<(&str, SessionInputValue<'_>)> =
                sample.inputs.iter().map(|(n, v)| (n.as_str(), v.into())).collect();
            self.session.run_with_options(inputs, &sample.options).err()
        });
        if let Some(e) = failed {
            // It ran before; if it no longer does, keep the memory rather than try again.
            tracing::warn!(error = %e, "the run that gives an arena back failed");
            *kept = None;
            self.sample.bytes.store(usize::MAX, Relaxed);
        }
        if let Some(held) = &mut self.held {
            held.gave_back();
        }
    }

    fn run(&mut self, inputs: &[BatchInput<'_>]) -> Result<Vec<Tensor>> {
        self.run_with(inputs, None)
    }

    /// A run its clients can leave: ONNX Runtime stops it (between nodes) once none of them
    /// waits, and the instance is free for the next batch.
    fn run_live(&mut self, inputs: &[BatchInput<'_>], live: &Live<'_>) -> Result<Vec<Tensor>> {
        if !live.abandonable() {
            return self.run_with(inputs, None);
        }
        // Options of this run alone: a stop that comes after it cannot reach the next.
        let options = std::sync::Arc::new(run_options(self.run_options.is_some())?);
        let stop = options.clone();
        live.on_abandoned(move || {
            let _ = stop.terminate();
        });
        self.run_with(inputs, Some(&options))
    }
}

impl OnnxInstance {
    /// A run under `options`, else the instance's own.
    fn run_with(&mut self, inputs: &[BatchInput<'_>], options: Option<&RunOptions>) -> Result<Vec<Tensor>> {
        let copying = Instant::now();
        self.staging.resize_with(inputs.len(), Vec::new);
        let mut values: Vec<DynValue> = Vec::with_capacity(inputs.len());
        for (input, staging) in inputs.iter().zip(&mut self.staging) {
            values.push(match input.datatype {
                DataType::Bytes => input_value(input)?,
                _ => {
                    let (bytes, gathered) = input_bytes(input, staging)?;
                    if gathered {
                        self.staged = Some(copying);
                    }
                    // SAFETY: the bytes are the request's or `self.staging`'s; neither changes
                    // before `values` is dropped at the end of this run.
                    unsafe { tensor_over(bytes, input.datatype, &input.shape)? }
                }
            });
        }
        self.input_time = copying.elapsed();
        let views = inputs.iter().zip(&values).map(|(i, v)| (i.name, SessionInputValue::from(v))).collect::<Vec<_>>();
        let mut outputs = match options.or(self.run_options.as_ref()) {
            Some(o) => self.session.run_with_options(views, o),
            None => self.session.run(views),
        }
        .map_err(run_err)?;
        if self.staging.iter().map(|b| b.len() * 64).sum::<usize>() > STAGING_KEPT {
            self.staging.clear();
        }
        if let Some(held) = &mut self.held {
            let bytes = inputs.iter().map(|i| i.shape.iter().product::<usize>() * i.datatype.size().unwrap_or(8)).sum();
            held.run(bytes, copying);
            if self.sample.wants(bytes) {
                // The sample outlives this run: inputs of its own, not views of the requests.
                let owned = inputs.iter().map(|i| Ok((i.name.to_string(), input_value(i)?))).collect::<Result<_>>()?;
                self.sample.offer(bytes, owned, &outputs, &self.output_names);
            }
        }
        let mut result = Vec::with_capacity(self.output_names.len());
        for name in &self.output_names {
            let value = outputs.remove(name.as_str()).ok_or_else(|| Error::internal(format!("no output '{name}'")))?;
            if let Some(z) = self.zipmaps.get(name) {
                result.push(zipmap_tensor(name, value, z)?);
                continue;
            }
            let tensor = value.downcast::<DynTensorValueType>().map_err(ort_err)?;
            let ValueType::Tensor { ty, shape, .. } = tensor.dtype() else {
                return Err(Error::internal(format!("output '{name}' is not a tensor")));
            };
            let datatype = from_ort(*ty).ok_or_else(|| Error::Unsupported(format!("output '{name}' type {ty:?}")))?;
            let shape: Vec<usize> = shape.iter().map(|&d| d.max(0) as usize).collect();
            let data = if datatype == DataType::Bytes {
                let (_, strings) = tensor.try_extract_strings().map_err(ort_err)?;
                TensorData::Strings(strings.into_iter().map(|s| s.into_bytes().into()).collect())
            } else {
                let len = tensor.size().unwrap_or(0);
                let ptr = tensor.data_ptr().cast::<u8>();
                let src: &[u8] = if len == 0 || ptr.is_null() {
                    &[]
                } else {
                    // SAFETY: ONNX Runtime owns `len` readable CPU bytes at `ptr` while `tensor` lives.
                    unsafe { std::slice::from_raw_parts(ptr, len) }
                };
                // The one copy on the way out, into memory that typed views can read in place.
                if src.len() >= REUSED_FROM {
                    self.staged = Some(copying);
                }
                TensorData::Fixed(self.outputs.copy(src))
            };
            result.push(Tensor { name: name.clone(), datatype, shape, data });
        }
        Ok(result)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MB: usize = 1 << 20;

    #[test]
    fn growth_is_due_back_a_period_after_the_last_run_that_needed_it() {
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let mut held = Held::default();
        held.run(MB, at(0));
        assert_eq!(held.due(MB), None, "runs of the sample's size hold nothing worth giving back");
        held.run(64 * MB, at(1));
        assert_eq!(held.due(MB), Some(at(1) + GIVE_BACK_AFTER), "a burst grows the arena");
        held.run(MB, at(2));
        assert_eq!(held.due(MB), Some(at(1) + GIVE_BACK_AFTER), "small runs after it do not use it");
        held.run(40 * MB, at(15));
        assert_eq!(held.due(MB), Some(at(15) + GIVE_BACK_AFTER), "a run needing over half of it does");
        assert_eq!(held.due(32 * MB), None, "not worth it when the sample needs a good part of it");
        held.gave_back();
        assert_eq!(held.due(MB), None);
        held.run(MB, at(40));
        assert_eq!(held.due(MB), None, "what the next run regrows is held anew");
    }

    #[test]
    fn one_aligned_request_is_read_in_place_and_the_rest_gathered() {
        let words: Vec<u32> = (0..9).collect();
        let body = bytes::Bytes::from(words.iter().flat_map(|w| w.to_le_bytes()).collect::<Vec<u8>>());
        let input = |parts: Vec<&'static TensorData>, rows| BatchInput {
            name: "x",
            datatype: DataType::Uint32,
            shape: vec![rows, 4],
            parts,
        };
        let leak = |b: bytes::Bytes| &*Box::leak(Box::new(TensorData::Fixed(b)));
        let mut staging = Vec::new();

        let aligned = leak(body.slice(4..20));
        let (got, gathered) = input_bytes(&input(vec![aligned], 1), &mut staging).unwrap();
        assert_eq!(got.as_ptr(), body[4..].as_ptr(), "one request's own bytes, no copy");
        assert!(!gathered);
        assert!(staging.is_empty());

        let odd = bytes::Bytes::from([&[0u8][..], &body[..16]].concat()).slice(1..);
        assert_ne!(odd.as_ptr() as usize % 4, 0);
        let got = input_bytes(&input(vec![leak(odd.clone())], 1), &mut staging).unwrap().0.to_vec();
        assert_eq!(got, &body[..16], "bytes not aligned for their type are copied");

        let second = leak(body.slice(20..36));
        let (got, gathered) = input_bytes(&input(vec![aligned, second], 2), &mut staging).unwrap();
        assert_eq!(got, &body[4..36], "a batch is gathered in order");
        assert!(gathered);
        let kept = staging.as_ptr();
        let (got, _) = input_bytes(&input(vec![second, aligned], 2), &mut staging).unwrap();
        assert_eq!(got, [&body[20..36], &body[4..20]].concat());
        assert_eq!(got.as_ptr().cast(), kept, "into the buffer the last batch used");

        assert!(input_bytes(&input(vec![aligned], 2), &mut staging).is_err(), "too few bytes for the shape");
    }

    #[test]
    fn steady_runs_of_varying_size_are_never_due_back() {
        let t0 = Instant::now();
        let mut held = Held::default();
        for i in 0..1000u64 {
            // Batches of 1 to 64 rows, a large one at least every few seconds.
            let now = t0 + Duration::from_millis(i * 500);
            held.run([1, 64, 8, 40, 2, 33][i as usize % 6] * MB, now);
            assert!(held.due(MB).is_none_or(|at| at > now), "run {i}");
        }
    }

    #[test]
    fn a_run_larger_than_usual_is_given_back_right_after() {
        let t0 = Instant::now();
        let mut held = Held { asked: true, ..Held::default() };
        assert_eq!(held.due(MB), None, "asked before its run: due once it has run");
        held.run(2 * MB, t0);
        assert_eq!(held.due(MB), Some(t0), "due at once, even when small beside the sample");
        held.gave_back();
        assert_eq!(held.due(MB), None);
    }
}
