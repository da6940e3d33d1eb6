"""What a Python model costs per request: a `model.py` that returns its input (Triton's Python
backend, served by Ferrite in a worker process) against Ferrite's own ONNX identity model, the
same function called in-process, and a FastAPI service wrapping it. Tiny (64-byte) and 1 MB
tensors; 1, 8 and 128 clients; perf_analyzer over gRPC and HTTP (binary tensors), oha for V2 JSON.
Writes bench/results/python_models.md.

Run: bench/run.sh --python-models [--duration 5]
"""

import argparse
import importlib.util
import io
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.run import (RESULTS, ROOT, WORK, ferrite, free_port, jpeg_body, measure, oha_load,  # noqa: E402
                       perf_analyzer_load)

HERE = WORK / "python"
SIZES = {"64 B": 16, "1 MB": 262144}
# The Python models' workers run under this interpreter (it has NumPy and Pillow).
PYTHON = ["--python", sys.executable]

MODEL_PY = '''import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor("OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy())])
            for r in requests]
'''

CONFIG = '''name: "{name}"
{backend}
max_batch_size: 0
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] }} ]
instance_group [ {{ count: 1 kind: KIND_CPU }} ]
'''


PRE_PY = '''import io

import numpy as np
from PIL import Image

import triton_python_backend_utils as pb_utils

MEAN = np.array([0.485, 0.456, 0.406], np.float32)
STD = np.array([0.229, 0.224, 0.225], np.float32)


class TritonPythonModel:
    """The bundled image classifier's steps in Pillow and NumPy: shorter side 36, centre 32x32."""

    def execute(self, requests):
        responses = []
        for request in requests:
            pixels = []
            for data in pb_utils.get_input_tensor_by_name(request, "image").as_numpy().reshape(-1):
                img = Image.open(io.BytesIO(data)).convert("RGB")
                r = 36 / min(img.size)
                img = img.resize((round(img.width * r), round(img.height * r)), Image.BILINEAR)
                left, top = (img.width - 32) // 2, (img.height - 32) // 2
                x = (np.asarray(img.crop((left, top, left + 32, top + 32)), np.float32) / 255 - MEAN) / STD
                pixels.append(x.transpose(2, 0, 1))
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("pixels", np.stack(pixels))]))
        return responses
'''

POST_PY = '''import numpy as np

import triton_python_backend_utils as pb_utils

LABELS = "airplane automobile bird cat deer dog frog horse ship truck".split()


class TritonPythonModel:
    """Softmax and the top 3 as "score:index:label", as the bundled classifier answers."""

    def execute(self, requests):
        responses = []
        for request in requests:
            logits = pb_utils.get_input_tensor_by_name(request, "logits").as_numpy()
            e = np.exp(logits - logits.max(axis=1, keepdims=True))
            p = e / e.sum(axis=1, keepdims=True)
            top = np.argsort(-p, axis=1)[:, :3]
            rows = [[f"{p[i, k]:.6f}:{k}:{LABELS[k]}".encode() for k in row] for i, row in enumerate(top)]
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("classes", np.array(rows, dtype=np.object_))]))
        return responses
'''

ENSEMBLE = '''name: "classify_py"
platform: "ensemble"
max_batch_size: 32
input [ { name: "image" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "classes" data_type: TYPE_STRING dims: [ 3 ] } ]
ensemble_scheduling {
  step [
    { model_name: "pre_py" model_version: -1 input_map { key: "image" value: "image" }
      output_map { key: "pixels" value: "pixels" } },
    { model_name: "tiny_cnn" model_version: -1 input_map { key: "pixels" value: "pixels" }
      output_map { key: "logits" value: "logits" } },
    { model_name: "post_py" model_version: -1 input_map { key: "logits" value: "logits" }
      output_map { key: "classes" value: "classes" } }
  ]
}
'''


def python_config(name, inputs, outputs, count=2):
    return (f'name: "{name}"\nbackend: "python"\nmax_batch_size: 32\ninput [ {inputs} ]\noutput [ {outputs} ]\n'
            f'dynamic_batching {{ }}\ninstance_group [ {{ count: {count} kind: KIND_CPU }} ]\n')


def pipelines_repository():
    """The bundled image classifier (native steps) beside the same as an ensemble of Python
    pre- and post-processing around the same ONNX model."""
    repo = HERE / "pipelines"
    shutil.rmtree(repo, ignore_errors=True)
    for name in ("tiny_cnn", "image_classifier"):
        shutil.copytree(ROOT / "models" / name, repo / name)
    for name, code, config in [
        ("pre_py", PRE_PY, python_config("pre_py", '{ name: "image" data_type: TYPE_STRING dims: [ 1 ] }',
                                         '{ name: "pixels" data_type: TYPE_FP32 dims: [ 3, 32, 32 ] }')),
        ("post_py", POST_PY, python_config("post_py", '{ name: "logits" data_type: TYPE_FP32 dims: [ 10 ] }',
                                           '{ name: "classes" data_type: TYPE_STRING dims: [ 3 ] }')),
    ]:
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "config.pbtxt").write_text(config)
        (repo / name / "1" / "model.py").write_text(code)
    (repo / "classify_py").mkdir()
    (repo / "classify_py" / "config.pbtxt").write_text(ENSEMBLE)
    return repo


