"""One client never fails another, through the real binary: a bad row in a batch fails only its
own request (the batch is run apart), BYTES that are not UTF-8 are refused before they can share a
batch, a replaced model is never answered from the cache, refusals over gRPC carry a retry hint,
a canary is judged only on the router's own choices and the model's own failures, and timeouts
below the deadline estimate cannot lock a model out."""

import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from conftest import http_call, make_repository
from test_lifecycle import SCALE, VARIANTS, call, canary_server, index, infer, replace, scale_repo, wait_for

# Requests wait up to 300 ms for others, so concurrent ones share a batch.
BATCHING = "max_batch_size = 16\n[dynamic_batching]\nmax_queue_delay_microseconds = 300000\npreferred_batch_size = [6]\n"


def lookup_inputs(ids, text=b"hi", client=httpclient):
    i = client.InferInput("ids", [1, 2], "INT64")
    i.set_data_from_numpy(np.array([ids], np.int64))
    t = client.InferInput("text", [1, 1], "BYTES")
    t.set_data_from_numpy(np.array([[text]], dtype=np.object_))
    return [i, t]


def lookup_server(start_server, tmp_path):
    repo = make_repository(tmp_path / "repo", ("lookup",))
    (repo / "lookup" / "config.toml").write_text(BATCHING)
    return start_server(repository=repo)


def run_together(url, requests):
    """Sends `requests` (ids, text) at once, each from its own client; returns answers or errors."""
    barrier = threading.Barrier(len(requests))

    def one(req):
        c = httpclient.InferenceServerClient(url)
        barrier.wait()
        try:
            return c.infer("lookup", lookup_inputs(*req)).as_numpy("vectors")
        except InferenceServerException as e:
            return e

    with ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(one, requests))


@pytest.mark.parametrize("poison", ["id out of range", "not UTF-8"])
def test_one_clients_bad_row_fails_only_its_own_request(start_server, tmp_path, poison):
    s = lookup_server(start_server, tmp_path)
    innocent = [([i, 9 - i], b"hi") for i in range(5)]
    bad = ([1, 12], b"hi") if poison == "id out of range" else ([1, 2], b"\xff\xfe")
    got = run_together(s.url, innocent + [bad])
    for (ids, _), r in zip(innocent, got):
        assert not isinstance(r, Exception), r
        np.testing.assert_array_equal(r[0], np.repeat(np.array(ids, np.float32)[:, None], 3, axis=1))
    err = got[-1]
    assert isinstance(err, InferenceServerException)
    assert err.status() == "400", "the client's own bad data is a 400 (ONNX Runtime's INVALID_ARGUMENT)"
    # The error is the poisoned request's own: no innocent's data or text in it.
    if poison == "id out of range":
        assert re.findall(r"idx=(-?\d+)", str(err)) == ["12"], err
    else:
        assert "UTF-8" in str(err), err
    stats = http_call(s.url, lambda c: c.get_inference_statistics("lookup"))["model_stats"][0]
    if poison == "id out of range":
        # They were batched (the UTF-8 poison is refused before it can queue).
        assert any(b["batch_size"] > 1 for b in stats["batch_stats"]), stats["batch_stats"]


def test_non_utf8_bytes_over_grpc_raw_contents_are_refused_alone(start_server, tmp_path):
    s = lookup_server(start_server, tmp_path)
    c = grpcclient.InferenceServerClient(s.grpc_url)
    with pytest.raises(InferenceServerException, match="not UTF-8"):
        c.infer("lookup", lookup_inputs([1, 2], b"\xc3\x28", client=grpcclient))
    assert c.infer("lookup", lookup_inputs([3, 4], client=grpcclient)).as_numpy("vectors")[0, 0, 0] == 3


def test_a_replaced_model_is_never_answered_from_the_cache(start_server, tmp_path):
    repo = scale_repo(tmp_path / "repo", {1: SCALE / "1" / "model.onnx"}, "[cache]\nenabled = true\n")
    s = start_server("--model-control-mode", "poll", "--repository-poll-secs", "0.2", repository=repo)
    assert infer(s.url, x=3.0)[2] == 1.0
    assert infer(s.url, x=3.0)[2] == 1.0  # a cache hit now
    replace(repo / "scale" / "1" / "model.onnx", VARIANTS / "times5.onnx")
    wait_for(lambda: "replaced=true" in re.sub(r"\x1b\[[0-9;]*m", "", s.logs()), what="the reload")
    assert infer(s.url, x=3.0)[2] == 5.0, "the old model's cached answer was served"


