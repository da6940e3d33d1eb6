//! Every V2 REST endpoint and error class, in-process through the real router and real models.

use std::{path::Path, time::Duration};

use axum::{
    body::{Body, Bytes},
    http::{HeaderMap, Request, StatusCode},
    Router,
};
use ferrite_core::{Core, Error, Limits, LoadOptions};
use ferrite_server::http::{app, ApiError, HttpLimits};
use http_body_util::BodyExt;
use serde_json::{json, Value};
use tower::ServiceExt;

fn repository() -> tempfile::TempDir {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let dir = tempfile::tempdir().unwrap();
    for (name, src) in [("mixed", "models"), ("mlp", "models"), ("identity", "tests/models"), ("fixed", "tests/models")]
    {
        let dst = dir.path().join(name).join("1");
        std::fs::create_dir_all(&dst).unwrap();
        std::fs::copy(root.join(src).join(name).join("1/model.onnx"), dst.join("model.onnx")).unwrap();
    }
    dir
}

struct Server {
    core: Core,
    app: Router,
    _dir: tempfile::TempDir,
}

fn server(max_body_bytes: usize) -> Server {
    ferrite_core::engine::onnx::init_runtime(None).expect("ONNX Runtime");
    let dir = repository();
    let core = Core::load(
        dir.path(),
        &LoadOptions { threads: 1, spinning: false, calibrate: false, cache: None, ..Default::default() },
        Limits::default(),
    )
    .unwrap();
    let limits = HttpLimits::new(max_body_bytes);
    let shm = ferrite_server::shm::Regions::new(false, max_body_bytes, limits.body_budget.clone());
    let app = app(core.clone(), &limits, std::sync::Arc::new(shm));
    Server { core, app, _dir: dir }
}

async fn call(app: &Router, method: &str, uri: &str, body: Option<String>) -> (StatusCode, HeaderMap, Value) {
    let req = Request::builder().method(method).uri(uri).body(body.map(Body::from).unwrap_or_default()).unwrap();
    let resp = app.clone().oneshot(req).await.unwrap();
    let status = resp.status();
    let headers = resp.headers().clone();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    let value = if bytes.is_empty() {
        Value::Null
    } else {
        // Python's json reads NaN/Infinity; serde_json does not, so map them for these checks.
        let text = String::from_utf8(bytes.to_vec()).unwrap();
        serde_json::from_str(
            &text.replace("-Infinity", "\"-Infinity\"").replace("NaN", "\"NaN\"").replace(",Infinity", ",\"Infinity\""),
        )
        .unwrap_or(Value::String(text))
    };
    (status, headers, value)
}

async fn infer(app: &Router, model: &str, body: Value) -> (StatusCode, HeaderMap, Value) {
    call(app, "POST", &format!("/v2/models/{model}/infer"), Some(body.to_string())).await
}

fn mixed_body() -> Value {
    json!({"id": "r1", "inputs": [
        {"name": "ids", "shape": [2, 4], "datatype": "INT64", "data": [[1, 2, 3, 4], [0, 0, 0, 2]]},
        {"name": "values", "shape": [2, 4], "datatype": "FP32", "data": [1, 1, 1, 0.5, 3, 3, 3, 3]}
    ]})
}

#[tokio::test]
async fn health_and_server_metadata() {
    let s = server(1 << 20);
    assert_eq!(call(&s.app, "GET", "/v2/health/live", None).await.0, StatusCode::OK);
    assert_eq!(call(&s.app, "GET", "/v2/health/ready", None).await.0, StatusCode::OK);
    let (status, _, meta) = call(&s.app, "GET", "/v2", None).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(meta["name"], "ferrite");
    assert!(meta["extensions"].as_array().unwrap().contains(&json!("statistics")));
}

