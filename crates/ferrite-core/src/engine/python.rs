//! Python models: Triton's Python-backend `model.py`, each instance a worker process.
//!
//! User code never runs in the server: an instance is a child process (`ferrite_python_worker.py`
//! under the configured interpreter) that imports the model, and Ferrite's own
//! `triton_python_backend_utils` gives it the API Triton documents. The control channel is a Unix
//! socket (the child's standard input) carrying small messages (JSON, and a packed form for each
//! batch's execute and its answer: `Packed`); tensors go through files in shared memory: the
//! server writes a batch's inputs into one the worker maps (its arrays are views of it), the
//! worker writes its outputs into one of its own that the server reads back.
//!
//! `execute` gets the batch's requests apart, as Triton gives them, and answers each; an
//! exception fails the call, whose requests the batcher then runs again in halves (as for any
//! backend), so that only the requests that raise get the error. A worker that dies, hangs past the execute timeout
//! or grows past its memory limit is killed; the requests it held fail with an error naming the
//! model, and a new worker takes its place (counted in `ferrite_python_restarts_total`).

use std::{
    io::{Read, Write},
    os::unix::{
        fs::{DirBuilderExt, FileExt, OpenOptionsExt},
        io::AsRawFd,
        net::UnixStream,
    },
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::{atomic::AtomicUsize, Arc, OnceLock, Weak},
    time::{Duration, Instant},
};

use bytes::Bytes;
use serde_json::{json, Value};

use crate::{
    engine::{
        backend::{Backend, BatchInput, Instance, Live},
        model::Models,
        spec::TensorSpec,
    },
    DataType, Error, InferRequest, Result, Tensor, TensorData,
};

const WORKER: &str = include_str!("../../python/ferrite_python_worker.py");
const UTILS: &str = include_str!("../../python/triton_python_backend_utils.py");

/// Tensors start at multiples of this in the shared files (any element type reads in place).
const ALIGN: u64 = 64;
/// How often a waiting instance looks at its worker (alive, in time, in memory, clients there).
const TICK: Duration = Duration::from_millis(20);
/// A batcher thread polls for its worker's reply, rather than sleeping, when recent replies came
/// within this and its caller is alone (`Live::alone`): waking a sleeping thread costs tens of
/// microseconds, as much as a quick model's whole `execute`. Under load it sleeps: the worker and
/// the server's I/O threads need the cores. It yields its core at each turn meanwhile; a model
/// slower than this is slept for from the start.
const REPLY_SPIN: Duration = Duration::from_micros(250);
/// The largest control message either side accepts.
const MAX_MESSAGE: usize = 64 << 20;
/// The most bytes of outputs one reply (or BLS call) may bring back.
const MAX_REPLY_BYTES: u64 = 4 << 30;

/// How a Python model's workers run (its config's `[python]`, Triton's `EXECUTION_ENV_PATH`).
#[derive(Debug, Clone)]
pub struct PythonOptions {
    /// The interpreter the workers run under.
    pub interpreter: PathBuf,
    /// `initialize` (and `auto_complete_config`) must return within this.
    pub init_timeout: Duration,
    /// One `execute` call must return within this, or the worker is killed.
    pub execute_timeout: Duration,
    /// A worker whose resident memory grows past this is killed (and restarted); `None`: no limit.
    pub memory_limit: Option<u64>,
    /// `finalize` is waited for this long on unload before the worker is killed.
    pub finalize_timeout: Duration,
}

impl Default for PythonOptions {
    fn default() -> Self {
        PythonOptions {
            interpreter: PathBuf::from("python3"),
            init_timeout: Duration::from_secs(120),
            execute_timeout: Duration::from_secs(60),
            memory_limit: None,
            finalize_timeout: Duration::from_secs(10),
        }
    }
}

/// What every instance of one Python model shares.
struct Shared {
    name: String,
    model_py: PathBuf,
    /// Triton's `args` for `initialize`, less the instance's own name.
    args: serde_json::Map<String, Value>,
    options: PythonOptions,
    /// Where BLS calls find the other models (none for a model loaded on its own).
    models: Option<Weak<dyn Models>>,
    next_instance: AtomicUsize,
}

/// A Python model as a backend: the tensors its config states, and how to start its workers.
pub struct PythonBackend {
    inputs: Vec<TensorSpec>,
    outputs: Vec<TensorSpec>,
    shared: Arc<Shared>,
}

impl PythonBackend {
    /// The backend of `model_py` (in `<model>/<version>/`), whose tensors are `inputs` and
    /// `outputs` (full shapes); `model_config` is the config as Triton's JSON.
    pub fn new(
        name: &str,
        version: u64,
        model_py: &Path,
        model_config: &Value,
        (inputs, outputs): (Vec<TensorSpec>, Vec<TensorSpec>),
        options: PythonOptions,
        models: Option<Weak<dyn Models>>,
    ) -> PythonBackend {
        let model_dir = model_py.parent().and_then(Path::parent).unwrap_or(Path::new("."));
        let mut args = serde_json::Map::new();
        args.insert("model_config".into(), Value::String(model_config.to_string()));
        args.insert("model_instance_kind".into(), "CPU".into());
        args.insert("model_instance_device_id".into(), "0".into());
        args.insert("model_repository".into(), model_dir.display().to_string().into());
        args.insert("model_version".into(), version.to_string().into());
        args.insert("model_name".into(), name.into());
        let shared = Arc::new(Shared {
            name: name.to_string(),
            model_py: model_py.to_path_buf(),
            args,
            options,
            models,
            next_instance: AtomicUsize::new(0),
        });
        PythonBackend { inputs, outputs, shared }
    }

