//! Generates Triton's model-config types from `proto/model_config.proto` (with a vendored `protoc`,
//! so the build needs nothing beyond crates), and its descriptor, which reads `config.pbtxt`.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    // SAFETY: build scripts are single-threaded; this only tells prost-build where protoc is.
    unsafe { std::env::set_var("PROTOC", protoc) };
    let proto = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../proto");
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
    prost_build::Config::new()
        .file_descriptor_set_path(out.join("model_config.bin"))
        .compile_protos(&[proto.join("model_config.proto")], std::slice::from_ref(&proto))?;
    println!("cargo:rerun-if-changed={}", proto.join("model_config.proto").display());
    Ok(())
}
