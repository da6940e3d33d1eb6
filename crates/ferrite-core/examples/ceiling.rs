//! The engine alone, in-process, with no server: rows per second at each batch size, for each
//! plan of the CPUs (one instance using every core, one single-threaded instance per core, or one
//! instance per core each using every core, run side by side) with ONNX Runtime's intra-op spinning off and on. `bench/` reports the best as the
//! ceiling a server can reach, and batch 1's time as the latency floor. Guards against a server
//! that falls far below its own engine.
//!
//! Usage: ceiling MODEL.onnx [SECONDS_PER_POINT] [DIMS], or CEILING_MODELS=... ceiling [SECONDS_PER_POINT]
//! DIMS (e.g. 3,320,320) replace the first input's dims after the batch dim, for variable ones.
//! With CEILING_MODELS=MODEL.onnx|INSTANCES,THREADS,BATCH[|DIMS];... (and no MODEL argument) it
//! loads every model listed with its plan, keeps all their instances at once (as a server holding
//! them does), runs each instance at its batch for SECONDS_PER_POINT, and prints the peak
//! resident memory: ONNX Runtime's own need for what a server chose for its models, the
//! reference for the server's memory.

use std::time::{Duration, Instant};

use ferrite_core::{
    engine::backend::{Backend, BatchInput},
    engine::onnx::{OnnxBackend, OnnxOptions},
    engine::spec::TensorSpec,
    DataType, Tensor, TensorData,
};

fn inputs(backend: &OnnxBackend, batch: usize, dims: &Option<Vec<usize>>) -> Vec<Tensor> {
    backend
        .inputs()
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let mut shape = vec![batch];
            match dims.as_ref().filter(|_| i == 0) {
                Some(d) => shape.extend(d),
                None => shape.extend(s.dims[1..].iter().map(|&d| d.max(1) as usize)),
            }
            let n: usize = shape.iter().product();
            match s.datatype {
                DataType::Fp32 => Tensor::from_le(&s.name, DataType::Fp32, shape, &vec![0.5f32; n]),
                DataType::Int64 => Tensor::from_le(&s.name, DataType::Int64, shape, &vec![1i64; n]),
                other => panic!("the ceiling bench feeds FP32 and INT64 inputs, not {other}"),
            }
        })
        .collect()
}

/// `tensors` (one per input spec, in order) as one batch.
fn batch_of<'a>(specs: &'a [TensorSpec], tensors: &'a [Tensor]) -> Vec<BatchInput<'a>> {
    specs
        .iter()
        .zip(tensors)
        .map(|(s, t)| BatchInput {
            name: &s.name,
            datatype: s.datatype,
            shape: t.shape.clone(),
            parts: vec![&t.data as &TensorData],
        })
        .collect()
}

/// Rows per second of `instances` instances of `backend` each running batches of `batch` rows
/// side by side for `secs`.
fn rate(backend: &OnnxBackend, instances: usize, batch: usize, dims: &Option<Vec<usize>>, secs: f64) -> f64 {
    let tensors = inputs(backend, batch, dims);
    let specs = backend.inputs();
    let start = Instant::now();
    let rows: usize = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..instances)
            .map(|_| {
                let tensors = &tensors;
                scope.spawn(move || {
                    let mut instance = backend.instance().unwrap();
                    let batch_inputs = batch_of(specs, tensors);
                    instance.run(&batch_inputs).unwrap();
                    let began = Instant::now();
                    let mut rows = 0;
                    while began.elapsed() < Duration::from_secs_f64(secs) {
                        instance.run(&batch_inputs).unwrap();
                        rows += batch;
                    }
                    rows
                })
            })
            .collect();
        workers.into_iter().map(|w| w.join().unwrap()).sum()
    });
    rows as f64 / start.elapsed().as_secs_f64()
}

fn peak_rss_mb() -> f64 {
    let kb = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines().find(|l| l.starts_with("VmHWM:")).and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0u64);
    kb as f64 / 1024.0
}

/// CEILING_MODELS: every model's instances alive together, each run at its plan's batch.
fn models_together(list: &str, secs: f64) {
    let mut held = Vec::new();
    for entry in list.split(';').filter(|e| !e.is_empty()) {
        let mut fields = entry.split('|');
        let path = fields.next().expect("MODEL.onnx");
        let plan: Vec<usize> = fields
            .next()
            .expect("INSTANCES,THREADS,BATCH")
            .split(',')
            .map(|x| x.parse().expect("INSTANCES,THREADS,BATCH"))
            .collect();
        let dims = fields.next().map(|d| d.split(',').map(|x| x.parse().expect("DIMS like 3,320,320")).collect());
        let options = OnnxOptions { intra_threads: plan[1], ..Default::default() };
        let backend = OnnxBackend::load(path.as_ref(), options).unwrap();
        let tensors = inputs(&backend, plan[2], &dims);
        let instances: Vec<_> = (0..plan[0]).map(|_| backend.instance().unwrap()).collect();
        held.push((backend, tensors, instances));
    }
    for (backend, tensors, instances) in &mut held {
        let batch_inputs = batch_of(backend.inputs(), tensors);
        for instance in instances.iter_mut() {
            let began = Instant::now();
            while began.elapsed() < Duration::from_secs_f64(secs) {
                instance.run(&batch_inputs).unwrap();
            }
        }
    }
    println!("{{\"models\": {}, \"peak_rss_mb\": {:.1}}}", held.len(), peak_rss_mb());
}

fn main() {
    ferrite_core::engine::onnx::init_runtime(None).expect("ONNX Runtime");
    let mut args = std::env::args().skip(1);
    if let Ok(list) = std::env::var("CEILING_MODELS") {
        let secs: f64 = args.next().map_or(1.0, |s| s.parse().expect("seconds"));
        return models_together(&list, secs);
    }
    let path = args.next().expect("usage: ceiling MODEL.onnx [SECONDS_PER_POINT] [DIMS]");
    let secs: f64 = args.next().map_or(1.0, |s| s.parse().expect("seconds"));
    let dims: Option<Vec<usize>> =
        args.next().map(|d| d.split(',').map(|x| x.parse().expect("DIMS like 3,320,320")).collect());
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut plans = vec![(1, cores)];
    if cores > 1 {
        plans.push((cores, 1));
        plans.push((cores, cores));
    }
    for spinning in [false, true] {
        for &(instances, threads) in &plans {
            if threads == 1 && spinning {
                continue; // no intra-op pool to spin
            }
            let options = OnnxOptions { intra_threads: threads, spinning, ..Default::default() };
            let backend = OnnxBackend::load(path.as_ref(), options).unwrap();
            let mut best = 0.0f64;
            for batch in [1usize, 2, 4, 8, 16, 32, 64, 128] {
                let r = rate(&backend, instances, batch, &dims, secs);
                println!(
                    "{{\"batch\": {batch}, \"instances\": {instances}, \"threads\": {threads}, \"spinning\": {spinning}, \"rows_per_sec\": {r:.1}}}"
                );
                // Past the peak by a clear margin, larger batches only cost time.
                if r < best * 0.8 {
                    break;
                }
                best = best.max(r);
            }
        }
    }
}
