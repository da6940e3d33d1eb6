"""The real binary through real clients: tritonclient.http (JSON tensors) and curl, checked against
the onnxruntime Python package on the same model files."""

import concurrent.futures
import json
import os
import signal
import subprocess
import threading
import time
import urllib.request

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import BIN, ROOT, make_repository


def client(server, concurrency=1):
    return httpclient.InferenceServerClient(url=server.url, concurrency=concurrency, network_timeout=60)


def reference(model_path, feeds):
    sess = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(None, feeds)))


def json_input(name, array, datatype):
    i = httpclient.InferInput(name, list(array.shape), datatype)
    i.set_data_from_numpy(array, binary_data=False)
    return i


def json_outputs(*names):
    return [httpclient.InferRequestedOutput(n, binary_data=False) for n in names]


def curl(*args):
    out = subprocess.run(["curl", "-s", "-w", "\n%{http_code}", *args], capture_output=True, text=True, check=True)
    body, _, code = out.stdout.rpartition("\n")
    return int(code), body


def test_health_and_metadata_through_tritonclient(server):
    c = client(server)
    assert c.is_server_live() and c.is_server_ready()
    assert c.is_model_ready("mlp") and c.is_model_ready("mixed", "1")
    assert not c.is_model_ready("nope")
    meta = c.get_server_metadata()
    assert meta["name"] == "ferrite" and "version" in meta
    mlp = c.get_model_metadata("mlp")
    assert mlp["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 512]}]
    assert mlp["outputs"] == [{"name": "output", "datatype": "FP32", "shape": [-1, 10]}]
    assert mlp["platform"] == "onnxruntime_onnx"
    config = c.get_model_config("mixed")
    assert config["max_batch_size"] > 0
    assert [i["data_type"] for i in config["input"]] == ["TYPE_INT64", "TYPE_FP32"]
    assert "dynamic_batching" in config


def test_health_through_curl(server):
    # The V2 protocol's bodies (KServe's SDK parses them), and the status codes Triton's read.
    code, body = curl(f"http://{server.url}/v2/health/live")
    assert code == 200 and json.loads(body) == {"live": True}
    code, body = curl(f"http://{server.url}/v2/health/ready")
    assert code == 200 and json.loads(body) == {"ready": True}
    code, body = curl(f"http://{server.url}/v2/models/mlp/ready")
    assert code == 200 and json.loads(body) == {"name": "mlp", "ready": True}
    code, body = curl(f"http://{server.url}/v2/models/nope/ready")
    assert code == 404 and "error" in json.loads(body)
    code, body = curl(f"http://{server.url}/v2/models/mlp/versions/1")
    assert code == 200 and json.loads(body)["name"] == "mlp"


@pytest.mark.parametrize("batch", [1, 8])
def test_mlp_matches_onnxruntime(server, batch):
    rng = np.random.default_rng(batch)
    x = rng.standard_normal((batch, 512)).astype(np.float32)
    r = client(server).infer("mlp", [json_input("input", x, "FP32")], outputs=json_outputs("output"))
    got = r.as_numpy("output")
    want = reference(ROOT / "models/mlp/1/model.onnx", {"input": x})["output"]
    assert got.shape == (batch, 10) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_two_dtype_model_matches_onnxruntime(server):
    ids = np.array([[1, 2, 3, 4], [5, -6, 7, 0]], dtype=np.int64)
    values = np.array([[0.5, 1.5, -2, 3], [1, 1, 1, 1]], dtype=np.float32)
    r = client(server).infer(
        "mixed",
        [json_input("ids", ids, "INT64"), json_input("values", values, "FP32")],
        outputs=json_outputs("weighted", "ids_sum"),
        request_id="abc",
    )
    want = reference(ROOT / "models/mixed/1/model.onnx", {"ids": ids, "values": values})
    np.testing.assert_allclose(r.as_numpy("weighted"), want["weighted"], rtol=1e-5)
    np.testing.assert_array_equal(r.as_numpy("ids_sum"), want["ids_sum"])
    assert r.get_response()["id"] == "abc"
    # Only the requested output comes back.
    r = client(server).infer(
        "mixed", [json_input("ids", ids, "INT64"), json_input("values", values, "FP32")], outputs=json_outputs("ids_sum")
    )
    assert [o["name"] for o in r.get_response()["outputs"]] == ["ids_sum"]


def test_bytes_and_integer_types_round_trip(server):
    words = np.array([[b"ferrite", b"", "déjà".encode()]], dtype=np.object_)
    ints = np.array([[-128, 0, 127]], dtype=np.int8)
    u64 = np.array([[0, 1, 2**64 - 1]], dtype=np.uint64)
    feeds = {f"{dt.lower()}_in": None for dt in ["BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", "FP16", "BF16", "FP32", "FP64", "BYTES"]}
    arrays = {
        "bool_in": (np.array([[True, False, True]]), "BOOL"),
        "uint8_in": (np.array([[0, 1, 255]], dtype=np.uint8), "UINT8"),
        "uint16_in": (np.array([[0, 1, 65535]], dtype=np.uint16), "UINT16"),
        "uint32_in": (np.array([[0, 1, 2**32 - 1]], dtype=np.uint32), "UINT32"),
        "uint64_in": (u64, "UINT64"),
        "int8_in": (ints, "INT8"),
        "int16_in": (ints.astype(np.int16), "INT16"),
        "int32_in": (ints.astype(np.int32), "INT32"),
        "int64_in": (np.array([[-(2**63), 0, 2**63 - 1]], dtype=np.int64), "INT64"),
        "fp16_in": (np.array([[-1.5, 0, 65504]], dtype=np.float16), "FP16"),
        "fp32_in": (np.array([[-1.5, 0, 3.25]], dtype=np.float32), "FP32"),
        "fp64_in": (np.array([[-1.5, 1e-300, 1e300]], dtype=np.float64), "FP64"),
        "bytes_in": (words, "BYTES"),
    }
    assert set(arrays) | {"bf16_in"} == set(feeds)
    inputs = [json_input(n, a, dt) for n, (a, dt) in arrays.items()]
    # numpy has no bfloat16: send its values as JSON numbers.
    bf16 = httpclient.InferInput("bf16_in", [1, 3], "BF16")
    bf16._data = [-1.5, 0.0, 2.0]
    bf16._parameters.pop("binary_data_size", None)
    inputs.append(bf16)
    outs = json_outputs(*[n.replace("_in", "_out") for n in arrays], "bf16_out")
    r = client(server).infer("identity", inputs, outputs=outs)
    for n, (a, _) in arrays.items():
        got = r.as_numpy(n.replace("_in", "_out"))
        if a.dtype == np.object_:
            got = np.array([[g if isinstance(g, bytes) else str(g).encode() for g in row] for row in got], dtype=np.object_)
        np.testing.assert_array_equal(got, a, err_msg=n)
    assert [o for o in r.get_response()["outputs"] if o["name"] == "bf16_out"][0]["data"] == [-1.5, 0.0, 2.0]


def test_non_finite_outputs_are_json_tokens_python_reads(server):
    body = {"inputs": [{"name": "x", "shape": [2, 3], "datatype": "FP64", "data": ["NaN", "Infinity", "-Infinity", 1, 2, 3]}]}
    req = urllib.request.Request(f"http://{server.url}/v2/models/fixed/infer", data=json.dumps(body).encode(), method="POST")
    with urllib.request.urlopen(req) as resp:
        out = json.loads(resp.read())["outputs"][0]["data"]
    assert np.isnan(out[0]) and out[1] == float("inf") and out[2] == float("-inf") and out[3:] == [2, 4, 6]


def test_errors_reach_tritonclient_with_status_and_message(server):
    c = client(server)
    with pytest.raises(InferenceServerException) as e:
        c.infer("mlp", [json_input("input", np.zeros((1, 511), np.float32), "FP32")])
    assert e.value.status() == "400" and "'input'" in e.value.message() and "512" in e.value.message()
    with pytest.raises(InferenceServerException) as e:
        c.infer("mlp", [json_input("input", np.zeros((1, 512), np.float64), "FP64")])
    assert e.value.status() == "400" and "FP32" in e.value.message()
    with pytest.raises(InferenceServerException) as e:
        c.infer("nope", [json_input("input", np.zeros((1, 512), np.float32), "FP32")])
    assert e.value.status() == "404"
    with pytest.raises(InferenceServerException) as e:
        c.infer("mlp", [json_input("input", np.zeros((65, 512), np.float32), "FP32")])
    assert e.value.status() == "400" and "max_batch_size" in e.value.message()
    code, body = curl("-X", "POST", "--data-binary", "{", f"http://{server.url}/v2/models/mlp/infer")
    assert code == 400 and "error" in json.loads(body)


def test_64_concurrent_requests_are_batched(start_server, tmp_path):
    # A queue delay makes merging certain on any machine; the default (0) batches whatever queues
    # while an instance is busy, which depends on timing (see bench/results/mlp.md).
    repo = make_repository(tmp_path / "batching", ("mlp",))
    (repo / "mlp" / "config.toml").write_text("[dynamic_batching]\nmax_queue_delay_microseconds = 20000\n")
    server = start_server(repository=repo)
    c = client(server, concurrency=64)
    before = c.get_inference_statistics("mlp")["model_stats"][0]
    rng = np.random.default_rng(7)
    xs = [rng.standard_normal((1, 512)).astype(np.float32) for _ in range(64)]
    pending = [c.async_infer("mlp", [json_input("input", x, "FP32")], outputs=json_outputs("output")) for x in xs]
    got = np.concatenate([p.get_result().as_numpy("output") for p in pending])
    want = reference(ROOT / "models/mlp/1/model.onnx", {"input": np.concatenate(xs)})["output"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    after = c.get_inference_statistics("mlp")["model_stats"][0]
    requests = after["inference_count"] - before["inference_count"]
    executions = after["execution_count"] - before["execution_count"]
    assert requests == 64
    assert executions < requests, f"{executions} executions for {requests} requests"
    c.close()


def test_bad_model_directory_is_skipped(start_server, tmp_path):
    repo = make_repository(tmp_path / "repo", ("mixed",))
    (repo / "broken" / "1").mkdir(parents=True)
    (repo / "broken" / "1" / "model.onnx").write_bytes(b"not onnx")
    s = start_server(repository=repo)
    c = client(s)
    assert c.is_model_ready("mixed")
    assert not c.is_model_ready("broken")
    assert "broken" in s.logs()


def test_sigterm_drains_in_flight_requests(start_server):
    s = start_server("--exit-timeout-secs", "20", models=("mlp",))
    c = client(s, concurrency=16)
    x = np.ones((64, 512), np.float32)
    pending = [c.async_infer("mlp", [json_input("input", x, "FP32")]) for _ in range(16)]
    time.sleep(0.05)
    s.proc.send_signal(signal.SIGTERM)
    results = []
    for p in pending:
        try:
            results.append(p.get_result().as_numpy("output").shape)
        except InferenceServerException as e:
            results.append(e.status())
    # Requests that reached the server before the signal finish; later ones are refused with 503.
    assert all(r == (64, 10) or r in ("503", None) for r in results), results
    assert (64, 10) in results
    assert s.proc.wait(30) == 0
    assert "shutting down" in s.logs()


def test_missing_onnxruntime_is_one_clear_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "ORT_DYLIB_PATH"}
    env["PATH"] = str(tmp_path)  # no python3 to ask
    out = subprocess.run([BIN, "serve", "--model-repository", str(ROOT / "models")], env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode != 0
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install onnxruntime" in lines[0], out.stderr
    out = subprocess.run([BIN, "serve", "--onnxruntime-lib", "/nonexistent/libonnxruntime.so"], capture_output=True, text=True, timeout=30)
    assert out.returncode != 0 and "does not exist" in out.stderr


def test_flags_read_from_environment(start_server, tmp_path):
    env = dict(os.environ, FERRITE_MAX_BODY_BYTES="100")
    s = start_server(models=("mlp",), env=env)
    code, body = curl("-X", "POST", "--data-binary", json.dumps({"inputs": [{"name": "input", "shape": [1, 512], "datatype": "FP32", "data": [0] * 512}]}), f"http://{s.url}/v2/models/mlp/infer")
    assert code == 413 and "error" in json.loads(body)
    help_text = subprocess.run([BIN, "serve", "--help"], capture_output=True, text=True).stdout
    for flag in ["--model-repository", "--http-port", "--host", "--onnxruntime-lib", "--exit-timeout-secs", "FERRITE_HTTP_PORT"]:
        assert flag in help_text


def test_host_takes_a_name(start_server, tmp_path):
    """--host takes a host name as TEI's --hostname does (Triton's takes addresses only): every
    listener on each address the name resolves to; a name that resolves to none fails before the
    models load, in one line."""
    s = start_server("--host", "localhost", models=("mlp",))
    code, body = curl(f"http://localhost:{s.port}/v2/models/mlp")
    assert code == 200 and json.loads(body)["name"] == "mlp"
    g = grpcclient.InferenceServerClient(f"localhost:{s.grpc_port}")
    assert g.is_model_ready("mlp")
    out = subprocess.run([BIN, "serve", "--model-repository", str(ROOT / "models"), "--host", "no-such-host.invalid"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode != 0
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "--host: host 'no-such-host.invalid'" in lines[0], out.stderr


def test_over_the_concurrency_cap_gets_429_with_retry_after(start_server, tmp_path):
    repo = make_repository(tmp_path / "capped", ("mlp",))
    (repo / "mlp" / "config.toml").write_text("[dynamic_batching]\nmax_queue_delay_microseconds = 2000000\n")
    s = start_server("--max-concurrent-requests", "1", repository=repo)
    c = client(s, concurrency=2)
    waiting = c.async_infer("mlp", [json_input("input", np.ones((1, 512), np.float32), "FP32")])
    time.sleep(0.3)
    body = json.dumps({"inputs": [{"name": "input", "shape": [1, 512], "datatype": "FP32", "data": [0] * 512}]})
    out = subprocess.run(["curl", "-s", "-i", "-X", "POST", "--data-binary", body, f"http://{s.url}/v2/models/mlp/infer"],
                         capture_output=True, text=True, check=True).stdout
    assert out.startswith("HTTP/1.1 429"), out
    assert "retry-after: 1" in out.lower()
    assert waiting.get_result().as_numpy("output").shape == (1, 10)
    with urllib.request.urlopen(f"http://127.0.0.1:{s.metrics_port}/metrics") as r:
        metrics = r.read().decode()
    assert 'reason="throttled"' in metrics
