"""gRPC specifics through real clients: tritonclient.grpc (sync, async, stream), the standard
health service, deadlines, and a stream that survives a bad request."""

import queue
import time

import grpc
import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from conftest import ROOT, make_repository


def mlp_input(x):
    i = grpcclient.InferInput("input", list(x.shape), "FP32")
    i.set_data_from_numpy(x)
    return i


def reference(x):
    sess = ort.InferenceSession(str(ROOT / "models/mlp/1/model.onnx"), providers=["CPUExecutionProvider"])
    return sess.run(None, {"input": x})[0]


def test_metadata_config_and_statistics(server):
    c = grpcclient.InferenceServerClient(server.grpc_url)
    assert c.is_server_live() and c.is_server_ready() and c.is_model_ready("mixed")
    assert not c.is_model_ready("nope")
    assert c.get_server_metadata(as_json=True)["name"] == "ferrite"
    meta = c.get_model_metadata("mlp", as_json=True)
    assert meta["inputs"] == [{"name": "input", "datatype": "FP32", "shape": ["-1", "512"]}]
    config = c.get_model_config("mixed", as_json=True)["config"]
    assert config["max_batch_size"] == 64
    assert [i["data_type"] for i in config["input"]] == ["TYPE_INT64", "TYPE_FP32"]
    assert "dynamic_batching" in config
    stats = c.get_inference_statistics("mixed", as_json=True)["model_stats"][0]
    assert stats["name"] == "mixed"


def test_health_service(server):
    with grpc.insecure_channel(server.grpc_url) as ch:
        check = ch.unary_unary("/grpc.health.v1.Health/Check")
        # HealthCheckRequest{} is empty on the wire; HealthCheckResponse{status: SERVING} is 08 01.
        assert check(b"") == b"\x08\x01"
        assert check(b"\x0a\x1einference.GRPCInferenceService") == b"\x08\x01"


def test_async_infer_matches_onnxruntime(server):
    c = grpcclient.InferenceServerClient(server.grpc_url)
    xs = [np.random.default_rng(i).standard_normal((1, 512)).astype(np.float32) for i in range(16)]
    done = queue.Queue()
    for i, x in enumerate(xs):
        c.async_infer("mlp", [mlp_input(x)], callback=lambda result, error, i=i: done.put((i, result, error)), request_id=str(i))
    got = {}
    for _ in xs:
        i, r, e = done.get(timeout=30)
        assert e is None, e
        assert r.get_response().id == str(i)
        got[i] = r.as_numpy("output")
    np.testing.assert_allclose(np.concatenate([got[i] for i in range(16)]), reference(np.concatenate(xs)), rtol=1e-5, atol=1e-6)


def test_stream_goes_on_after_a_bad_request(server):
    c = grpcclient.InferenceServerClient(server.grpc_url)
    results = queue.Queue()
    c.start_stream(callback=lambda result, error: results.put((result, error)))
    x = np.ones((1, 512), np.float32)
    c.async_stream_infer("mlp", [mlp_input(x)], request_id="a")
    c.async_stream_infer("mlp", [mlp_input(np.ones((1, 3), np.float32))], request_id="bad")
    c.async_stream_infer("mlp", [mlp_input(x)], request_id="c")
    outcomes = [results.get(timeout=30) for _ in range(3)]
    c.stop_stream()
    ok = sorted(r.get_response().id for r, e in outcomes if e is None)
    errors = [e for r, e in outcomes if e is not None]
    assert ok == ["a", "c"]
    assert len(errors) == 1 and "'input'" in errors[0].message()


def test_large_messages_are_each_answered_from_their_own_bytes(start_server, tmp_path):
    """Unary messages of 256 KiB and more are read into buffers reused from call to call: answers to
    concurrent ones, plain or gzip-compressed, above and below the pool's 1 MiB, are each their own
    request's; one over the decoding limit is refused before it is read."""
    repo = make_repository(tmp_path / "repo", ("mlp",))
    (repo / "mlp" / "config.toml").write_text("max_batch_size = 1024\n")
    s = start_server("--grpc-max-decoding-message-size", str(3 << 19), repository=repo)
    c = grpcclient.InferenceServerClient(s.grpc_url)
    # 1.2 MB and 614 KB messages.
    xs = [np.random.default_rng(i).standard_normal((600 if i % 2 else 300, 512)).astype(np.float32) for i in range(8)]
    done = queue.Queue()
    for i, x in enumerate(xs):
        c.async_infer("mlp", [mlp_input(x)], callback=lambda result, error, i=i: done.put((i, result, error)),
                      compression_algorithm="gzip" if i % 4 == 3 else None)
    for _ in xs:
        i, r, e = done.get(timeout=60)
        assert e is None, e
        np.testing.assert_allclose(r.as_numpy("output"), reference(xs[i]), rtol=1e-5, atol=1e-5)
    with pytest.raises(InferenceServerException) as e:
        c.infer("mlp", [mlp_input(np.ones((800, 512), np.float32))])  # 1.6 MB, over the 1.5 MiB limit
    assert e.value.status() == "StatusCode.OUT_OF_RANGE", e.value
    r = c.infer("mlp", [mlp_input(xs[0])])
    np.testing.assert_allclose(r.as_numpy("output"), reference(xs[0]), rtol=1e-5, atol=1e-5)


def test_deadline_ends_a_queued_request_without_running_it(start_server, tmp_path):
    repo = make_repository(tmp_path / "slow", ("mlp",))
    (repo / "mlp" / "config.toml").write_text("[dynamic_batching]\nmax_queue_delay_microseconds = 3000000\n")
    s = start_server(repository=repo)
    c = grpcclient.InferenceServerClient(s.grpc_url)
    started = time.time()
    with pytest.raises(InferenceServerException) as e:
        c.infer("mlp", [mlp_input(np.ones((1, 512), np.float32))], client_timeout=0.2)
    # The client's own deadline, ours (DEADLINE_EXCEEDED) or tonic's (CANCELLED): whichever fires first.
    assert e.value.status() in ("StatusCode.DEADLINE_EXCEEDED", "StatusCode.CANCELLED")
    assert time.time() - started < 2
    time.sleep(3.5)  # past the queue delay: had the request stayed queued, it would have run by now
    stats = c.get_inference_statistics("mlp", as_json=True)["model_stats"][0]
    assert int(stats.get("execution_count", 0)) == 0, stats