    /// Runs the model class's `auto_complete_config` (when `source`, the text of `model_py`,
    /// defines one) on `config` (Triton's JSON) in a worker of its own, and returns the config it
    /// gives back.
    pub fn auto_complete(model_py: &Path, source: &[u8], config: &Value, options: &PythonOptions) -> Result<Value> {
        if !source.windows(b"auto_complete_config".len()).any(|w| w == b"auto_complete_config") {
            return Ok(config.clone());
        }
        let mut worker = Worker::spawn(model_py, options)?;
        let args = json!({"model_config": config.to_string()});
        let reply = worker.init(model_py, &args, true, options.init_timeout, ("", ""));
        worker.kill();
        let reply = reply?;
        Ok(reply.get("config").cloned().unwrap_or_else(|| config.clone()))
    }
}

impl Backend for PythonBackend {
    fn inputs(&self) -> &[TensorSpec] {
        &self.inputs
    }

    fn outputs(&self) -> &[TensorSpec] {
        &self.outputs
    }

    fn instance(&self) -> Result<Box<dyn Instance>> {
        let n = self.shared.next_instance.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let name = format!("{}_0_{n}", self.shared.name);
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .map_err(|e| Error::internal(format!("cannot start a Python instance's runtime: {e}")))?;
        let mut instance =
            PythonInstance { shared: self.shared.clone(), name, worker: None, runtime, reply: REPLY_SPIN };
        instance.worker = Some(instance.start()?);
        Ok(Box::new(instance))
    }

    fn answers_each(&self) -> bool {
        true
    }
}

struct PythonInstance {
    shared: Arc<Shared>,
    /// Triton's instance name (`<model>_0_<n>`), which its errors and logs carry.
    name: String,
    /// `None` after the worker failed, until one starts again.
    worker: Option<Worker>,
    /// Where BLS calls wait for the models they call.
    runtime: tokio::runtime::Runtime,
    /// The moving average of the time the worker took to reply (see REPLY_SPIN).
    reply: Duration,
}

impl PythonInstance {
    fn start(&self) -> Result<Worker> {
        let mut worker = Worker::spawn(&self.shared.model_py, &self.shared.options)?;
        let mut args = self.shared.args.clone();
        args.insert("model_instance_name".into(), self.name.clone().into());
        let who = (self.shared.name.as_str(), self.name.as_str());
        match worker.init(&self.shared.model_py, &Value::Object(args), false, self.shared.options.init_timeout, who) {
            Ok(_) => Ok(worker),
            Err(e) => {
                worker.kill();
                Err(Error::invalid(format!("model '{}': initialize failed: {e}", self.shared.name)))
            }
        }
    }

    /// A worker ended badly (`why`): it is killed, counted and logged, and a new one started.
    fn replace(&mut self, why: &str) {
        if let Some(mut w) = self.worker.take() {
            w.kill();
        }
        tracing::error!(model = %self.shared.name, instance = %self.name, "Python worker {why}; restarting it");
        crate::telemetry::metrics::global().python_restarts.with_label_values(&[&self.shared.name]).inc();
        match self.start() {
            Ok(w) => self.worker = Some(w),
            Err(e) => tracing::error!(model = %self.shared.name, instance = %self.name, error = %e,
                "the Python worker could not be restarted; the next batch tries again"),
        }
    }

