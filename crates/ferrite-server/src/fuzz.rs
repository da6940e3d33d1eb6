//! Corpus-driven fuzzing of every parser a client or operator can feed: the JSON infer request,
//! the binary-extension body, MessagePack, the gRPC request (protobuf decoding and conversion) and
//! the model and tenant configs, and the image decoders and resize behind a pipeline's steps.
//!
//! Each target first replays its corpus (`fuzz/corpus/<target>/`: seeds, and every crash found so
//! far, kept as regression inputs), then mutates corpus entries for `FERRITE_FUZZ_SECS` seconds
//! (default 1; `.ci/run` gives each target longer). A panic saves its input as
//! `fuzz/corpus/<target>/crash-<hash>` to commit with the fix, and fails the test.

use std::{
    panic::{catch_unwind, AssertUnwindSafe},
    path::PathBuf,
    time::{Duration, Instant},
};

use bytes::Bytes;
use prost::Message;

const MAX_ELEMENTS: usize = 1 << 16;

fn corpus_dir(target: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus").join(target)
}

/// xorshift64*: small, seeded, good enough to pick mutations.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// Values that tend to reach edge cases in these formats.
const INTERESTING: &[&[u8]] = &[
    b"-1",
    b"0",
    b"18446744073709551616",
    b"1e309",
    b"NaN",
    b"[",
    b"]",
    b"{",
    b"}",
    b"\"",
    b"\\",
    b",",
    b"\xff",
    b"\x00",
    b"\xc1",
    b"\xdd\xff\xff\xff\xff",
    b"\x7f",
    b"FP16",
    b"BYTES",
    b"binary_data_size",
];

fn mutate(rng: &mut Rng, input: &[u8], other: &[u8]) -> Vec<u8> {
    let mut out = input.to_vec();
    for _ in 0..1 + rng.below(4) {
        let at = rng.below(out.len() + 1);
        match rng.below(6) {
            0 if !out.is_empty() => {
                let i = rng.below(out.len());
                out[i] ^= 1 << rng.below(8);
            }
            1 => out.insert(at, rng.next() as u8),
            2 if at < out.len() => {
                let end = (at + 1 + rng.below(16)).min(out.len());
                out.drain(at..end);
            }
            3 if at < out.len() => {
                let end = (at + 1 + rng.below(32)).min(out.len());
                let chunk = out[at..end].to_vec();
                out.splice(at..at, chunk);
            }
            4 if !other.is_empty() => {
                let from = rng.below(other.len());
                let end = (from + 1 + rng.below(64)).min(other.len());
                out.splice(at..at, other[from..end].iter().copied());
            }
            _ => {
                let v = INTERESTING[rng.below(INTERESTING.len())];
                out.splice(at..at, v.iter().copied());
            }
        }
    }
    out
}

fn fuzz(target: &str, run: fn(&[u8])) {
    fuzz_in(corpus_dir(target), target, run)
}

fn fuzz_in(dir: PathBuf, target: &str, run: fn(&[u8])) {
    let mut corpus: Vec<Vec<u8>> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .filter_map(|e| std::fs::read(e.ok()?.path()).ok())
        .collect();
    assert!(!corpus.is_empty(), "no corpus in {}", dir.display());
    let secs = std::env::var("FERRITE_FUZZ_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(1.0);
    let seed = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64);
    let mut rng = Rng(seed | 1);
    let deadline = Instant::now() + Duration::from_secs_f64(secs);
    let mut runs = 0u64;
    let mut crashes = Vec::new();
    let mut queue: Vec<Vec<u8>> = corpus.clone();
    loop {
        let input = match queue.pop() {
            Some(i) => i,
            None if Instant::now() < deadline => {
                let a = &corpus[rng.below(corpus.len())];
                let b = &corpus[rng.below(corpus.len())];
                mutate(&mut rng, a, b)
            }
            None => break,
        };
        runs += 1;
        if catch_unwind(AssertUnwindSafe(|| run(&input))).is_err() {
            let name = format!("crash-{:016x}", xxhash_rust::xxh3::xxh3_64(&input));
            let _ = std::fs::write(dir.join(&name), &input);
            crashes.push(name);
            if crashes.len() >= 10 {
                break;
            }
        }
        // Keep some mutants that still parse as seeds, so later rounds go deeper.
        if runs.is_multiple_of(64) && corpus.len() < 256 && input.len() < 1 << 16 {
            corpus.push(input);
        }
    }
    assert!(
        crashes.is_empty(),
        "{target}: {} crashing inputs saved in {}: {crashes:?} (seed {seed})",
        crashes.len(),
        dir.display()
    );
    eprintln!("fuzz {target}: {runs} inputs in {secs} s, no crash");
}

/// Besides not crashing: reading the inputs' `data` apart from the body gives what serde reading
/// the whole body gives, value for value and error for error; so does it watched as a large body
/// is, but that a body refused by an input's header is not read again, and says so whatever else
/// is wrong with it (data that is not JSON, which only the whole read would find first).
fn json(data: &[u8]) {
    let said = |r: Result<(ferrite_core::InferRequest, crate::http::json::BinaryOutputs), ferrite_core::Error>| {
        r.map(|(req, bin)| format!("{req:?} {bin:?}")).map_err(|e| e.to_string())
    };
    let apart = said(crate::http::json::parse("m", None, data, None, MAX_ELEMENTS, None, None));
    let whole = said(crate::http::json::read_whole("m", None, data, None, MAX_ELEMENTS, None, None));
    assert_eq!(apart, whole);
    let wanted = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let check = |_: &str, _: ferrite_core::DataType, _: &[usize]| Ok(());
    let watch = crate::http::decode::Watch { check: &check, wanted: &wanted, refused: Default::default() };
    let watched = said(crate::http::json::parse("m", None, data, None, MAX_ELEMENTS, None, Some(&watch)));
    match (&watched, &whole) {
        (Err(_), Err(_)) if watch.settled() => {}
        _ => assert_eq!(watched, whole),
    }
}

