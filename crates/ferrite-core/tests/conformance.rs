//! Backend conformance suite: every backend adapter must pass these cases through the `Backend`
//! trait alone. The ONNX Runtime adapter runs them below; the next backend adds one line.

use std::path::{Path, PathBuf};

use bytes::Bytes;
use ferrite_core::{
    engine::backend::{Backend, BatchInput},
    engine::onnx::{OnnxBackend, OnnxOptions},
    engine::spec::TensorSpec,
    DataType, Error, Tensor, TensorData,
};

fn repo(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").join(rel)
}

type Loader = fn(&Path) -> Box<dyn Backend>;

fn run(backend: &dyn Backend, inputs: &[(&str, DataType, Vec<usize>, Vec<&TensorData>)]) -> Result<Vec<Tensor>, Error> {
    let batch: Vec<BatchInput<'_>> = inputs
        .iter()
        .map(|(name, datatype, shape, parts)| BatchInput {
            name,
            datatype: *datatype,
            shape: shape.clone(),
            parts: parts.clone(),
        })
        .collect();
    backend.instance()?.run(&batch)
}

/// Six sample values of each datatype, as a [2, 3] tensor.
fn sample(dt: DataType) -> TensorData {
    let t = match dt {
        DataType::Bool => Tensor::from_le("", dt, vec![6], &[true, false, true, true, false, false]),
        DataType::Uint8 => Tensor::from_le("", dt, vec![6], &[0u8, 1, 2, 127, 128, 255]),
        DataType::Uint16 => Tensor::from_le("", dt, vec![6], &[0u16, 1, 2, 3, 4, u16::MAX]),
        DataType::Uint32 => Tensor::from_le("", dt, vec![6], &[0u32, 1, 2, 3, 4, u32::MAX]),
        DataType::Uint64 => Tensor::from_le("", dt, vec![6], &[0u64, 1, 2, 3, 4, u64::MAX]),
        DataType::Int8 => Tensor::from_le("", dt, vec![6], &[i8::MIN, -1, 0, 1, 2, i8::MAX]),
        DataType::Int16 => Tensor::from_le("", dt, vec![6], &[i16::MIN, -1, 0, 1, 2, i16::MAX]),
        DataType::Int32 => Tensor::from_le("", dt, vec![6], &[i32::MIN, -1, 0, 1, 2, i32::MAX]),
        DataType::Int64 => Tensor::from_le("", dt, vec![6], &[i64::MIN, -1, 0, 1, 2, i64::MAX]),
        DataType::Fp16 => {
            Tensor::from_le("", dt, vec![6], &[-1.5f32, 0.0, 1.0, 2.5, 65504.0, f32::NAN].map(half::f16::from_f32))
        }
        DataType::Bf16 => {
            Tensor::from_le("", dt, vec![6], &[-1.5f32, 0.0, 1.0, 2.5, 1e30, f32::INFINITY].map(half::bf16::from_f32))
        }
        DataType::Fp32 => Tensor::from_le("", dt, vec![6], &[-1.5f32, 0.0, 1.0, f32::MAX, f32::NAN, f32::NEG_INFINITY]),
        DataType::Fp64 => Tensor::from_le("", dt, vec![6], &[-1.5f64, 0.0, 1.0, f64::MAX, 1e-300, f64::INFINITY]),
        DataType::Bytes => {
            let words = ["", "a", "bc", "déjà", "ferrite", "x y"];
            return TensorData::Strings(words.iter().map(|w| Bytes::copy_from_slice(w.as_bytes())).collect());
        }
    };
    t.data
}

fn declares_its_signature(load: Loader) {
    let b = load(&repo("models/mixed/1/model.onnx"));
    assert_eq!(
        b.inputs(),
        &[
            TensorSpec { name: "ids".into(), datatype: DataType::Int64, dims: vec![-1, 4] },
            TensorSpec { name: "values".into(), datatype: DataType::Fp32, dims: vec![-1, 4] },
        ]
    );
    assert_eq!(b.outputs().iter().map(|o| o.name.as_str()).collect::<Vec<_>>(), ["weighted", "ids_sum"]);
}

