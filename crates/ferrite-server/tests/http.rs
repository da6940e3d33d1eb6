//! Every V2 REST endpoint and error class, in-process through the real router and real models.

use std::path::Path;

use axum::{
    body::Body,
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
    let dir = repository();
    let core = Core::load(dir.path(), &LoadOptions { threads: 1, spinning: false }, Limits::default()).unwrap();
    let app = app(core.clone(), &HttpLimits { max_body_bytes });
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
        assert_eq!(config["input"][1], json!({"name": "values", "data_type": "TYPE_FP32", "dims": [4]}));
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

#[tokio::test]
async fn binary_tensors_are_refused_clearly_for_now() {
    let s = server(1 << 20);
    let req = Request::post("/v2/models/mlp/infer")
        .header("Inference-Header-Content-Length", "10")
        .body(Body::from("{}"))
        .unwrap();
    let resp = s.app.clone().oneshot(req).await.unwrap();
    assert_eq!(resp.status(), StatusCode::NOT_IMPLEMENTED);
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
        (Error::DeadlineExceeded("x".into()), StatusCode::GATEWAY_TIMEOUT),
        (Error::Unsupported("x".into()), StatusCode::NOT_IMPLEMENTED),
        (Error::internal("x"), StatusCode::INTERNAL_SERVER_ERROR),
    ];
    for (e, status) in cases {
        assert_eq!(ApiError::from(e).status, status);
    }
}