#[tokio::test]
async fn model_metadata_ready_and_config() {
    let s = server(1 << 20);
    for prefix in ["/v2/models/mixed", "/v2/models/mixed/versions/1"] {
        let (status, _, meta) = call(&s.app, "GET", prefix, None).await;
        assert_eq!(status, StatusCode::OK, "{prefix}");
        assert_eq!(meta["platform"], "onnxruntime_onnx");
        assert_eq!(meta["versions"], json!(["1"]));
        assert_eq!(meta["inputs"][0], json!({"name": "ids", "datatype": "INT64", "shape": [-1, 4]}));
        assert_eq!(meta["outputs"][1], json!({"name": "ids_sum", "datatype": "INT64", "shape": [-1, 1]}));
        assert_eq!(call(&s.app, "GET", &format!("{prefix}/ready"), None).await.0, StatusCode::OK);
        let (status, _, config) = call(&s.app, "GET", &format!("{prefix}/config"), None).await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(config["max_batch_size"], 64);
        let values = &config["input"][1];
        assert_eq!(
            (&values["name"], &values["data_type"], &values["dims"]),
            (&json!("values"), &json!("TYPE_FP32"), &json!([4]))
        );
        // Triton's shape: every scalar printed, enums by name.
        assert_eq!((&values["format"], &values["optional"]), (&json!("FORMAT_NONE"), &json!(false)));
        assert_eq!(config["instance_group"][0]["kind"], "KIND_CPU");
        assert!(config["dynamic_batching"].is_object());
    }
    let (_, _, fixed) = call(&s.app, "GET", "/v2/models/fixed/config", None).await;
    assert_eq!(fixed["max_batch_size"], 0);
    assert_eq!(fixed["input"][0]["dims"], json!([2, 3]));
    assert!(fixed.get("dynamic_batching").is_none());
    let (_, _, identity) = call(&s.app, "GET", "/v2/models/identity", None).await;
    assert!(identity["inputs"]
        .as_array()
        .unwrap()
        .contains(&json!({"name": "bytes_in", "datatype": "BYTES", "shape": [-1, 3]})));

    for uri in ["/v2/models/nope", "/v2/models/mixed/versions/2", "/v2/models/nope/config", "/v2/models/nope/stats"] {
        let (status, _, body) = call(&s.app, "GET", uri, None).await;
        assert_eq!(status, StatusCode::NOT_FOUND, "{uri}");
        assert!(body["error"].is_string(), "{uri}: {body}");
    }
    assert_eq!(call(&s.app, "GET", "/v2/models/nope/ready", None).await.0, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn infer_json_and_statistics() {
    let s = server(1 << 20);
    let (status, headers, body) = infer(&s.app, "mixed", mixed_body()).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(headers["content-type"], "application/json");
    assert_eq!(body["model_name"], "mixed");
    assert_eq!(body["model_version"], "1");
    assert_eq!(body["id"], "r1");
    assert_eq!(
        body["outputs"],
        json!([
            {"name": "weighted", "datatype": "FP32", "shape": [2, 4], "data": [1.0, 2.0, 3.0, 2.0, 0.0, 0.0, 0.0, 6.0]},
            {"name": "ids_sum", "datatype": "INT64", "shape": [2, 1], "data": [10, 2]}
        ])
    );
    // Output filter, on the versioned route.
    let mut filtered = mixed_body();
    filtered["outputs"] = json!([{"name": "ids_sum"}]);
    let (status, _, body) = call(&s.app, "POST", "/v2/models/mixed/versions/1/infer", Some(filtered.to_string())).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body["outputs"].as_array().unwrap().len(), 1);
    assert_eq!(body["outputs"][0]["name"], "ids_sum");

    let (_, _, stats) = call(&s.app, "GET", "/v2/models/mixed/stats", None).await;
    let m = &stats["model_stats"][0];
    assert_eq!(m["name"], "mixed");
    assert_eq!(m["inference_count"], 4);
    assert_eq!(m["execution_count"], 2);
    assert_eq!(m["inference_stats"]["success"]["count"], 2);
    let (_, _, all) = call(&s.app, "GET", "/v2/models/stats", None).await;
    assert_eq!(all["model_stats"].as_array().unwrap().len(), 4);
}

#[tokio::test]
async fn every_datatype_through_json_including_bytes_and_non_finite() {
    let s = server(1 << 20);
    let values = |dt: &str| match dt {
        "BOOL" => json!([true, false, true]),
        "BYTES" => json!(["a", "", "ünï"]),
        "FP16" | "BF16" | "FP32" | "FP64" => json!([-1.5, "NaN", "Infinity"]),
        "INT8" | "INT16" | "INT32" | "INT64" => json!([-1, 0, 7]),
        _ => json!([0, 1, 255]),
    };
    let dts = [
        "BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", "FP16", "BF16", "FP32",
        "FP64", "BYTES",
    ];
    let inputs: Vec<Value> = dts
        .iter()
        .map(|dt| json!({"name": format!("{}_in", dt.to_lowercase()), "shape": [1, 3], "datatype": dt, "data": values(dt)}))
        .collect();
    let (status, _, body) = infer(&s.app, "identity", json!({"inputs": inputs})).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    for (i, dt) in dts.iter().enumerate() {
        let out = &body["outputs"][i];
        assert_eq!(out["datatype"], *dt);
        assert_eq!(out["data"], values(dt), "{dt}");
    }
}

#[tokio::test]
async fn bad_requests_get_400_and_name_the_problem() {
    let s = server(1 << 20);
    let cases = [
        ("{not json", "invalid JSON"),
        (r#"{"inputs": 3}"#, "invalid JSON"),
        (&"[".repeat(200), "invalid JSON"),
        (r#"{"inputs":[{"name":"ids","shape":[1,4],"datatype":"INT64","data":[1,2,3]}]}"#, "'ids'"),
        (
            r#"{"inputs":[{"name":"ids","shape":[1,4],"datatype":"INT64","data":[1,2,3,4]},{"name":"values","shape":[1,4],"datatype":"FP32","data":[1,2,3,"x"]}]}"#,
            "'values'",
        ),
        (r#"{"inputs":[{"name":"ids","shape":[1,4],"datatype":"INT64","data":[1,2,3,4]}]}"#, "missing input 'values'"),
        (r#"{"inputs":[{"name":"ids","shape":[4294967296,4294967296],"datatype":"INT64","data":[]}]}"#, "elements"),
        (
            r#"{"inputs":[{"name":"ids","shape":[1,4],"datatype":"INT64","data":[[[[[[[[[[1,2,3,4]]]]]]]]]]},{"name":"values","shape":[1,4],"datatype":"FP32","data":[1,1,1,1]}],"parameters":{"priority":"high"}}"#,
            "priority",
        ),
    ];
    for (body, needle) in cases {
        let (status, _, err) = call(&s.app, "POST", "/v2/models/mixed/infer", Some(body.to_string())).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}: {err}");
        assert!(err["error"].as_str().unwrap().contains(needle), "{body}: {err}");
    }
    let (status, _, err) = infer(&s.app, "nope", mixed_body()).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert!(err["error"].as_str().unwrap().contains("nope"));
    let (status, _, _) = call(&s.app, "GET", "/v2/no/such/route", None).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn oversized_bodies_are_refused_before_parsing() {
    let s = server(1024);
    let (status, _, err) = infer(
        &s.app,
        "mlp",
        json!({"inputs": [{"name": "input", "shape": [1, 512], "datatype": "FP32", "data": vec![0.5; 512]}]}),
    )
    .await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
    assert!(err["error"].is_string(), "{err}");
}

async fn raw_call(app: &Router, req: Request<Body>) -> (StatusCode, HeaderMap, Bytes) {
    let resp = app.clone().oneshot(req).await.unwrap();
    let (status, headers) = (resp.status(), resp.headers().clone());
    (status, headers, resp.into_body().collect().await.unwrap().to_bytes())
}

fn binary_request(json: &Value, blobs: &[&[u8]]) -> Request<Body> {
    let text = json.to_string();
    let mut body = text.clone().into_bytes();
    for b in blobs {
        body.extend_from_slice(b);
    }
    Request::post("/v2/models/mixed/infer")
        .header("Inference-Header-Content-Length", text.len())
        .body(Body::from(body))
        .unwrap()
}

fn le<T: Copy, const N: usize>(values: [T; N], f: fn(T) -> [u8; 8]) -> Vec<u8> {
    values.iter().flat_map(|&v| f(v)).collect()
}

#[tokio::test]
async fn binary_tensor_extension_in_and_out() {
    let s = server(1 << 20);
    let ids = le([1i64, 2, 3, 4], i64::to_le_bytes);
    let values: Vec<u8> = [1f32, 1.0, 1.0, 0.5].iter().flat_map(|v| v.to_le_bytes()).collect();
    let json = json!({
        "inputs": [
            {"name": "ids", "shape": [1, 4], "datatype": "INT64", "parameters": {"binary_data_size": 32}},
            {"name": "values", "shape": [1, 4], "datatype": "FP32", "parameters": {"binary_data_size": 16}}
        ],
        "outputs": [{"name": "weighted", "parameters": {"binary_data": true}}, {"name": "ids_sum"}]
    });
    let (status, headers, body) = raw_call(&s.app, binary_request(&json, &[&ids, &values])).await;
    assert_eq!(status, StatusCode::OK, "{body:?}");
    assert_eq!(headers["content-type"], "application/octet-stream");
    let len: usize = headers["inference-header-content-length"].to_str().unwrap().parse().unwrap();
    let head: Value = serde_json::from_slice(&body[..len]).unwrap();
    assert_eq!(head["outputs"][0]["parameters"]["binary_data_size"], 16);
    assert!(head["outputs"][0].get("data").is_none());
    assert_eq!(head["outputs"][1]["data"], json!([10]));
    let weighted: Vec<f32> = body[len..].chunks(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
    assert_eq!(weighted, [1.0, 2.0, 3.0, 2.0]);

    // Lies about lengths are refused, naming the input.
    let mut short = json.clone();
    short["inputs"][1]["parameters"]["binary_data_size"] = json!(20);
    let (status, _, body) = raw_call(&s.app, binary_request(&short, &[&ids, &values])).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(String::from_utf8_lossy(&body).contains("'values'"), "{body:?}");
    let (status, _, _) = raw_call(&s.app, binary_request(&json, &[&ids, &values, b"x"])).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    let req = Request::post("/v2/models/mixed/infer")
        .header("Inference-Header-Content-Length", "999")
        .body(Body::from("{}"))
        .unwrap();
    assert_eq!(raw_call(&s.app, req).await.0, StatusCode::BAD_REQUEST);
}

#[tokio::test]
async fn binary_bytes_tensors_use_length_prefixes() {
    let s = server(1 << 20);
    let mut words = Vec::new();
    for w in [&b"ab"[..], b"", b"xyz"] {
        words.extend_from_slice(&(w.len() as u32).to_le_bytes());
        words.extend_from_slice(w);
    }
    let dts = [
        "BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", "FP16", "BF16", "FP32",
        "FP64",
    ];
    let mut inputs = Vec::new();
    let mut blobs: Vec<Vec<u8>> = Vec::new();
    for dt in dts {
        let size = match dt {
            "BOOL" | "UINT8" | "INT8" => 1,
            "UINT16" | "INT16" | "FP16" | "BF16" => 2,
            "UINT32" | "INT32" | "FP32" => 4,
            _ => 8,
        };
        inputs.push(json!({"name": format!("{}_in", dt.to_lowercase()), "shape": [1, 3], "datatype": dt, "parameters": {"binary_data_size": 3 * size}}));
        blobs.push((0..3 * size).map(|i| if dt == "BOOL" { (i % 2) as u8 } else { i as u8 }).collect());
    }
    inputs.push(json!({"name": "bytes_in", "shape": [1, 3], "datatype": "BYTES", "parameters": {"binary_data_size": words.len()}}));
    blobs.push(words.clone());
    let json = json!({"inputs": inputs, "parameters": {"binary_data_output": true}});
    let refs: Vec<&[u8]> = blobs.iter().map(Vec::as_slice).collect();
    let mut req = binary_request(&json, &refs);
    *req.uri_mut() = "/v2/models/identity/infer".parse().unwrap();
    let (status, headers, body) = raw_call(&s.app, req).await;
    assert_eq!(status, StatusCode::OK, "{body:?}");
    let len: usize = headers["inference-header-content-length"].to_str().unwrap().parse().unwrap();
    // Every output comes back byte for byte, in order.
    assert_eq!(&body[len..], &refs.concat()[..]);
}

#[tokio::test]
async fn msgpack_requests_and_responses() {
    let s = server(1 << 20);
    let body = rmp_serde::to_vec_named(&mixed_body()).unwrap();
    let req = Request::post("/v2/models/mixed/infer")
        .header("content-type", "application/msgpack")
        .body(Body::from(body))
        .unwrap();
    let (status, headers, body) = raw_call(&s.app, req).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(headers["content-type"], "application/msgpack");
    let v: rmpv::Value = rmp_serde::from_slice(&body).unwrap();
    assert_eq!(v["id"].as_str(), Some("r1"));
    let sums: Vec<i64> = v["outputs"][1]["data"]
        .as_slice()
        .unwrap()
        .chunks(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert_eq!(sums, [10, 2]);
    // A JSON request may ask for a MessagePack answer, and a MessagePack one for JSON.
    let req = Request::post("/v2/models/mixed/infer")
        .header("accept", "application/msgpack")
        .body(Body::from(mixed_body().to_string()))
        .unwrap();
    assert_eq!(raw_call(&s.app, req).await.1["content-type"], "application/msgpack");
    let body = rmp_serde::to_vec_named(&mixed_body()).unwrap();
    let req = Request::post("/v2/models/mixed/infer")
        .header("content-type", "application/msgpack")
        .header("accept", "application/json")
        .body(Body::from(body))
        .unwrap();
    let (_, headers, body) = raw_call(&s.app, req).await;
    assert_eq!(headers["content-type"], "application/json");
    assert_eq!(serde_json::from_slice::<Value>(&body).unwrap()["outputs"][1]["data"], json!([10, 2]));
    // Errors are the same JSON errors.
    let req = Request::post("/v2/models/mixed/infer")
        .header("content-type", "application/msgpack")
        .body(Body::from(&b"\xc1"[..]))
        .unwrap();
    let (status, _, body) = raw_call(&s.app, req).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(serde_json::from_slice::<Value>(&body).unwrap()["error"].as_str().unwrap().contains("MessagePack"));
}

#[tokio::test]
async fn shutdown_turns_readiness_off_and_refuses_work() {
    let s = server(1 << 20);
    s.core.begin_shutdown();
    assert_eq!(call(&s.app, "GET", "/v2/health/ready", None).await.0, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(call(&s.app, "GET", "/v2/health/live", None).await.0, StatusCode::OK);
    assert_eq!(call(&s.app, "GET", "/v2/models/mixed/ready", None).await.0, StatusCode::SERVICE_UNAVAILABLE);
    let (status, headers, _) = infer(&s.app, "mixed", mixed_body()).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(headers["retry-after"], "1");
}

#[test]
fn every_core_error_maps_to_its_status() {
    let cases = [
        (Error::invalid("x"), StatusCode::BAD_REQUEST),
        (Error::NotFound("x".into()), StatusCode::NOT_FOUND),
        (Error::unavailable("x", None), StatusCode::SERVICE_UNAVAILABLE),
        (Error::Overloaded { message: "x".into(), retry_after: None }, StatusCode::TOO_MANY_REQUESTS),
        (Error::DeadlineExceeded("x".into()), StatusCode::GATEWAY_TIMEOUT),
        (Error::Unsupported("x".into()), StatusCode::NOT_IMPLEMENTED),
        (Error::internal("x"), StatusCode::INTERNAL_SERVER_ERROR),
    ];
    for (e, status) in cases {
        assert_eq!(ApiError::from(e).status, status);
    }
    let limited = ApiError::from(Error::Overloaded { message: "x".into(), retry_after: Some(Duration::from_secs(2)) });
    assert_eq!(limited.retry_after, Some(2));
}
