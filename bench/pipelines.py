"""The pipelines benchmark (bench/run.sh --pipelines): images and texts in, answers out, at 1, 32
and 128 concurrent clients each sending one item, in one run:

- Ferrite's image pipeline (decode_image -> resize 256 -> crop 224 -> normalize -> a ResNet-style
  CNN -> softmax -> topk 5) over the binary tensor extension, and its text pipeline (tokenize ->
  a BERT-style encoder of all-MiniLM-L6-v2's size, 6 layers x 384, at any length -> mean pool,
  L2) over TEI's POST /embed;
- the same pipelines as a Python team writes them: FastAPI + Pillow / tokenizers + onnxruntime +
  NumPy (bench/baseline/pipelines.py, 2 uvicorn workers);
- the in-process ceiling: Pillow or tokenizers and ONNX Runtime in one process, at the best batch
  size (1, 8, 32, 64);
- and the text pipelines again on texts of many lengths (`mixed_sentences`, the next one each
  request), whose ceiling groups each batch's rows by length as the tokenize step does.

Writes bench/results/pipelines.md with the ratios, and where Ferrite's time goes per step (from
ferrite_pipeline_step_duration_seconds).

Usage: python3 bench/pipelines.py [--duration 10] [--clients 1,32,128]

With one client, "/ ceiling" compares with the in-process batch 1 (one item at a time, back to
back: the latency floor), with more clients with the ceiling's best batch.
"""

import argparse
import io
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.run import ROOT, RESULTS, WORK, free_port, jpeg_body, measure, oha_load  # noqa: E402

REPO = WORK / "pipelines"
SENTENCE = "the cat eats fast food and the dog runs in the big city"  # 14 tokens with [CLS] and [SEP]
TOKENIZER = ROOT / "models" / "text_embedder" / "tokenizer.json"


def photo(w=640, h=480, seed=0):
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([x * 255 / w, y * 255 / h, (x + y) * 127 / (w + h)], -1)
    img = Image.fromarray(np.clip(base + rng.normal(0, 12, (h, w, 3)), 0, 255).astype(np.uint8))
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=90)
    return buf.getvalue()


def repository():
    """The bench models (bench/make_models.py) and the two pipelines over them."""
    kinds = WORK / "kinds"
    if not (kinds / "bert_var" / "1" / "model.onnx").exists():
        subprocess.run([sys.executable, str(ROOT / "bench" / "make_models.py"), str(kinds)], check=True)
    shutil.rmtree(REPO, ignore_errors=True)
    for m in ("resnet", "bert_var"):
        shutil.copytree(kinds / m, REPO / m)
    (REPO / "images").mkdir(parents=True)
    # The defaults (workers, rows per batch) as a user gets them.
    (REPO / "images" / "config.toml").write_text("""[[steps]]
op = "decode_image"
[[steps]]
op = "resize"
mode = "shorter_side"
size = [256]
[[steps]]
op = "crop"
size = [224, 224]
[[steps]]
op = "normalize"
mean = [0.485, 0.456, 0.406]
std = [0.229, 0.224, 0.225]
output = "images"
[[steps]]
op = "model"
model = "resnet"
[[steps]]
op = "softmax"
input = "logits"
[[steps]]
op = "topk"
input = "logits"
output = "classes"
k = 5
""")
    (REPO / "text").mkdir()
    shutil.copy(TOKENIZER, REPO / "text" / "tokenizer.json")
    (REPO / "text" / "config.toml").write_text("""[[steps]]
op = "tokenize"
max_length = 256
outputs = ["input_ids", "attention_mask"]
[[steps]]
op = "model"
model = "bert_var"
[[steps]]
op = "pool"
normalize = true
[[output]]
name = "embedding"
""")


def bodies(jpeg):
    header_len = jpeg_body(WORK / "image.bin", jpeg)
    (WORK / "image.jpg").write_bytes(jpeg)
    (WORK / "embed.json").write_text(json.dumps({"inputs": SENTENCE}))
    mixed = mixed_sentences()
    (WORK / "embed-mixed.jsonl").write_text("".join(json.dumps({"inputs": t}) + "\n" for t in mixed))
    (WORK / "embed-mixed16.jsonl").write_text(
        "".join(json.dumps({"inputs": mixed[i:i + 16]}) + "\n" for i in range(0, len(mixed), 16)))
    # 32 passages of 200 words a request, as a document indexer sends them: a pipeline batch of
    # much text (a heavy request).
    (WORK / "embed-long.json").write_text(json.dumps({"inputs": [f"{i} " + " ".join(["passage"] * 200)
                                                                 for i in range(32)]}))
    return header_len


