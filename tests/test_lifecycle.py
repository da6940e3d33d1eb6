"""Model lifecycle through the real binary: reloads under live traffic (poll mode), version
policies, the repository API (HTTP and gRPC, admin scope), canary rollout with automatic
withdrawal. The `scale` test models answer y = k x, so each answer shows which files served it."""

import http.client
import json
import os
import shutil
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import ROOT
from test_metrics import scrape, value

SCALE = ROOT / "tests" / "models" / "scale"
VARIANTS = ROOT / "tests" / "models" / "scale_variants"
ADMIN = "admin-token-0123456789abcdef"
INFER = "infer-token-0123456789abcdef"


def scale_repo(path: Path, versions, config=None, name="scale"):
    """A repository with model `name`: versions maps a version to a model file."""
    for v, src in versions.items():
        (path / name / str(v)).mkdir(parents=True, exist_ok=True)
        shutil.copy(src, path / name / str(v) / "model.onnx")
    if config is not None:
        (path / name / "config.toml").write_text(config)
    return path


def replace(dst: Path, src: Path):
    """Replaces a file atomically (write beside, then rename), as deploy tools do."""
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.copy(src, tmp)
    os.replace(tmp, dst)


def call(url, method, path, body=None, headers=None):
    conn = http.client.HTTPConnection(url, timeout=30)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        r = conn.getresponse()
        data = r.read()
        return r.status, (json.loads(data) if data else None)
    finally:
        conn.close()


def infer(url, x=1.0, version=None, headers=None, request_id=None, model="scale"):
    """One request; returns (status, served version, k) where y = k x."""
    body = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [x, x, x, x]}]}
    if request_id:
        body["id"] = request_id
    path = f"/v2/models/{model}" + (f"/versions/{version}" if version else "") + "/infer"
    status, out = call(url, "POST", path, json.dumps(body), {"Content-Type": "application/json", **(headers or {})})
    if status != 200:
        return status, None, out
    y = out["outputs"][0]["data"][0]
    k = None if y is None or y != y else round(y / x, 3)  # NaN comes back as NaN
    return status, out["model_version"], k


def index(url, token=ADMIN):
    status, rows = call(url, "POST", "/v2/repository/index", b"{}", {"Authorization": f"Bearer {token}"})
    assert status == 200, rows
    return rows


def wait_for(check, timeout=20, what="condition"):
    deadline = time.time() + timeout
    while time.time() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


class Load:
    """Clients sending unversioned requests without pause, recording every answer."""

    def __init__(self, url, threads=4, headers=None):
        self.url, self.headers, self.results, self.stop = url, headers, [], threading.Event()
        # Daemon threads that give up after a minute: a failing test must not leave them running.
        self.until = time.time() + 60
        self.threads = [threading.Thread(target=self.run, daemon=True) for _ in range(threads)]
        for t in self.threads:
            t.start()

    def run(self):
        while not self.stop.is_set() and time.time() < self.until:
            sent = time.time()
            try:
                status, version, k = infer(self.url, headers=self.headers)
            except Exception as e:  # noqa: BLE001 - a transport failure is a failed request
                status, version, k = repr(e), None, None
            self.results.append((sent, time.time(), status, version, k))

    def finish(self):
        self.stop.set()
        for t in self.threads:
            t.join()
        return self.results

    def last(self):
        return self.results[-1] if self.results else None


