//! Per-request round trip through the core (queue, batcher thread, backend, reply) for one
//! sequential caller, against the backend's run alone: the cost of the hand-off.
//!
//! Usage: cargo run --release -p ferrite-core --example roundtrip -- MODEL_DIR

use std::time::Instant;

use ferrite_core::{
    control::repository::load_with,
    engine::backend::{Backend, BatchInput},
    engine::onnx::{OnnxBackend, OnnxOptions},
    Core, DataType, InferRequest, Limits, LoadOptions, Tensor,
};

fn main() {
    ferrite_core::engine::onnx::init_runtime(None).expect("ONNX Runtime");
    let dir = std::path::PathBuf::from(std::env::args().nth(1).expect("usage: roundtrip MODEL_DIR"));
    let name = dir.file_name().unwrap().to_str().unwrap().to_string();
    let options = LoadOptions { threads: 1, spinning: false, calibrate: false, cache: None, ..Default::default() };
    let model = load_with(&dir, &name, &options, &Default::default(), None).unwrap();
    let spec = model.spec.clone();
    let core =
        Core::from_models([(name.clone(), std::sync::Arc::new(model))].into(), Default::default(), Limits::default());
    let input = &spec.inputs[0];
    assert_eq!(input.datatype, DataType::Fp64, "feeds one FP64 input");
    let shape: Vec<usize> = input.dims.iter().map(|&d| d.max(1) as usize).collect();
    let n: usize = shape.iter().product();
    let x = Tensor::from_le(&input.name, DataType::Fp64, shape.clone(), &vec![1.0f64; n]);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let req = || InferRequest { model_name: name.clone(), inputs: vec![x.clone()], ..Default::default() };
    let iters = 20_000;
    for _ in 0..1000 {
        rt.block_on(core.infer(req())).unwrap();
    }
    let t = Instant::now();
    for _ in 0..iters {
        rt.block_on(core.infer(req())).unwrap();
    }
    let core_us = t.elapsed().as_secs_f64() * 1e6 / iters as f64;

    let onnx = dir.join(spec.version.to_string()).join("model.onnx");
    let backend = OnnxBackend::load(&onnx, OnnxOptions { intra_threads: 1, ..Default::default() }).unwrap();
    let mut instance = backend.instance().unwrap();
    let batch = [BatchInput { name: &input.name, datatype: DataType::Fp64, shape, parts: vec![&x.data] }];
    let t = Instant::now();
    for _ in 0..iters {
        instance.run(&batch).unwrap();
    }
    let run_us = t.elapsed().as_secs_f64() * 1e6 / iters as f64;
    println!(
        "core round trip: {core_us:.1} us; backend run alone: {run_us:.1} us; hand-off: {:.1} us",
        core_us - run_us
    );
}