fn binary(data: &[u8]) {
    if data.len() < 4 {
        return;
    }
    let n = u32::from_le_bytes(data[..4].try_into().unwrap()) as usize;
    let body = &data[4..];
    if n <= body.len() {
        let _ = crate::http::json::parse(
            "m",
            None,
            &body[..n],
            Some(Bytes::copy_from_slice(&body[n..])),
            MAX_ELEMENTS,
            None,
            None,
        );
    }
}

fn msgpack(data: &[u8]) {
    let _ = crate::http::msgpack::parse("m", None, data, MAX_ELEMENTS, None, None);
}

fn grpc(data: &[u8]) {
    if let Ok(req) = crate::grpc::pb::ModelInferRequest::decode(data) {
        let _ = crate::grpc::convert::to_core(req, MAX_ELEMENTS, None);
    }
}

fn config(data: &[u8]) {
    use ferrite_core::{
        control::config::ModelConfig,
        engine::spec::{ModelSpec, TensorSpec},
        DataType,
    };
    let Ok(text) = std::str::from_utf8(data) else { return };
    let io = [TensorSpec { name: "x".into(), datatype: DataType::Fp32, dims: vec![-1, 4] }];
    if let Ok(cfg) = toml::from_str::<ModelConfig>(text) {
        let _ = ModelSpec::resolve("m", 1, &cfg, &io, &io, 1);
    }
    // Triton's config.pbtxt, read as the repository reads it.
    let triton = ferrite_core::control::triton::parse(text);
    if let Ok(cfg) = triton.and_then(|c| ferrite_core::control::triton::to_config(&c, "m")) {
        let _ = ModelSpec::resolve("m", 1, &cfg, &io, &io, 1);
    }
    let _ = ferrite_core::admission::tenant::TenantConfig::parse(text);
}

/// The image steps a pipeline runs on a client's bytes: decode (small limits, so a fuzzed header
/// cannot make one run slow), then resize, pad, crop and normalize.
fn image(data: &[u8]) {
    use std::sync::{Arc, OnceLock};

    use ferrite_core::{engine::backend::BatchInput, Backend, DataType, TensorData};
    static PIPELINE: OnceLock<ferrite_core::pipeline::Pipeline> = OnceLock::new();
    let pipeline = PIPELINE.get_or_init(|| {
        let steps = ferrite_core::control::repository::parse_config(
            "[[steps]]\nop = \"decode_image\"\nmax_pixels = 1000000\nmax_side = 4096\n\
             [[steps]]\nop = \"resize\"\nmode = \"shorter_side\"\nsize = [20]\n\
             [[steps]]\nop = \"pad\"\nmode = \"square\"\n\
             [[steps]]\nop = \"crop\"\nsize = [16, 16]\n\
             [[steps]]\nop = \"normalize\"\n",
        )
        .unwrap()
        .steps;
        let registry: Arc<dyn ferrite_core::pipeline::Models> =
            Arc::new(arc_swap::ArcSwap::from_pointee(ferrite_core::Registry::default()));
        let dir = std::env::temp_dir();
        ferrite_core::pipeline::Pipeline::build(
            "fuzz",
            &dir,
            &steps,
            &[],
            &[],
            &ferrite_core::Registry::default(),
            registry,
            Default::default(),
        )
        .unwrap()
    });
    let mut instance = pipeline.instance().unwrap();
    let rows = TensorData::Strings(vec![Bytes::copy_from_slice(data)]);
    let input = BatchInput { name: "image", datatype: DataType::Bytes, shape: vec![1], parts: vec![&rows] };
    let _ = instance.run(&[input]);
}

#[test]
fn fuzz_json_request() {
    fuzz("json", json);
}

#[test]
fn fuzz_binary_body() {
    fuzz("binary", binary);
}

#[test]
fn fuzz_msgpack_request() {
    fuzz("msgpack", msgpack);
}

#[test]
fn fuzz_grpc_request() {
    fuzz("grpc", grpc);
}

#[test]
fn fuzz_image_decode_and_resize() {
    fuzz("image", image);
}

#[test]
fn fuzz_config_files() {
    fuzz("config", config);
}

#[test]
fn the_fuzzer_finds_and_keeps_a_crash() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("seed"), b"{\"a\": 1}").unwrap();
    let found =
        catch_unwind(|| fuzz_in(dir.path().to_path_buf(), "self-test", |d| assert!(!d.contains(&b'}') || d.len() > 7)));
    assert!(found.is_err(), "a target that panics on short inputs with a brace must be caught");
    let kept = std::fs::read_dir(dir.path())
        .unwrap()
        .filter(|e| e.as_ref().unwrap().file_name().to_string_lossy().starts_with("crash-"))
        .count();
    assert!(kept > 0);
}