fn every_datatype_round_trips(load: Loader) {
    let b = load(&repo("tests/models/identity/1/model.onnx"));
    let data: Vec<TensorData> = DataType::ALL.iter().map(|&dt| sample(dt)).collect();
    let names: Vec<String> = DataType::ALL.iter().map(|dt| format!("{}_in", dt.as_str().to_lowercase())).collect();
    let inputs: Vec<_> =
        DataType::ALL.iter().enumerate().map(|(i, &dt)| (names[i].as_str(), dt, vec![2, 3], vec![&data[i]])).collect();
    let out = run(b.as_ref(), &inputs).unwrap();
    assert_eq!(out.len(), DataType::ALL.len());
    for (i, dt) in DataType::ALL.iter().enumerate() {
        assert_eq!(out[i].name, format!("{}_out", dt.as_str().to_lowercase()));
        assert_eq!(out[i].datatype, *dt);
        assert_eq!(out[i].shape, vec![2, 3]);
        assert_eq!(out[i].data, data[i], "{dt}");
    }
}

/// Every datatype gathered from two requests, and one request whose bytes are not aligned for
/// their type (a binary tensor after a JSON header of any length): both answer as one whole.
fn every_datatype_gathered_or_unaligned_round_trips(load: Loader) {
    let b = load(&repo("tests/models/identity/1/model.onnx"));
    let whole: Vec<TensorData> = DataType::ALL.iter().map(|&dt| sample(dt)).collect();
    let rows = |i: usize, start| Tensor::new("", DataType::ALL[i], vec![2, 3], whole[i].clone()).rows(start, 1).data;
    let (first, second): (Vec<_>, Vec<_>) = (0..whole.len()).map(|i| (rows(i, 0), rows(i, 1))).unzip();
    let unaligned: Vec<TensorData> = whole
        .iter()
        .map(|d| match d {
            TensorData::Fixed(b) => TensorData::Fixed(Bytes::from([&[0u8][..], b].concat()).slice(1..)),
            strings => strings.clone(),
        })
        .collect();
    let names: Vec<String> = DataType::ALL.iter().map(|dt| format!("{}_in", dt.as_str().to_lowercase())).collect();
    let gathered: Vec<_> = (0..whole.len())
        .map(|i| (names[i].as_str(), DataType::ALL[i], vec![2, 3], vec![&first[i], &second[i]]))
        .collect();
    let alone: Vec<_> =
        (0..whole.len()).map(|i| (names[i].as_str(), DataType::ALL[i], vec![2, 3], vec![&unaligned[i]])).collect();
    for inputs in [gathered, alone] {
        let out = run(b.as_ref(), &inputs).unwrap();
        for (i, dt) in DataType::ALL.iter().enumerate() {
            assert_eq!(out[i].data, whole[i], "{dt}");
        }
    }
}

fn parts_are_concatenated_along_dim0(load: Loader) {
    let b = load(&repo("models/mixed/1/model.onnx"));
    let ids_a = Tensor::from_le("ids", DataType::Int64, vec![1, 4], &[1i64, 2, 3, 4]).data;
    let ids_b = Tensor::from_le("ids", DataType::Int64, vec![2, 4], &[0i64, 0, 0, 1, 5, 5, 5, 5]).data;
    let v_a = Tensor::from_le("values", DataType::Fp32, vec![1, 4], &[1f32, 1.0, 1.0, 0.5]).data;
    let v_b = Tensor::from_le("values", DataType::Fp32, vec![2, 4], &[9f32, 9.0, 9.0, 2.0, 0.5, 0.5, 0.5, 0.5]).data;
    let out = run(
        b.as_ref(),
        &[
            ("ids", DataType::Int64, vec![3, 4], vec![&ids_a, &ids_b]),
            ("values", DataType::Fp32, vec![3, 4], vec![&v_a, &v_b]),
        ],
    )
    .unwrap();
    assert_eq!(
        out[0],
        Tensor::from_le(
            "weighted",
            DataType::Fp32,
            vec![3, 4],
            &[1f32, 2.0, 3.0, 2.0, 0.0, 0.0, 0.0, 2.0, 2.5, 2.5, 2.5, 2.5]
        )
    );
    assert_eq!(out[1], Tensor::from_le("ids_sum", DataType::Int64, vec![3, 1], &[10i64, 1, 20]));
}

