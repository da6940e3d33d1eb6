"""KServe's Python SDK against a running server (`python kserve_client.py HTTP_URL GRPC_URL`), run in
a process of its own by test_kserve_sdk.py: KServe's gRPC stubs and tritonclient's register the same
protobuf names, which one process cannot hold both of."""

import asyncio
import sys

import numpy as np
from kserve import InferenceGRPCClient, InferenceRESTClient, InferInput, InferRequest, RESTConfig


def mixed_request(binary):
    ids = np.array([[1, 2, 3, 4], [5, 6, 7, 8]], np.int64)
    values = np.linspace(0, 1, 8, dtype=np.float32).reshape(2, 4)
    inputs = []
    for name, value, dt in (("ids", ids, "INT64"), ("values", values, "FP32")):
        i = InferInput(name, list(value.shape), dt)
        i.set_data_from_numpy(value, binary_data=binary)
        inputs.append(i)
    return InferRequest(model_name="mixed", infer_inputs=inputs), ids, values


def outputs_of(response):
    return {o.name: o.as_numpy() for o in response.outputs}


def check_mixed(out, ids, values):
    np.testing.assert_allclose(out["weighted"], values * ids, rtol=1e-6)
    np.testing.assert_array_equal(out["ids_sum"], ids.sum(axis=1, keepdims=True))


async def rest(url):
    base = f"http://{url}"
    async with InferenceRESTClient(RESTConfig(protocol="v2")) as c:
        assert await c.is_server_live(base)
        assert await c.is_server_ready(base)
        assert await c.is_model_ready(base, "mixed")
        for binary in (False, True):
            request, ids, values = mixed_request(binary)
            check_mixed(outputs_of(await c.infer(base, request, model_name="mixed")), ids, values)
        x = np.random.default_rng(0).standard_normal((1, 1, 6, 10)).astype(np.float32)
        i = InferInput("images", list(x.shape), "FP32")
        i.set_data_from_numpy(x, binary_data=True)
        maps = outputs_of(await c.infer(base, InferRequest("fpn", [i]), model_name="fpn"))["maps"]
        np.testing.assert_allclose(maps[:, 0], x[:, 0], rtol=1e-6)


async def grpc(url):
    c = InferenceGRPCClient(url)
    try:
        assert await c.is_server_live()
        assert await c.is_server_ready()
        assert await c.is_model_ready("mixed")
        request, ids, values = mixed_request(True)
        check_mixed(outputs_of(await c.infer(request)), ids, values)
    finally:
        await c.close()


if __name__ == "__main__":
    asyncio.run(rest(sys.argv[1]))
    asyncio.run(grpc(sys.argv[2]))
    print("kserve sdk: ok")
