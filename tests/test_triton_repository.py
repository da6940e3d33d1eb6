"""A Triton user's repository as it is (tests/triton: config.pbtxt files, labels, warm-up data,
a renamed model file) served unchanged, through tritonclient over HTTP and gRPC: every honoured
field acts and shows in /config; what Ferrite does not do is refused by name, and the model shows
UNAVAILABLE with that reason in the repository index."""

import shutil
import subprocess

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from conftest import BIN, ROOT, Server

SOURCES = {
    "classifier": ("models/mlp", "net.onnx"),
    "det": ("tests/models/fpn", "model.onnx"),
    "shaped": ("models/mixed", "model.onnx"),
    "fixed": ("tests/models/fixed", "model.onnx"),
    "sequence": ("models/mlp", "model.onnx"),
    "on_gpu": ("models/mlp", "model.onnx"),
    "custom_ops": ("models/mlp", "model.onnx"),
    "bad_warmup": ("models/mlp", "model.onnx"),
    "scale4": ("tests/models/scale/2/model.onnx", "model.onnx"),
}
REFUSED = {
    "sequence": "'sequence_batching' is not supported",
    "on_gpu": "KIND_GPU",
    "custom_ops": "'model_operations.op_library_filename' is not supported",
    "bad_warmup": "warm-up 'short'",
}


def triton_repository(dest):
    for name, (src, filename) in SOURCES.items():
        shutil.copytree(ROOT / "tests" / "triton" / name, dest / name)
        (dest / name / "1").mkdir()
        shutil.copy(ROOT / src if src.endswith(".onnx") else ROOT / src / "1" / "model.onnx", dest / name / "1" / filename)
    # An ensemble has no model file (Triton's has an empty version directory; none is needed here).
    shutil.copytree(ROOT / "tests" / "triton" / "chain", dest / "chain")
    return dest


@pytest.fixture(scope="module")
def triton(tmp_path_factory):
    s = Server(triton_repository(tmp_path_factory.mktemp("triton") / "repo"))
    yield s
    s.stop()


CLIENTS = [httpclient, grpcclient]


def client_of(s, client):
    return client.InferenceServerClient(s.url if client is httpclient else s.grpc_url)


def tensor(client, name, value, datatype):
    i = client.InferInput(name, list(value.shape), datatype)
    i.set_data_from_numpy(value)
    return i


@pytest.mark.parametrize("client", CLIENTS)
def test_a_classifier_from_its_pbtxt_answers_with_labels(triton, client):
    c = client_of(triton, client)
    x = np.random.default_rng(3).standard_normal((3, 512)).astype(np.float32)
    raw = c.infer("classifier", [tensor(client, "input", x, "FP32")]).as_numpy("output")
    top = c.infer("classifier", [tensor(client, "input", x, "FP32")],
                  outputs=[client.InferRequestedOutput("output", class_count=3)]).as_numpy("output")
    assert top.shape == (3, 3)
    for row in range(3):
        want = np.argsort(-raw[row], kind="stable")[:3]
        got = [entry.decode().split(":") for entry in top[row]]
        assert [int(i) for _, i, _ in got] == list(want)
        assert [label for _, _, label in got] == [f"class_{i}" for i in want]
        np.testing.assert_allclose([float(v) for v, _, _ in got], raw[row][want], atol=1e-6)  # printed to 6 decimals


@pytest.mark.parametrize("client", CLIENTS)
def test_an_ensemble_runs_its_steps_through_the_stated_tensor_maps(triton, client):
    c = client_of(triton, client)
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    out = c.infer("chain", [tensor(client, "INPUT", x, "FP32")]).as_numpy("OUTPUT")
    np.testing.assert_allclose(out, 4 * x)
    meta = c.get_model_metadata("chain")
    meta = meta if client is httpclient else {"platform": meta.platform, "outputs": [{"name": o.name} for o in meta.outputs]}
    assert meta["platform"] == "ensemble" and [o["name"] for o in meta["outputs"]] == ["OUTPUT"]
    # Its config gives the steps back as the pbtxt states them.
    config = c.get_model_config("chain", as_json=True)["config"] if client is grpcclient else c.get_model_config("chain")
    steps = config["ensemble_scheduling"]["step"]
    assert [(s["model_name"], s["input_map"], s["output_map"]) for s in steps] == [
        ("scale4", {"x": "INPUT"}, {"y": "twice"}),
        ("scale4", {"x": "twice"}, {"y": "OUTPUT"}),
    ]
    assert all(int(s["model_version"]) == -1 for s in steps)


@pytest.mark.parametrize("client", CLIENTS)
def test_a_variable_hw_detector_warmed_up_from_its_config_answers(triton, client):
    c = client_of(triton, client)
    x = np.random.default_rng(0).standard_normal((2, 1, 6, 10)).astype(np.float32)
    maps = c.infer("det", [tensor(client, "images", x, "FP32")]).as_numpy("maps")
    assert maps.shape == (2, 2, 6, 10)
    np.testing.assert_allclose(maps[:, 0], x[:, 0], rtol=1e-6)


