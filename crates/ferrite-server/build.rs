//! Generates the KServe V2 and TEI gRPC types (and the etcd client) from `proto/` with a vendored `protoc`, so the build needs
//! nothing beyond crates.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    // SAFETY: build scripts are single-threaded; this only tells prost-build where protoc is.
    unsafe { std::env::set_var("PROTOC", protoc) };
    let proto = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../proto");
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
    // Each message served is checked before it is decoded (`grpc::bound`): from the descriptors
    // written here, by a codec that finds them by the messages' names.
    let served = |descriptors: &str| {
        let mut config = prost_build::Config::new();
        config.enable_type_names();
        (
            config,
            tonic_prost_build::configure()
                .codec_path("crate::grpc::bound::Codec")
                .file_descriptor_set_path(out.join(descriptors)),
        )
    };
    // The model config is the core's type (it builds the resolved config every front-end reports).
    let (config, build) = served("inference.bin");
    build
        .bytes(".")
        .extern_path(".inference.ModelConfig", "::ferrite_core::control::triton::pb::ModelConfig")
        .compile_with_config(config, &[proto.join("grpc_service.proto")], std::slice::from_ref(&proto))?;
    // TEI's gRPC API (tei.v1), served beside it.
    let (config, build) = served("tei.bin");
    build.compile_with_config(config, &[proto.join("tei.proto")], std::slice::from_ref(&proto))?;
    // The etcd client for --config-source: a client only.
    tonic_prost_build::configure()
        .build_server(false)
        .compile_protos(&[proto.join("etcd.proto")], std::slice::from_ref(&proto))?;
    println!("cargo:rerun-if-changed={}", proto.display());
    Ok(())
}