fn instances_are_independent(load: Loader) {
    let b = load(&repo("models/mlp/1/model.onnx"));
    let x = Tensor::from_le("input", DataType::Fp32, vec![1, 512], &[0.25f32; 512]).data;
    let mut first = b.instance().unwrap();
    let mut second = b.instance().unwrap();
    let input = || [BatchInput { name: "input", datatype: DataType::Fp32, shape: vec![1, 512], parts: vec![&x] }];
    let a = first.run(&input()).unwrap();
    let c = second.run(&input()).unwrap();
    assert_eq!(a, c);
    assert_eq!(a[0].shape, vec![1, 10]);
}

fn bad_bytes_are_refused_not_panicked(load: Loader) {
    let b = load(&repo("tests/models/identity/1/model.onnx"));
    let data: Vec<TensorData> = DataType::ALL.iter().map(|&dt| sample(dt)).collect();
    let mut bad = data.clone();
    let i = DataType::ALL.iter().position(|&d| d == DataType::Bytes).unwrap();
    bad[i] = TensorData::Strings(vec![Bytes::from_static(&[0xff, 0xfe]); 6]);
    let names: Vec<String> = DataType::ALL.iter().map(|dt| format!("{}_in", dt.as_str().to_lowercase())).collect();
    let inputs: Vec<_> =
        DataType::ALL.iter().enumerate().map(|(i, &dt)| (names[i].as_str(), dt, vec![2, 3], vec![&bad[i]])).collect();
    assert!(matches!(run(b.as_ref(), &inputs), Err(Error::InvalidInput(_))));
}

fn suite(load: Loader) {
    declares_its_signature(load);
    every_datatype_round_trips(load);
    every_datatype_gathered_or_unaligned_round_trips(load);
    parts_are_concatenated_along_dim0(load);
    instances_are_independent(load);
    bad_bytes_are_refused_not_panicked(load);
}

#[test]
fn onnxruntime_backend_conforms() {
    ferrite_core::engine::onnx::init_runtime(None).expect("ONNX Runtime");
    suite(|path| Box::new(OnnxBackend::load(path, OnnxOptions { intra_threads: 1, ..Default::default() }).unwrap()));
}

#[test]
fn onnxruntime_backend_spinning_within_runs_conforms() {
    ferrite_core::engine::onnx::init_runtime(None).expect("ONNX Runtime");
    suite(|path| {
        let options = OnnxOptions { intra_threads: 2, spin_in_run: true, ..Default::default() };
        Box::new(OnnxBackend::load(path, options).unwrap())
    });
}

#[test]
fn only_a_one_thread_session_in_order_runs_on_its_callers_thread() {
    ferrite_core::engine::onnx::init_runtime(None).expect("ONNX Runtime");
    let path = repo("models/mlp/1/model.onnx");
    let on_caller =
        |options: OnnxOptions| OnnxBackend::load(&path, options).unwrap().instance().unwrap().runs_on_caller();
    assert!(on_caller(OnnxOptions { intra_threads: 1, ..Default::default() }));
    assert!(!on_caller(OnnxOptions { intra_threads: 2, ..Default::default() }));
    assert!(!on_caller(OnnxOptions { intra_threads: 1, parallel: true, inter_threads: 2, ..Default::default() }));
}

#[test]
fn onnxruntime_refuses_a_file_that_is_not_onnx() {
    ferrite_core::engine::onnx::init_runtime(None).expect("ONNX Runtime");
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.onnx");
    std::fs::write(&path, b"not a model").unwrap();
    let err = OnnxBackend::load(&path, OnnxOptions { intra_threads: 1, ..Default::default() }).err().unwrap();
    assert!(err.to_string().contains("cannot load"), "{err}");
}