@pytest.mark.parametrize("client", CLIENTS)
def test_reshape_gives_clients_the_stated_dims(triton, client):
    c = client_of(triton, client)
    ids = np.arange(8, dtype=np.int64).reshape(2, 2, 2)
    values = np.linspace(0, 1, 8, dtype=np.float32).reshape(2, 2, 2)
    r = c.infer("shaped", [tensor(client, "ids", ids, "INT64"), tensor(client, "values", values, "FP32")])
    np.testing.assert_allclose(r.as_numpy("weighted"), values * ids, rtol=1e-6)
    np.testing.assert_array_equal(r.as_numpy("ids_sum"), ids.reshape(2, 4).sum(axis=1, keepdims=True))
    meta = c.get_model_metadata("shaped", as_json=True) if client is grpcclient else c.get_model_metadata("shaped")
    shapes = {t["name"]: [int(d) for d in t["shape"]] for t in meta["inputs"] + meta["outputs"]}
    assert shapes == {"ids": [-1, 2, 2], "values": [-1, 2, 2], "weighted": [-1, 2, 2], "ids_sum": [-1, 1]}


def test_a_model_without_a_batch_dim(triton):
    c = client_of(triton, httpclient)
    x = np.arange(6, dtype=np.float64).reshape(2, 3)
    np.testing.assert_array_equal(c.infer("fixed", [tensor(httpclient, "x", x, "FP64")]).as_numpy("y"), 2 * x)


@pytest.mark.parametrize("client", CLIENTS)
def test_config_round_trips_the_stated_fields(triton, client):
    c = client_of(triton, client)
    config = c.get_model_config("classifier", as_json=True) if client is grpcclient else c.get_model_config("classifier")
    if client is grpcclient:
        config = config["config"]
        num = int
    else:
        num = lambda v: v  # noqa: E731 -- Triton's JSON gives numbers where protobuf's gives strings
    assert config["name"] == "classifier" and config["platform"] == "onnxruntime_onnx"
    assert config["max_batch_size"] == 16
    assert config["default_model_filename"] == "net.onnx"
    assert config["input"][0]["name"] == "input" and [num(d) for d in config["input"][0]["dims"]] == [512]
    assert config["output"][0]["label_filename"] == "labels.txt"
    assert config["instance_group"][0]["count"] == 2 and config["instance_group"][0]["kind"] == "KIND_CPU"
    db = config["dynamic_batching"]
    assert db["preferred_batch_size"] == [4, 8] and num(db["max_queue_delay_microseconds"]) == 200
    assert db["preserve_ordering"] is True and num(db["priority_levels"]) == 2
    assert num(db["default_priority_level"]) == 2 and db["default_queue_policy"]["max_queue_size"] == 64
    level1 = db["priority_queue_policy"]["1"]
    assert level1["max_queue_size"] == 8 and num(level1["default_timeout_microseconds"]) == 2000000
    assert config["parameters"]["intra_op_thread_count"]["string_value"] == "1"
    assert config["optimization"]["graph"]["level"] == 1
    assert config["response_cache"]["enable"] is True
    assert config["version_policy"]["latest"]["num_versions"] == 1
    assert [w["name"] for w in config["model_warmup"]] == ["zeros", "from_file"]
    shaped = c.get_model_config("shaped", as_json=True) if client is grpcclient else c.get_model_config("shaped")
    shaped = shaped["config"] if client is grpcclient else shaped
    assert [num(d) for d in shaped["input"][0]["reshape"]["shape"]] == [4]


def test_refused_fields_are_named_in_the_repository_index(triton):
    index = {m["name"]: m for m in client_of(triton, httpclient).get_model_repository_index()}
    for name, why in REFUSED.items():
        assert index[name]["state"] == "UNAVAILABLE", index[name]
        assert why in index[name]["reason"], index[name]
    for name in ("classifier", "det", "shaped", "fixed"):
        assert index[name]["state"] == "READY", index[name]
    grpc_index = client_of(triton, grpcclient).get_model_repository_index(as_json=True)["models"]
    assert any(m["name"] == "sequence" and "sequence_batching" in m["reason"] for m in grpc_index)


def test_both_config_files_in_one_directory_is_an_error_naming_both(tmp_path):
    repo = triton_repository(tmp_path / "repo")
    (repo / "fixed" / "config.toml").write_text("max_batch_size = 0\n")
    r = subprocess.run([BIN, "check", "--model-repository", str(repo)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr
    rows = {line.split()[0]: line for line in r.stdout.splitlines()[1:]}
    assert "UNAVAILABLE" in rows["fixed"] and "config.toml and config.pbtxt" in rows["fixed"], rows["fixed"]
    assert "READY" in rows["classifier"] and "READY" in rows["det"]
