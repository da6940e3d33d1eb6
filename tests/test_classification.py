"""Triton's classification extension through tritonclient (HTTP and gRPC): an output asked for
with class_count=k comes back as its top k per row, "value:index:label" BYTES, as Triton sends it;
checked against a NumPy top-k of the plain output."""

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import make_repository

LABELS = [f"class-{i}" for i in range(10)]


@pytest.fixture(scope="module")
def labelled(tmp_path_factory):
    from conftest import Server
    repo = make_repository(tmp_path_factory.mktemp("cls") / "repo", ("mlp",))
    (repo / "mlp" / "labels.txt").write_text("\n".join(LABELS) + "\n")
    config = (repo / "mlp" / "config.toml")
    text = config.read_text() if config.exists() else ""
    config.write_text(text + '\n[[output]]\nname = "output"\nlabel_filename = "labels.txt"\n')
    s = Server(repo)
    yield s
    s.stop()


def expected(scores, k):
    rows = []
    for row in scores:
        order = sorted(range(len(row)), key=lambda i: (-row[i], i))[:k]
        rows.append([f"{row[i]:.6f}:{i}:{LABELS[i]}".encode() for i in order])
    return np.array(rows, dtype=object)


@pytest.mark.parametrize("client", [httpclient, grpcclient])
def test_class_count_answers_the_top_k_with_labels(labelled, client):
    url = labelled.url if client is httpclient else labelled.grpc_url
    c = client.InferenceServerClient(url)
    x = np.random.default_rng(3).standard_normal((3, 512)).astype(np.float32)
    i = client.InferInput("input", list(x.shape), "FP32")
    i.set_data_from_numpy(x)
    plain = c.infer("mlp", [i]).as_numpy("output")
    got = c.infer("mlp", [i], outputs=[client.InferRequestedOutput("output", class_count=3)]).as_numpy("output")
    assert got.shape == (3, 3)
    assert (got == expected(plain, 3)).all(), (got, expected(plain, 3))


def test_classification_of_a_bad_request_is_refused(labelled):
    c = httpclient.InferenceServerClient(labelled.url)
    x = np.zeros((1, 512), np.float32)
    i = httpclient.InferInput("input", list(x.shape), "FP32")
    i.set_data_from_numpy(x)
    # tritonclient sends no parameter for class_count=0; a raw request asking 0 classes is a 400.
    import json
    import urllib.error
    import urllib.request
    body = {"inputs": [{"name": "input", "shape": [1, 512], "datatype": "FP32", "data": [0.0] * 512}],
            "outputs": [{"name": "output", "parameters": {"classification": 0}}]}
    req = urllib.request.Request(f"http://{labelled.url}/v2/models/mlp/infer", json.dumps(body).encode(), method="POST")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=10)
    assert e.value.code == 400 and b"cannot be classified" in e.value.read()
    with pytest.raises(InferenceServerException, match="unknown output"):
        c.infer("mlp", [i], outputs=[httpclient.InferRequestedOutput("nope", class_count=2)])


def test_classification_over_messagepack(labelled):
    import urllib.request

    import msgpack
    x = np.random.default_rng(5).standard_normal((1, 512)).astype(np.float32)
    body = {"inputs": [{"name": "input", "shape": [1, 512], "datatype": "FP32", "data": x.ravel().tolist()}],
            "outputs": [{"name": "output", "parameters": {"classification": 2}}]}
    req = urllib.request.Request(f"http://{labelled.url}/v2/models/mlp/infer", msgpack.packb(body),
                                 {"Content-Type": "application/msgpack"}, method="POST")
    with urllib.request.urlopen(req, timeout=10) as r:
        out = msgpack.unpackb(r.read())["outputs"][0]
    c = httpclient.InferenceServerClient(labelled.url)
    i = httpclient.InferInput("input", [1, 512], "FP32")
    i.set_data_from_numpy(x)
    plain = c.infer("mlp", [i]).as_numpy("output")
    assert out["datatype"] == "BYTES" and list(out["shape"]) == [1, 2]
    got = [v.encode() if isinstance(v, str) else bytes(v) for v in out["data"]]
    assert got == list(expected(plain, 2)[0]), (got, expected(plain, 2))