#[test]
fn onnxruntime_backend_with_shared_weights_conforms() {
    ferrite_core::engine::onnx::init_runtime(None).expect("ONNX Runtime");
    suite(|path| {
        let b = OnnxBackend::load(path, OnnxOptions { intra_threads: 1, ..Default::default() }).unwrap();
        Box::new(b.sharing_weights().unwrap_or(b))
    });
}

#[test]
fn shared_weights_give_the_answers_of_a_session_of_its_own() {
    ferrite_core::engine::onnx::init_runtime(None).expect("ONNX Runtime");
    let path = repo("models/mlp/1/model.onnx");
    let own = OnnxBackend::load(&path, OnnxOptions { intra_threads: 1, ..Default::default() }).unwrap();
    let shared = own.sharing_weights().expect("an MLP's Gemm weights are shared");
    assert!(shared.sharing_weights().is_none(), "shared once");
    let off = OnnxOptions { intra_threads: 1, share_weights: false, ..Default::default() };
    assert!(OnnxBackend::load(&path, off).unwrap().sharing_weights().is_none(), "share_weights = false");
    let spec = &own.inputs()[0];
    let width = spec.dims[1] as usize;
    let values: Vec<f32> = (0..3 * width).map(|i| ((i % 17) as f32 - 8.0) / 8.0).collect();
    let data = Tensor::from_le("", DataType::Fp32, vec![3, width], &values).data;
    let input = [(spec.name.as_str(), DataType::Fp32, vec![3, width], vec![&data])];
    let expected = run(&own, &input).unwrap();
    // Several sessions on the shared weights, the first and later ones, answer alike.
    for _ in 0..3 {
        assert_eq!(run(&shared, &input).unwrap(), expected);
    }
}

#[test]
fn an_arena_given_back_after_a_burst_answers_alike_and_can_give_back_again() {
    ferrite_core::engine::onnx::init_runtime(None).expect("ONNX Runtime");
    // An MLP (a batch of many rows) and a conv net at a large size (any H/W).
    for (model, small, big) in [
        ("models/mlp/1/model.onnx", vec![1, 512], vec![64, 512]),
        ("tests/models/fpn/1/model.onnx", vec![1, 1, 16, 16], vec![2, 1, 256, 256]),
    ] {
        let backend = OnnxBackend::load(&repo(model), OnnxOptions { intra_threads: 1, ..Default::default() }).unwrap();
        let name = backend.inputs()[0].name.clone();
        let data = |shape: &[usize]| {
            let n: usize = shape.iter().product();
            let values: Vec<f32> = (0..n).map(|i| ((i % 17) as f32 - 8.0) / 8.0).collect();
            Tensor::from_le("", DataType::Fp32, shape.to_vec(), &values).data
        };
        let (small_data, big_data) = (data(&small), data(&big));
        let input = |shape: &[usize], d| {
            vec![BatchInput { name: &name, datatype: DataType::Fp32, shape: shape.to_vec(), parts: vec![d] }]
        };
        let mut instance = backend.instance().unwrap();
        let expected = instance.run(&input(&small, &small_data)).unwrap();
        assert_eq!(instance.give_back_due(), None, "{model}: nothing grown yet");
        // A batch larger than usual: given back right after it, by a run of the sample.
        instance.shrink_after_next();
        let big_answer = instance.run(&input(&big, &big_data)).unwrap();
        assert!(instance.give_back_due().is_some_and(|at| at <= std::time::Instant::now()), "{model}");
        instance.give_back();
        assert_eq!(instance.give_back_due(), None, "{model}: given back");
        assert_eq!(instance.run(&input(&small, &small_data)).unwrap(), expected, "{model}: after giving back");
        assert_eq!(instance.run(&input(&big, &big_data)).unwrap(), big_answer, "{model}");
        // The sample still runs: the next burst is due back a while after its last run.
        assert!(instance.give_back_due().is_some_and(|at| at > std::time::Instant::now()), "{model}: sample lost");
        instance.give_back();
        assert_eq!(instance.run(&input(&small, &small_data)).unwrap(), expected, "{model}");
    }
}
