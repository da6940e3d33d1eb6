//! The engine end to end through `Core`: repository loading, validation, batching, timeouts,
//! cancellation and shutdown, on the real ONNX Runtime backend and the bundled models.

use std::{
    path::{Path, PathBuf},
    sync::{
        atomic::{AtomicUsize, Ordering},
        mpsc, Arc, Mutex,
    },
    time::{Duration, Instant},
};

use ferrite_core::{
    control::config::ModelConfig,
    engine::backend::{Backend, BatchInput, Instance},
    engine::spec::{ModelSpec, TensorSpec},
    Core, DataType, Error, InferRequest, Limits, LoadOptions, Model, Tensor,
};

/// Loads ONNX Runtime as the binary does at start-up (the test's `python3` has the wheel).
fn runtime() {
    ferrite_core::engine::onnx::init_runtime(None).expect("ONNX Runtime");
}

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// A repository holding copies of the named models (from models/ or tests/models/), with configs.
fn repo(models: &[(&str, Option<&str>)]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for (name, config) in models {
        let src = [root().join("models").join(name), root().join("tests/models").join(name)]
            .into_iter()
            .find(|p| p.exists())
            .unwrap_or_else(|| panic!("no model {name}"));
        let dst = dir.path().join(name).join("1");
        std::fs::create_dir_all(&dst).unwrap();
        std::fs::copy(src.join("1/model.onnx"), dst.join("model.onnx")).unwrap();
        if let Some(c) = config {
            std::fs::write(dir.path().join(name).join("config.toml"), c).unwrap();
        }
    }
    dir
}

fn load(dir: &Path) -> Core {
    runtime();
    Core::load(
        dir,
        &LoadOptions { threads: 1, spinning: false, calibrate: false, cache: None, ..Default::default() },
        Limits::default(),
    )
    .unwrap()
}

fn mlp_request(value: f32) -> InferRequest {
    InferRequest {
        model_name: "mlp".into(),
        inputs: vec![Tensor::from_le("input", DataType::Fp32, vec![1, 512], &[value; 512])],
        ..Default::default()
    }
}

#[test]
fn bad_model_directories_are_skipped_with_a_reason() {
    let dir = repo(&[("mixed", None)]);
    let p = dir.path();
    std::fs::create_dir_all(p.join("broken/1")).unwrap();
    std::fs::write(p.join("broken/1/model.onnx"), b"garbage").unwrap();
    std::fs::create_dir_all(p.join("empty")).unwrap();
    std::fs::create_dir_all(p.join("badconfig/1")).unwrap();
    std::fs::copy(root().join("models/mixed/1/model.onnx"), p.join("badconfig/1/model.onnx")).unwrap();
    std::fs::write(p.join("badconfig/config.toml"), "max_batch_size = \"many\"").unwrap();
    std::fs::create_dir_all(p.join("bad name")).unwrap();
    let core = load(p);
    assert_eq!(core.models().iter().map(|m| m.spec.name.clone()).collect::<Vec<_>>(), ["mixed"]);
    let failed = core.failed();
    assert!(failed["broken"].contains("cannot load"), "{failed:?}");
    assert!(failed["empty"].contains("no version"), "{failed:?}");
    assert!(failed["badconfig"].contains("config.toml"), "{failed:?}");
    assert!(failed["bad name"].contains("not a valid model name"), "{failed:?}");
}

