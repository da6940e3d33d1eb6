"""Triton Python-backend models (tests/triton_python: `model.py` files written as Triton's
python_backend examples write them) served unchanged, each instance a worker process: answers
checked through tritonclient over HTTP and gRPC against the same code run in plain Python; an
ensemble python -> onnx -> python; BLS calls; a worker's exception, crash, hang and memory
growth each contained (the others keep serving); cancellation; finalize on unload and shutdown."""

import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from PIL import Image
from tritonclient.utils import InferenceServerException

from conftest import BIN, ROOT, Server, http_call

CLIENTS = [httpclient, grpcclient]


def repository(dest: Path):
    for d in (ROOT / "tests" / "triton_python").iterdir():
        if d.is_dir():
            shutil.copytree(d, dest / d.name)
    for name in ("mlp", "tiny_cnn", "image_classifier"):
        shutil.copytree(ROOT / "models" / name, dest / name)
    # A native pipeline whose last step is the Python post-processor: the bundled image
    # classifier's steps up to its model, then `postprocess` in place of softmax and top-k.
    native = (ROOT / "models" / "image_classifier" / "config.toml").read_text().split('op = "softmax"')[0]
    native = native.rsplit("[[steps]]", 1)[0] + (
        '[[steps]]\nop = "model"\nmodel = "postprocess"\ninputs = { LOGITS = "logits" }\n'
        '\n[[output]]\nname = "CLASS"\n\n[[output]]\nname = "LABEL"\n')
    (dest / "native_then_python").mkdir()
    (dest / "native_then_python" / "config.toml").write_text(native)
    return dest


@pytest.fixture(scope="module")
def marks(tmp_path_factory):
    return tmp_path_factory.mktemp("marks")


@pytest.fixture(scope="module")
def served(tmp_path_factory, marks):
    repo = repository(tmp_path_factory.mktemp("python") / "repo")
    env = dict(os.environ, FAULTY_MARKS=str(marks))
    s = Server(repo, "--python", sys.executable, env=env)
    yield s
    s.stop()


def client_of(s, client, **kw):
    return client.InferenceServerClient(s.url if client is httpclient else s.grpc_url, **kw)


def tensor(client, name, value, datatype):
    t = client.InferInput(name, list(value.shape), datatype)
    t.set_data_from_numpy(value)
    return t


def action(client, what):
    return tensor(client, "ACTION", np.array([what.encode()], dtype=np.object_), "BYTES")


def metric(s, name):
    text = urllib.request.urlopen(s.metrics_url, timeout=10).read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


@pytest.mark.parametrize("client", CLIENTS)
def test_add_sub_as_triton_example(served, client):
    c = client_of(served, client)
    a = np.arange(8, dtype=np.float32).reshape(2, 4)
    b = np.full((2, 4), 0.5, np.float32)
    r = c.infer("add_sub", [tensor(client, "INPUT0", a, "FP32"), tensor(client, "INPUT1", b, "FP32")])
    np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), a + b)
    np.testing.assert_array_equal(r.as_numpy("OUTPUT1"), a - b)
    # One output asked for: that one only.
    out = client.InferRequestedOutput("OUTPUT1")
    r = c.infer("add_sub", [tensor(client, "INPUT0", a, "FP32"), tensor(client, "INPUT1", b, "FP32")], outputs=[out])
    assert r.as_numpy("OUTPUT0") is None
    np.testing.assert_array_equal(r.as_numpy("OUTPUT1"), a - b)


