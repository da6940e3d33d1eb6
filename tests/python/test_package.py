"""The `ferrite` Python package (the wheel built by scripts/test): same answers as the server and
onnxruntime, zero-copy in and out, the GIL released, asyncio without stalls, errors by class."""

import asyncio
import gc
import sys
import threading
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

import ferrite

ROOT = Path(__file__).resolve().parents[2]
MLP = ROOT / "models" / "mlp"


@pytest.fixture(scope="module")
def mlp():
    return ferrite.Model.load(MLP)


def reference(x):
    sess = ort.InferenceSession(str(MLP / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
    return sess.run(None, {"input": x})[0]


def test_metadata_is_frozen_dataclasses(mlp):
    meta = mlp.metadata
    assert meta == ferrite.ModelMetadata(
        name="mlp",
        version="1",
        platform="onnxruntime_onnx",
        max_batch_size=64,
        inputs=(ferrite.TensorSpec("input", "FP32", (-1, 512)),),
        outputs=(ferrite.TensorSpec("output", "FP32", (-1, 10)),),
    )
    with pytest.raises(AttributeError):
        meta.name = "x"


def test_outputs_match_onnxruntime_and_the_server(mlp, start_server):
    x = np.random.default_rng(0).standard_normal((4, 512)).astype(np.float32)
    got = mlp.infer({"input": x})["output"]
    np.testing.assert_allclose(got, reference(x), rtol=1e-5, atol=1e-6)
    import tritonclient.http as httpclient

    s = start_server(models=("mlp",))
    i = httpclient.InferInput("input", [4, 512], "FP32")
    i.set_data_from_numpy(x)
    served = httpclient.InferenceServerClient(s.url).infer("mlp", [i]).as_numpy("output")
    np.testing.assert_array_equal(got, served)


def test_engine_loads_a_repository_and_serves_it():
    engine = ferrite.Engine(ROOT / "models")
    assert set(engine.models) == {"mlp", "mixed", "tiny_cnn", "image_classifier", "text_encoder", "text_embedder"}
    mixed = engine.model("mixed")
    out = mixed.infer({"ids": np.array([[1, 2, 3, 4]], np.int64), "values": np.ones((1, 4), np.float32)}, outputs=["ids_sum"])
    assert list(out) == ["ids_sum"] and out["ids_sum"].tolist() == [[10]]
    with pytest.raises(ferrite.ModelNotFound):
        engine.model("nope")
    import tritonclient.http as httpclient

    with ferrite.serve(engine, http_port=0, grpc_port=0) as server:
        c = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
        assert c.is_model_ready("mixed")
        i = httpclient.InferInput("ids", [1, 4], "INT64")
        i.set_data_from_numpy(np.array([[1, 2, 3, 4]], np.int64))
        v = httpclient.InferInput("values", [1, 4], "FP32")
        v.set_data_from_numpy(np.ones((1, 4), np.float32))
        assert c.infer("mixed", [i, v]).as_numpy("ids_sum").tolist() == [[10]]
        # The server and in-process calls share the model's statistics (one batcher).
        assert c.get_inference_statistics("mixed")["model_stats"][0]["inference_count"] == 2
    # Stopping the server closes its listeners, not the application's engine: in-process calls go
    # on, and another server listens on it again.
    out = mixed.infer({"ids": np.array([[1, 1, 1, 1]], np.int64), "values": np.ones((1, 4), np.float32)})
    assert out["ids_sum"].tolist() == [[4]]
    with ferrite.serve(engine, http_port=0, grpc_port=0) as server:
        c = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
        assert c.is_server_ready() and c.is_model_ready("mixed")
        assert c.infer("mixed", [i, v]).as_numpy("ids_sum").tolist() == [[10]]
        assert c.get_inference_statistics("mixed")["model_stats"][0]["inference_count"] == 4


def test_stopping_a_server_ends_its_open_streams_and_waits_for_no_idle_client():
    import tritonclient.grpc as grpcclient

    engine = ferrite.Engine(ROOT / "models")
    server = ferrite.serve(engine, http_port=0, grpc_port=0, exit_timeout=20)
    c = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    x = grpcclient.InferInput("input", [1, 512], "FP32")
    x.set_data_from_numpy(np.ones((1, 512), np.float32))
    got = []
    c.start_stream(callback=lambda result, error: got.append((result, error)))
    c.async_stream_infer("mlp", [x], request_id="before")
    deadline = time.time() + 10
    while not got and time.time() < deadline:
        time.sleep(0.01)
    started = time.time()
    server.stop()
    # An idle stream no longer holds stop() for the exit timeout: it ends with UNAVAILABLE.
    assert time.time() - started < 5
    deadline = time.time() + 10
    while len(got) < 2 and time.time() < deadline:
        time.sleep(0.01)
    c.stop_stream()
    (answer, none), (nothing, error) = got
    assert none is None and answer.get_response().id == "before"
    assert nothing is None and error.status() == "StatusCode.UNAVAILABLE" and "stopping" in error.message()


def test_serve_takes_the_binarys_security_options(tmp_path):
    import urllib.error
    import urllib.request

    engine = ferrite.Engine(ROOT / "models")
    # Listening beyond loopback with no token is refused unless said outright.
    with pytest.raises(ferrite.InvalidInput, match="allow_unauthenticated"):
        ferrite.serve(engine, host="0.0.0.0", http_port=0, grpc_port=0)
    tokens = tmp_path / "tokens"
    tokens.write_text("a-token-of-sixteen-chars infer\n")
    with pytest.raises(ferrite.InvalidInput, match="tls_key"):
        ferrite.serve(engine, http_port=0, grpc_port=0, tls_cert=tokens)
    with ferrite.serve(engine, host="0.0.0.0", http_port=0, grpc_port=0, auth_token_file=tokens) as server:
        url = f"http://127.0.0.1:{server.http_port}/v2/models/mlp"
        with pytest.raises(urllib.error.HTTPError) as denied:
            urllib.request.urlopen(url, timeout=5)
        assert denied.value.code == 401
        req = urllib.request.Request(url, headers={"Authorization": "Bearer a-token-of-sixteen-chars"})
        with urllib.request.urlopen(req, timeout=5) as r:
            assert r.status == 200
    # A host name as the binary's --host: every address it resolves to, all loopback here.
    with ferrite.serve(engine, host="localhost", http_port=0, grpc_port=0) as server:
        with urllib.request.urlopen(f"http://localhost:{server.http_port}/v2/health/ready", timeout=5) as r:
            assert r.status == 200
    with pytest.raises(ferrite.InvalidInput, match="host 'no-such-host.invalid'"):
        ferrite.serve(engine, host="no-such-host.invalid", http_port=0, grpc_port=0)


def test_serve_takes_the_binarys_tenant_limits(tmp_path):
    """An engine's tenant_header and tenant_config are the binary's --tenant-header and
    --tenant-config: a tenant over its rate is refused (429, Retry-After) while another tenant goes
    on; the refusal is counted under its tenant. The application's own calls take no tenant's
    place: anonymous clients that used up [default]'s rate do not refuse them."""
    import json
    import urllib.error
    import urllib.request

    limits = tmp_path / "tenants.toml"
    limits.write_text("[default]\nrate = 0.01\nburst = 1\n[tenants.acme]\nrate = 0.01\nburst = 1\n")
    with pytest.raises(ferrite.InvalidInput, match="together"):
        ferrite.Engine(ROOT / "models", tenant_header="x-tenant")
    with pytest.raises(ferrite.InvalidInput, match="not a valid header name"):
        ferrite.Engine(ROOT / "models", tenant_header="x tenant", tenant_config=limits)
    engine = ferrite.Engine(ROOT / "models", tenant_header="x-tenant", tenant_config=limits)
    body = json.dumps({"inputs": [{"name": "input", "shape": [1, 512], "datatype": "FP32", "data": [0.5] * 512}]})

    with ferrite.serve(engine, http_port=0, grpc_port=0) as server:
        def infer(tenant):
            req = urllib.request.Request(f"http://127.0.0.1:{server.http_port}/v2/models/mlp/infer",
                                         data=body.encode(), headers={"x-tenant": tenant} if tenant else {})
            try:
                with urllib.request.urlopen(req, timeout=10) as r:
                    return r.status, None
            except urllib.error.HTTPError as e:
                return e.code, e.headers.get("retry-after")

        assert infer("acme") == (200, None)
        code, retry = infer("acme")
        assert code == 429 and retry is not None
        assert infer("globex") == (200, None)
        assert infer(None) == (200, None)
        assert infer(None)[0] == 429
        model = engine.model("mlp")
        for _ in range(3):
            assert model.infer({"input": np.full((1, 512), 0.5, np.float32)})["output"].shape == (1, 10)
        assert asyncio.run(model.infer_async({"input": np.full((1, 512), 0.5, np.float32)}))["output"].shape == (1, 10)
        with urllib.request.urlopen(f"http://127.0.0.1:{server.http_port}/metrics", timeout=5) as r:
            metrics = r.read().decode()
        assert 'ferrite_tenant_refusals_total{limit="rate",tenant="acme"} 1' in metrics, metrics


def test_engine_caps_the_requests_in_flight(tmp_path):
    """An engine's max_concurrent_requests is the binary's --max-concurrent-requests: while one
    request waits in the queue, the application's next call raises Overloaded and a served
    client gets 429 with Retry-After; the place comes back when the first is answered."""
    import json
    import shutil
    import urllib.error
    import urllib.request
    from concurrent.futures import ThreadPoolExecutor

    shutil.copytree(MLP, tmp_path / "mlp")
    (tmp_path / "mlp" / "config.toml").write_text("[dynamic_batching]\nmax_queue_delay_microseconds = 1000000\n")
    engine = ferrite.Engine(tmp_path, max_concurrent_requests=1)
    model = engine.model("mlp")
    x = np.full((1, 512), 0.5, np.float32)
    body = json.dumps({"inputs": [{"name": "input", "shape": [1, 512], "datatype": "FP32", "data": [0.5] * 512}]})
    with ferrite.serve(engine, http_port=0, grpc_port=0) as server, ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(model.infer, {"input": x})
        time.sleep(0.3)
        with pytest.raises(ferrite.Overloaded, match=r"max_concurrent_requests \(1 requests in flight\)"):
            model.infer({"input": x})
        req = urllib.request.Request(f"http://127.0.0.1:{server.http_port}/v2/models/mlp/infer", data=body.encode())
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(req, timeout=10)
        assert refused.value.code == 429 and refused.value.headers.get("retry-after") == "1"
        np.testing.assert_allclose(waiting.result(timeout=10)["output"], reference(x), rtol=1e-5, atol=1e-6)
        with urllib.request.urlopen(req, timeout=10) as r:
            assert r.status == 200


def test_a_loaded_model_caps_the_calls_in_flight():
    """Model.load's max_concurrent_requests bounds the calls in the model at once, sync and async
    alike: while one waits in the queue the next raises Overloaded at once (an application serving
    its own clients sheds load instead of growing the queue); the place comes back when the first
    is answered. Without it, calls queue."""
    from concurrent.futures import ThreadPoolExecutor

    x = np.full((1, 512), 0.5, np.float32)
    model = ferrite.Model.load(MLP, max_queue_delay_us=1_000_000, max_concurrent_requests=1)
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(model.infer, {"input": x})
        time.sleep(0.3)
        started = time.monotonic()
        with pytest.raises(ferrite.Overloaded, match=r"max_concurrent_requests \(1 requests in flight\)"):
            model.infer({"input": x})
        with pytest.raises(ferrite.Overloaded):
            asyncio.run(model.infer_async({"input": x}))
        assert time.monotonic() - started < 0.3, "refused at once, not after the queue delay"
        np.testing.assert_allclose(waiting.result(timeout=10)["output"], reference(x), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(model.infer({"input": x})["output"], reference(x), rtol=1e-5, atol=1e-6)
    unbounded = ferrite.Model.load(MLP, max_queue_delay_us=200_000)
    with ThreadPoolExecutor(4) as pool:
        answers = [f.result(timeout=10) for f in [pool.submit(unbounded.infer, {"input": x}) for _ in range(4)]]
    assert all(a["output"].shape == (1, 10) for a in answers)


def test_serve_takes_shared_memory_as_the_binary_does(request):
    import os

    import tritonclient.http as httpclient
    import tritonclient.utils.shared_memory as shm
    from tritonclient.utils import InferenceServerException

    engine = ferrite.Engine(ROOT / "models")
    with pytest.raises(ferrite.InvalidInput, match="'off' or 'system'"):
        ferrite.serve(engine, http_port=0, grpc_port=0, shared_memory="cuda")
    x = np.random.default_rng(7).standard_normal((3, 512)).astype(np.float32)
    key = f"/ferrite-{os.getpid()}-{request.node.name[:40]}"
    inp, out = shm.create_shared_memory_region("in", key + "-in", x.nbytes), shm.create_shared_memory_region(
        "out", key + "-out", 3 * 10 * 4)
    try:
        shm.set_shared_memory_region(inp, [x])
        # Off unless asked for, as `ferrite serve` has it.
        with ferrite.serve(engine, http_port=0, grpc_port=0) as server:
            c = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
            assert "system_shared_memory" not in c.get_server_metadata()["extensions"]
            with pytest.raises(InferenceServerException, match="shared memory is off"):
                c.register_system_shared_memory("in", key + "-in", x.nbytes)
        with ferrite.serve(engine, http_port=0, grpc_port=0, shared_memory="system") as server:
            c = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
            assert "system_shared_memory" in c.get_server_metadata()["extensions"]
            c.register_system_shared_memory("in", key + "-in", x.nbytes)
            c.register_system_shared_memory("out", key + "-out", 3 * 10 * 4)
            i = httpclient.InferInput("input", [3, 512], "FP32")
            i.set_shared_memory("in", x.nbytes)
            o = httpclient.InferRequestedOutput("output")
            o.set_shared_memory("out", 3 * 10 * 4)
            c.infer("mlp", [i], outputs=[o])
            got = shm.get_contents_as_numpy(out, np.float32, [3, 10])
            # The same engine in-process, and onnxruntime itself, agree with what came back.
            np.testing.assert_array_equal(got, engine.model("mlp").infer({"input": x})["output"])
            np.testing.assert_allclose(got, reference(x), rtol=1e-5, atol=1e-6)
            c.unregister_system_shared_memory()
    finally:
        shm.destroy_shared_memory_region(inp)
        shm.destroy_shared_memory_region(out)


def test_inputs_are_read_in_place(mlp):
    x = np.ones((2, 512), np.float32)
    (name, ptr), = mlp._native._input_pointers({"input": x})
    assert name == "input" and ptr == x.ctypes.data
    # A non-contiguous or wrong-dtype array is refused unless the caller allows a copy.
    with pytest.raises(ValueError, match="C-contiguous"):
        mlp.infer({"input": np.ones((512, 2), np.float32).T})
    with pytest.raises(TypeError, match="FP32"):
        mlp.infer({"input": np.ones((2, 512), np.float64)})
    with pytest.raises(TypeError, match="copy=True"):
        mlp.infer({"input": [[0.0] * 512]})
    (_, copied), = mlp._native._input_pointers({"input": np.ones((2, 512), np.float64)}, copy=True)
    assert copied != 0
    a = mlp.infer({"input": np.ones((512, 2), np.float64).T}, copy=True)["output"]
    b = mlp.infer({"input": np.ones((2, 512), np.float32)})["output"]
    np.testing.assert_array_equal(a, b)


def test_outputs_are_views_of_the_rust_buffer(mlp):
    out = mlp.infer({"input": np.ones((3, 512), np.float32)})["output"]
    assert not out.flags.owndata
    assert type(out.base).__name__ == "OutputBuffer"
    assert not out.flags.writeable
    # The array keeps the buffer alive after everything else is gone.
    del mlp
    gc.collect()
    assert out.shape == (3, 10) and np.isfinite(out).all()


def test_dlpack_inputs_are_not_copied(mlp):
    class Producer:
        """A DLPack producer that is not a NumPy array."""

        def __init__(self, a):
            self.a = a

        def __dlpack__(self, **kw):
            return self.a.__dlpack__(**kw)

        def __dlpack_device__(self):
            return self.a.__dlpack_device__()

    x = np.full((1, 512), 0.5, np.float32)
    (_, ptr), = mlp._native._input_pointers({"input": Producer(x)})
    assert ptr == x.ctypes.data
    np.testing.assert_array_equal(mlp.infer({"input": Producer(x)})["output"], mlp.infer({"input": x})["output"])


def test_gil_is_released_during_a_call():
    slow = ferrite.Model.load(MLP, max_queue_delay_us=300_000, name="slow")
    ticks = []
    stop = threading.Event()

    def ticker():
        while not stop.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.005)

    t = threading.Thread(target=ticker)
    t.start()
    start = time.perf_counter()
    slow.infer({"input": np.ones((1, 512), np.float32)})
    elapsed = time.perf_counter() - start
    stop.set()
    t.join()
    assert elapsed >= 0.25
    during = [x for x in ticks if start < x < start + elapsed]
    assert len(during) >= 10, f"the other thread ran {len(during)} times in {elapsed:.3f}s"


def test_threads_share_the_batcher():
    m = ferrite.Model.load(MLP, max_queue_delay_us=20_000, name="threads")
    x = np.random.default_rng(1).standard_normal((16, 512)).astype(np.float32)
    results = [None] * 16
    barrier = threading.Barrier(16)

    def call(i):
        barrier.wait()
        results[i] = m.infer({"input": x[i : i + 1]})["output"]

    threads = [threading.Thread(target=call, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    np.testing.assert_allclose(np.concatenate(results), reference(x), rtol=1e-5, atol=1e-6)


def test_a_thousand_awaits_finish_fast_without_stalling_the_loop(mlp):
    x = np.ones((1, 512), np.float32)
    start = time.perf_counter()
    for _ in range(20):
        mlp.infer({"input": x})
    serial_per_call = (time.perf_counter() - start) / 20

    async def main():
        lags = []

        async def watch():
            while True:
                t = time.perf_counter()
                await asyncio.sleep(0.001)
                lags.append(time.perf_counter() - t - 0.001)

        watcher = asyncio.create_task(watch())
        t0 = time.perf_counter()
        outs = await asyncio.gather(*(mlp.infer_async({"input": x}) for _ in range(1000)))
        elapsed = time.perf_counter() - t0
        watcher.cancel()
        return outs, elapsed, lags

    outs, elapsed, lags = asyncio.run(main())
    assert len(outs) == 1000 and all(o["output"].shape == (1, 10) for o in outs)
    assert elapsed < 1000 * serial_per_call / 3, f"{elapsed:.3f}s vs {serial_per_call * 1000:.3f}s serial"
    lags.sort()
    assert lags[len(lags) // 2] < 0.005, f"median loop lag {lags[len(lags) // 2] * 1000:.1f} ms"


def test_cancelled_awaits_drop_their_request():
    m = ferrite.Model.load(MLP, max_queue_delay_us=2_000_000, max_batch_size=8, name="cancel")

    async def main():
        task = asyncio.create_task(m.infer_async({"input": np.ones((1, 512), np.float32)}))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # Fill a batch: it runs now, without the cancelled request.
        return await asyncio.gather(*(m.infer_async({"input": np.ones((2, 512), np.float32)}) for _ in range(4)))

    outs = asyncio.run(main())
    assert all(o["output"].shape == (2, 10) for o in outs)


def test_errors_map_to_classes(mlp):
    assert issubclass(ferrite.InvalidInput, ferrite.FerriteError)
    with pytest.raises(ferrite.InvalidInput, match="'input'"):
        mlp.infer({"input": np.ones((1, 511), np.float32)})
    with pytest.raises(ferrite.InvalidInput, match="missing input"):
        mlp.infer({})
    with pytest.raises(ferrite.InvalidInput, match="unknown output"):
        mlp.infer({"input": np.ones((1, 512), np.float32)}, outputs=["nope"])
    with pytest.raises(ferrite.DeadlineExceeded):
        ferrite.Model.load(MLP, max_queue_delay_us=1_000_000, name="late").infer(
            {"input": np.ones((1, 512), np.float32)}, timeout_us=20_000
        )
    with pytest.raises(ferrite.FerriteError):
        ferrite.Model.load(ROOT / "tests" / "python" / "does-not-exist.onnx")

    async def bad():
        await mlp.infer_async({"input": np.ones((1, 3), np.float32)})

    with pytest.raises(ferrite.InvalidInput):
        asyncio.run(bad())


def test_bytes_and_all_types_round_trip():
    m = ferrite.Model.load(ROOT / "tests" / "models" / "identity")
    feeds = {}
    for spec in m.metadata.inputs:
        dt = spec.datatype
        if dt == "BYTES":
            feeds[spec.name] = np.array([[b"a", "b\u00e9", b""]], dtype=object)
        elif dt == "BF16":
            feeds[spec.name] = np.array([[1.5, -2.0, 0.25]], np.float32)
        elif dt == "BOOL":
            feeds[spec.name] = np.array([[True, False, True]])
        else:
            np_dt = {"FP16": np.float16, "FP32": np.float32, "FP64": np.float64}.get(dt) or np.dtype(dt.lower())
            feeds[spec.name] = np.array([[1, 2, 3]], dtype=np_dt)
    out = m.infer(feeds, copy=True)
    assert out["bytes_out"].tolist() == [[b"a", "b\u00e9".encode(), b""]]
    assert out["bf16_out"].tolist() == [[1.5, -2.0, 0.25]]
    for name, a in feeds.items():
        if a.dtype != object and name != "bf16_in":
            np.testing.assert_array_equal(out[name.replace("_in", "_out")], a)


def test_fastapi_example_through_testclient(monkeypatch):
    from fastapi.testclient import TestClient

    monkeypatch.setenv("FERRITE_MODEL", str(MLP))
    sys.path.insert(0, str(ROOT))
    from examples import fastapi_app

    client = TestClient(fastapi_app.app)
    x = np.random.default_rng(2).standard_normal((2, 512)).astype(np.float32)
    r = client.post("/predict", json={"rows": x.tolist()})
    assert r.status_code == 200, r.text
    np.testing.assert_allclose(np.array(r.json()["scores"], np.float32), reference(x), rtol=1e-5, atol=1e-5)
    assert client.post("/predict", json={"rows": [[1.0, 2.0]]}).status_code == 422
    assert client.post("/predict", json={"rows": []}).status_code == 422


def test_stubs_match_the_module():
    import subprocess

    out = subprocess.run(
        [sys.executable, "-m", "mypy.stubtest", "ferrite._native", "--ignore-missing-stub"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_ctrl_c_interrupts_a_blocking_call(tmp_path):
    import signal
    import subprocess

    script = tmp_path / "slow.py"
    script.write_text(
        # A shell that starts the suite in the background ignores SIGINT for its children, and
        # Python then installs no KeyboardInterrupt handler: install it, as an interactive run has.
        "import signal, sys, time, numpy as np, ferrite\n"
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        f"m = ferrite.Model.load({str(MLP)!r}, max_queue_delay_us=30_000_000, name='slow')\n"
        "print('ready', flush=True)\n"
        "t = time.time()\n"
        "try:\n"
        "    m.infer({'input': np.ones((1, 512), np.float32)})\n"
        "except KeyboardInterrupt:\n"
        "    print('interrupted', round(time.time() - t, 2), flush=True)\n"
    )
    p = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    time.sleep(0.5)
    p.send_signal(signal.SIGINT)
    out, _ = p.communicate(timeout=20)
    assert out.startswith("interrupted"), out
    assert float(out.split()[1]) < 5


def test_traces_continue_the_python_callers_trace(tmp_path):
    """In a fresh interpreter (tracing is set up once per process): a FastAPI-style caller passes
    its traceparent; the engine's spans land in that trace, under the caller's span."""
    import subprocess

    script = tmp_path / "traced.py"
    script.write_text(
        "import sys, time, queue, grpc, numpy as np, ferrite\n"
        "from concurrent import futures\n"
        f"sys.path.insert(0, {str(ROOT / 'tests')!r})\n"
        "from test_tracing import Receiver\n"
        "r = Receiver(); server = grpc.server(futures.ThreadPoolExecutor(2))\n"
        "from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc\n"
        "trace_service_pb2_grpc.add_TraceServiceServicer_to_server(r, server)\n"
        "port = server.add_insecure_port('127.0.0.1:0'); server.start()\n"
        "ferrite.init_tracing(f'http://127.0.0.1:{port}', sample_rate=0.0)\n"
        f"m = ferrite.Model.load({str(MLP)!r})\n"
        "tp = '00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01'\n"
        "m.infer({'input': np.ones((1, 512), np.float32)}, traceparent=tp)\n"
        "import asyncio\n"
        "asyncio.run(m.infer_async({'input': np.ones((1, 512), np.float32)}, traceparent=tp))\n"
        "m.infer({'input': np.ones((1, 512), np.float32)})  # no context, rate 0: not traced\n"
        "ferrite.shutdown_tracing()\n"
        "spans = []\n"
        "while not r.spans.empty(): spans.append(r.spans.get())\n"
        "recv = [s for s in spans if s.name == 'receive']\n"
        "print(len(recv), all(s.trace_id.hex() == '4bf92f3577b34da6a3ce929d0e0e4736' for s in recv),"
        " all(s.parent_span_id.hex() == '00f067aa0ba902b7' for s in recv))\n"
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["2", "True", "True"], out.stdout + out.stderr


def test_engine_reports_failed_models_and_closes(tmp_path):
    import shutil

    shutil.copytree(MLP, tmp_path / "mlp")
    (tmp_path / "broken" / "1").mkdir(parents=True)
    (tmp_path / "broken" / "1" / "model.onnx").write_bytes(b"not onnx")
    engine = ferrite.Engine(tmp_path)
    assert engine.models == ("mlp",)
    assert "cannot load" in engine.failed["broken"]
    model = engine.model("mlp")
    assert model.infer({"input": np.ones((1, 512), np.float32)})["output"].shape == (1, 10)
    assert engine.close(timeout=5) == 0
    with pytest.raises(ferrite.Unavailable):
        model.infer({"input": np.ones((1, 512), np.float32)})