def test_changes_under_load_fail_no_request(start_server, tmp_path):
    repo = scale_repo(tmp_path / "repo", {1: SCALE / "1" / "model.onnx"})
    s = start_server("--model-control-mode", "poll", "--repository-poll-secs", "0.2", repository=repo)
    load = Load(s.url)
    marks = {}

    def switched(version, k, after=0.0):
        # An answer to a request sent after `after`: one sent before a change can come back after
        # it (version 1's answer to a request sent before version 2 served let the half-written
        # file below land before the poll that loads version 1 again, which then failed as a load,
        # not a reload).
        def check():
            r = load.last()
            return r and r[0] > after and r[3] == version and r[4] == k and r[1]
        return check

    # Replace a model file: k 1 -> 5 on the same version.
    replace(repo / "scale" / "1" / "model.onnx", VARIANTS / "times5.onnx")
    marks["v1k5"] = wait_for(switched("1", 5), what="the replaced file to serve")
    # Change its config.
    (repo / "scale" / "config.toml").write_text("max_batch_size = 8\n")
    wait_for(lambda: call(s.url, "GET", "/v2/models/scale/config")[1]["max_batch_size"] == 8, what="the new config")
    # Add a version: the latest serves.
    (repo / "scale" / "2").mkdir()
    replace(repo / "scale" / "2" / "model.onnx", SCALE / "2" / "model.onnx")
    marks["v2"] = wait_for(switched("2", 2), what="version 2")
    # Remove it again: back to version 1.
    removed = time.time()
    shutil.rmtree(repo / "scale" / "2")
    marks["back"] = wait_for(switched("1", 5, after=removed), what="version 1 again")
    # A half-written file and a file with other inputs: refused, version 1 keeps serving.
    data = (VARIANTS / "times5.onnx").read_bytes()
    (repo / "scale" / "1" / "model.onnx").write_bytes(data[: len(data) // 2])
    wait_for(lambda: any("reload failed" in r["reason"] for r in index(s.url)), what="the failed reload in the index")
    replace(repo / "scale" / "1" / "model.onnx", VARIANTS / "renamed.onnx")
    wait_for(lambda: any("inputs or outputs" in r["reason"] for r in index(s.url)), what="the refused interface change")
    time.sleep(0.5)
    results = load.finish()

    failed = [r for r in results if r[2] != 200]
    assert not failed, failed[:5]
    assert len(results) > 100
    # Every answer came from files that were live: (version, k) pairs that existed ...
    assert {(r[3], r[4]) for r in results} <= {("1", 1.0), ("1", 5.0), ("2", 2.0)}
    # ... and once a change was seen, requests sent after it never reached what it replaced.
    assert not [r for r in results if r[0] > marks["v1k5"] and r[4] == 1.0]
    assert not [r for r in results if marks["v2"] < r[0] < removed and r[3] != "2"]
    assert not [r for r in results if r[0] > marks["back"] and r[3] == "2"]
    rows = index(s.url)
    assert [r for r in rows if r["name"] == "scale" and r["state"] == "READY" and r.get("version") == "1"]
    m = scrape(s.metrics_url)
    assert value(m, "ferrite_model_load_failures_total", model="scale") >= 2


def test_version_policies_and_per_version_readiness(start_server, tmp_path):
    versions = {v: SCALE / str(v) / "model.onnx" for v in (1, 2, 3)}
    repo = scale_repo(tmp_path / "repo", versions, "[version_policy]\nspecific = [1, 3]\n")
    s = start_server("--model-control-mode", "poll", "--repository-poll-secs", "0.2", repository=repo)
    c = httpclient.InferenceServerClient(s.url)
    assert c.is_model_ready("scale", "1") and c.is_model_ready("scale", "3") and not c.is_model_ready("scale", "2")
    assert c.get_model_metadata("scale")["versions"] == ["1", "3"]
    assert infer(s.url)[1:] == ("3", 3.0)
    assert infer(s.url, version=1)[1:] == ("1", 1.0)
    assert infer(s.url, version=2)[0] == 404
    assert c.get_model_config("scale")["version_policy"] == {"specific": {"versions": [1, 3]}}

    (repo / "scale" / "config.toml").write_text("[version_policy]\nall = true\n")
    wait_for(lambda: c.is_model_ready("scale", "2"), what="policy all")
    assert c.get_model_metadata("scale")["versions"] == ["1", "2", "3"]
    (repo / "scale" / "config.toml").write_text("[version_policy]\nlatest = 2\n")
    wait_for(lambda: not c.is_model_ready("scale", "1"), what="policy latest 2")
    assert c.get_model_metadata("scale")["versions"] == ["2", "3"]
    # Server readiness never dropped meanwhile; per-version readiness over gRPC too.
    assert c.is_server_ready()
    g = grpcclient.InferenceServerClient(s.grpc_url)
    assert g.is_model_ready("scale", "3") and not g.is_model_ready("scale", "1")


@pytest.fixture
def admin_server(start_server, tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{INFER}\n{ADMIN} admin\n")
    repo = scale_repo(tmp_path / "repo", {v: SCALE / str(v) / "model.onnx" for v in (1, 2)})
    shutil.copytree(ROOT / "models" / "mlp", repo / "mlp")
    s = start_server("--model-control-mode", "explicit", "--load-model", "scale", "--auth-token-file", str(tokens),
                     repository=repo)
    s.repo = repo
    return s


def test_repository_api_over_http_and_grpc_needs_admin(admin_server, tmp_path):
    s = admin_server
    admin = {"Authorization": f"Bearer {ADMIN}"}
    rows = index(s.url)
    assert {"name": "scale", "version": "2", "state": "READY", "reason": ""} in rows
    assert {"name": "mlp", "state": "UNAVAILABLE", "reason": "not loaded"} in rows
    # Only the admin scope reaches the repository API; an admin token does not infer.
    for path in ("/v2/repository/index", "/v2/repository/models/mlp/load", "/v2/repository/models/mlp/unload"):
        assert call(s.url, "POST", path)[0] == 401
        assert call(s.url, "POST", path, headers={"Authorization": f"Bearer {INFER}"})[0] == 403
    assert infer(s.url, headers=admin)[0] == 403

    h = httpclient.InferenceServerClient(s.url)
    g = grpcclient.InferenceServerClient(s.grpc_url)
    ih, ah = {"Authorization": f"Bearer {INFER}"}, {"authorization": f"Bearer {ADMIN}"}
    with pytest.raises(InferenceServerException) as e:
        g.load_model("mlp", headers={"authorization": f"Bearer {INFER}"})
    assert "PERMISSION_DENIED" in e.value.status()
    # Load and unload through tritonclient, over both protocols, while scale serves traffic.
    load = Load(s.url, threads=2, headers=ih)
    h.load_model("mlp", headers=admin)
    assert h.is_model_ready("mlp", headers=ih)
    g.unload_model("mlp", headers=ah)
    assert not h.is_model_ready("mlp", headers=ih)
    # A model that is not ready: 503 with Retry-After, as for a full queue.
    conn = http.client.HTTPConnection(s.url, timeout=30)
    body = json.dumps({"inputs": [{"name": "input", "shape": [1, 512], "datatype": "FP32", "data": [0.5] * 512}]})
    conn.request("POST", "/v2/models/mlp/infer", body, ih)
    r = conn.getresponse()
    assert r.status == 503 and r.getheader("Retry-After") and b"unloaded" in r.read()
    conn.close()
    g.load_model("mlp", headers=ah)
    assert g.is_model_ready("mlp", headers={"authorization": f"Bearer {INFER}"})
    idx = g.get_model_repository_index(headers=ah, as_json=True)["models"]
    assert {"name": "mlp", "version": "1", "state": "READY"} in [{k: m.get(k) for k in ("name", "version", "state")} for m in idx]
    h.unload_model("mlp", headers=admin)
    # Reload scale itself (a new version appears on disk) while it serves.
    (s.repo / "scale" / "3").mkdir()
    shutil.copy(SCALE / "3" / "model.onnx", s.repo / "scale" / "3" / "model.onnx")
    h.load_model("scale", headers=admin)
    time.sleep(0.3)
    results = load.finish()
    failed = [r for r in results if r[2] != 200]
    assert results and not failed, failed[:5]
    assert {(r[3], r[4]) for r in results} <= {("2", 2.0), ("3", 3.0)}
    assert infer(s.url, headers=ih)[1:] == ("3", 3.0)

    # Names are identifiers; nothing outside the repository is read; no config or files by API.
    assert call(s.url, "POST", "/v2/repository/models/..%2F..%2Fetc/load", headers=admin)[0] == 400
    assert call(s.url, "POST", "/v2/repository/models/nope/load", headers=admin)[0] == 404
    outside = tmp_path / "outside" / "evil"
    scale_repo(tmp_path / "outside", {1: SCALE / "1" / "model.onnx"}, name="evil")
    os.symlink(outside, s.repo / "evil")
    status, body = call(s.url, "POST", "/v2/repository/models/evil/load", headers=admin)
    assert status == 400 and "outside" in body["error"], body
    status, body = call(s.url, "POST", "/v2/repository/models/scale/load",
                        json.dumps({"parameters": {"config": "{}"}}), admin)
    assert status == 501, body


def test_repository_api_is_off_unless_explicit(start_server, tmp_path):
    repo = scale_repo(tmp_path / "repo", {1: SCALE / "1" / "model.onnx"})
    s = start_server(repository=repo)
    status, body = call(s.url, "POST", "/v2/repository/models/scale/unload")
    assert status == 501 and "explicit" in body["error"]
    assert infer(s.url)[0] == 200
    # The index is readable (without auth configured, by anyone local).
    assert index(s.url, token="") == [{"name": "scale", "version": "1", "state": "READY", "reason": ""}]


def canary_server(start_server, tmp_path, candidate, extra=""):
    config = f"[canary]\nversion = 2\nweight = 0.5\nmin_samples = 20\n{extra}"
    repo = scale_repo(tmp_path / "repo", {1: SCALE / "1" / "model.onnx", 2: candidate}, config)
    return start_server("--model-control-mode", "explicit", "--load-model", "*", repository=repo)


def test_a_canary_answering_nan_is_withdrawn(start_server, tmp_path):
    s = canary_server(start_server, tmp_path, VARIANTS / "nan.onnx")
    seen = [infer(s.url, x=-1.0, request_id=f"r{i}") for i in range(200)]
    assert all(r[0] == 200 for r in seen)
    assert {r[1] for r in seen[:40]} == {"1", "2"}, "both sides took traffic"
    rows = [r for r in index(s.url) if r.get("version") == "2"]
    assert "canary withdrawn: error rate" in rows[0]["reason"], rows
    # From then on everything unversioned goes to the stable version.
    assert {infer(s.url, x=-1.0, request_id=f"after{i}")[1] for i in range(50)} == {"1"}
    assert value(scrape(s.metrics_url), "ferrite_canary_rollbacks_total", model="scale") == 1
    assert "canary withdrawn" in s.logs()


def test_a_slow_canary_is_withdrawn(start_server, tmp_path):
    s = canary_server(start_server, tmp_path, VARIANTS / "slow.onnx", "max_p99_delta_ms = 1.5\n")
    for i in range(300):
        assert infer(s.url, request_id=f"r{i}")[0] == 200
    rows = [r for r in index(s.url) if r.get("version") == "2"]
    assert "canary withdrawn: p99" in rows[0]["reason"], rows


def test_a_large_body_is_checked_against_either_side_of_a_canary(start_server, tmp_path):
    """A large body's inputs are checked against the model before their data is decoded. While a
    canary runs, which side serves a request is chosen once it is whole (by its id), so an input
    that either side takes is decoded: here the candidate takes FP64 where the stable version
    takes FP32, and each is refused only by the side that serves it."""
    import onnx
    from onnx import TensorProto, helper
    graph = helper.make_graph([helper.make_node("Mul", ["x", "k"], ["y"])], "double",
                              [helper.make_tensor_value_info("x", TensorProto.DOUBLE, ["N", 4])],
                              [helper.make_tensor_value_info("y", TensorProto.DOUBLE, ["N", 4])],
                              [helper.make_tensor("k", TensorProto.DOUBLE, [], [3.0])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8),
              tmp_path / "double.onnx")
    config = "max_batch_size = 8192\n[canary]\nversion = 2\nweight = 0.5\nmin_samples = 20\n"
    repo = scale_repo(tmp_path / "repo", {1: SCALE / "1" / "model.onnx", 2: tmp_path / "double.onnx"}, config)
    s = start_server("--model-control-mode", "explicit", "--load-model", "*", repository=repo)

    def send(datatype, side):
        body = json.dumps({"inputs": [{"name": "x", "shape": [8000, 4], "datatype": datatype,
                                       "data": [0.123456789] * 32000}]})
        assert len(body) > 256 << 10, "decoded off the I/O threads, and checked first"
        headers = {"Content-Type": "application/json", "x-ferrite-canary": side}
        return call(s.url, "POST", "/v2/models/scale/infer", body, headers)

    for datatype, side, version in (("FP64", "always", "2"), ("FP32", "never", "1")):
        status, out = send(datatype, side)
        assert status == 200 and out["model_version"] == version and out["outputs"][0]["shape"] == [8000, 4], out
    for datatype, side, wanted in (("FP32", "always", "FP64"), ("FP64", "never", "FP32"), ("FP16", "auto", "FP32")):
        status, out = send(datatype, side)
        assert status == 400 and out["error"] == f"input 'x': expected datatype {wanted}, got {datatype}", out


def test_a_good_canary_stays_routes_sticky_and_is_promoted(start_server, tmp_path):
    s = canary_server(start_server, tmp_path, SCALE / "2" / "model.onnx")
    seen = [infer(s.url, x=-1.0, request_id=f"r{i}") for i in range(300)]
    sides = [r[1] for r in seen]
    assert 90 < sides.count("2") < 210, sides.count("2")
    assert all(r[2] == {"1": 1.0, "2": 2.0}[r[1]] for r in seen)
    assert "withdrawn" not in json.dumps(index(s.url))
    # Sticky per request id; the header overrides for testers.
    for i in range(10):
        assert infer(s.url, request_id=f"r{i}")[1] == sides[i]
    assert {infer(s.url, headers={"x-ferrite-canary": "always"})[1] for _ in range(10)} == {"2"}
    assert {infer(s.url, headers={"x-ferrite-canary": "never"})[1] for _ in range(10)} == {"1"}
    assert infer(s.url, headers={"x-ferrite-canary": "sometimes"})[0] == 400
    g = grpcclient.InferenceServerClient(s.grpc_url)
    x = grpcclient.InferInput("x", [1, 4], "FP32")
    x.set_data_from_numpy(np.ones((1, 4), np.float32))
    assert g.infer("scale", [x], headers={"x-ferrite-canary": "always"}).get_response().model_version == "2"
    # Promotion: an explicit call.
    assert call(s.url, "POST", "/v2/repository/models/scale/promote")[0] == 200
    assert {infer(s.url, request_id=f"p{i}")[1] for i in range(20)} == {"2"}
