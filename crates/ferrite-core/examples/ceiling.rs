//! The engine alone, in-process, with no server: rows per second at each batch size, on one
//! instance using every core. `bench/run.sh` reports the best as the ceiling a server can reach.
//!
//! Usage: cargo run --release -p ferrite-core --example ceiling -- MODEL.onnx [SECONDS_PER_SIZE]

use std::time::{Duration, Instant};

use ferrite_core::{
    engine::backend::{Backend, BatchInput},
    engine::onnx::{OnnxBackend, OnnxOptions},
    DataType, Tensor,
};

fn main() {
    ferrite_core::engine::onnx::init_runtime(None).expect("ONNX Runtime");
    let mut args = std::env::args().skip(1);
    let path = args.next().expect("usage: ceiling MODEL.onnx [SECONDS_PER_SIZE]");
    let secs: f64 = args.next().map_or(3.0, |s| s.parse().expect("seconds"));
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let backend =
        OnnxBackend::load(path.as_ref(), OnnxOptions { intra_threads: threads, ..Default::default() }).unwrap();
    let input = &backend.inputs()[0];
    assert_eq!(input.datatype, DataType::Fp32, "the ceiling bench feeds one FP32 input");
    let width: usize = input.dims[1..].iter().map(|&d| d.max(1) as usize).product();
    let mut instance = backend.instance().unwrap();
    for batch in [1usize, 4, 8, 16, 32, 64, 128] {
        let x = Tensor::from_le(&input.name, DataType::Fp32, vec![batch, width], &vec![0.5f32; batch * width]);
        let mut shape = vec![batch];
        shape.extend(input.dims[1..].iter().map(|&d| d.max(1) as usize));
        let run = |instance: &mut Box<dyn ferrite_core::engine::backend::Instance>| {
            let inputs = [BatchInput {
                name: &input.name,
                datatype: DataType::Fp32,
                shape: shape.clone(),
                parts: vec![&x.data],
            }];
            instance.run(&inputs).unwrap();
        };
        run(&mut instance);
        let start = Instant::now();
        let mut rows = 0usize;
        while start.elapsed() < Duration::from_secs_f64(secs) {
            run(&mut instance);
            rows += batch;
        }
        let rate = rows as f64 / start.elapsed().as_secs_f64();
        println!("{{\"batch\": {batch}, \"rows_per_sec\": {rate:.1}}}");
    }
}
