//! The CPU budget holds across models: instances share the intra-op threads the budget gives
//! instead of each starting as many as there are cores (onnxruntime_backend #245). Its own test
//! binary, so no other test's threads are counted.

use std::path::Path;

use ferrite_core::{Core, Limits, LoadOptions};

fn threads() -> usize {
    std::fs::read_dir("/proc/self/task").unwrap().count()
}

#[test]
fn eight_models_of_two_instances_start_no_more_threads_than_instances() {
    ferrite_core::engine::onnx::init_runtime(None).expect("ONNX Runtime");
    let mlp = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/mlp/1/model.onnx");
    let dir = tempfile::tempdir().unwrap();
    for i in 0..8 {
        let d = dir.path().join(format!("m{i}"));
        std::fs::create_dir_all(d.join("1")).unwrap();
        std::fs::copy(&mlp, d.join("1/model.onnx")).unwrap();
        std::fs::write(d.join("config.toml"), "instance_count = 2\n").unwrap();
    }
    let before = threads();
    let options = LoadOptions { threads: 2, spinning: false, calibrate: false, cache: None, ..Default::default() };
    let core = Core::load(dir.path(), &options, Limits::default()).unwrap();
    assert_eq!(core.models().len(), 8);
    let added = threads() - before;
    // One batcher thread per instance; with a budget of 2 shared by 2 instances each runs on its
    // own thread (intra-op pool of 1). Each instance starting 2 would add 16 more.
    assert!(added <= 16 + 2, "8 models x 2 instances started {added} threads");
    for m in core.models() {
        assert_eq!(m.spec.onnx.intra_threads, 1);
    }
}