def image_body(shape):
    """A binary-extension request body with one 640x480 JPEG as input "image" of `shape`."""
    from PIL import Image

    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:480, 0:640]
    pixels = np.stack([xx * 255 // 640, yy * 255 // 480, (xx + yy) % 256], -1).astype(np.uint8)
    pixels = np.clip(pixels + rng.integers(0, 24, pixels.shape), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "JPEG", quality=90)
    jpeg = buf.getvalue()
    path = HERE / f"image-{len(shape)}.bin"
    return path, jpeg_body(path, jpeg, shape)


def pipeline_rows(args, clients):
    repo = pipelines_repository()
    rows = []
    for model, shape in (("image_classifier", [1]), ("classify_py", [1, 1])):
        body, header = image_body(shape)
        for c in clients:
            def load_for(base, grpc, body=body, header=header, model=model, c=c):
                return oha_load(f"{base}/v2/models/{model}/infer", body, c,
                                headers=[f"Inference-Header-Content-Length: {header}"])

            row = ferrite(f"{model}-{c}", args, load_for, extra=PYTHON, repo=repo)
            row.update(model=model, clients=c)
            rows.append(row)
    return rows


def repository():
    import onnx
    from onnx import TensorProto, helper

    repo = HERE / "repo"
    (repo / "identity_py" / "1").mkdir(parents=True, exist_ok=True)
    (repo / "identity_py" / "config.pbtxt").write_text(CONFIG.format(name="identity_py", backend='backend: "python"'))
    (repo / "identity_py" / "1" / "model.py").write_text(MODEL_PY)
    (repo / "identity_onnx" / "1").mkdir(parents=True, exist_ok=True)
    (repo / "identity_onnx" / "config.pbtxt").write_text(
        CONFIG.format(name="identity_onnx", backend='platform: "onnxruntime_onnx"'))
    graph = helper.make_graph(
        [helper.make_node("Identity", ["INPUT0"], ["OUTPUT0"])], "identity",
        [helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, ["N"])],
        [helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, ["N"])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    onnx.save(model, repo / "identity_onnx" / "1" / "model.onnx")
    return repo


def in_process(n, secs=2.0):
    """µs per call of the model's execute with one request, in this process."""
    sys.path.insert(0, str(ROOT / "crates" / "ferrite-core" / "python"))
    import triton_python_backend_utils as pb_utils

    spec = importlib.util.spec_from_file_location("identity_model", HERE / "repo" / "identity_py" / "1" / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = module.TritonPythonModel()
    x = np.ones(n, np.float32)
    calls, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < secs:
        model.execute([pb_utils.InferenceRequest("m", [], [pb_utils.Tensor("INPUT0", x)])])
        calls += 1
    return (time.perf_counter() - t0) / calls * 1e6


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--duration", type=int, default=5)
    p.add_argument("--clients", default="1,8,128")
    p.add_argument("--quick", action="store_true", help="64-byte tensors only, no pipelines (a quick check)")
    args = p.parse_args()
    if args.quick:
        SIZES.pop("1 MB")
    clients = [int(c) for c in args.clients.split(",")]
    repo = repository()
    started = time.time()
    rows = []
    for size, n in SIZES.items():
        for protocol in ("grpc", "http"):
            for c in clients:
                for model in ("identity_onnx", "identity_py"):
                    shape = ["--shape", f"INPUT0:{n}"]

                    def load_for(base, grpc, protocol=protocol, c=c, model=model, shape=shape):
                        url = grpc if protocol == "grpc" else base.removeprefix("http://")
                        return perf_analyzer_load(protocol, url, c, model=model, extra=shape, fatal=False)

                    row = ferrite(f"{model}-{protocol}-{c}-{n}", args, load_for, extra=PYTHON, repo=repo)
                    row.update(size=size, protocol=protocol, clients=c, model=model)
                    rows.append(row)
    # V2 JSON, tiny tensor: Ferrite's Python model against FastAPI wrapping the same model.py.
    body = HERE / "body.json"
    body.write_text(json.dumps({"inputs": [{"name": "INPUT0", "shape": [16], "datatype": "FP32", "data": [1.0] * 16}]}))
    for c in clients:
        def json_load(base, grpc, c=c):
            return oha_load(f"{base}/v2/models/identity_py/infer", body, c, headers=["Content-Type: application/json"])

        row = ferrite(f"ferrite-json-{c}", args, json_load, extra=PYTHON, repo=repo)
        row.update(size="64 B", protocol="json", clients=c, model="identity_py")
        rows.append(row)
        port = free_port()
        cmd = [sys.executable, "-m", "uvicorn", "bench.baseline.python_model:app", "--port", str(port), "--log-level",
               "warning", "--workers", "2"]
        env = dict(os.environ, MODEL_PY=str(repo / "identity_py" / "1" / "model.py"))
        base = f"http://127.0.0.1:{port}"
        row = measure(f"fastapi-json-{c}", cmd, f"{base}/docs",
                      oha_load(f"{base}/v2/models/identity_py/infer", body, c, headers=["Content-Type: application/json"]),
                      args, env=env)
        row.update(size="64 B", protocol="json", clients=c, model="fastapi")
        rows.append(row)
    pipelines = [] if args.quick else pipeline_rows(args, clients)
    calls = {size: in_process(n) for size, n in SIZES.items()}
    write(rows, pipelines, calls, args, time.time() - started)


def write(rows, pipelines, calls, args, took):
    def cpu_us(r):
        return r["cpu_cores"] / r["rps"] * 1e6 if r["rps"] == r["rps"] and r["rps"] > 0 else float("nan")

    lines = [
        "# Python models: per-request cost against the ONNX identity",
        "",
        f"`bench/run.sh --python-models --duration {args.duration}`, {platform.machine()}, "
        f"{os.cpu_count()} CPUs, {took / 60:.0f} minutes. A `model.py` returning its input (one worker process) "
        "against Ferrite's ONNX identity model (one instance), both `max_batch_size: 0`, no dynamic batching; "
        "server CPU counts the worker. perf_analyzer for gRPC and HTTP (binary tensors), oha for V2 JSON.",
        "",
        "| tensor | protocol | clients | ONNX req/s | Python req/s | ratio | ONNX p50 ms | Python p50 ms | p50 + µs | "
        "ONNX CPU µs/req | Python CPU µs/req | CPU + µs |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for size in SIZES:
        for protocol in ("grpc", "http"):
            for c in sorted({r["clients"] for r in rows}):
                pick = {r["model"]: r for r in rows if (r["size"], r["protocol"], r["clients"]) == (size, protocol, c)}
                o, py = pick.get("identity_onnx"), pick.get("identity_py")
                if not o or not py:
                    continue
                lines.append(
                    f"| {size} | {protocol} | {c} | {o['rps']:,.0f} | {py['rps']:,.0f} | {py['rps'] / o['rps']:.2f} | "
                    f"{o['p50_ms']:.3f} | {py['p50_ms']:.3f} | {(py['p50_ms'] - o['p50_ms']) * 1000:+.0f} | "
                    f"{cpu_us(o):.0f} | {cpu_us(py):.0f} | {cpu_us(py) - cpu_us(o):+.0f} |")
    lines += [
        "",
        "V2 JSON, 64-byte tensor: Ferrite's Python model against FastAPI + uvicorn (2 workers) wrapping the same `model.py`.",
        "",
        "| clients | Ferrite req/s | FastAPI req/s | ratio | Ferrite p99 ms | FastAPI p99 ms |",
        "|---|---|---|---|---|---|",
    ]
    for c in sorted({r["clients"] for r in rows if r["protocol"] == "json"}):
        f = next(r for r in rows if r["protocol"] == "json" and r["clients"] == c and r["model"] == "identity_py")
        b = next(r for r in rows if r["protocol"] == "json" and r["clients"] == c and r["model"] == "fastapi")
        ratio = f"{f['rps'] / b['rps']:.1f}" if b["rps"] > 0 else "(FastAPI served none)"
        lines.append(f"| {c} | {f['rps']:,.0f} | {b['rps']:,.0f} | {ratio} | "
                     f"{f['p99_ms']:.2f} | {b['p99_ms']:.2f} |")
    lines += [
        "",
        "An image pipeline (one 640x480 JPEG per request, binary HTTP, oha): the bundled `image_classifier` "
        "(native steps: decode, resize, crop, normalize, `tiny_cnn`, softmax, top 3) against an ensemble of the "
        "same steps in Python (Pillow and NumPy, 2 worker processes each, dynamic batching) around the same ONNX model.",
        "",
        "| clients | native req/s | Python ensemble req/s | native / Python | native p50 ms | Python p50 ms | "
        "native p99 ms | Python p99 ms | native CPU ms/req | Python CPU ms/req |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in sorted({r["clients"] for r in pipelines}):
        n = next(r for r in pipelines if r["clients"] == c and r["model"] == "image_classifier")
        py = next(r for r in pipelines if r["clients"] == c and r["model"] == "classify_py")
        lines.append(f"| {c} | {n['rps']:,.0f} | {py['rps']:,.0f} | {n['rps'] / max(py['rps'], 1e-9):.2f} | "
                     f"{n['p50_ms']:.2f} | {py['p50_ms']:.2f} | {n['p99_ms']:.2f} | {py['p99_ms']:.2f} | "
                     f"{n['cpu_cores'] / n['rps'] * 1e3:.2f} | {py['cpu_cores'] / py['rps'] * 1e3:.2f} |")
    lines += ["", "The same `execute` called in this process with one request: "
              + ", ".join(f"{size} {us:.1f} µs" for size, us in calls.items()) + ".", ""]
    (RESULTS / ("python_models-quick.md" if args.quick else "python_models.md")).write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