    fn execute(&mut self, inputs: &[BatchInput<'_>], live: &Live<'_>) -> Result<Vec<Result<Vec<Tensor>>>> {
        if self.worker.is_none() {
            self.worker = Some(self.start().map_err(|e| {
                Error::unavailable(format!("the Python worker of '{}' is not running: {e}", self.name), None)
            })?);
        }
        let worker = self.worker.as_mut().expect("started above");
        let requests = inputs.first().map_or(1, |i| i.parts.len());
        // The requests' tensors, each its own part of the batch.
        let mut blobs: Vec<Bytes> = Vec::with_capacity(requests * inputs.len());
        let mut shapes = Vec::with_capacity(requests * inputs.len());
        for r in 0..requests {
            for i in inputs {
                let part = i.parts[r];
                let shape = part_shape(i, part);
                if shape.len() > MAX_DIMS {
                    return Err(Error::invalid(format!("input '{}' has over {MAX_DIMS} dimensions", i.name)));
                }
                shapes.push(shape);
                blobs.push(part.to_wire());
            }
        }
        let (file, places) = worker.input.write(requests, &blobs)?;
        let mut m = Packed::new(EXECUTE);
        m.str(&self.shared.name).str(&file).count(0).count(requests);
        let mut k = 0;
        for r in 0..requests {
            m.str(live.id(r)).str(live.parameters(r)).count(inputs.len());
            for i in inputs {
                m.tensor(i.name, i.datatype.as_str(), &shapes[k], places[k]);
                k += 1;
            }
        }
        let sent = worker.send_packed(m.0);
        let deadline = Instant::now() + self.shared.options.execute_timeout;
        let mut told = vec![false; requests];
        let reply = sent.and_then(|()| loop {
            match self.wait(deadline, live, &mut told) {
                Ok(Message::Json(m)) if m["op"] == "infer" => {
                    let answer = self.bls(&m, deadline);
                    let worker = self.worker.as_mut().expect("running");
                    if let Err(e) = worker.answer_bls(answer) {
                        break Err(e);
                    }
                }
                other => break other,
            }
        });
        let answers = match reply.and_then(|m| match m {
            Message::Done(body) => done(&body, requests).map(Ok),
            Message::Json(m) if m["op"] == "failed" => Ok(Err(m)),
            Message::Json(_) => Err(Fatal("sent an unexpected message".into())),
        }) {
            Ok(Ok(answers)) => answers,
            Ok(Err(failed)) => {
                return Err(Error::internal(format!(
                    "Failed to process the request(s) for model '{}', message: {}",
                    self.name,
                    failed["message"].as_str().unwrap_or_default()
                )))
            }
            Err(Fatal(why)) => {
                let e = Error::internal(format!("the Python worker of '{}' {why}; it is being restarted", self.name));
                self.replace(&why);
                return Err(e);
            }
        };
        let (file, answers) = answers;
        let worker = self.worker.as_mut().expect("running");
        let mut budget = MAX_REPLY_BYTES;
        Ok(answers
            .into_iter()
            .map(|a| match a {
                Answer::Error(code, message) => Err(model_error(&message, code)),
                Answer::Outputs(outputs) => worker.read_tensors(&file, &outputs, &mut budget),
            })
            .collect())
    }

    /// The worker's next message other than a log line, watching it meanwhile: dead, late past
    /// `deadline` or over its memory limit is fatal. Requests whose clients left are told so
    /// (`is_cancelled()`).
    fn wait(&mut self, deadline: Instant, live: &Live<'_>, told: &mut [bool]) -> std::result::Result<Message, Fatal> {
        let limit = self.shared.options.memory_limit;
        let timeout = self.shared.options.execute_timeout;
        let worker = self.worker.as_mut().expect("running");
        let started = Instant::now();
        let spin_until = started + reply_spin(self.reply);
        let reply = loop {
            let spinning = Instant::now() < spin_until && live.alone();
            match worker.poll(!spinning)? {
                Some(Message::Json(m)) if m["op"] == "log" => log(&self.shared.name, &self.name, &m),
                Some(m) => break m,
                None if spinning => {
                    std::thread::yield_now();
                    continue;
                }
                None => {}
            }
            // Memory first: a worker past its limit and late is late because it grew.
            if let Some(limit) = limit {
                let rss = worker.rss();
                if rss > limit {
                    return Err(Fatal(format!("used {} MiB, over its limit of {} MiB", rss >> 20, limit >> 20)));
                }
            }
            if Instant::now() > deadline {
                return Err(Fatal(format!("did not return from execute within {timeout:?}")));
            }
            for (i, t) in told.iter_mut().enumerate() {
                if !*t && !live.request_awaited(i) {
                    *t = true;
                    worker.input.cancel(i);
                }
            }
        };
        // A moving average (1/8 of each reply), so one slow call does not end the polling.
        let took = started.elapsed().min(Duration::from_secs(1));
        self.reply = (self.reply * 7 + took) / 8;
        Ok(reply)
    }

    /// A BLS call of the worker's: the model it names, through that model's batcher.
    fn bls(&mut self, m: &Value, deadline: Instant) -> Result<Vec<Tensor>> {
        let worker = self.worker.as_mut().expect("running");
        let file = m["file"].as_str().unwrap_or_default().to_string();
        let mut budget = MAX_REPLY_BYTES;
        let inputs = worker.read_tensors(&file, &placed(&m["inputs"])?, &mut budget)?;
        let model_name = m["model"].as_str().unwrap_or_default().to_string();
        let version = m["version"].as_str().filter(|v| !v.is_empty()).map(str::to_string);
        let outputs: Option<Vec<String>> = m["outputs"]
            .as_array()
            .filter(|o| !o.is_empty())
            .map(|o| o.iter().filter_map(|n| n.as_str().map(str::to_string)).collect());
        let models =
            self.shared.models.as_ref().and_then(Weak::upgrade).ok_or_else(|| {
                Error::unavailable("BLS calls need a repository: this model was loaded on its own", None)
            })?;
        let model = models.model(&model_name, version.as_deref());
        drop(models);
        let model = model?;
        let timeout_us = m["timeout_us"].as_u64().filter(|&t| t > 0);
        let req =
            InferRequest { model_name, model_version: version, inputs, outputs, timeout_us, ..Default::default() };
        let left = deadline.saturating_duration_since(Instant::now());
        let answer = self.runtime.block_on(async {
            match tokio::time::timeout(left, model.infer(req, crate::wire::DEFAULT_MAX_ELEMENTS)).await {
                Ok(a) => a,
                Err(_) => Err(Error::DeadlineExceeded("the BLS call outlasted its caller's execute timeout".into())),
            }
        });
        crate::engine::model::release(model);
        answer.map(|r| r.outputs)
    }
}

impl Instance for PythonInstance {
    fn run(&mut self, inputs: &[BatchInput<'_>]) -> Result<Vec<Tensor>> {
        let _ = inputs;
        Err(Error::internal("a Python model answers each request apart"))
    }

    fn run_each(&mut self, inputs: &[BatchInput<'_>], live: &Live<'_>) -> Result<Vec<Result<Vec<Tensor>>>> {
        self.execute(inputs, live)
    }
}

impl Drop for PythonInstance {
    fn drop(&mut self) {
        if let Some(mut w) = self.worker.take() {
            // `finalize` runs on unload; a worker that does not finish it in time is killed.
            if w.send(&json!({"op": "finalize"})).is_ok() {
                let deadline = Instant::now() + self.shared.options.finalize_timeout;
                while Instant::now() < deadline {
                    match w.poll(true) {
                        Ok(Some(Message::Json(m))) if m["op"] == "log" => log(&self.shared.name, &self.name, &m),
                        Ok(Some(_)) | Err(_) => break,
                        Ok(None) => {}
                    }
                }
            }
            w.kill();
        }
    }
}

/// Why a worker cannot go on (it is then killed and replaced).
struct Fatal(String);

/// A message from a worker: JSON, or the packed answer to an execute (`DONE`).
enum Message {
    Json(Value),
    Done(Vec<u8>),
}

/// The first byte of a packed message (a JSON one starts with `{`).
const EXECUTE: u8 = 1;
const DONE: u8 = 2;
/// The most dimensions a tensor may have on the channel (NumPy's limit).
const MAX_DIMS: usize = 64;

/// One request's answer in a worker's `DONE`.
enum Answer {
    /// A `TritonError`'s code and message.
    Error(i64, String),
    Outputs(Vec<Placed>),
}

/// A tensor in a shared file, as a message describes it.
struct Placed {
    name: String,
    /// `None`: a NumPy type with no Triton type.
    datatype: Option<DataType>,
    shape: Vec<usize>,
    offset: u64,
    size: u64,
}

/// A packed message being written: little-endian; a string is its length (u32; u8 for a
/// datatype) then its bytes, a count a u32, a tensor its name, datatype, ndim (u8), dims (i64
/// each), offset and size (u64). The worker's module doc lays out `EXECUTE` and `DONE`.
struct Packed(Vec<u8>);

impl Packed {
    fn new(kind: u8) -> Packed {
        let mut b = Vec::with_capacity(256);
        b.extend_from_slice(&[0, 0, 0, 0, kind]);
        Packed(b)
    }

    fn count(&mut self, n: usize) -> &mut Packed {
        self.0.extend_from_slice(&(n as u32).to_le_bytes());
        self
    }

    fn str(&mut self, s: &str) -> &mut Packed {
        self.count(s.len());
        self.0.extend_from_slice(s.as_bytes());
        self
    }

    fn tensor(&mut self, name: &str, datatype: &str, shape: &[usize], (offset, size): (u64, u64)) {
        self.str(name);
        self.0.push(datatype.len() as u8);
        self.0.extend_from_slice(datatype.as_bytes());
        self.0.push(shape.len() as u8);
        for &d in shape {
            self.0.extend_from_slice(&(d as i64).to_le_bytes());
        }
        self.0.extend_from_slice(&offset.to_le_bytes());
        self.0.extend_from_slice(&size.to_le_bytes());
    }
}

/// Reads a packed message; running past its end is a worker sending what is not a message.
struct Unpack<'a>(&'a [u8]);

impl<'a> Unpack<'a> {
    fn take(&mut self, n: usize) -> std::result::Result<&'a [u8], Fatal> {
        if n > self.0.len() {
            return Err(Fatal("sent a packed message cut short".into()));
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }

    fn u8(&mut self) -> std::result::Result<u8, Fatal> {
        Ok(self.take(1)?[0])
    }

    fn u32(&mut self) -> std::result::Result<u32, Fatal> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4 bytes")))
    }

    fn u64(&mut self) -> std::result::Result<u64, Fatal> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8 bytes")))
    }

    fn text(&mut self, n: usize) -> std::result::Result<String, Fatal> {
        String::from_utf8(self.take(n)?.to_vec()).map_err(|_| Fatal("sent a string that is not UTF-8".into()))
    }

    fn str(&mut self) -> std::result::Result<String, Fatal> {
        let n = self.u32()? as usize;
        self.text(n)
    }

    fn tensor(&mut self) -> std::result::Result<Placed, Fatal> {
        let name = self.str()?;
        let n = self.u8()? as usize;
        let datatype = DataType::parse(&self.text(n)?);
        let ndim = self.u8()? as usize;
        let shape = (0..ndim)
            .map(|_| usize::try_from(self.u64()? as i64).map_err(|_| Fatal(format!("sent a negative dim of '{name}'"))))
            .collect::<std::result::Result<_, _>>()?;
        Ok(Placed { name, datatype, shape, offset: self.u64()?, size: self.u64()? })
    }
}

/// A worker's `DONE` for an execute of `requests` requests: its output file and each answer.
fn done(body: &[u8], requests: usize) -> std::result::Result<(String, Vec<Answer>), Fatal> {
    let mut m = Unpack(&body[1..]);
    let file = m.str()?;
    let n = m.u32()? as usize;
    if n != requests {
        return Err(Fatal(format!("answered {n} of {requests} requests")));
    }
    let answers = (0..n)
        .map(|_| match m.u8()? {
            0 => {
                let outputs = m.u32()?;
                Ok(Answer::Outputs((0..outputs).map(|_| m.tensor()).collect::<std::result::Result<_, _>>()?))
            }
            _ => {
                let code = m.u32()? as i64;
                Ok(Answer::Error(code, m.str()?))
            }
        })
        .collect::<std::result::Result<_, Fatal>>()?;
    Ok((file, answers))
}

/// The tensors a JSON message describes (a BLS call's inputs).
fn placed(described: &Value) -> Result<Vec<Placed>> {
    let bad = |what: &str| Error::internal(format!("the Python worker described a tensor badly: {what}"));
    let Some(list) = described.as_array() else { return Ok(Vec::new()) };
    list.iter()
        .map(|t| {
            let shape = t["shape"]
                .as_array()
                .ok_or_else(|| bad("no shape"))?
                .iter()
                .map(|d| d.as_u64().map(|d| d as usize).ok_or_else(|| bad("a dim")))
                .collect::<Result<_>>()?;
            Ok(Placed {
                name: t["name"].as_str().ok_or_else(|| bad("no name"))?.to_string(),
                datatype: t["datatype"].as_str().and_then(DataType::parse),
                shape,
                offset: t["offset"].as_u64().ok_or_else(|| bad("offset"))?,
                size: t["size"].as_u64().ok_or_else(|| bad("size"))?,
            })
        })
        .collect()
}