def test_grpc_refusals_carry_a_retry_hint(start_server, tmp_path):
    repo = make_repository(tmp_path / "repo", ("slow",))
    (repo / "slow" / "config.toml").write_text("max_batch_size = 1\n[dynamic_batching]\nmax_queue_size = 1\n")
    s = start_server(repository=repo)
    stub = service_pb2_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(s.grpc_url))
    raw = np.full((1, 512), 0.25, np.float32).tobytes()
    req = service_pb2.ModelInferRequest(model_name="slow", raw_input_contents=[raw])
    t = req.inputs.add()
    t.name, t.datatype = "x", "FP32"
    t.shape.extend([1, 512])

    def one(_):
        try:
            stub.ModelInfer(req, timeout=30)
            return None
        except grpc.RpcError as e:
            return e

    with ThreadPoolExecutor(16) as pool:
        refused = [e for e in pool.map(one, range(48)) if e is not None]
    assert refused, "a queue of 1 under 16 concurrent clients refused nothing"
    for e in refused:
        assert e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED), e
        md = dict(e.trailing_metadata())
        assert md.get("retry-after") == "1", md
        assert b"type.googleapis.com/google.rpc.RetryInfo" in md["grpc-status-details-bin"]


def test_forced_and_timed_out_requests_do_not_withdraw_a_healthy_canary(start_server, tmp_path):
    s = canary_server(start_server, tmp_path, SCALE / "2" / "model.onnx")
    # NaN inputs give NaN answers on both versions; forced to the candidate with the header.
    always = {"x-ferrite-canary": "always"}
    for i in range(60):
        assert infer(s.url, x=float("nan"), headers=always, request_id=f"n{i}")[0] == 200
    # Requests with a 1 µs timeout: the client's own deadline, not the model's failure.
    body = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1, 1, 1, 1]}],
            "parameters": {"timeout": 1}}
    for i in range(60):
        body["id"] = f"t{i}"
        call(s.url, "POST", "/v2/models/scale/infer", json.dumps(body), {"Content-Type": "application/json"})
    # Routed NaN questions answered NaN are not failures either.
    for i in range(60):
        assert infer(s.url, x=float("nan"), request_id=f"r{i}")[0] == 200
    rows = [r for r in index(s.url) if r.get("version") == "2"]
    assert "withdrawn" not in rows[0]["reason"], rows
    assert "canary: weight" in rows[0]["reason"], rows


def test_timeouts_below_the_estimate_never_lock_a_model_out(start_server, tmp_path):
    repo = make_repository(tmp_path / "repo", ("slow",))
    (repo / "slow" / "config.toml").write_text("max_batch_size = 64\ninstance_count = 1\nthreads = 1\n")
    s = start_server(repository=repo)
    big = {"inputs": [{"name": "x", "shape": [48, 512], "datatype": "FP32", "data": [0.25] * (48 * 512)}]}
    for _ in range(3):  # seeds the estimate with large batches
        assert call(s.url, "POST", "/v2/models/slow/infer", json.dumps(big), {"Content-Type": "application/json"})[0] == 200
    small = {"inputs": [{"name": "x", "shape": [1, 512], "datatype": "FP32", "data": [0.25] * 512}],
             "parameters": {"timeout": 100000}}

    def ok():
        return call(s.url, "POST", "/v2/models/slow/infer", json.dumps(small), {"Content-Type": "application/json"})[0]

    # One at a time, nothing is ahead of a request: each is admitted and runs (a lone one may still
    # miss 100 ms on a loaded machine), and the estimate follows the small runs from then on. The
    # estimate the big batches left (hundreds of ms) refused every one of them before.
    first = [ok() for _ in range(10)]
    assert first.count(200) >= 8, first
    time.sleep(3)
    assert [ok() for _ in range(10)].count(200) >= 9
