"""Auth: every route of every listener, without a token, with a wrong one, with one of the wrong
scope and with the right one; gRPC too, through tritonclient and the raw health service."""

import json
import os
import subprocess
import time
import urllib.error
import urllib.request

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from conftest import make_repository

INFER = "infer-token-0123456789abcdef"
METRICS = "metrics-token-0123456789abcdef"
ADMIN = "admin-token-0123456789abcdef"
WRONG = "wrong-token-0123456789abcdef"

BODY = json.dumps({"inputs": [{"name": "input", "shape": [1, 512], "datatype": "FP32", "data": [0] * 512}]})
HTTP_ROUTES = [
    ("GET", "/v2"),
    ("GET", "/v2/models/mlp"),
    ("GET", "/v2/models/mlp/ready"),
    ("GET", "/v2/models/mlp/config"),
    ("GET", "/v2/models/mlp/versions/1"),
    ("GET", "/v2/models/mlp/versions/1/config"),
    ("POST", "/v2/models/mlp/infer"),
    ("POST", "/v2/models/mlp/versions/1/infer"),
    ("GET", "/v2/no/such/route"),
]
# Statistics count every tenant's traffic and cache hits: the operator's (metrics) scope.
STATS_ROUTES = [("GET", "/v2/models/mlp/stats"), ("GET", "/v2/models/stats"), ("GET", "/v2/models/mlp/versions/1/stats"),
                ("GET", "/dashboard/metrics")]
HEALTH = [("GET", "/v2/health/live"), ("GET", "/v2/health/ready"), ("GET", "/health"), ("GET", "/ping"), ("GET", "/")]


def http(method, url, token=None):
    req = urllib.request.Request(url, data=BODY.encode() if method == "POST" else None, method=method)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req) as r:
            return r.status
    except urllib.error.HTTPError as e:
        if e.code == 401:
            assert e.headers["WWW-Authenticate"] == "Bearer"
        return e.code


