"""Models of the kinds that break naive warm-ups load with no config (calibration on, as `ferrite
serve` runs by default) and answer correctly through tritonclient: a variable-length INT64 sequence
model (a text encoder's inputs and masked mean pooling) and a detector-shaped graph with variable
H/W whose concat fails at a made-up 1x1."""

import os

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from conftest import http_call


@pytest.fixture(scope="module")
def kinds(tmp_path_factory):
    from conftest import Server, make_repository
    repo = make_repository(tmp_path_factory.mktemp("kinds") / "repo", ("encoder", "fpn"))
    s = Server(repo, env=dict(os.environ, FERRITE_CALIBRATE="true"))
    yield s
    s.stop()


def pooled(ids, mask):
    table = np.arange(100, dtype=np.float32)[:, None] * np.array([1, 2, -1, 0.5], np.float32)
    m = mask[..., None].astype(np.float32)
    return (table[ids] * m).sum(axis=1) / m.sum(axis=1)


@pytest.mark.parametrize("client", [httpclient, grpcclient])
@pytest.mark.parametrize("length", [5, 17])
def test_a_variable_length_sequence_model_answers(kinds, client, length):
    url = kinds.url if client is httpclient else kinds.grpc_url
    c = client.InferenceServerClient(url)
    rng = np.random.default_rng(length)
    ids = rng.integers(0, 100, (2, length), dtype=np.int64)
    mask = np.ones((2, length), np.int64)
    mask[1, length // 2:] = 0  # the second row is padded
    inputs = []
    for name, value in (("input_ids", ids), ("attention_mask", mask)):
        i = client.InferInput(name, list(value.shape), "INT64")
        i.set_data_from_numpy(value)
        inputs.append(i)
    got = c.infer("encoder", inputs).as_numpy("embeddings")
    np.testing.assert_allclose(got, pooled(ids, mask), rtol=1e-6)


def test_a_variable_hw_detector_head_answers(kinds):
    c = httpclient.InferenceServerClient(kinds.url)
    x = np.random.default_rng(0).standard_normal((1, 1, 6, 10)).astype(np.float32)
    i = httpclient.InferInput("images", list(x.shape), "FP32")
    i.set_data_from_numpy(x)
    maps = c.infer("fpn", [i]).as_numpy("maps")
    pooled_half = x.reshape(1, 1, 3, 2, 5, 2).mean(axis=(3, 5))
    np.testing.assert_allclose(maps[:, 0], x[:, 0], rtol=1e-6)
    np.testing.assert_allclose(maps[:, 1], pooled_half.repeat(2, axis=2).repeat(2, axis=3)[:, 0], rtol=1e-5)


def test_both_were_calibrated_without_a_warm_up_they_cannot_run(kinds):
    import json
    import urllib.request
    for model in ("encoder", "fpn"):
        with urllib.request.urlopen(f"http://{kinds.url}/v2/models/{model}/config", timeout=10) as r:
            assert "calibrated" in json.loads(r.read())["parameters"], model


def test_large_answers_in_flight_together_are_each_their_own(kinds):
    """Batches whose outputs pass 1 MiB are copied into buffers the model instance reuses once no
    answer holds them: waves of concurrent requests (distinct images, 512 KB of maps each) over
    gRPC and HTTP each get their own maps, and none another's or an earlier wave's."""
    import queue
    import threading

    def expected(x):
        half = x.reshape(1, 1, 128, 2, 128, 2).mean(axis=(3, 5))
        return np.concatenate([x, half.repeat(2, axis=2).repeat(2, axis=3)], axis=1)

    g = grpcclient.InferenceServerClient(kinds.grpc_url)
    done = queue.Queue()

    def over_http(k, x):
        i = httpclient.InferInput("images", list(x.shape), "FP32")
        i.set_data_from_numpy(x, binary_data=True)
        try:
            done.put((k, http_call(kinds.url, lambda c: c.infer("fpn", [i]).as_numpy("maps")), None))
        except Exception as e:  # noqa: BLE001 - reported by the assertion below
            done.put((k, None, e))

    for wave in range(3):
        xs = [np.random.default_rng(100 * wave + k).standard_normal((1, 1, 256, 256)).astype(np.float32)
              for k in range(8)]
        threads = []
        for k, x in enumerate(xs):
            if k % 2:
                threads.append(threading.Thread(target=over_http, args=(k, x)))
                threads[-1].start()
            else:
                i = grpcclient.InferInput("images", list(x.shape), "FP32")
                i.set_data_from_numpy(x)
                g.async_infer("fpn", [i],
                              callback=lambda result, error, k=k: done.put((k, result and result.as_numpy("maps"), error)))
        for _ in xs:
            k, maps, error = done.get(timeout=60)
            assert error is None, error
            np.testing.assert_allclose(maps, expected(xs[k]), rtol=1e-5, atol=1e-6)
        for t in threads:
            t.join()
