"""Tabular models as their converters write them (scripts/make_models.py --tabular): scikit-learn
through skl2onnx, LightGBM and XGBoost through onnxmltools, with the converters' defaults. A
classifier's ZipMap (probabilities as one {class: probability} map per row) is served as the
FP32[N, classes] tensor it was made from, labelled with its classes, so Triton's classification
extension names them; every answer equals ONNX Runtime's on the same file."""

import subprocess
import sys

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from conftest import BIN, ROOT, Server

X = np.random.default_rng(11).normal(size=(9, 4)).astype(np.float32)
# name -> (label output, probabilities output or None)
MODELS = {
    "forest": ("output_label", "output_probability"),
    "scaled_logreg": ("output_label", "output_probability"),
    "lightgbm": ("label", "probabilities"),
    "xgboost": ("label", "probabilities"),
    "boosted_regressor": ("variable", None),
}


@pytest.fixture(scope="module")
def tabular(tmp_path_factory):
    repo = tmp_path_factory.mktemp("tabular") / "repo"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_models.py"), "--tabular", str(repo)], check=True,
                   capture_output=True)
    s = Server(repo)
    yield s, repo
    s.stop()


def reference(repo, name):
    """ONNX Runtime's outputs by name; a ZipMap's maps as rows in the order of their keys."""
    sess = ort.InferenceSession(str(repo / name / "1" / "model.onnx"))
    out = {}
    for meta, value in zip(sess.get_outputs(), sess.run(None, {"input": X})):
        if meta.type.startswith("seq(map"):
            keys = list(value[0])
            value = np.array([[row[k] for k in keys] for row in value], np.float32), [str(k) for k in keys]
        out[meta.name] = value
    return out


def infer(client, url, name, outputs=None):
    """X through tritonclient's `client` module (http or grpc): the client and the answer."""
    c = client.InferenceServerClient(url)
    t = client.InferInput("input", list(X.shape), "FP32")
    t.set_data_from_numpy(X)
    return c, c.infer(name, [t], outputs=outputs)


@pytest.mark.parametrize("name", list(MODELS))
def test_converted_models_answer_as_onnx_runtime_does(tabular, name):
    server, repo = tabular
    label, probabilities = MODELS[name]
    ref = reference(repo, name)
    c, got = infer(httpclient, server.url, name)
    if probabilities is None:
        np.testing.assert_array_equal(got.as_numpy(label), ref[label])
        return
    want = ref[probabilities]
    if isinstance(want, tuple):  # a ZipMap
        want, classes = want
        config = c.get_model_config(name)
        out = next(o for o in config["output"] if o["name"] == probabilities)
        assert out["data_type"] == "TYPE_FP32" and out["dims"][-1] == len(classes), out
    np.testing.assert_array_equal(got.as_numpy(probabilities), want)
    labels = got.as_numpy(label)
    assert [v.decode() if isinstance(v, bytes) else int(v) for v in labels] == \
        [v if isinstance(v, str) else int(v) for v in ref[label]]


@pytest.mark.parametrize("name", ["forest", "scaled_logreg"])
def test_a_zipmaps_classes_name_the_classification_extensions_answers(tabular, name):
    """top-1 over gRPC: "probability:index:class", the class being the predicted label. (LightGBM
    through onnxmltools declares its label output [1], so the model does not batch and the
    extension ranks its whole tensor, as Triton does for a model without a batch dimension.)"""
    server, repo = tabular
    label, probabilities = MODELS[name]
    ref = reference(repo, name)
    _, got = infer(grpcclient, server.grpc_url, name, [grpcclient.InferRequestedOutput(probabilities, class_count=1)])
    top = [v.decode().split(":") for v in got.as_numpy(probabilities).reshape(-1)]
    predicted = [v if isinstance(v, str) else str(int(v)) for v in ref[label]]
    assert [t[2] for t in top] == predicted
    want, classes = ref[probabilities]
    assert [classes[int(t[1])] for t in top] == predicted
    np.testing.assert_allclose([float(t[0]) for t in top], want.max(axis=1), rtol=1e-6)


def test_check_shows_the_zipmap_as_the_tensor_it_serves(tabular):
    _, repo = tabular
    r = subprocess.run([BIN, "check", "--model-repository", str(repo)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    row = next(line for line in r.stdout.splitlines() if line.startswith("forest"))
    assert "output_probability:FP32[-1,3]" in row, row