def test_config_and_metadata_say_python(served):
    c = httpclient.InferenceServerClient(served.url)
    config = c.get_model_config("add_sub")
    assert config["backend"] == "python"
    assert config["max_batch_size"] == 8
    assert config["parameters"]["greeting"] == {"string_value": "hello"}
    assert [i["name"] for i in config["input"]] == ["INPUT0", "INPUT1"]
    meta = c.get_model_metadata("add_sub")
    assert [o["name"] for o in meta["outputs"]] == ["OUTPUT0", "OUTPUT1"]
    assert meta["inputs"][0]["shape"] == [-1, 4]
    # auto_complete_config stated the tensors of a config that names only its backend.
    auto = c.get_model_config("auto")
    assert [i["name"] for i in auto["input"]] == ["X"] and auto["max_batch_size"] == 4
    r = c.infer("auto", [tensor(httpclient, "X", np.array([[1, 2]], np.int32), "INT32")])
    np.testing.assert_array_equal(r.as_numpy("Y"), [[3, 6]])
    assert "initialized as add_sub_0_0" in served.logs()


def test_concurrent_requests_keep_their_own_rows(served):
    """The batcher gives execute several requests at once, each with its own first dimension, and
    each gets its own answer."""
    errors, done = [], []

    def one(i):
        try:
            c = httpclient.InferenceServerClient(served.url)
            rows = 1 + i % 3
            a = np.full((rows, 4), i, np.float32)
            b = np.arange(rows * 4, dtype=np.float32).reshape(rows, 4)
            r = c.infer("add_sub", [tensor(httpclient, "INPUT0", a, "FP32"), tensor(httpclient, "INPUT1", b, "FP32")])
            np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), a + b)
            done.append(i)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(24)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(done) == 24
    stats = http_call(served.url, lambda c: c.get_inference_statistics("add_sub"))["model_stats"][0]
    # Requests were merged into fewer executions than requests (dynamic batching).
    assert stats["execution_count"] < stats["inference_count"]


def test_a_request_that_raises_fails_alone(served):
    """One client's request that makes execute raise does not fail the requests batched with it:
    the call's requests run again in halves, and only the one that raises gets the error."""
    results = {}

    def one(i):
        c = httpclient.InferenceServerClient(served.url)
        x = np.full((1, 2), -1.0 if i == 3 else float(i), np.float32)
        try:
            results[i] = c.infer("strict", [tensor(httpclient, "X", x, "FP32")]).as_numpy("Y")
        except InferenceServerException as e:
            results[i] = e

    threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert isinstance(results[3], InferenceServerException) and "negative input" in str(results[3])
    for i in (0, 1, 2, 4, 5):
        np.testing.assert_allclose(results[i], np.sqrt(np.full((1, 2), float(i), np.float32)))
    stats = http_call(served.url, lambda c: c.get_inference_statistics("strict"))["model_stats"][0]
    assert stats["execution_count"] > 1  # the first call held several requests, then its halves ran


def reference_classify(encoded):
    """The ensemble's steps in plain Python: preprocess's code, tiny_cnn in onnxruntime, argmax."""
    img = Image.open(io.BytesIO(encoded)).convert("RGB").resize((32, 32), Image.BILINEAR)
    x = (np.asarray(img, dtype=np.float32) / 255.0).transpose(2, 0, 1)[None]
    session = ort.InferenceSession(str(ROOT / "models" / "tiny_cnn" / "1" / "model.onnx"))
    logits = session.run(None, {"pixels": x})[0]
    labels = "airplane,automobile,bird,cat,deer,dog,frog,horse,ship,truck".split(",")
    best = int(np.argmax(logits[0]))
    return best, labels[best]


def test_a_request_id_or_parameters_cannot_reach_into_another_request(served):
    """Ids and parameters travel to the worker inside each batch's packed message: ones made to
    look like its length fields, or long, stay their own request's and shift no one's tensors."""
    errors, done = [], []
    crafted = "\x00\x00\x00\x00\x01\x04FP32\x01\xff" + "é" * 40

    def one(i):
        try:
            c = httpclient.InferenceServerClient(served.url)
            rows = 1 + i % 3
            a = np.full((rows, 4), i, np.float32)
            b = np.arange(rows * 4, dtype=np.float32).reshape(rows, 4)
            r = c.infer("add_sub", [tensor(httpclient, "INPUT0", a, "FP32"), tensor(httpclient, "INPUT1", b, "FP32")],
                        request_id=f"{crafted}{i}", parameters={"flavour": crafted * (1 + 200 * (i % 2))})
            np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), a + b)
            done.append(i)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(24)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(done) == 24
    c = httpclient.InferenceServerClient(served.url)
    r = c.infer("faulty", [action(httpclient, "whoami")], request_id=crafted, parameters={"flavour": crafted})
    assert r.as_numpy("ECHO")[0].decode() == f"{crafted} ECHO {crafted}"