@pytest.fixture
def secured(start_server, tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text(f"# scopes default to infer\n{INFER}\n{METRICS} metrics\n{ADMIN} admin,metrics\n")

    def start(*extra):
        return start_server("--auth-token-file", str(tokens), "--metrics-on-http", *extra,
                            repository=make_repository(tmp_path / f"repo{len(extra)}", ("mlp",)))

    return start


def test_every_http_route_needs_the_right_token(secured):
    s = secured()
    base = f"http://{s.url}"
    for method, path in HTTP_ROUTES + HEALTH:
        assert http(method, base + path) == 401, path
        assert http(method, base + path, WRONG) == 401, path
        assert http(method, base + path, METRICS) == 403, path
        expected = 404 if path == "/v2/no/such/route" else 200
        assert http(method, base + path, INFER) == expected, path
    for method, path in STATS_ROUTES:
        assert http(method, base + path) == 401, path
        assert http(method, base + path, INFER) == 403, path
        assert http(method, base + path, METRICS) == 200, path
    for url in (f"{base}/metrics", s.metrics_url):
        assert http("GET", url) == 401
        assert http("GET", url, WRONG) == 401
        assert http("GET", url, INFER) == 403
        assert http("GET", url, METRICS) == 200
        assert http("GET", url, ADMIN) == 200
    # The live page is static (a browser cannot send a token to load it); its data is behind
    # the metrics scope above.
    assert http("GET", f"{base}/dashboard") == 200
    # The token never appears in the logs.
    assert INFER not in s.logs() and WRONG not in s.logs()


REPOSITORY_ROUTES = [("POST", "/v2/repository/index", 200), ("POST", "/v2/repository/models/mlp/load", 501),
                     ("POST", "/v2/repository/models/mlp/unload", 501), ("POST", "/v2/repository/models/mlp/promote", 501)]


def test_the_repository_api_needs_the_admin_scope(secured):
    s = secured()
    base = f"http://{s.url}"
    for method, path, reached in REPOSITORY_ROUTES:
        assert http(method, base + path) == 401, path
        assert http(method, base + path, WRONG) == 401, path
        assert http(method, base + path, INFER) == 403, path
        assert http(method, base + path, METRICS) == 403, path
        # With the admin scope the handler answers (load and unload need explicit mode: 501).
        assert http(method, base + path, ADMIN) == reached, path
    c = grpcclient.InferenceServerClient(s.grpc_url)
    for token, code in ((None, "UNAUTHENTICATED"), (WRONG, "UNAUTHENTICATED"), (INFER, "PERMISSION_DENIED")):
        headers = {"authorization": f"Bearer {token}"} if token else None
        for call in (lambda: c.get_model_repository_index(headers=headers),
                     lambda: c.load_model("mlp", headers=headers), lambda: c.unload_model("mlp", headers=headers)):
            with pytest.raises(InferenceServerException) as e:
                call()
            assert e.value.status() == f"StatusCode.{code}"
    assert c.get_model_repository_index(headers={"authorization": f"Bearer {ADMIN}"}, as_json=True)["models"]


def test_health_may_be_left_open(secured):
    s = secured("--auth-allow-health")
    for method, path in HEALTH:
        assert http(method, f"http://{s.url}{path}") == 200
    assert http("GET", f"http://{s.url}/v2/models/mlp") == 401
    # TEI's health is GET /; its POST is an inference call.
    assert http("POST", f"http://{s.url}/") == 401
    assert http("POST", f"http://{s.url}/invocations") == 401


GRPC_CALLS = ["ServerLive", "ServerReady", "ModelReady", "ServerMetadata", "ModelMetadata", "ModelConfig",
              "ModelInfer"]


@pytest.mark.parametrize("token,code", [(None, "UNAUTHENTICATED"), (WRONG, "UNAUTHENTICATED"), (METRICS, "PERMISSION_DENIED")])
def test_every_grpc_call_needs_the_right_token(secured, token, code):
    s = secured()
    headers = {"authorization": f"Bearer {token}"} if token else None
    c = grpcclient.InferenceServerClient(s.grpc_url)
    for name in GRPC_CALLS:
        with pytest.raises(InferenceServerException) as e:
            call_with(c, name, headers)
        assert e.value.status() == f"StatusCode.{code}", name
    with grpc.insecure_channel(s.grpc_url) as ch:
        check = ch.unary_unary("/grpc.health.v1.Health/Check")
        with pytest.raises(grpc.RpcError) as e:
            check(b"", metadata=[("authorization", f"Bearer {token}")] if token else None)
        assert e.value.code().name == code


def call_with(c, name, headers):
    """One RPC through tritonclient, with `headers` as call metadata."""
    x = grpcclient.InferInput("input", [1, 512], "FP32")
    x.set_data_from_numpy(np.zeros((1, 512), np.float32))
    calls = {
        "ServerLive": lambda: c.is_server_live(headers=headers),
        "ServerReady": lambda: c.is_server_ready(headers=headers),
        "ModelReady": lambda: c.is_model_ready("mlp", headers=headers),
        "ServerMetadata": lambda: c.get_server_metadata(headers=headers),
        "ModelMetadata": lambda: c.get_model_metadata("mlp", headers=headers),
        "ModelConfig": lambda: c.get_model_config("mlp", headers=headers),
        "ModelInfer": lambda: c.infer("mlp", [x], headers=headers),
        "ModelStatistics": lambda: c.get_inference_statistics("mlp", headers=headers),
    }
    return calls[name]()


def test_grpc_with_the_right_token(secured):
    s = secured()
    c = grpcclient.InferenceServerClient(s.grpc_url)
    headers = {"authorization": f"Bearer {INFER}"}
    for name in GRPC_CALLS:
        call_with(c, name, headers)
    assert call_with(c, "ModelInfer", headers).as_numpy("output").shape == (1, 10)
    # Statistics are the operator's: an infer token cannot read them, a metrics token can.
    with pytest.raises(InferenceServerException) as e:
        call_with(c, "ModelStatistics", headers)
    assert e.value.status() == "StatusCode.PERMISSION_DENIED"
    call_with(c, "ModelStatistics", {"authorization": f"Bearer {METRICS}"})
    with grpc.insecure_channel(s.grpc_url) as ch:
        assert ch.unary_unary("/grpc.health.v1.Health/Check")(b"", metadata=[("authorization", f"Bearer {INFER}")]) == b"\x08\x01"


def test_a_changed_token_file_is_used_without_a_restart(secured, tmp_path):
    s = secured()
    model = f"http://{s.url}/v2/models/mlp"
    assert http("GET", model, INFER) == 200
    rotated = "rotated-token-0123456789abcdef"

    def replace(text):
        # As a Kubernetes Secret update does: the new file takes the old one's place.
        (tmp_path / "tokens.new").write_text(text)
        os.replace(tmp_path / "tokens.new", tmp_path / "tokens")

    replace(f"{rotated}\n{METRICS} metrics\n")
    deadline = time.time() + 15
    while http("GET", model, rotated) != 200 and time.time() < deadline:
        time.sleep(0.2)
    assert http("GET", model, rotated) == 200
    assert http("GET", model, INFER) == 401, "the old token stops working"
    # A file that does not parse leaves the tokens in use as they were.
    replace("too-short\n")
    deadline = time.time() + 15
    while "cannot be used" not in s.logs() and time.time() < deadline:
        time.sleep(0.2)
    assert "cannot be used" in s.logs()
    assert http("GET", model, rotated) == 200 and http("GET", model, INFER) == 401
    assert rotated not in s.logs()