#[test]
fn highest_version_is_served_and_others_are_not_found() {
    let dir = repo(&[("mixed", None)]);
    let v3 = dir.path().join("mixed/3");
    std::fs::create_dir_all(&v3).unwrap();
    std::fs::copy(root().join("models/mixed/1/model.onnx"), v3.join("model.onnx")).unwrap();
    let core = load(dir.path());
    assert_eq!(core.model("mixed", None).unwrap().spec.version, 3);
    assert_eq!(core.model("mixed", Some("3")).unwrap().spec.version, 3);
    assert!(matches!(core.model("mixed", Some("1")), Err(Error::NotFound(_))));
    assert!(matches!(core.model("nope", None), Err(Error::NotFound(_))));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_are_batched_and_split_exactly() {
    let dir = repo(&[("mlp", Some("[dynamic_batching]\nmax_queue_delay_microseconds = 20000\n"))]);
    let core = load(dir.path());
    // Reference: each value alone.
    let mut expected = Vec::new();
    for i in 0..16 {
        expected.push(core.infer(mlp_request(i as f32 / 16.0)).await.unwrap().outputs);
    }
    let before = core.model("mlp", None).unwrap().stats.execution_count.load(Ordering::Relaxed);
    let tasks: Vec<_> = (0..64)
        .map(|i| {
            let core = core.clone();
            tokio::spawn(async move { core.infer(mlp_request((i % 16) as f32 / 16.0)).await })
        })
        .collect();
    for (i, t) in tasks.into_iter().enumerate() {
        let out = t.await.unwrap().unwrap().outputs;
        assert_eq!(out, expected[i % 16], "request {i}");
    }
    let stats = &core.model("mlp", None).unwrap().stats;
    let executions = stats.execution_count.load(Ordering::Relaxed) - before;
    assert!(executions < 64, "{executions} executions for 64 requests");
    assert_eq!(stats.inference_count.load(Ordering::Relaxed), 16 + 64);
}

#[tokio::test]
async fn invalid_requests_are_refused_with_the_input_named() {
    let dir = repo(&[("mixed", Some("max_batch_size = 4\n")), ("fixed", None)]);
    let core = load(dir.path());
    let ids = |shape: Vec<usize>| {
        let n = shape.iter().product::<usize>();
        Tensor::from_le("ids", DataType::Int64, shape, &vec![1i64; n])
    };
    let values = |shape: Vec<usize>| {
        let n = shape.iter().product::<usize>();
        Tensor::from_le("values", DataType::Fp32, shape, &vec![1f32; n])
    };
    let req = |inputs: Vec<Tensor>| InferRequest { model_name: "mixed".into(), inputs, ..Default::default() };
    let mut wrong_size = values(vec![1, 4]);
    wrong_size.shape = vec![1, 3];
    let cases = vec![
        (req(vec![ids(vec![1, 4])]), "missing input 'values'"),
        (req(vec![ids(vec![1, 4]), values(vec![1, 4]), values(vec![1, 4])]), "'values' is given more than once"),
        (
            req(vec![ids(vec![1, 4]), Tensor::from_le("values", DataType::Fp64, vec![1, 4], &[1f64; 4])]),
            "expected datatype FP32",
        ),
        (req(vec![ids(vec![1, 4]), values(vec![4])]), "'values': expected shape [-1, 4]"),
        (req(vec![ids(vec![1, 4]), values(vec![1, 5])]), "'values': expected shape"),
        (req(vec![ids(vec![5, 4]), values(vec![5, 4])]), "batch size 5 is outside 1..=4"),
        (req(vec![ids(vec![1, 4]), values(vec![2, 4])]), "disagree on the batch size"),
        (req(vec![ids(vec![1, 4]), wrong_size]), "'values': expected shape"),
        (
            req(vec![ids(vec![1, 4]), values(vec![1, 4]), Tensor::from_le("extra", DataType::Fp32, vec![1], &[1f32])]),
            "unexpected input 'extra'",
        ),
        (
            InferRequest { outputs: Some(vec!["nope".into()]), ..req(vec![ids(vec![1, 4]), values(vec![1, 4])]) },
            "unknown output 'nope'",
        ),
        (InferRequest { priority: 7, ..req(vec![ids(vec![1, 4]), values(vec![1, 4])]) }, "priority 7"),
    ];
    for (r, needle) in cases {
        let err = core.infer(r).await.unwrap_err();
        assert!(matches!(err, Error::InvalidInput(_)), "{needle}: {err:?}");
        assert!(err.to_string().contains(needle), "{needle}: {err}");
    }
    // Bytes that do not match the shape.
    let mut short = values(vec![1, 4]);
    short.data = Tensor::from_le("values", DataType::Fp32, vec![3], &[1f32; 3]).data;
    let err = core.infer(req(vec![ids(vec![1, 4]), short])).await.unwrap_err();
    assert!(err.to_string().contains("needs 16 bytes, got 12"), "{err}");
    // A model without a batch dim takes its exact shape.
    let x = Tensor::from_le("x", DataType::Fp64, vec![2, 3], &[1f64, 2.0, 3.0, 4.0, 5.0, 6.0]);
    let out =
        core.infer(InferRequest { model_name: "fixed".into(), inputs: vec![x], ..Default::default() }).await.unwrap();
    assert_eq!(out.outputs[0], Tensor::from_le("y", DataType::Fp64, vec![2, 3], &[2f64, 4.0, 6.0, 8.0, 10.0, 12.0]));
    // Caps on elements apply before anything is queued.
    let small = Core::load(
        dir.path(),
        &LoadOptions { threads: 1, spinning: false, calibrate: false, cache: None, ..Default::default() },
        Limits { max_elements: 6, ..Default::default() },
    )
    .unwrap();
    let err = small.infer(req(vec![ids(vec![1, 4]), values(vec![1, 4])])).await.unwrap_err();
    assert!(err.to_string().contains("more than 6 elements"), "{err}");
}

#[tokio::test]
async fn requested_outputs_are_filtered_in_the_order_asked() {
    let dir = repo(&[("mixed", None)]);
    let core = load(dir.path());
    let r = InferRequest {
        model_name: "mixed".into(),
        inputs: vec![
            Tensor::from_le("ids", DataType::Int64, vec![1, 4], &[1i64, 2, 3, 4]),
            Tensor::from_le("values", DataType::Fp32, vec![1, 4], &[1f32; 4]),
        ],
        outputs: Some(vec!["ids_sum".into()]),
        id: Some("req-7".into()),
        ..Default::default()
    };
    let out = core.infer(r).await.unwrap();
    assert_eq!(out.id.as_deref(), Some("req-7"));
    assert_eq!(out.outputs, vec![Tensor::from_le("ids_sum", DataType::Int64, vec![1, 1], &[10i64])]);
}

#[tokio::test]
async fn a_request_times_out_in_the_queue_and_never_runs() {
    let dir = repo(&[("mlp", Some("[dynamic_batching]\nmax_queue_delay_microseconds = 10000000\n"))]);
    let core = load(dir.path());
    let started = Instant::now();
    let r = InferRequest { timeout_us: Some(50_000), ..mlp_request(0.5) };
    let err = core.infer(r).await.unwrap_err();
    assert!(matches!(err, Error::DeadlineExceeded(_)), "{err:?}");
    assert!(started.elapsed() < Duration::from_secs(5));
    let stats = &core.model("mlp", None).unwrap().stats;
    assert_eq!(stats.execution_count.load(Ordering::Relaxed), 0);
    assert_eq!(stats.fail.snapshot().count, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_left_is_dropped_before_it_runs() {
    let config = "max_batch_size = 4\n[dynamic_batching]\nmax_queue_delay_microseconds = 10000000\n";
    let dir = repo(&[("mlp", Some(config))]);
    let core = load(dir.path());
    let gone = {
        let core = core.clone();
        tokio::spawn(async move { core.infer(mlp_request(0.1)).await })
    };
    while core.model("mlp", None).unwrap().batcher().queued() == 0 {
        tokio::task::yield_now().await;
    }
    gone.abort();
    let _ = gone.await;
    // Four more rows fill a batch, which runs at once; the request that left is not in it.
    let tasks: Vec<_> = (0..4)
        .map(|_| {
            let core = core.clone();
            tokio::spawn(async move { core.infer(mlp_request(0.2)).await })
        })
        .collect();
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    let stats = &core.model("mlp", None).unwrap().stats;
    assert_eq!(stats.inference_count.load(Ordering::Relaxed), 4);
    assert_eq!(core.model("mlp", None).unwrap().batcher().cancelled(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_queue_refuses_with_retry_after() {
    let config =
        "max_batch_size = 4\n[dynamic_batching]\nmax_queue_delay_microseconds = 10000000\nmax_queue_size = 2\n";
    let dir = repo(&[("mlp", Some(config))]);
    let core = load(dir.path());
    let waiting: Vec<_> = (0..2)
        .map(|_| {
            let core = core.clone();
            tokio::spawn(async move { core.infer(mlp_request(0.3)).await })
        })
        .collect();
    while core.model("mlp", None).unwrap().batcher().queued() < 2 {
        tokio::task::yield_now().await;
    }
    let err = core.infer(mlp_request(0.3)).await.unwrap_err();
    assert!(matches!(err, Error::Unavailable { retry_after: Some(_), .. }), "{err:?}");
    // Shutdown flushes what waits instead of holding it for the queue delay.
    core.begin_shutdown();
    assert!(matches!(core.infer(mlp_request(0.3)).await, Err(Error::Unavailable { .. })));
    assert_eq!(tokio::task::spawn_blocking(move || core.drain(Duration::from_secs(10))).await.unwrap(), 0);
    for w in waiting {
        w.await.unwrap().unwrap();
    }
}

/// A made-up backend: `specs` its inputs and outputs alike, its instances made by the closure (the
/// instance types below are the faults and behaviours the tests need).
struct Fake<F>(Vec<TensorSpec>, F);

impl<F: Fn() -> Box<dyn Instance> + Send + Sync> Backend for Fake<F> {
    fn inputs(&self) -> &[TensorSpec] {
        &self.0
    }
    fn outputs(&self) -> &[TensorSpec] {
        &self.0
    }
    fn instance(&self) -> ferrite_core::Result<Box<dyn Instance>> {
        Ok((self.1)())
    }
}

/// Runs that block until the test lets them go: a fault (a stuck model) that cannot be caused on
/// demand with a real model.
struct StuckInstance(Arc<Mutex<mpsc::Receiver<()>>>, Arc<AtomicUsize>);

/// What lets a stuck model's runs go, and tells how many runs have reached the backend (a batch
/// counts as running a little before that, and a request whose client left by then is never run).
struct Gate {
    tx: mpsc::Sender<()>,
    entered: Arc<AtomicUsize>,
}

impl Gate {
    fn send(&self, release: ()) -> Result<(), mpsc::SendError<()>> {
        self.tx.send(release)
    }

    /// Waits until `n` runs in all have reached the backend.
    async fn entered(&self, n: usize) {
        while self.entered.load(Ordering::Acquire) < n {
            tokio::task::yield_now().await;
        }
    }
}

impl Instance for StuckInstance {
    fn run(&mut self, inputs: &[BatchInput<'_>]) -> ferrite_core::Result<Vec<Tensor>> {
        self.1.fetch_add(1, Ordering::AcqRel);
        let _ = self.0.lock().unwrap().recv_timeout(Duration::from_secs(30));
        let i = &inputs[0];
        let data = i.parts.iter().fold(Vec::new(), |mut acc, p| {
            if let ferrite_core::TensorData::Fixed(b) = p {
                acc.extend_from_slice(b);
            }
            acc
        });
        Ok(vec![Tensor::new("x", i.datatype, i.shape.clone(), ferrite_core::TensorData::Fixed(data.into()))])
    }
}

/// A core serving one stuck model (batch size 1), the gate that lets its runs go, and the model.
fn stuck_core(limits: Limits) -> (Core, Gate, Arc<Model>) {
    stuck_core_with(limits, "max_batch_size = 1")
}

fn stuck_core_with(limits: Limits, config: &str) -> (Core, Gate, Arc<Model>) {
    let (tx, rx) = mpsc::channel();
    let entered = Arc::new(AtomicUsize::new(0));
    let specs = vec![TensorSpec { name: "x".into(), datatype: DataType::Fp32, dims: vec![-1, 1] }];
    let (release, ran) = (Arc::new(Mutex::new(rx)), entered.clone());
    let backend =
        Fake(specs.clone(), move || -> Box<dyn Instance> { Box::new(StuckInstance(release.clone(), ran.clone())) });
    let config: ModelConfig = toml::from_str(config).unwrap();
    let spec = ModelSpec::resolve("stuck", 1, &config, &specs, &specs, 1).unwrap();
    let model = Arc::new(Model::start(spec, &backend, None).unwrap());
    let core = Core::from_models([("stuck".to_string(), model.clone())].into(), Default::default(), limits);
    (core, Gate { tx, entered }, model)
}

fn stuck_request() -> InferRequest {
    InferRequest {
        model_name: "stuck".into(),
        inputs: vec![Tensor::from_le("x", DataType::Fp32, vec![1, 1], &[1f32])],
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_fails_what_is_left_after_the_deadline() {
    let (core, tx, model) = stuck_core(Limits::default());
    let req = stuck_request;
    let tasks: Vec<_> = (0..3)
        .map(|_| {
            let core = core.clone();
            tokio::spawn(async move { core.infer(req()).await })
        })
        .collect();
    // One runs (stuck), two wait.
    while model.batcher().queued() < 2 || model.batcher().running() < 1 {
        tokio::task::yield_now().await;
    }
    core.begin_shutdown();
    let drain_core = core.clone();
    let failed = tokio::task::spawn_blocking(move || drain_core.drain(Duration::from_millis(100))).await.unwrap();
    assert_eq!(failed, 2);
    tx.send(()).unwrap();
    let results: Vec<_> = futures_join(tasks).await;
    assert_eq!(results.iter().filter(|r| r.is_ok()).count(), 1);
    for r in results.iter().filter(|r| r.is_err()) {
        assert!(matches!(r, Err(Error::Unavailable { .. })), "{r:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_the_concurrency_cap_is_refused_at_once_and_counted() {
    let (core, tx, model) = stuck_core(Limits { max_concurrent_requests: 1, ..Default::default() });
    let req = stuck_request;
    let first = {
        let core = core.clone();
        tokio::spawn(async move { core.infer(req()).await })
    };
    while model.batcher().running() < 1 {
        tokio::task::yield_now().await;
    }
    let err = core.infer(req()).await.unwrap_err();
    assert!(matches!(err, Error::Overloaded { retry_after: Some(_), .. }), "{err:?}");
    assert_eq!(model.stats.fail.snapshot().count, 1);
    tx.send(()).unwrap();
    first.await.unwrap().unwrap();
    // The place is given back: the next request is admitted.
    tx.send(()).unwrap();
    core.infer(req()).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_leaves_keeps_its_place_until_its_work_stops() {
    let (core, tx, model) = stuck_core(Limits { max_concurrent_requests: 1, ..Default::default() });
    let first = {
        let core = core.clone();
        tokio::spawn(async move { core.infer(stuck_request()).await })
    };
    // In the backend, not only counted as running: a client gone before the run starts is
    // dropped unrun, and its place given back at once.
    tx.entered(1).await;
    // The client leaves while its batch runs: the batch still holds the place, so a second
    // request is refused rather than run beside it.
    first.abort();
    let _ = first.await;
    let err = core.infer(stuck_request()).await.unwrap_err();
    assert!(matches!(err, Error::Overloaded { .. }), "{err:?}");
    // Once the abandoned work has stopped, the place is free.
    tx.send(()).unwrap();
    while model.batcher().running() > 0 {
        tokio::task::yield_now().await;
    }
    tx.send(()).unwrap();
    core.infer(stuck_request()).await.unwrap();
}

/// Starts `req` on its own task and returns once the model has it (queued or running).
async fn started(core: &Core, model: &Model, req: InferRequest) -> tokio::task::JoinHandle<ferrite_core::Result<()>> {
    let before = model.batcher().queued() + model.batcher().running();
    let core = core.clone();
    let task = tokio::spawn(async move { core.infer(req).await.map(|_| ()) });
    while model.batcher().queued() + model.batcher().running() == before {
        tokio::task::yield_now().await;
    }
    task
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deadline_that_cannot_be_met_is_refused_at_admission() {
    let (core, tx, model) = stuck_core(Limits::default());
    // One batch that takes 200 ms teaches the batcher how long a batch takes.
    let first = started(&core, &model, stuck_request()).await;
    std::thread::sleep(Duration::from_millis(200));
    tx.send(()).unwrap();
    first.await.unwrap().unwrap();
    while model.batcher().running() > 0 {
        tokio::task::yield_now().await;
    }
    // One running, one queued: about 400 ms of work before a new request's answer.
    let running = started(&core, &model, stuck_request()).await;
    let queued = started(&core, &model, stuck_request()).await;
    let t = Instant::now();
    let err = core.infer(InferRequest { timeout_us: Some(50_000), ..stuck_request() }).await.unwrap_err();
    assert!(t.elapsed() < Duration::from_millis(40), "refused at once, not after waiting");
    assert!(matches!(&err, Error::DeadlineExceeded(m) if m.contains("cannot be met")), "{err:?}");
    // A timeout that leaves room is admitted.
    let roomy = started(&core, &model, InferRequest { timeout_us: Some(30_000_000), ..stuck_request() }).await;
    for _ in 0..3 {
        tx.send(()).unwrap();
    }
    for t in [running, queued, roomy] {
        t.await.unwrap().unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_level_queue_policies_cap_and_delay() {
    let config = r#"
        max_batch_size = 1
        [dynamic_batching]
        priority_levels = 2
        [dynamic_batching.priority_queue_policy.2]
        max_queue_size = 1
        default_timeout_microseconds = 20000
        timeout_action = "delay"
    "#;
    let (core, tx, model) = stuck_core_with(Limits::default(), config);
    let at = |priority| InferRequest { priority, ..stuck_request() };
    let running = started(&core, &model, at(1)).await;
    let late = started(&core, &model, at(2)).await;
    // Level 2 holds one request; level 1 still takes more.
    let err = core.infer(at(2)).await.unwrap_err();
    assert!(matches!(err, Error::Unavailable { .. }), "{err:?}");
    let high = started(&core, &model, at(1)).await;
    // Past its 20 ms timeout, the level-2 request is delayed, not failed.
    tokio::time::sleep(Duration::from_millis(60)).await;
    for _ in 0..3 {
        tx.send(()).unwrap();
    }
    for t in [running, high, late] {
        t.await.unwrap().unwrap();
    }
    // A config naming a level that does not exist is refused.
    let bad =
        "max_batch_size = 1\n[dynamic_batching]\npriority_levels = 2\n[dynamic_batching.priority_queue_policy.3]\n";
    let specs = vec![TensorSpec { name: "x".into(), datatype: DataType::Fp32, dims: vec![-1, 1] }];
    let cfg: ModelConfig = toml::from_str(bad).unwrap();
    assert!(ModelSpec::resolve("m", 1, &cfg, &specs, &specs, 1).is_err());
}

async fn futures_join<T>(tasks: Vec<tokio::task::JoinHandle<T>>) -> Vec<T> {
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap());
    }
    out
}

/// A repository holding the `scale` test model at the given versions.
fn scale_repo(versions: &[u64]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for v in versions {
        let dst = dir.path().join("scale").join(v.to_string());
        std::fs::create_dir_all(&dst).unwrap();
        std::fs::copy(root().join(format!("tests/models/scale/{v}/model.onnx")), dst.join("model.onnx")).unwrap();
    }
    dir
}

#[test]
fn reloads_keep_what_did_not_change_and_what_failed_to_replace() {
    let dir = scale_repo(&[1, 2]);
    let p = dir.path().join("scale");
    std::fs::write(p.join("config.toml"), "[version_policy]\nall = true\n").unwrap();
    let core = load(dir.path());
    let v1 = core.model("scale", Some("1")).unwrap();
    let v2 = core.model("scale", Some("2")).unwrap();
    // Nothing changed: the same loads serve on.
    core.poll(Duration::ZERO);
    assert!(Arc::ptr_eq(&v1, &core.model("scale", Some("1")).unwrap()));
    // Version 2's file replaced: only version 2 is reloaded.
    std::fs::copy(root().join("tests/models/scale_variants/times5.onnx"), p.join("2/model.onnx.new")).unwrap();
    std::fs::rename(p.join("2/model.onnx.new"), p.join("2/model.onnx")).unwrap();
    core.poll(Duration::ZERO);
    assert!(Arc::ptr_eq(&v1, &core.model("scale", Some("1")).unwrap()));
    let v2b = core.model("scale", Some("2")).unwrap();
    assert!(!Arc::ptr_eq(&v2, &v2b));
    // A truncated file: refused, the previous load keeps serving, and the index says why.
    let bytes = std::fs::read(root().join("tests/models/scale/1/model.onnx")).unwrap();
    std::fs::write(p.join("2/model.onnx"), &bytes[..bytes.len() / 2]).unwrap();
    core.poll(Duration::ZERO);
    assert!(Arc::ptr_eq(&v2b, &core.model("scale", Some("2")).unwrap()));
    let row = core.index().into_iter().find(|r| r.version == Some(2)).unwrap();
    assert_eq!(row.state, ferrite_core::control::registry::State::Ready);
    assert!(row.reason.contains("reload failed"), "{row:?}");
    // The old load stays alive while someone holds it, though the registry moved on.
    std::fs::write(p.join("config.toml"), "[version_policy]\nspecific = [2]\n").unwrap();
    core.poll(Duration::ZERO);
    assert!(matches!(core.model("scale", Some("1")), Err(Error::NotFound(_))));
    assert_eq!(v1.spec.version, 1);
}

#[test]
fn a_symlink_out_of_the_repository_is_refused() {
    let outside = scale_repo(&[1]);
    let dir = repo(&[("mixed", None)]);
    std::os::unix::fs::symlink(outside.path().join("scale"), dir.path().join("scale")).unwrap();
    let core = load(dir.path());
    assert!(core.failed()["scale"].contains("outside the model repository"), "{:?}", core.failed());
    assert!(core.model("mixed", None).is_ok());
}

#[test]
fn calibration_measures_the_model_and_config_values_win() {
    runtime();
    let dir = repo(&[("mlp", None), ("fpn", None), ("mixed", Some("calibrate = false")), ("identity", Some("[onnxruntime]\nspinning = true\nintra_op_thread_count = 2\nexecution_mode = \"parallel\"\nenable_memory_arena_shrinkage = true\n"))]);
    let options = LoadOptions { threads: 2, spinning: false, calibrate: true, cache: None, ..Default::default() };
    let core = Core::load(dir.path(), &options, Limits::default()).unwrap();
    let mlp = core.model("mlp", None).unwrap();
    let chosen = mlp.spec.load.calibrated.clone().expect("the mlp was calibrated");
    assert!(chosen.contains("batch limit"), "{chosen}");
    assert!((1..=mlp.spec.batch.max_batch_size).contains(&mlp.spec.batch.merge_limit));
    // Fixed dims: the limit holds for every request.
    assert_eq!(mlp.spec.batch.merge_at, 0);
    // Variable H/W: calibrated at a size the graph takes, which its limit is scaled from.
    let fpn = core.model("fpn", None).unwrap();
    assert!(fpn.spec.load.calibrated.as_deref().is_some_and(|c| c.contains("at rows of")), "{:?}", fpn.spec.load);
    assert!([224, 128, 64].map(|side| side * side).contains(&fpn.spec.batch.merge_at), "{:?}", fpn.spec.batch);
    let at = fpn.spec.batch.merge_at.to_string();
    assert!(fpn.spec.parameters().contains(&("batch_merge_limit_row_elements".to_string(), at)));
    let mixed = core.model("mixed", None).unwrap();
    assert!(mixed.spec.load.calibrated.is_none());
    assert_eq!(mixed.spec.batch.merge_limit, mixed.spec.batch.max_batch_size);
    let identity = core.model("identity", None).unwrap();
    let o = &identity.spec.onnx;
    assert!(o.spinning && o.parallel && o.arena_shrinkage && o.intra_threads == 2, "{o:?}");
    assert!(identity.spec.parameters().contains(&("spinning".to_string(), "true".to_string())));
    // A bad setting refuses the model with the reason.
    let bad = repo(&[("mlp", Some("[onnxruntime]\ngraph_optimization_level = \"max\"\n"))]);
    let core = Core::load(bad.path(), &options, Limits::default()).unwrap();
    assert!(core.failed()["mlp"].contains("graph_optimization_level"), "{:?}", core.failed());
}

#[tokio::test]
async fn spinning_within_runs_is_asked_for_and_kept_from_short_runs() {
    runtime();
    // Asked for on the command line (a config's `spinning = false` keeps it out) and in a config.
    let dir = repo(&[
        ("mlp", None),
        ("fpn", Some("[onnxruntime]\nspinning = false\n")),
        ("identity", Some("[onnxruntime]\nspin_in_run = true\nintra_op_thread_count = 1\n")),
    ]);
    let options = LoadOptions { threads: 2, spin_in_run: true, ..Default::default() };
    let core = Core::load(dir.path(), &options, Limits::default()).unwrap();
    assert!(core.failed().is_empty(), "{:?}", core.failed());
    let spins = |name: &str| core.model(name, None).unwrap().spec.onnx.spin_in_run;
    // The MLP's one-row run takes microseconds, far under the 2 ms line; the identity has one
    // thread; the fpn's config said no spinning.
    assert!(!spins("mlp") && !spins("identity") && !spins("fpn"));
    let mlp = core.model("mlp", None).unwrap();
    assert!(mlp.spec.parameters().contains(&("spin_in_run".to_string(), "false".to_string())));
    let answer = core.infer(mlp_request(1.0)).await.unwrap();
    assert_eq!(answer.outputs.len(), 1);
}

#[tokio::test]
async fn a_variable_hw_model_whose_graph_refuses_1x1_loads_and_answers() {
    // The concat of upsampled feature maps needs even H and W: a synthetic 1x1 warm-up would fail.
    let dir = repo(&[("fpn", None)]);
    let core = load(dir.path());
    assert!(core.failed().is_empty(), "{:?}", core.failed());
    let x: Vec<f32> = (0..24).map(|i| i as f32).collect();
    let req = InferRequest {
        model_name: "fpn".into(),
        inputs: vec![Tensor::from_le("images", DataType::Fp32, vec![1, 1, 4, 6], &x)],
        ..Default::default()
    };
    let out = core.infer(req).await.unwrap();
    let maps = &out.outputs[0];
    assert_eq!(maps.shape, vec![1, 2, 4, 6]);
    let ferrite_core::TensorData::Fixed(b) = &maps.data else { panic!("fixed-size output") };
    let v: Vec<f32> = b.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
    assert_eq!(&v[..24], &x[..], "channel 0 is the input");
    // Channel 1: each 2x2 block's mean, repeated over the block.
    assert_eq!(v[24], (0.0 + 1.0 + 6.0 + 7.0) / 4.0);
    assert_eq!(v[24 + 7], (0.0 + 1.0 + 6.0 + 7.0) / 4.0);
    // An odd size is the model's own error, for that request only.
    let odd = Tensor::from_le("images", DataType::Fp32, vec![1, 1, 3, 3], &[0f32; 9]);
    let req = InferRequest { model_name: "fpn".into(), inputs: vec![odd], ..Default::default() };
    assert!(core.infer(req).await.is_err());
}

/// Fails any run holding a row of -1 (with every row's value in its error, as a careless backend
/// might), and panics on a row of -2; otherwise echoes.
struct PoisonableInstance;

/// The bytes of a batch input's parts, in order.
fn batch_bytes(i: &BatchInput<'_>) -> Vec<u8> {
    let mut data = Vec::new();
    for p in &i.parts {
        if let ferrite_core::TensorData::Fixed(b) = p {
            data.extend_from_slice(b);
        }
    }
    data
}

/// A model `name` of `backend` (one input and output "x", FP32 [-1, 1]) whose requests wait for
/// each other (up to 2 s) until `rows` rows are there, so they share one batch.
fn one_batch_of(
    name: &str,
    rows: usize,
    backend: impl FnOnce(Vec<TensorSpec>) -> Box<dyn Backend>,
) -> (Core, Arc<Model>) {
    let specs = vec![TensorSpec { name: "x".into(), datatype: DataType::Fp32, dims: vec![-1, 1] }];
    let config: ModelConfig = toml::from_str(&format!(
        "max_batch_size = 8\n[dynamic_batching]\nmax_queue_delay_microseconds = 2000000\npreferred_batch_size = [{rows}]\n"
    ))
    .unwrap();
    let spec = ModelSpec::resolve(name, 1, &config, &specs, &specs, 1).unwrap();
    let model = Arc::new(Model::start(spec, backend(specs).as_ref(), None).unwrap());
    let core = Core::from_models([(name.to_string(), model.clone())].into(), Default::default(), Limits::default());
    (core, model)
}

impl Instance for PoisonableInstance {
    fn run(&mut self, inputs: &[BatchInput<'_>]) -> ferrite_core::Result<Vec<Tensor>> {
        let i = &inputs[0];
        let data = batch_bytes(i);
        let values: Vec<f32> = data.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
        if values.contains(&-2.0) {
            panic!("a bug reached with {values:?}");
        }
        if values.contains(&-1.0) {
            return Err(Error::internal(format!("bad row among {values:?}")));
        }
        Ok(vec![Tensor::new("x", i.datatype, i.shape.clone(), ferrite_core::TensorData::Fixed(data.into()))])
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_row_or_a_panic_fails_only_its_own_request_in_a_shared_batch() {
    let (core, model) =
        one_batch_of("p", 8, |specs| Box::new(Fake(specs, || -> Box<dyn Instance> { Box::new(PoisonableInstance) })));
    let values = [10.0f32, 11.0, -1.0, 13.0, 14.0, -2.0, 16.0, 17.0];
    let tasks: Vec<_> = values
        .iter()
        .map(|&v| {
            let core = core.clone();
            tokio::spawn(async move {
                let req = InferRequest {
                    model_name: "p".into(),
                    inputs: vec![Tensor::from_le("x", DataType::Fp32, vec![1, 1], &[v])],
                    ..Default::default()
                };
                core.infer(req).await
            })
        })
        .collect();
    let results = futures_join(tasks).await;
    for (v, r) in values.iter().zip(&results) {
        match *v {
            -1.0 => {
                let e = r.as_ref().unwrap_err().to_string();
                // Its own run's error: no other request's value in it.
                assert!(e.contains("[-1.0]") && !e.contains("10.0"), "{e}");
            }
            -2.0 => assert!(r.as_ref().unwrap_err().to_string().contains("panicked"), "{r:?}"),
            v => assert_eq!(r.as_ref().unwrap().outputs[0], Tensor::from_le("x", DataType::Fp32, vec![1, 1], &[v])),
        }
    }
    // One batch of 8 first, then its halves and quarters apart.
    let s = model.stats.snapshot("p", 1);
    assert_eq!(s.batch_stats.iter().find(|b| b.batch_size == 8).map(|b| b.compute_infer.count), Some(1), "{s:?}");
    // Every run that held the panicking row panicked, and was counted: 8, 4, 2, then 1 row.
    assert!(core.metrics().contains("ferrite_backend_panics_total{model=\"p\",version=\"1\"} 4"));
}

/// Echoes every row, naming rows of -1 as failed on their own (as a pipeline's per-row steps do)
/// while the run succeeds for the others.
struct RowWiseInstance(Vec<(usize, Error)>);

impl Instance for RowWiseInstance {
    fn run(&mut self, inputs: &[BatchInput<'_>]) -> ferrite_core::Result<Vec<Tensor>> {
        let i = &inputs[0];
        let data = batch_bytes(i);
        let values = data.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap()));
        self.0 =
            values.enumerate().filter(|(_, v)| *v == -1.0).map(|(r, _)| (r, Error::invalid("a bad row"))).collect();
        Ok(vec![Tensor::new("x", i.datatype, i.shape.clone(), ferrite_core::TensorData::Fixed(data.into()))])
    }
    fn failed_rows(&mut self) -> Vec<(usize, Error)> {
        std::mem::take(&mut self.0)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_that_fail_on_their_own_fail_their_requests_and_the_others_are_answered_from_the_same_run() {
    let (core, model) = one_batch_of("r", 6, |specs| {
        Box::new(Fake(specs, || -> Box<dyn Instance> { Box::new(RowWiseInstance(Vec::new())) }))
    });
    // Five requests, six rows: the fourth request's second row fails.
    let requests: Vec<Vec<f32>> = vec![vec![10.0], vec![-1.0], vec![12.0], vec![13.0, -1.0], vec![15.0]];
    let tasks: Vec<_> = requests
        .iter()
        .map(|rows| {
            let (core, rows) = (core.clone(), rows.clone());
            tokio::spawn(async move {
                let x = Tensor::from_le("x", DataType::Fp32, vec![rows.len(), 1], &rows);
                core.infer(InferRequest { model_name: "r".into(), inputs: vec![x], ..Default::default() }).await
            })
        })
        .collect();
    let results = futures_join(tasks).await;
    for (rows, r) in requests.iter().zip(&results) {
        match rows.iter().position(|&v| v == -1.0) {
            Some(0) if rows.len() == 1 => assert!(r.as_ref().unwrap_err().to_string().contains("a bad row"), "{r:?}"),
            Some(k) => assert!(r.as_ref().unwrap_err().to_string().contains(&format!("row {k}: a bad row")), "{r:?}"),
            None => {
                let x = Tensor::from_le("x", DataType::Fp32, vec![1, 1], rows);
                assert_eq!(r.as_ref().unwrap().outputs[0], x);
            }
        }
    }
    // One run answered them all: nothing was run again.
    let s = model.stats.snapshot("r", 1);
    assert_eq!(s.execution_count, 1, "{s:?}");
}

/// Echoes after 5 ms, recording which kind of instance ran and whether a solo run ever overlapped
/// another run.
#[derive(Clone, Default)]
struct Turns {
    active: Arc<std::sync::atomic::AtomicUsize>,
    solo_active: Arc<std::sync::atomic::AtomicBool>,
    overlapped: Arc<std::sync::atomic::AtomicBool>,
    solo_runs: Arc<std::sync::atomic::AtomicUsize>,
    narrow_runs: Arc<std::sync::atomic::AtomicUsize>,
}
struct TurnsInstance(Turns, bool);

impl Instance for TurnsInstance {
    fn run(&mut self, inputs: &[BatchInput<'_>]) -> ferrite_core::Result<Vec<Tensor>> {
        use std::sync::atomic::Ordering::SeqCst;
        let t = &self.0;
        let before = t.active.fetch_add(1, SeqCst);
        if self.1 {
            t.solo_active.store(true, SeqCst);
        }
        if (self.1 && before > 0) || (!self.1 && t.solo_active.load(SeqCst)) {
            t.overlapped.store(true, SeqCst);
        }
        std::thread::sleep(Duration::from_millis(5));
        if self.1 {
            t.solo_active.store(false, SeqCst);
            t.solo_runs.fetch_add(1, SeqCst);
        } else {
            t.narrow_runs.fetch_add(1, SeqCst);
        }
        t.active.fetch_sub(1, SeqCst);
        let i = &inputs[0];
        let ferrite_core::TensorData::Fixed(b) = i.parts[0] else { unreachable!() };
        Ok(vec![Tensor::new("x", i.datatype, i.shape.clone(), ferrite_core::TensorData::Fixed(b.clone()))])
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_solo_instance_takes_lone_work_and_never_runs_beside_the_others() {
    use std::sync::atomic::Ordering::SeqCst;
    let specs = vec![TensorSpec { name: "x".into(), datatype: DataType::Fp32, dims: vec![-1, 1] }];
    let config: ModelConfig = toml::from_str("max_batch_size = 1\ninstance_count = 2\n").unwrap();
    let spec = ModelSpec::resolve("t", 1, &config, &specs, &specs, 1).unwrap();
    let turns = Turns::default();
    let solo: Box<dyn Instance> = Box::new(TurnsInstance(turns.clone(), true));
    let narrow = turns.clone();
    let backend = Fake(specs, move || -> Box<dyn Instance> { Box::new(TurnsInstance(narrow.clone(), false)) });
    let model = Arc::new(Model::start(spec, &backend, Some(solo)).unwrap());
    let core = Core::from_models([("t".to_string(), model)].into(), Default::default(), Limits::default());
    let one = |core: Core, v: f32| async move {
        let req = InferRequest {
            model_name: "t".into(),
            inputs: vec![Tensor::from_le("x", DataType::Fp32, vec![1, 1], &[v])],
            ..Default::default()
        };
        let out = core.infer(req).await.unwrap();
        assert_eq!(out.outputs[0], Tensor::from_le("x", DataType::Fp32, vec![1, 1], &[v]));
    };
    // One client at a time: every request runs on the solo instance.
    for i in 0..10 {
        one(core.clone(), i as f32).await;
    }
    assert_eq!((turns.solo_runs.load(SeqCst), turns.narrow_runs.load(SeqCst)), (10, 0));
    // Many at once: the single-threaded instances take the load, never beside the solo one.
    let tasks: Vec<_> = (0..40).map(|i| tokio::spawn(one(core.clone(), i as f32))).collect();
    futures_join(tasks).await;
    assert!(turns.narrow_runs.load(SeqCst) >= 20, "narrow runs: {}", turns.narrow_runs.load(SeqCst));
    assert_eq!(turns.solo_runs.load(SeqCst) + turns.narrow_runs.load(SeqCst), 50);
    assert!(!turns.overlapped.load(SeqCst), "the solo instance ran beside another");
}

/// Sleeps as many milliseconds as its first input value says, then echoes it: a slow and a fast
/// request on two instances finish in the opposite order of their arrival.
struct SleepyInstance;

impl Instance for SleepyInstance {
    fn run(&mut self, inputs: &[BatchInput<'_>]) -> ferrite_core::Result<Vec<Tensor>> {
        let ferrite_core::TensorData::Fixed(b) = inputs[0].parts[0] else { unreachable!() };
        let ms = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        std::thread::sleep(Duration::from_millis(ms as u64));
        Ok(vec![Tensor::new("x", DataType::Fp32, inputs[0].shape.clone(), inputs[0].parts[0].clone())])
    }
}

/// Instances that hold "memory" after each run and ask to give it back 300 ms later: counts the
/// runs and give-backs, and whether one came before it was due.
#[derive(Default)]
struct Holding {
    runs: std::sync::atomic::AtomicUsize,
    gave_back: std::sync::atomic::AtomicUsize,
    early: std::sync::atomic::AtomicBool,
}
struct HolderInstance(Arc<Holding>, Option<Instant>);

impl Instance for HolderInstance {
    fn run(&mut self, inputs: &[BatchInput<'_>]) -> ferrite_core::Result<Vec<Tensor>> {
        self.0.runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        self.1 = Some(Instant::now() + Duration::from_millis(300));
        Ok(vec![Tensor::new("x", DataType::Fp32, inputs[0].shape.clone(), inputs[0].parts[0].clone())])
    }
    fn give_back_due(&self) -> Option<Instant> {
        self.1
    }
    fn give_back(&mut self) {
        if self.1.is_none_or(|at| Instant::now() < at) {
            self.0.early.store(true, std::sync::atomic::Ordering::SeqCst);
        }
        self.1 = None;
        self.0.gave_back.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_instance_gives_back_what_it_holds_when_due_and_serves_after() {
    use std::sync::atomic::Ordering::SeqCst;
    let specs = vec![TensorSpec { name: "x".into(), datatype: DataType::Fp32, dims: vec![-1, 1] }];
    let config: ModelConfig = toml::from_str("max_batch_size = 8\ninstance_count = 1\n[dynamic_batching]").unwrap();
    let spec = ModelSpec::resolve("holder", 1, &config, &specs, &specs, 1).unwrap();
    let holding = Arc::new(Holding::default());
    let model = Arc::new(
        Model::start(
            spec,
            &Fake(specs, {
                let holding = holding.clone();
                move || -> Box<dyn Instance> { Box::new(HolderInstance(holding.clone(), None)) }
            }),
            None,
        )
        .unwrap(),
    );
    let core =
        Arc::new(Core::from_models([("holder".to_string(), model)].into(), Default::default(), Limits::default()));
    let one = |v: f32| {
        let core = core.clone();
        async move {
            let r = InferRequest {
                model_name: "holder".into(),
                inputs: vec![Tensor::from_le("x", DataType::Fp32, vec![1, 1], &[v])],
                ..Default::default()
            };
            core.infer(r).await.unwrap().outputs[0].clone()
        }
    };
    for round in 1..=3 {
        // Traffic closer together than the 300 ms: nothing is given back while it lasts.
        for i in 0..5 {
            assert_eq!(one(i as f32).await, Tensor::from_le("x", DataType::Fp32, vec![1, 1], &[i as f32]));
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(holding.gave_back.load(SeqCst), round - 1, "given back while in use");
        // Idle: given back once, when due, with no request to wake the worker.
        let deadline = Instant::now() + Duration::from_secs(10);
        while holding.gave_back.load(SeqCst) < round && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(holding.gave_back.load(SeqCst), round, "round {round}");
    }
    assert_eq!(holding.runs.load(SeqCst), 15);
    assert!(!holding.early.load(SeqCst), "given back before it was due");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn preserve_ordering_answers_in_the_order_requests_left_the_queue() {
    for preserve in [false, true] {
        let specs = vec![TensorSpec { name: "x".into(), datatype: DataType::Fp32, dims: vec![-1, 1] }];
        let config: ModelConfig = toml::from_str(&format!(
            "max_batch_size = 1\ninstance_count = 2\n[dynamic_batching]\nmax_queue_delay_microseconds = 0\npreserve_ordering = {preserve}"
        ))
        .unwrap();
        let spec = ModelSpec::resolve("sleepy", 1, &config, &specs, &specs, 1).unwrap();
        let model = Arc::new(
            Model::start(spec, &Fake(specs, || -> Box<dyn Instance> { Box::new(SleepyInstance) }), None).unwrap(),
        );
        let core = Arc::new(Core::from_models(
            [("sleepy".to_string(), model.clone())].into(),
            Default::default(),
            Limits::default(),
        ));
        let request = |ms: f32| InferRequest {
            model_name: "sleepy".into(),
            inputs: vec![Tensor::from_le("x", DataType::Fp32, vec![1, 1], &[ms])],
            ..Default::default()
        };
        // A slow request (1 s) runs on one instance; then a fast one arrives and runs on the other.
        let slow = tokio::spawn({
            let core = core.clone();
            async move { core.infer(request(1000.0)).await.unwrap() }
        });
        let deadline = Instant::now() + Duration::from_secs(10);
        while model.batcher().running() == 0 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let started = Instant::now();
        core.infer(request(0.0)).await.unwrap();
        let fast = started.elapsed();
        slow.await.unwrap();
        if preserve {
            assert!(fast >= Duration::from_millis(700), "the fast answer waited for the slow one: {fast:?}");
        } else {
            assert!(fast < Duration::from_millis(500), "the fast answer did not wait: {fast:?}");
        }
    }
}

#[tokio::test]
async fn a_shape_the_reshape_cannot_take_is_refused_before_it_joins_a_batch() {
    // Clients send ids with any number of elements per row; the model takes 4.
    let dir = repo(&[("mixed", Some("[[input]]\nname = \"ids\"\ndims = [-1]\nreshape = [4]\n"))]);
    let core = load(dir.path());
    let req = |n: usize| InferRequest {
        model_name: "mixed".into(),
        inputs: vec![
            Tensor::from_le("ids", DataType::Int64, vec![1, n], &vec![1i64; n]),
            Tensor::from_le("values", DataType::Fp32, vec![1, 4], &[1f32; 4]),
        ],
        ..Default::default()
    };
    let err = core.infer(req(3)).await.unwrap_err();
    assert!(matches!(err, Error::InvalidInput(_)) && err.to_string().contains("input 'ids'"), "{err}");
    assert!(err.to_string().contains("cannot be reshaped to [4]"), "{err}");
    let model = core.model("mixed", None).unwrap();
    assert_eq!(model.stats.snapshot("mixed", 1).execution_count, 0, "refused before any run");
    let ok = core.infer(req(4)).await.unwrap();
    assert_eq!(ok.outputs[1].shape, vec![1, 1]);
}