def mixed_sentences(n=2000, seed=7):
    """Sentences of 3 to 60 words (5 to 150 tokens with [CLS] and [SEP], median 22), as a search
    engine's queries and passages come: most short, some long. A load of them (oha -Z, the next line per request)
    is what a real TEI deployment sees; one sentence repeated makes every batch one shape."""
    import random
    rng = random.Random(seed)
    words = SENTENCE.split() + ["a", "house", "water", "red", "people", "walks", "near", "river", "with", "old",
                                "friends", "after", "work", "every", "day", "small", "children", "play", "music"]
    out = []
    for _ in range(n):
        length = min(60, 3 + int(rng.expovariate(1 / 12)))
        out.append(" ".join(rng.choice(words) for _ in range(length)))
    return out


def ceilings(jpeg, secs):
    """Items/s of preprocessing and ONNX Runtime in one process, best over batch sizes."""
    import onnxruntime as ort
    from PIL import Image
    from tokenizers import Tokenizer

    out = {}
    sess = ort.InferenceSession(str(REPO / "resnet" / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
    name = sess.get_inputs()[0].name
    mean, std = np.array([0.485, 0.456, 0.406], np.float32), np.array([0.229, 0.224, 0.225], np.float32)

    def image(data):
        img = Image.open(io.BytesIO(data)).convert("RGB")
        r = 256 / min(img.size)
        img = img.resize((round(img.width * r), round(img.height * r)), Image.BILINEAR)
        left, top = (img.width - 224) // 2, (img.height - 224) // 2
        x = (np.asarray(img.crop((left, top, left + 224, top + 224)), np.float32) / 255 - mean) / std
        return x.transpose(2, 0, 1)

    best = {}
    for b in (1, 8, 32):
        n, t0 = 0, time.time()
        while time.time() - t0 < secs:
            sess.run(None, {name: np.stack([image(jpeg) for _ in range(b)])})
            n += b
        best[b] = n / (time.time() - t0)
    out["image"] = best
    tok = Tokenizer.from_file(str(TOKENIZER))
    tok.no_padding()
    tok.no_truncation()
    bert = ort.InferenceSession(str(REPO / "bert_var" / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
    # One sentence over and over, and texts of many lengths: each batch's rows grouped by length as
    # the tokenize step groups them (bench/text_lengths.py; one sentence makes one group), each
    # group one run padded to its longest.
    from bench.text_lengths import PAD_WASTE, feed, groups

    for kind, texts in (("text", [SENTENCE]), ("texts of many lengths", mixed_sentences())):
        best, i = {}, 0
        for b in (1, 8, 32, 64):
            n, t0 = 0, time.time()
            while time.time() - t0 < secs:
                enc = tok.encode_batch([texts[(i + k) % len(texts)] for k in range(b)])
                i += b
                for group in groups([len(e.ids) for e in enc], PAD_WASTE):
                    inputs = feed(enc, group)
                    h = bert.run(None, inputs)[0]
                    m = inputs["attention_mask"][..., None].astype(np.float32)
                    v = (h * m).sum(1) / m.sum(1)
                    v /= np.linalg.norm(v, axis=1, keepdims=True)
                n += b
            best[b] = n / (time.time() - t0)
        out[kind] = best
    return out


def step_times(metrics):
    """Mean ms per batch of each pipeline step, from the server's /metrics text."""
    sums, counts = {}, {}
    for line in metrics.splitlines():
        m = re.match(r'ferrite_pipeline_step_duration_seconds_(sum|count)\{model="(\w+)",step="(\w+)"\} (\S+)', line)
        if m:
            (sums if m[1] == "sum" else counts)[(m[2], m[3])] = float(m[4])
    return {k: 1000 * sums[k] / counts[k] for k in sums if counts.get(k)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--duration", type=int, default=10)
    ap.add_argument("--clients", default="1,32,128")
    args = ap.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    repository()
    jpeg = photo()
    header_len = bodies(jpeg)
    clients = [int(c) for c in args.clients.split(",")]
    # The ceiling is measured before and after the servers run (best of the two per batch size):
    # on a shared host one measurement can land in a slow spell.
    ceiling = ceilings(jpeg, max(args.duration // 2, 3))
    print(json.dumps({"ceiling": ceiling}), flush=True)
    rows = []
    # Ferrite: one server for both pipelines, the step times read from it after the loads.
    port, grpc_port, metrics_port = free_port(), free_port(), free_port()
    cmd = [str(ROOT / "target/release/ferrite"), "serve", "--model-repository", str(REPO), "--http-port", str(port),
           "--grpc-port", str(grpc_port), "--metrics-port", str(metrics_port), "--log", "warn"]
    base = f"http://127.0.0.1:{port}"
    binary = [f"Inference-Header-Content-Length: {header_len}"]
    steps = {}
    for c in clients:
        rows.append(("images", "Ferrite (V2 binary)", c, measure(
            f"ferrite-images-{c}", cmd, f"{base}/v2/health/ready",
            load_and_read_steps(oha_load(f"{base}/v2/models/images/infer", WORK / "image.bin", c, binary),
                                metrics_port, steps), args)))
        rows.append(("text", "Ferrite (TEI /embed)", c, measure(
            f"ferrite-text-{c}", cmd, f"{base}/v2/health/ready",
            load_and_read_steps(oha_load(f"{base}/embed", WORK / "embed.json", c, ["Content-Type: application/json"]),
                                metrics_port, steps), args)))
        rows.append(("texts of many lengths", "Ferrite (TEI /embed)", c, measure(
            f"ferrite-mixed-{c}", cmd, f"{base}/v2/health/ready",
            oha_load(f"{base}/embed", WORK / "embed-mixed.jsonl", c, ["Content-Type: application/json"], lines=True),
            args)))
    # The FastAPI baseline, 2 workers (one per core).
    bport = free_port()
    env = dict(os.environ, RESNET=str(REPO / "resnet" / "1" / "model.onnx"), BERT=str(REPO / "bert_var" / "1" / "model.onnx"),
               TOKENIZER=str(TOKENIZER))
    bcmd = [sys.executable, "-m", "uvicorn", "bench.baseline.pipelines:app", "--workers", "2", "--port", str(bport),
            "--log-level", "warning"]
    bbase = f"http://127.0.0.1:{bport}"
    for c in clients:
        rows.append(("images", "FastAPI + Pillow + onnxruntime", c, measure(
            f"fastapi-images-{c}", bcmd, f"{bbase}/health",
            oha_load(f"{bbase}/classify", WORK / "image.jpg", c, ["Content-Type: image/jpeg"]), args, env=env)))
        rows.append(("text", "FastAPI + tokenizers + onnxruntime", c, measure(
            f"fastapi-text-{c}", bcmd, f"{bbase}/health",
            oha_load(f"{bbase}/embed", WORK / "embed.json", c, ["Content-Type: application/json"]), args, env=env)))
        rows.append(("texts of many lengths", "FastAPI + tokenizers + onnxruntime", c, measure(
            f"fastapi-mixed-{c}", bcmd, f"{bbase}/health",
            oha_load(f"{bbase}/embed", WORK / "embed-mixed.jsonl", c, ["Content-Type: application/json"], lines=True),
            args, env=env)))
    again = ceilings(jpeg, max(args.duration // 2, 3))
    ceiling = {k: {b: max(v, again[k][b]) for b, v in ceiling[k].items()} for k in ceiling}
    write(rows, ceiling, steps, args)


def load_and_read_steps(load, metrics_port, steps):
    """`load`, then the server's per-step times (read while it still runs)."""

    def run(duration):
        result = load(duration)
        if duration > 2:
            with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics") as r:
                steps.update(step_times(r.read().decode()))
        return result

    return run


def write(rows, ceiling, steps, args):
    lines = [
        "# Pipelines: images and texts in, answers out",
        "",
        f"`bench/run.sh --pipelines`, {time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores ({platform.processor() or platform.machine()}),"
        f" load generator (oha) on the same host, {args.duration} s per point. One item per request.",
        "",
        "In-process ceiling (preprocessing + ONNX Runtime in one process, items/s by batch size; the best of a",
        "measurement before and one after the servers ran). For images it runs decoding and the model one after",
        "the other in one Python thread (ONNX Runtime on both cores): a server that decodes while the model runs",
        "can pass it. Texts of many lengths (`mixed_sentences`, 5 to 150 tokens, one a request; the text rows send",
        "one sentence): each batch's rows grouped by length as the tokenize step groups them, one run a group.",
        "",
        "| pipeline | " + " | ".join(f"batch {b}" for b in ceiling["text"]) + " |",
        "|---|" + "---|" * len(ceiling["text"]),
    ]
    for kind in ("image", "text", "texts of many lengths"):
        lines.append(f"| {kind} | " + " | ".join(f"{ceiling[kind].get(b, float('nan')):.1f}" for b in ceiling["text"]) + " |")
    lines += ["", "| pipeline | system | clients | items/s | p50 ms | p99 ms | CPU cores | errors | / ceiling | / FastAPI |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    best = {k: max(v.values()) for k, v in ceiling.items()}
    best["images"] = best["image"]
    for kind, system, c, r in rows:
        base = next((b for k, s, cc, b in rows if k == kind and cc == c and s.startswith("FastAPI")), None)
        vs = f"{r['rps'] / base['rps']:.2f}" if base and base["rps"] else ""
        # One client is held to the latency floor, the in-process batch 1, not to the best batch.
        ceil = ceiling["image" if kind == "images" else kind][1] if c == 1 else best[kind]
        lines.append(f"| {kind} | {system} | {c} | {r['rps']:.1f} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | "
                     f"{r['cpu_cores']:.2f} | {r['errors']} | {r['rps'] / ceil:.2f} | {vs} |")
    lines += ["", "Where Ferrite's time goes (mean ms per pipeline batch, over the whole run; a model step counts",
              "its queue and run in that model's batcher):", "", "| pipeline | step | ms per batch |", "|---|---|---|"]
    for (model, step), ms in sorted(steps.items()):
        lines.append(f"| {model} | {step} | {ms:.2f} |")
    (RESULTS / "pipelines.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