/// The shape of request part `part` of batch input `input`.
fn part_shape(input: &BatchInput<'_>, part: &TensorData) -> Vec<usize> {
    if input.parts.len() == 1 {
        return input.shape.clone();
    }
    let per_row: usize = input.shape[1..].iter().product();
    let elements = match part {
        TensorData::Fixed(b) => b.len() / input.datatype.size().unwrap_or(1).max(1),
        TensorData::Strings(s) => s.len(),
    };
    std::iter::once(elements / per_row.max(1)).chain(input.shape[1..].iter().copied()).collect()
}

/// A model's error for one request (`TritonError`), by Triton's codes.
/// How long to poll for a reply, given the moving average of recent ones: twice that, up to
/// REPLY_SPIN, when they come within REPLY_SPIN (a model as quick as an identity); not at all
/// when they take longer (polling a part of a long wait only burns a core).
fn reply_spin(recent: Duration) -> Duration {
    if recent <= REPLY_SPIN {
        (recent * 2).min(REPLY_SPIN)
    } else {
        Duration::ZERO
    }
}

fn model_error(message: &str, code: i64) -> Error {
    let message = message.to_string();
    match code {
        2 => Error::NotFound(message),
        3 => Error::InvalidInput(message),
        4 => Error::unavailable(message, None),
        5 => Error::Unsupported(message),
        _ => Error::Internal(message),
    }
}

fn log(model: &str, instance: &str, m: &Value) {
    let text = m["message"].as_str().unwrap_or_default();
    match m["level"].as_i64() {
        Some(1) => tracing::warn!(model, instance, "{text}"),
        Some(2) => tracing::error!(model, instance, "{text}"),
        Some(3) => tracing::debug!(model, instance, "{text}"),
        _ => tracing::info!(model, instance, "{text}"),
    }
}

static DIR: OnceLock<std::result::Result<PathBuf, String>> = OnceLock::new();