@pytest.mark.parametrize("client", CLIENTS)
def test_ensemble_python_onnx_python_equals_plain_python(served, client):
    c = client_of(served, client)
    rng = np.random.default_rng(7)
    for size, fmt in [((40, 50), "PNG"), ((64, 48), "JPEG"), ((20, 20), "PNG")]:
        buf = io.BytesIO()
        Image.fromarray((rng.random((*size, 3)) * 255).astype(np.uint8)).save(buf, fmt)
        encoded = buf.getvalue()
        r = c.infer("classify", [tensor(client, "IMAGE", np.array([[encoded]], dtype=np.object_), "BYTES")])
        best, label = reference_classify(encoded)
        assert r.as_numpy("CLASS").tolist() == [[best]]
        assert r.as_numpy("LABEL").tolist() == [[label.encode()]]


def test_a_native_pipeline_calls_a_python_model(served):
    """Native steps (decode, resize, crop, normalize, the ONNX model) then a Python step: its
    class is the bundled image classifier's top class for the same image."""
    c = httpclient.InferenceServerClient(served.url)
    rng = np.random.default_rng(3)
    for _ in range(3):
        buf = io.BytesIO()
        Image.fromarray((rng.random((48, 40, 3)) * 255).astype(np.uint8)).save(buf, "PNG")
        image = tensor(httpclient, "image", np.array([buf.getvalue()], dtype=np.object_), "BYTES")
        r = c.infer("native_then_python", [image])
        top = c.infer("image_classifier", [image]).as_numpy("classes")[0][0].decode().split(":")
        assert r.as_numpy("CLASS").tolist() == [[int(top[1])]]
        assert r.as_numpy("LABEL").tolist() == [[top[2].encode()]]


@pytest.mark.parametrize("client", CLIENTS)
def test_bls_calls_an_onnx_model(served, client):
    c = client_of(served, client)
    x = np.random.default_rng(1).random((3, 512), dtype=np.float32)
    r = c.infer("bls", [tensor(client, "INPUT", x, "FP32")])
    session = ort.InferenceSession(str(ROOT / "models" / "mlp" / "1" / "model.onnx"))
    expected = session.run(None, {"input": x})[0] * 2.0
    np.testing.assert_allclose(r.as_numpy("OUTPUT"), expected, rtol=1e-5, atol=1e-5)
    # A BLS call to a model that does not exist returns a response with the error, naming it.
    assert b"no_such_model" in r.as_numpy("MISSING_ERROR")[0]


@pytest.mark.parametrize("client", CLIENTS)
def test_errors_of_the_model_answer_with_triton_codes(served, client):
    c = client_of(served, client)
    with pytest.raises(InferenceServerException) as e:
        c.infer("faulty", [action(client, "raise")])
    assert "Failed to process the request(s) for model 'faulty_0_0', message: ValueError: asked to raise" in str(e.value)
    assert e.value.status() in ("500", "StatusCode.INTERNAL")
    with pytest.raises(InferenceServerException) as e:
        c.infer("faulty", [action(client, "invalid")])
    assert e.value.status() in ("400", "StatusCode.INVALID_ARGUMENT") and "not valid" in str(e.value)
    with pytest.raises(InferenceServerException) as e:
        c.infer("faulty", [action(client, "error")])
    assert e.value.status() in ("500", "StatusCode.INTERNAL")
    # The request's id reaches the model.
    r = c.infer("faulty", [action(client, "whoami")], request_id="req-17", parameters={"flavour": "mint"})
    assert r.as_numpy("ECHO")[0] == b"req-17 ECHO mint"
    # The worker is the same one throughout: errors are answers, not failures.
    first = c.infer("faulty", [action(client, "echo")]).as_numpy("ECHO")[0]
    assert c.infer("faulty", [action(client, "echo")]).as_numpy("ECHO")[0] == first