def test_classes_of_a_segmentation_map_are_bounded(start_server, tmp_path):
    """A segmentation model's 21x512x512 scores (5.5 million) answered from 84 bytes in: its top 5
    is ranked as Triton ranks it (off the I/O threads, a pass over the scores rather than a sort of
    them all); asking for more classes than a request may have (rows x k over 262,144) is a 400,
    not a million strings built and sent: before the model runs where its output's size is
    fixed, once it is there where not."""
    import onnx
    from onnx import TensorProto, helper

    rng = np.random.default_rng(5)
    ramp = rng.standard_normal((1, 512, 512)).astype(np.float32)
    repo = make_repository(tmp_path / "seg", ("mlp",))
    # The same scores, their size known before the run; and the channels alone broadcast to a size
    # only the run knows (an Expand to a shape sent as an input).
    ramp_t = helper.make_tensor("ramp", TensorProto.FLOAT, ramp.shape, ramp.tobytes(), raw=True)
    fixed = helper.make_graph([helper.make_node("Add", ["x", "ramp"], ["scores"])], "segmenter",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [21, 1, 1])],
                              [helper.make_tensor_value_info("scores", TensorProto.FLOAT, [21, 512, 512])], [ramp_t])
    grown = helper.make_graph([helper.make_node("Expand", ["x", "size"], ["scores"])], "expander",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [21, 1, 1]),
                               helper.make_tensor_value_info("size", TensorProto.INT64, [3])],
                              [helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["c", "h", "w"])])
    for graph in (fixed, grown):
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
        (repo / graph.name / "1").mkdir(parents=True)
        onnx.save(model, repo / graph.name / "1" / "model.onnx")
    s = start_server("--calibrate", "false", repository=repo)
    c = httpclient.InferenceServerClient(s.url, network_timeout=60)
    x = np.arange(21, dtype=np.float32).reshape(21, 1, 1) / 10
    inputs = {}
    for name, feeds in (("segmenter", {"x": x}), ("expander", {"x": x, "size": np.array([21, 512, 512], np.int64)})):
        inputs[name] = []
        for n, v in feeds.items():
            inputs[name].append(httpclient.InferInput(n, list(v.shape), "FP32" if v.dtype == np.float32 else "INT64"))
            inputs[name][-1].set_data_from_numpy(v)
    flat = (x + ramp).ravel()
    top = {"segmenter": [f"{flat[j]:.6f}:{j}".encode() for j in np.argsort(-flat, kind="stable")[:5]],
           # Ties in index order: the last channel's first five.
           "expander": [f"2.000000:{20 * 512 * 512 + j}".encode() for j in range(5)]}
    runs = {}
    for name in ("segmenter", "expander"):
        got = c.infer(name, inputs[name], outputs=[httpclient.InferRequestedOutput("scores", binary_data=True, class_count=5)])
        assert list(got.as_numpy("scores")) == top[name]
        for k in ((1 << 18) + 1, 1 << 30):
            with pytest.raises(InferenceServerException, match=r"classification asks for \d+ classes \(rows x k\); at most 262144") as e:
                c.infer(name, inputs[name], outputs=[httpclient.InferRequestedOutput("scores", class_count=k)])
            assert e.value.status() == "400"
        runs[name] = c.get_inference_statistics(name)["model_stats"][0]["execution_count"]
    # Refused before the run where the size was known; after it where not.
    assert runs == {"segmenter": 1, "expander": 3}, runs
    g = grpcclient.InferenceServerClient(s.grpc_url)
    gi = grpcclient.InferInput("x", [21, 1, 1], "FP32")
    gi.set_data_from_numpy(x)
    with pytest.raises(InferenceServerException, match="at most 262144") as e:
        g.infer("segmenter", [gi], outputs=[grpcclient.InferRequestedOutput("scores", class_count=1 << 20)])
    assert e.value.status() == "StatusCode.INVALID_ARGUMENT"
