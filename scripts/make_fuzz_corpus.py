#!/usr/bin/env python3
"""Writes the seed corpus of the parser fuzzers (fuzz/corpus/<target>/): valid requests of every
shape the parsers take, from which the fuzzer mutates. Crashes the fuzzer finds are saved next to
these seeds and committed, so they are replayed by every `cargo test` from then on.

Run from the repository root: python3 scripts/make_fuzz_corpus.py (needs msgpack and tritonclient).
"""
import json
import os
import struct

import msgpack
from tritonclient.grpc import service_pb2

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORPUS = os.path.join(ROOT, "fuzz", "corpus")


def write(target, name, data):
    path = os.path.join(CORPUS, target, name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode())


def requests():
    yield "fp32", {"inputs": [{"name": "input", "shape": [1, 4], "datatype": "FP32", "data": [0.5, -1, 2e3, 0]}]}
    yield "nested", {"inputs": [{"name": "x", "shape": [2, 2], "datatype": "INT64", "data": [[1, 2], [3, 4]]}],
                     "outputs": [{"name": "y", "parameters": {"binary_data": True}}]}
    yield "bytes", {"id": "r1", "inputs": [{"name": "s", "shape": [2], "datatype": "BYTES", "data": ["a", "\u00e9"]}]}
    yield "params", {"inputs": [{"name": "b", "shape": [3], "datatype": "BOOL", "data": [True, False, True]}],
                     "parameters": {"priority": 1, "timeout": 1000, "cache": False, "binary_data_output": True}}
    yield "half", {"inputs": [{"name": "h", "shape": [1], "datatype": "FP16", "data": [1.5]},
                              {"name": "g", "shape": [1], "datatype": "BF16", "data": ["NaN"]}]}


for name, req in requests():
    write("json", name + ".json", json.dumps(req))
    write("msgpack", name + ".msgpack", msgpack.packb(req))

# Binary extension: a 4-byte little-endian JSON length, the JSON, then the tensor bytes.
head = json.dumps({"inputs": [{"name": "x", "shape": [2], "datatype": "FP32", "parameters": {"binary_data_size": 8}},
                              {"name": "s", "shape": [1], "datatype": "BYTES", "parameters": {"binary_data_size": 7}}]})
write("binary", "two.bin", struct.pack("<I", len(head)) + head.encode() + struct.pack("<2f", 1.0, 2.0)
      + struct.pack("<I", 3) + b"abc")

typed = service_pb2.ModelInferRequest(model_name="m", id="7")
t = typed.inputs.add(name="x", datatype="FP32", shape=[1, 2])
t.contents.fp32_contents.extend([1.0, 2.0])
typed.parameters["priority"].int64_param = 1
typed.outputs.add(name="y")
write("grpc", "typed.pb", typed.SerializeToString())
raw = service_pb2.ModelInferRequest(model_name="m")
raw.inputs.add(name="x", datatype="INT32", shape=[2])
raw.raw_input_contents.append(struct.pack("<2i", 5, 6))
write("grpc", "raw.pb", raw.SerializeToString())

write("config", "full.toml", """backend = "onnxruntime"
max_batch_size = 8
instance_count = 2
threads = 1
[dynamic_batching]
preferred_batch_size = [4, 8]
max_queue_delay_microseconds = 100
max_queue_size = 10
priority_levels = 2
default_priority_level = 2
timeout_action = "delay"
[dynamic_batching.priority_queue_policy.1]
max_queue_size = 4
[cache]
enabled = true
[[input]]
name = "x"
dims = [4]
""")
write("config", "empty.toml", "")

# Encoded images for the decode and resize chain, one of each format and mode the decoders take.
try:
    import io

    from PIL import Image

    def image(name, img, fmt, **kw):
        buf = io.BytesIO()
        img.save(buf, fmt, **kw)
        write("image", name, buf.getvalue())

    rgb = Image.radial_gradient("L").resize((24, 16)).convert("RGB")
    image("rgb.png", rgb, "PNG")
    image("gray.png", rgb.convert("L"), "PNG")
    image("rgba.png", rgb.convert("RGBA"), "PNG")
    image("rgb16.png", rgb.convert("I;16"), "PNG")
    image("baseline.jpg", rgb, "JPEG", quality=80)
    image("progressive.jpg", rgb, "JPEG", progressive=True)
    exif = Image.Exif()
    exif[0x0112] = 6
    image("rotated.jpg", rgb, "JPEG", exif=exif.tobytes())
    image("lossless.webp", rgb, "WEBP", lossless=True)
    image("lossy.webp", rgb, "WEBP", quality=50)
    image("tall.png", Image.new("L", (1, 300)), "PNG")
except ImportError:
    print("Pillow is not installed: no image seeds")
print("wrote", CORPUS)