def echo_pid(c, client):
    return c.infer("faulty", [action(client, "echo")]).as_numpy("ECHO")[0].decode().split()[-1]


def test_crash_hang_and_memory_are_contained_and_restarted(served):
    client = httpclient
    c = client_of(served, client, network_timeout=60)
    before = metric(served, "ferrite_python_restarts_total")
    pid = echo_pid(c, client)
    with pytest.raises(InferenceServerException) as e:
        c.infer("faulty", [action(client, "crash")])
    assert "faulty_0_0" in str(e.value) and "exited" in str(e.value) and e.value.status() == "500"
    after_crash = echo_pid(c, client)
    assert after_crash != pid

    # A hang: killed at the model's execute timeout (2 s); other models serve meanwhile.
    hung = {}

    def hang():
        t = time.time()
        try:
            c2 = client_of(served, client, network_timeout=60)
            c2.infer("faulty", [action(client, "hang")])
        except InferenceServerException as e:
            hung["error"] = str(e)
        hung["seconds"] = time.time() - t

    t = threading.Thread(target=hang)
    t.start()
    time.sleep(0.5)
    a = np.ones((1, 4), np.float32)
    r = c.infer("add_sub", [tensor(client, "INPUT0", a, "FP32"), tensor(client, "INPUT1", a, "FP32")])
    np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), 2 * a)
    t.join()
    assert "did not return from execute within 2s" in hung["error"]
    assert 1.5 < hung["seconds"] < 10
    assert echo_pid(c, client) != after_crash

    # Memory past the model's limit (128 MiB; its worker idles near 30): killed as it grows, before
    # the 2 s execute timeout. A fresh machine faults memory in slowly the first time it is
    # touched (600 MiB took 0.5-4.6 s on one), so the limit sits close above the idle worker.
    with pytest.raises(InferenceServerException) as e:
        c.infer("faulty", [action(client, "hoard")])
    assert "over its limit of 128 MiB" in str(e.value)
    echo_pid(c, client)
    assert metric(served, "ferrite_python_restarts_total") - before == 3
    logs = served.logs()
    assert "Python worker exited (exit status: 3); restarting it" in logs and "faulty_0_0" in logs


def test_a_client_that_leaves_is_cancelled_in_the_model(served, marks):
    c = httpclient.InferenceServerClient(served.url, network_timeout=1.0)
    with pytest.raises(Exception):
        c.infer("faulty", [action(httpclient, "wait_cancel")])
    deadline = time.time() + 10
    while time.time() < deadline and not list(marks.glob("cancelled-*")):
        time.sleep(0.1)
    assert list(marks.glob("cancelled-*")), "request.is_cancelled() never turned true"
    assert not list(marks.glob("not-cancelled-*"))


LENGTHS_MODEL = """
import os
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            ids = pb_utils.get_input_tensor_by_name(request, "input_ids").as_numpy()
            with open(os.path.join(os.environ["LENGTH_MARKS"], "runs"), "a") as f:
                f.write(f"{ids.shape[1]}\\n")
            if ids.shape[1] > 16:
                time.sleep(3)
            tokens = (ids != 0).sum(axis=1, keepdims=True).astype(np.int64)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("TOKENS", tokens)]))
        return responses
"""