/// This process's directory for the workers' script and shared files (in `/dev/shm` where it
/// exists), private to its user; those of processes that ended without removing theirs go.
fn directory() -> Result<&'static Path> {
    let made = DIR.get_or_init(|| {
        let shm = Path::new("/dev/shm");
        let base = if shm.is_dir() { shm.to_path_buf() } else { std::env::temp_dir() };
        for e in std::fs::read_dir(&base).into_iter().flatten().flatten() {
            let name = e.file_name().to_string_lossy().to_string();
            let pid = name.strip_prefix("ferrite-").and_then(|n| n.strip_suffix("-python"));
            if pid.is_some_and(|p| p.parse::<u32>().is_ok() && !Path::new("/proc").join(p).exists()) {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
        let dir = base.join(format!("ferrite-{}-python", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::DirBuilder::new().mode(0o700).create(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        for (file, text) in [("ferrite_python_worker.py", WORKER), ("triton_python_backend_utils.py", UTILS)] {
            std::fs::write(dir.join(file), text).map_err(|e| format!("{}: {e}", dir.display()))?;
        }
        Ok(dir)
    });
    made.as_deref().map_err(|e| Error::internal(format!("cannot make the Python workers' directory {e}")))
}

/// Removes this process's directory of shared files, if it made one (at exit: workers still
/// running keep what they mapped).
pub fn remove_directory() {
    if let Some(Ok(dir)) = DIR.get() {
        let _ = std::fs::remove_dir_all(dir);
    }
}

/// One worker process and its end of the channel and of the shared files.
struct Worker {
    child: Child,
    chan: UnixStream,
    /// Bytes read from the channel and not yet a whole message.
    pending: Vec<u8>,
    input: InputFile,
    /// The worker's current output file, opened, and its length.
    output: Option<(String, std::fs::File, u64)>,
}

impl Worker {
    fn spawn(model_py: &Path, options: &PythonOptions) -> Result<Worker> {
        let dir = directory()?;
        let (ours, theirs) = UnixStream::pair().map_err(|e| Error::internal(format!("socketpair: {e}")))?;
        let stdout = std::os::fd::AsFd::as_fd(&std::io::stderr())
            .try_clone_to_owned()
            .map_err(|e| Error::internal(format!("cannot give the worker an output: {e}")))?;
        let mut command = Command::new(&options.interpreter);
        command
            .arg("-u")
            .arg(dir.join("ferrite_python_worker.py"))
            .stdin(Stdio::from(std::os::fd::OwnedFd::from(theirs)))
            .stdout(Stdio::from(stdout))
            .stderr(Stdio::inherit())
            .env("PYTHONUNBUFFERED", "1")
            .env("PYTHONDONTWRITEBYTECODE", "1");
        if let Some(venv) =
            options.interpreter.parent().and_then(Path::parent).filter(|v| v.join("pyvenv.cfg").is_file())
        {
            // A model's own environment: its packages, and its `bin/` first on PATH.
            let path = std::env::var_os("PATH").unwrap_or_default();
            let mut paths = vec![venv.join("bin")];
            paths.extend(std::env::split_paths(&path));
            command.env("VIRTUAL_ENV", venv).env("PATH", std::env::join_paths(paths).unwrap_or(path));
        }
        let input = InputFile::new(dir)?;
        let child = command.spawn().map_err(|e| {
            Error::invalid(format!(
                "cannot start the Python interpreter '{}' for {}: {e}",
                options.interpreter.display(),
                model_py.display()
            ))
        })?;
        // Reads wait a tick at most (the waiting side looks at the worker between them); a write
        // the worker does not take within 10 s is a worker that is stuck.
        ours.set_read_timeout(Some(TICK)).map_err(|e| Error::internal(format!("socket timeout: {e}")))?;
        ours.set_write_timeout(Some(Duration::from_secs(10)))
            .map_err(|e| Error::internal(format!("socket timeout: {e}")))?;
        Ok(Worker { child, chan: ours, pending: Vec::new(), input, output: None })
    }

    /// Imports the model and runs its `initialize` (or, `auto_complete`, its class's
    /// `auto_complete_config`); `who` names the model and instance in its log lines.
    fn init(
        &mut self,
        model_py: &Path,
        args: &Value,
        auto_complete: bool,
        timeout: Duration,
        who: (&str, &str),
    ) -> Result<Value> {
        let dir = directory()?;
        self.send(
            &json!({"op": "init", "model_py": model_py, "args": args, "dir": dir, "auto_complete": auto_complete}),
        )
        .map_err(|Fatal(w)| Error::invalid(w))?;
        let deadline = Instant::now() + timeout;
        loop {
            match self.poll(true) {
                Ok(Some(Message::Json(m))) if m["op"] == "log" => log(who.0, who.1, &m),
                Ok(Some(Message::Json(m))) if m["op"] == "error" => {
                    let tb = m["traceback"].as_str().unwrap_or_default();
                    tracing::error!(model = %model_py.display(), "{tb}");
                    return Err(Error::invalid(m["message"].as_str().unwrap_or_default().to_string()));
                }
                Ok(Some(Message::Json(m))) => return Ok(m),
                Ok(Some(Message::Done(_))) => {
                    return Err(Error::invalid("the worker answered an execute it was not given"))
                }
                Ok(None) if Instant::now() > deadline => {
                    return Err(Error::invalid(format!("it did not return within {timeout:?}")))
                }
                Ok(None) => {}
                Err(Fatal(why)) => return Err(Error::invalid(why)),
            }
        }
    }

    fn send(&mut self, m: &Value) -> std::result::Result<(), Fatal> {
        let mut framed = vec![0; 4];
        serde_json::to_writer(&mut framed, m).map_err(|e| Fatal(format!("message not encoded: {e}")))?;
        self.send_packed(framed)
    }

    /// Sends `framed`: a message after 4 bytes left for its length.
    fn send_packed(&mut self, mut framed: Vec<u8>) -> std::result::Result<(), Fatal> {
        let n = (framed.len() - 4) as u32;
        framed[..4].copy_from_slice(&n.to_le_bytes());
        self.chan.write_all(&framed).map_err(|e| Fatal(format!("cannot be written to ({e})")))
    }

    /// The next whole message, or `None` after waiting up to `TICK` (the channel's read timeout),
    /// or at once without `block`; a worker that exited or closed its end, or sends what is not a
    /// message, is fatal.
    fn poll(&mut self, block: bool) -> std::result::Result<Option<Message>, Fatal> {
        loop {
            if self.pending.len() >= 4 {
                let n = u32::from_le_bytes(self.pending[..4].try_into().expect("4 bytes")) as usize;
                if n > MAX_MESSAGE {
                    return Err(Fatal(format!("sent a message of {n} bytes")));
                }
                if self.pending.len() >= 4 + n {
                    let body = &self.pending[4..4 + n];
                    let m = if body.first() == Some(&DONE) {
                        Ok(Message::Done(body.to_vec()))
                    } else {
                        serde_json::from_slice(body)
                            .map(Message::Json)
                            .map_err(|e| Fatal(format!("sent a message that is not JSON ({e})")))
                    };
                    self.pending.drain(..4 + n);
                    return m.map(Some);
                }
            }
            let mut buf = [0u8; 16 << 10];
            let read = if block {
                self.chan.read(&mut buf)
            } else {
                // SAFETY: `buf` is writable for its length; the descriptor is our end of the channel.
                let n = unsafe {
                    libc::recv(self.chan.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), libc::MSG_DONTWAIT)
                };
                if n < 0 {
                    Err(std::io::Error::last_os_error())
                } else {
                    Ok(n as usize)
                }
            };
            match read {
                Ok(0) => {
                    let status = self.child.wait().map(|s| s.to_string()).unwrap_or_else(|e| e.to_string());
                    return Err(Fatal(format!("exited ({status})")));
                }
                Ok(n) => self.pending.extend_from_slice(&buf[..n]),
                Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                    return Ok(None)
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(Fatal(format!("cannot be read from ({e})"))),
            }
        }
    }

    /// Resident memory of the worker, in bytes.
    fn rss(&self) -> u64 {
        let statm = std::fs::read_to_string(format!("/proc/{}/statm", self.child.id())).unwrap_or_default();
        let pages: u64 = statm.split_whitespace().nth(1).and_then(|p| p.parse().ok()).unwrap_or(0);
        // SAFETY: sysconf has no preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(4096) as u64;
        pages * page
    }

    /// The tensors `described` of the worker's file `file`, each counted against `budget` bytes
    /// before it is read.
    fn read_tensors(&mut self, file: &str, described: &[Placed], budget: &mut u64) -> Result<Vec<Tensor>> {
        let bad = |what: &str| Error::internal(format!("the Python worker described a tensor badly: {what}"));
        if described.is_empty() {
            return Ok(Vec::new());
        }
        if self.output.as_ref().is_none_or(|(p, ..)| p != file) {
            let path = Path::new(file);
            if path.parent() != Some(directory()?) {
                return Err(bad("its file is not in the workers' directory"));
            }
            // The worker never shrinks a file it wrote to: a new size is a new file.
            let f = std::fs::File::open(path).map_err(|e| bad(&format!("{file}: {e}")))?;
            let length = f.metadata().map(|m| m.len()).unwrap_or(0);
            self.output = Some((file.to_string(), f, length));
        }
        let (_, f, length) = self.output.as_ref().expect("opened above");
        described
            .iter()
            .map(|t| {
                let name = &t.name;
                let datatype = t
                    .datatype
                    .ok_or_else(|| Error::internal(format!("output '{name}': its NumPy type has no Triton type")))?;
                let (offset, size) = (t.offset, t.size);
                if offset.checked_add(size).is_none_or(|end| end > *length) || size > *budget {
                    return Err(bad(&format!(
                        "'{name}' of {size} bytes at {offset} is outside its file or over the reply limit"
                    )));
                }
                *budget -= size;
                let count = crate::data::tensor::element_count(&t.shape, usize::MAX)?;
                let mut raw = vec![0u8; size as usize];
                f.read_exact_at(&mut raw, offset).map_err(|e| bad(&format!("{file}: {e}")))?;
                let data = TensorData::from_wire(name, datatype, count, Bytes::from(raw))
                    .map_err(|e| Error::internal(format!("the Python model's output: {e}")))?;
                Ok(Tensor::new(name, datatype, t.shape.clone(), data))
            })
            .collect()
    }

    /// Gives a BLS call its answer: the outputs written after the batch's inputs.
    fn answer_bls(&mut self, answer: Result<Vec<Tensor>>) -> std::result::Result<(), Fatal> {
        let m = match answer {
            Err(e) => json!({"op": "infer_result", "error": e.to_string(), "code": code_of(&e)}),
            Ok(tensors) => {
                let blobs: Vec<Bytes> = tensors.iter().map(|t| t.data.to_wire()).collect();
                match self.input.append(&blobs) {
                    Err(e) => json!({"op": "infer_result", "error": e.to_string(), "code": 1}),
                    Ok((file, places)) => {
                        let outputs: Vec<Value> = tensors
                            .iter()
                            .zip(places)
                            .map(|(t, (offset, size))| {
                                json!({"name": t.name, "datatype": t.datatype.as_str(),
                                "shape": t.shape, "offset": offset, "size": size})
                            })
                            .collect();
                        json!({"op": "infer_result", "file": file, "outputs": outputs})
                    }
                }
            }
        };
        self.send(&m)
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if let Some((path, ..)) = self.output.take() {
            let _ = std::fs::remove_file(path);
        }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Triton's error code of `e`, for a BLS response's error.
fn code_of(e: &Error) -> i64 {
    match e {
        Error::NotFound(_) => 2,
        Error::InvalidInput(_) | Error::TooLarge(_) => 3,
        Error::Unavailable { .. } | Error::Overloaded { .. } => 4,
        Error::Unsupported(_) => 5,
        _ => 1,
    }
}

/// The server's file of a worker's inputs: each execute writes its flags (a byte per request,
/// set when its client leaves) and tensors from the start; BLS answers follow them. A file too
/// small (or far too large after a burst) is replaced by a new one; the worker's mappings of the
/// old one stay valid until it lets them go.
struct InputFile {
    dir: PathBuf,
    path: PathBuf,
    file: Arc<std::fs::File>,
    capacity: u64,
    /// The end of what the current execute has written.
    end: u64,
    serial: u64,
    /// The file holding the current execute's flags.
    flags: Option<Arc<std::fs::File>>,
    /// A small execute's flags and tensors, laid out here and written in one call.
    staged: Vec<u8>,
}

impl InputFile {
    fn new(dir: &Path) -> Result<InputFile> {
        let (path, file) = Self::create(dir, 0, 1 << 16)?;
        Ok(InputFile {
            dir: dir.to_path_buf(),
            path,
            file: Arc::new(file),
            capacity: 1 << 16,
            end: 0,
            serial: 0,
            flags: None,
            staged: Vec::new(),
        })
    }

    fn create(dir: &Path, serial: u64, size: u64) -> Result<(PathBuf, std::fs::File)> {
        static FILES: AtomicUsize = AtomicUsize::new(0);
        let n = FILES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let path = dir.join(format!("in-{n}-{serial}"));
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
            .and_then(|f| f.set_len(size).map(|_| f))
            .map_err(|e| Error::internal(format!("cannot make a shared file {}: {e}", path.display())))?;
        Ok((path, file))
    }

    /// Room for `need` more bytes from `end` (a new file when there is none).
    fn room(&mut self, need: u64, fresh: bool) -> Result<()> {
        let too_small = self.end + need > self.capacity;
        let too_large = fresh && self.capacity > (64 << 20) && need < self.capacity / 4;
        if too_small || too_large {
            let size = if too_small { (need + need / 2).max(self.capacity) } else { need.max(1 << 16) };
            self.serial += 1;
            let (path, file) = Self::create(&self.dir, self.serial, size)?;
            let _ = std::fs::remove_file(&self.path);
            self.path = path;
            self.file = Arc::new(file);
            self.capacity = size;
            self.end = 0;
        }
        Ok(())
    }

    fn layout(start: u64, blobs: &[Bytes]) -> (Vec<(u64, u64)>, u64) {
        let mut at = start;
        let places = blobs
            .iter()
            .map(|b| {
                let offset = at.div_ceil(ALIGN) * ALIGN;
                at = offset + b.len() as u64;
                (offset, b.len() as u64)
            })
            .collect();
        (places, at)
    }

    fn put(&self, blobs: &[Bytes], places: &[(u64, u64)]) -> Result<()> {
        for (b, (offset, _)) in blobs.iter().zip(places) {
            self.file
                .write_all_at(b, *offset)
                .map_err(|e| Error::internal(format!("cannot write the shared file {}: {e}", self.path.display())))?;
        }
        Ok(())
    }

    /// One execute's `requests` flags (from offset 0) and tensors: its path and each blob's place.
    fn write(&mut self, requests: usize, blobs: &[Bytes]) -> Result<(String, Vec<(u64, u64)>)> {
        /// Up to this much is copied into one buffer and written with one call.
        const STAGED: u64 = 256 << 10;
        self.end = 0;
        let (places, end) = Self::layout(requests as u64, blobs);
        self.room(end, true)?;
        if end <= STAGED {
            self.staged.clear();
            self.staged.resize(end as usize, 0);
            for (b, (offset, size)) in blobs.iter().zip(&places) {
                self.staged[*offset as usize..(*offset + *size) as usize].copy_from_slice(b);
            }
            self.file
                .write_all_at(&self.staged, 0)
                .map_err(|e| Error::internal(format!("cannot write the shared file {}: {e}", self.path.display())))?;
        } else {
            self.file
                .write_all_at(&vec![0u8; requests], 0)
                .map_err(|e| Error::internal(format!("cannot write the shared file: {e}")))?;
            self.put(blobs, &places)?;
        }
        self.end = end;
        self.flags = Some(self.file.clone());
        Ok((self.path.display().to_string(), places))
    }

    /// Tensors after what the current execute wrote (a BLS answer): its path and their places.
    fn append(&mut self, blobs: &[Bytes]) -> Result<(String, Vec<(u64, u64)>)> {
        let (_, need) = Self::layout(0, blobs);
        self.room(need + ALIGN, false)?;
        let (places, end) = Self::layout(self.end, blobs);
        self.put(blobs, &places)?;
        self.end = end;
        Ok((self.path.display().to_string(), places))
    }

    /// Marks request `i` of the current execute as cancelled.
    fn cancel(&self, i: usize) {
        if let Some(f) = &self.flags {
            let _ = f.write_all_at(&[1], i as u64);
        }
    }
}

impl Drop for InputFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An output as the worker packs it: name, datatype, shape, place in its file.
    type Out<'a> = (&'a str, &'a str, &'a [usize], (u64, u64));

    /// A worker's DONE as `ferrite_python_worker.py` packs it: one response with `outputs`.
    fn done_of(file: &str, outputs: &[Out<'_>]) -> Vec<u8> {
        let mut m = Packed::new(DONE);
        m.str(file).count(1);
        m.0.push(0);
        m.count(outputs.len());
        for (name, datatype, shape, place) in outputs {
            m.tensor(name, datatype, shape, *place);
        }
        m.0.split_off(4)
    }

    #[test]
    fn replies_are_polled_for_only_when_they_come_quickly() {
        assert_eq!(reply_spin(Duration::from_micros(60)), Duration::from_micros(120));
        assert_eq!(reply_spin(Duration::from_micros(200)), REPLY_SPIN);
        assert_eq!(reply_spin(REPLY_SPIN), REPLY_SPIN);
        assert_eq!(reply_spin(REPLY_SPIN + Duration::from_micros(1)), Duration::ZERO);
        assert_eq!(reply_spin(Duration::from_millis(30)), Duration::ZERO);
    }

    #[test]
    fn a_packed_answer_reads_back_as_written() {
        let body = done_of("/f", &[("OUT", "FP32", &[2, 3], (64, 24)), ("T", "BYTES", &[], (128, 9))]);
        let Ok((file, answers)) = done(&body, 1) else { panic!("not read") };
        assert_eq!(file, "/f");
        let [Answer::Outputs(outputs)] = &answers[..] else { panic!("not one answer with outputs") };
        let placed: Vec<_> =
            outputs.iter().map(|t| (t.name.as_str(), t.datatype, t.shape.clone(), t.offset, t.size)).collect();
        assert_eq!(
            placed,
            [("OUT", Some(DataType::Fp32), vec![2, 3], 64, 24), ("T", Some(DataType::Bytes), vec![], 128, 9)]
        );
        // A NumPy type with no Triton type comes as an empty name: no datatype, an error later.
        let body = done_of("/f", &[("OUT", "", &[1], (0, 2))]);
        let Ok((_, answers)) = done(&body, 1) else { panic!("not read") };
        assert!(matches!(&answers[..], [Answer::Outputs(o)] if o[0].datatype.is_none()));
    }

    #[test]
    fn a_packed_error_keeps_its_code_and_message() {
        let mut m = Packed::new(DONE);
        m.str("").count(1);
        m.0.push(1);
        m.count(3).str("not valid");
        let Ok((_, answers)) = done(&m.0[4..], 1) else { panic!("not read") };
        assert!(matches!(&answers[..], [Answer::Error(3, msg)] if msg == "not valid"));
    }

    #[test]
    fn a_bad_packed_answer_is_fatal_never_a_panic() {
        let body = done_of("/f", &[("OUT", "FP32", &[2, 3], (64, 24))]);
        // Cut anywhere, it is a worker to restart.
        for n in 1..body.len() {
            assert!(done(&body[..n], 1).is_err(), "cut at {n}");
        }
        // Answers for another number of requests.
        assert!(done(&body, 2).is_err());
        // Counts far past the message's end are not allocated for.
        let mut m = Packed::new(DONE);
        m.str("/f").count(1);
        m.0.push(0);
        m.count(u32::MAX as usize);
        assert!(done(&m.0[4..], 1).is_err());
        // A negative dim.
        let mut body = done_of("/f", &[("OUT", "FP32", &[1], (0, 4))]);
        let at = body.len() - 16 - 8;
        body[at..at + 8].copy_from_slice(&(-1i64).to_le_bytes());
        assert!(done(&body, 1).is_err());
        // Not UTF-8.
        let mut body = done_of("/f", &[("OUT", "FP32", &[1], (0, 4))]);
        body[5] = 0xff;
        assert!(done(&body, 1).is_err());
    }
}
