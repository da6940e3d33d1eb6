"""The same requests through every entry path give the same tensors, and the same bad requests the
same error class and message: REST-JSON, REST-binary, REST-msgpack, gRPC typed, gRPC raw, gRPC
stream. Real clients: tritonclient (http and grpc), msgpack over urllib, and the raw gRPC stub."""

import json
import queue
import urllib.error
import urllib.request

import grpc
import msgpack
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

RNG = np.random.default_rng(3)

CASES = {
    "mlp batch 2": ("mlp", {"input": RNG.standard_normal((2, 512)).astype(np.float32)}),
    "mixed": ("mixed", {"ids": np.array([[1, -2, 3, 4]], np.int64), "values": np.array([[0.5, 2, -1, 3]], np.float32)}),
    "fixed, no batch dim": ("fixed", {"x": np.arange(6, dtype=np.float64).reshape(2, 3)}),
}

BAD = {
    "wrong shape": ("mlp", {"input": np.zeros((1, 511), np.float32)}, "invalid"),
    "wrong datatype": ("mlp", {"input": np.zeros((1, 512), np.float64)}, "invalid"),
    "missing input": ("mixed", {"ids": np.zeros((1, 4), np.int64)}, "invalid"),
    "batch over max": ("mixed", {"ids": np.zeros((65, 4), np.int64), "values": np.zeros((65, 4), np.float32)}, "invalid"),
    "unknown model": ("nope", {"x": np.zeros((1,), np.float32)}, "not_found"),
}


class Failure(Exception):
    def __init__(self, kind, message):
        super().__init__(f"{kind}: {message}")
        self.kind, self.message = kind, message


HTTP_KIND = {"400": "invalid", "404": "not_found"}
GRPC_KIND = {"StatusCode.INVALID_ARGUMENT": "invalid", "StatusCode.NOT_FOUND": "not_found"}


def rest(server, model, feeds, binary):
    c = httpclient.InferenceServerClient(server.url)
    inputs = []
    for name, a in feeds.items():
        i = httpclient.InferInput(name, list(a.shape), np_to_triton_dtype(a.dtype))
        i.set_data_from_numpy(a, binary_data=binary)
        inputs.append(i)
    try:
        r = c.infer(model, inputs)
    except InferenceServerException as e:
        raise Failure(HTTP_KIND.get(e.status(), e.status()), e.message())
    return {o["name"]: r.as_numpy(o["name"]) for o in r.get_response()["outputs"]}


def rest_msgpack(server, model, feeds):
    body = {"inputs": [{"name": n, "shape": list(a.shape), "datatype": np_to_triton_dtype(a.dtype), "data": a.tobytes()}
                       for n, a in feeds.items()]}
    req = urllib.request.Request(f"http://{server.url}/v2/models/{model}/infer", data=msgpack.packb(body),
                                 headers={"Content-Type": "application/msgpack"}, method="POST")
    try:
        with urllib.request.urlopen(req) as resp:
            assert resp.headers["Content-Type"] == "application/msgpack"
            out = msgpack.unpackb(resp.read())
    except urllib.error.HTTPError as e:
        raise Failure(HTTP_KIND.get(str(e.code), e.code), json.loads(e.read())["error"])
    dtypes = {"FP32": np.float32, "FP64": np.float64, "INT64": np.int64}
    return {o["name"]: np.frombuffer(o["data"], dtypes[o["datatype"]]).reshape(o["shape"]) for o in out["outputs"]}


def grpc_inputs(feeds):
    inputs = []
    for name, a in feeds.items():
        i = grpcclient.InferInput(name, list(a.shape), np_to_triton_dtype(a.dtype))
        i.set_data_from_numpy(a)
        inputs.append(i)
    return inputs


def grpc_raw(server, model, feeds):
    c = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        r = c.infer(model, grpc_inputs(feeds))
    except InferenceServerException as e:
        raise Failure(GRPC_KIND.get(e.status(), e.status()), e.message())
    return {o.name: r.as_numpy(o.name) for o in r.get_response().outputs}


def grpc_typed(server, model, feeds):
    field = {np.float32: "fp32_contents", np.float64: "fp64_contents", np.int64: "int64_contents"}
    req = service_pb2.ModelInferRequest(model_name=model)
    for name, a in feeds.items():
        t = req.inputs.add(name=name, datatype=np_to_triton_dtype(a.dtype), shape=list(a.shape))
        getattr(t.contents, field[a.dtype.type]).extend(a.ravel().tolist())
    with grpc.insecure_channel(server.grpc_url) as ch:
        try:
            r = service_pb2_grpc.GRPCInferenceServiceStub(ch).ModelInfer(req)
        except grpc.RpcError as e:
            raise Failure(GRPC_KIND.get(str(e.code()), str(e.code())), e.details())
    dtypes = {"FP32": np.float32, "FP64": np.float64, "INT64": np.int64}
    return {o.name: np.frombuffer(raw, dtypes[o.datatype]).reshape(o.shape) for o, raw in zip(r.outputs, r.raw_output_contents)}


def grpc_stream(server, model, feeds):
    c = grpcclient.InferenceServerClient(server.grpc_url)
    results = queue.Queue()
    c.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        c.async_stream_infer(model, grpc_inputs(feeds), request_id="s1")
        result, error = results.get(timeout=30)
    finally:
        c.stop_stream()
    if error is not None:
        # A stream carries only the message; the class is read from it as the other paths give it.
        raise Failure("stream", error.message())
    return {o.name: result.as_numpy(o.name) for o in result.get_response().outputs}


PATHS = {
    "rest-json": lambda s, m, f: rest(s, m, f, binary=False),
    "rest-binary": lambda s, m, f: rest(s, m, f, binary=True),
    "rest-msgpack": rest_msgpack,
    "grpc-typed": grpc_typed,
    "grpc-raw": grpc_raw,
    "grpc-stream": grpc_stream,
}


@pytest.mark.parametrize("case", CASES)
def test_same_tensors_through_every_path(server, case):
    model, feeds = CASES[case]
    results = {path: call(server, model, feeds) for path, call in PATHS.items()}
    reference = results["rest-binary"]
    for path, got in results.items():
        assert got.keys() == reference.keys(), path
        for name in reference:
            assert got[name].dtype == reference[name].dtype, (path, name)
            np.testing.assert_array_equal(got[name], reference[name], err_msg=f"{path} {name}")


@pytest.mark.parametrize("case", BAD)
def test_same_error_through_every_path(server, case):
    model, feeds, kind = BAD[case]
    failures = {}
    for path, call in PATHS.items():
        with pytest.raises(Failure) as e:
            call(server, model, feeds)
        failures[path] = e.value
    messages = {f.message for f in failures.values()}
    assert len(messages) == 1, failures
    for path, f in failures.items():
        assert f.kind in (kind, "stream"), (path, f)