def test_a_client_that_leaves_a_pipeline_batch_costs_its_other_requests_nothing(tmp_path):
    """A pipeline batch of a short and a long text (one worker, a queue delay that merges them)
    calls a model once per length; the long text's client leaves while its call runs. Its call is
    dropped and the short text is answered from its own call: it used to fail the whole batch,
    which ran again without the client that left, the short text's call twice. Alone, a long text
    whose client leaves ends its batch without a warning of a backend failure."""
    repo = tmp_path / "repo"
    model = repo / "lengths"
    (model / "1").mkdir(parents=True)
    (model / "1" / "model.py").write_text(LENGTHS_MODEL)
    (model / "config.pbtxt").write_text(
        'name: "lengths"\nbackend: "python"\nmax_batch_size: 8\n'
        'input [ { name: "input_ids" data_type: TYPE_INT64 dims: [ -1 ] } ]\n'
        'output [ { name: "TOKENS" data_type: TYPE_INT64 dims: [ 1 ] } ]\n'
        'instance_group [ { count: 1 kind: KIND_CPU } ]\n')
    (repo / "texts").mkdir()
    shutil.copy(ROOT / "models" / "text_embedder" / "tokenizer.json", repo / "texts")
    (repo / "texts" / "config.toml").write_text(
        'instance_count = 1\n\n[dynamic_batching]\nmax_queue_delay_microseconds = 300000\n\n'
        '[[steps]]\nop = "tokenize"\nmax_length = 64\n\n[[steps]]\nop = "model"\nmodel = "lengths"\n\n'
        '[[output]]\nname = "TOKENS"\n')
    marks = tmp_path / "marks"
    marks.mkdir()
    s = Server(repo, "--python", sys.executable, env=dict(os.environ, LENGTH_MARKS=str(marks)))
    try:
        def body(text):
            return json.dumps({"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": [text]}]})

        long = body(" ".join(["sentence"] * 30)).encode()
        leaving = socket.create_connection(("127.0.0.1", s.port))
        leaving.sendall(b"POST /v2/models/texts/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                        + f"Content-Length: {len(long)}\r\n\r\n".encode() + long)
        time.sleep(0.05)
        answer = {}

        def short():
            req = urllib.request.Request(f"http://{s.url}/v2/models/texts/infer", body("a cat").encode(),
                                         {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=30) as r:
                answer["short"] = json.loads(r.read())

        waiting = threading.Thread(target=short)
        waiting.start()
        # The batch forms at 0.3 s; the long text's call sleeps 3 s from then.
        time.sleep(1.0)
        leaving.close()
        waiting.join(30)
        assert answer["short"]["outputs"][0]["data"] == [4], answer
        runs = (marks / "runs").read_text().split()
        assert runs.count("4") == 1, f"the short text's call ran {runs.count('4')} times: {runs}"
        assert runs.count("32") == 1, runs
        # Alone, the long text's client leaving ends its batch: no backend failure to warn of.
        leaving = socket.create_connection(("127.0.0.1", s.port))
        leaving.sendall(b"POST /v2/models/texts/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                        + f"Content-Length: {len(long)}\r\n\r\n".encode() + long)
        time.sleep(1.0)
        leaving.close()
        # Answered after that batch has ended (one worker; its call waits for the model).
        short()
        assert answer["short"]["outputs"][0]["data"] == [4], answer
        assert "failed in the backend" not in s.logs(), s.logs()
    finally:
        s.stop()


def test_finalize_runs_on_unload_and_on_shutdown(tmp_path):
    repo = repository(tmp_path / "repo")
    marks = tmp_path / "marks"
    marks.mkdir()
    env = dict(os.environ, FAULTY_MARKS=str(marks))
    s = Server(repo, "--python", sys.executable, "--model-control-mode", "explicit", "--load-model", "faulty",
               env=env)
    try:
        c = httpclient.InferenceServerClient(s.url)
        assert c.is_model_ready("faulty")
        assert len(list(marks.glob("initialize-*"))) == 1
        c.unload_model("faulty")
        deadline = time.time() + 15
        while time.time() < deadline and not list(marks.glob("finalize-*")):
            time.sleep(0.1)
        assert len(list(marks.glob("finalize-*"))) == 1
        c.load_model("faulty")
        assert c.is_model_ready("faulty")
    finally:
        s.stop(signal.SIGTERM)
    deadline = time.time() + 15
    while time.time() < deadline and len(list(marks.glob("finalize-*"))) < 2:
        time.sleep(0.1)
    assert len(list(marks.glob("finalize-*"))) == 2
    # No shared files are left behind.
    assert not list(Path("/dev/shm").glob(f"ferrite-{s.proc.pid}-python"))


def test_environment_and_refusals(tmp_path):
    repo = repository(tmp_path / "repo")
    # EXECUTION_ENV_PATH: the model runs in that environment (here the test's own venv).
    env_model = repo / "in_env"
    shutil.copytree(repo / "add_sub", env_model)
    text = (env_model / "config.pbtxt").read_text().replace('name: "add_sub"', 'name: "in_env"')
    text += f'parameters: {{ key: "EXECUTION_ENV_PATH" value: {{ string_value: "{sys.prefix}" }} }}\n'
    (env_model / "config.pbtxt").write_text(text)
    packed = repo / "packed"
    shutil.copytree(repo / "add_sub", packed)
    text = (packed / "config.pbtxt").read_text().replace('name: "add_sub"', 'name: "packed"')
    text += 'parameters: { key: "EXECUTION_ENV_PATH", value: { string_value: "$$TRITON_MODEL_DIRECTORY/env.tar.gz" } }\n'
    (packed / "config.pbtxt").write_text(text)
    decoupled = repo / "decoupled"
    shutil.copytree(repo / "add_sub", decoupled)
    text = (decoupled / "config.pbtxt").read_text().replace('name: "add_sub"', 'name: "decoupled"')
    (decoupled / "config.pbtxt").write_text(text + "model_transaction_policy { decoupled: true }\n")
    broken = repo / "broken"
    shutil.copytree(repo / "add_sub", broken)
    (broken / "config.pbtxt").write_text((broken / "config.pbtxt").read_text().replace('"add_sub"', '"broken"'))
    (broken / "1" / "model.py").write_text("import no_such_module_here\n")
    # The server's default interpreter is python3 on PATH, which need not have NumPy: the models
    # name the test's through the flag.
    s = Server(repo, "--python", "/nonexistent/python3")
    try:
        index = {m["name"]: m for m in http_call(s.url, lambda c: c.get_model_repository_index())}
        assert index["in_env"]["state"] == "READY"
        assert index["add_sub"]["state"] == "UNAVAILABLE" and "/nonexistent/python3" in index["add_sub"]["reason"]
        assert "packed environments are not unpacked" in index["packed"]["reason"]
        assert "decoupled" in index["decoupled"]["reason"]
        assert "ModuleNotFoundError" in index["broken"]["reason"] or "nonexistent" in index["broken"]["reason"]
        c = httpclient.InferenceServerClient(s.url)
        a = np.ones((1, 4), np.float32)
        r = c.infer("in_env", [tensor(httpclient, "INPUT0", a, "FP32"), tensor(httpclient, "INPUT1", a, "FP32")])
        np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), 2 * a)
    finally:
        s.stop()


def test_check_lists_python_models(tmp_path):
    repo = repository(tmp_path / "repo")
    out = subprocess.run([BIN, "check", "--model-repository", str(repo), "--python", sys.executable],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    row = next(line for line in out.stdout.splitlines() if line.startswith("add_sub "))
    assert "READY" in row and "1 x Python worker" in row and "INPUT0:FP32[-1,4]" in row


def test_broken_model_py_says_why(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    shutil.copytree(ROOT / "tests" / "triton_python" / "add_sub", repo / "add_sub")
    (repo / "add_sub" / "1" / "model.py").write_text("import no_such_module_here\n")
    s = Server(repo, "--python", sys.executable)
    try:
        index = http_call(s.url, lambda c: c.get_model_repository_index())
        reason = [m for m in index if m["name"] == "add_sub"][0]["reason"]
        assert "initialize failed" in reason and "ModuleNotFoundError" in reason
    finally:
        s.stop()
