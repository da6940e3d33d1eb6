"""The text tasks benchmark (bench/run.sh --texts): TEI's POST /rerank (one query, 16 passages a
request) and POST /predict (one text a request) at 32 and 128 concurrent clients, in one run:

- Ferrite's pipelines: tokenize (pairs for the re-ranker) -> a BERT-style encoder of
  all-MiniLM-L6-v2's size (6 layers x 384) with a classification head on [CLS] (1 label: a
  cross-encoder; 3 labels: a classifier), declared `task = "rerank"` and `"classify"`;
- the same calls as a Python team writes them: FastAPI + tokenizers + onnxruntime + NumPy
  (bench/baseline/pipelines.py, 2 uvicorn workers);
- the in-process ceiling: tokenizers and ONNX Runtime in one process, at the best batch size.

Items are passages for /rerank and texts for /predict. Writes bench/results/texts.md.

Usage: python3 bench/texts.py [--duration 10] [--clients 32,128]
"""

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.run import ROOT, RESULTS, WORK, free_port, measure, oha_load  # noqa: E402

REPO = WORK / "texts"
TOKENIZER = ROOT / "models" / "text_embedder" / "tokenizer.json"
QUERY = "what does the cat eat in the big city"
PASSAGES = [f"the {a} {v} {o} in the {p}" for a, v, o, p in zip(
    ["cat", "dog", "bird", "fish", "man", "woman", "child", "people"] * 2,
    ["eats", "runs", "plays", "sleeps", "eats", "walks", "drinks", "likes"] * 2,
    ["food", "fast", "water", "well", "fish", "home", "water", "cars"] * 2,
    ["city", "road", "sky", "sea", "house", "world", "night", "day"] * 2)]
TEXT = "the cat eats fast food and the dog runs in the big city"
PER_REQUEST = {"rerank": len(PASSAGES), "predict": 1}


def repository():
    kinds = WORK / "kinds"
    if not (kinds / "bert_classify" / "1" / "model.onnx").exists():
        subprocess.run([sys.executable, str(ROOT / "bench" / "make_models.py"), str(kinds)], check=True)
    shutil.rmtree(REPO, ignore_errors=True)
    for m in ("bert_rerank", "bert_classify"):
        shutil.copytree(kinds / m, REPO / m)
    for name, model, pair, task in [("rerank", "bert_rerank", 'pair = "passage"\n', "rerank"),
                                    ("predict", "bert_classify", "", "classify")]:
        (REPO / name).mkdir()
        shutil.copy(TOKENIZER, REPO / name / "tokenizer.json")
        (REPO / name / "labels.txt").write_text("negative\nneutral\npositive\n")
        outputs = "" if pair else 'outputs = ["input_ids", "attention_mask"]\n'
        labels = "" if pair else 'label_filename = "labels.txt"\n'
        (REPO / name / "config.toml").write_text(
            f'task = "{task}"\n[[steps]]\nop = "tokenize"\nmax_length = 256\n{pair}{outputs}'
            f'[[steps]]\nop = "model"\nmodel = "{model}"\n[[output]]\nname = "logits"\n{labels}')
    (WORK / "rerank.json").write_text(json.dumps({"query": QUERY, "texts": PASSAGES}))
    (WORK / "predict.json").write_text(json.dumps({"inputs": TEXT}))


def ceilings(secs):
    """Items/s of tokenizers and ONNX Runtime in one process, by batch size."""
    import onnxruntime as ort
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(TOKENIZER))
    tok.no_padding()
    tok.enable_truncation(256)
    out = {}
    for kind, model, batches in [("rerank", "bert_rerank", (16, 32, 64)), ("predict", "bert_classify", (1, 8, 32, 64))]:
        sess = ort.InferenceSession(str(REPO / model / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
        best = {}
        for b in batches:
            n, t0 = 0, time.time()
            while time.time() - t0 < secs:
                if kind == "rerank":
                    enc = tok.encode_batch([(QUERY, p) for p in (PASSAGES * 4)[:b]])
                else:
                    enc = tok.encode_batch([TEXT] * b)
                longest = max(len(e.ids) for e in enc)
                pad = lambda rows: np.array([r + [0] * (longest - len(r)) for r in rows], np.int64)  # noqa: E731
                feed = {"input_ids": pad([e.ids for e in enc]), "attention_mask": pad([e.attention_mask for e in enc])}
                if kind == "rerank":
                    feed["token_type_ids"] = pad([e.type_ids for e in enc])
                logits = sess.run(None, feed)[0]
                if kind == "rerank":
                    np.argsort(-(1 / (1 + np.exp(-logits[:, 0]))))
                else:
                    e = np.exp(logits - logits.max(1, keepdims=True))
                    np.argsort(-(e / e.sum(1, keepdims=True)), axis=1)
                n += b
            best[b] = n / (time.time() - t0)
        out[kind] = best
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--duration", type=int, default=10)
    ap.add_argument("--clients", default="32,128")
    args = ap.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    repository()
    clients = [int(c) for c in args.clients.split(",")]
    ceiling = ceilings(max(args.duration // 2, 3))
    print(json.dumps({"ceiling": ceiling}), flush=True)
    rows = []
    port, grpc_port = free_port(), free_port()
    cmd = [str(ROOT / "target/release/ferrite"), "serve", "--model-repository", str(REPO), "--http-port", str(port),
           "--grpc-port", str(grpc_port), "--metrics-port", "0", "--log", "warn"]
    base = f"http://127.0.0.1:{port}"
    json_header = ["Content-Type: application/json"]
    for c in clients:
        for kind in ("rerank", "predict"):
            rows.append((kind, f"Ferrite (TEI /{kind})", c, measure(
                f"ferrite-{kind}-{c}", cmd, f"{base}/v2/health/ready",
                oha_load(f"{base}/{kind}", WORK / f"{kind}.json", c, json_header), args)))
    bport = free_port()
    env = dict(os.environ, RERANKER=str(REPO / "bert_rerank" / "1" / "model.onnx"),
               CLASSIFIER=str(REPO / "bert_classify" / "1" / "model.onnx"), TOKENIZER=str(TOKENIZER))
    bcmd = [sys.executable, "-m", "uvicorn", "bench.baseline.pipelines:app", "--workers", "2", "--port", str(bport),
            "--log-level", "warning"]
    bbase = f"http://127.0.0.1:{bport}"
    for c in clients:
        for kind in ("rerank", "predict"):
            rows.append((kind, "FastAPI + tokenizers + onnxruntime", c, measure(
                f"fastapi-{kind}-{c}", bcmd, f"{bbase}/health",
                oha_load(f"{bbase}/{kind}", WORK / f"{kind}.json", c, json_header), args, env=env)))
    again = ceilings(max(args.duration // 2, 3))
    ceiling = {k: {b: max(v, again[k][b]) for b, v in ceiling[k].items()} for k in ceiling}
    write(rows, ceiling, args)


def write(rows, ceiling, args):
    lines = [
        "# Text tasks: re-ranking and classification",
        "",
        f"`bench/run.sh --texts`, {time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores ({platform.processor() or platform.machine()}),"
        f" load generator (oha) on the same host, {args.duration} s per point. `/rerank`: one query and"
        f" {len(PASSAGES)} passages a request (items are passages); `/predict`: one text a request.",
        "",
        "In-process ceiling (tokenizers + ONNX Runtime in one process, items/s by batch size; the best of a",
        "measurement before and one after the servers ran):",
        "",
    ]
    for kind, best in ceiling.items():
        lines += [f"| {kind} | " + " | ".join(f"batch {b}" for b in best) + " |", "|---|" + "---|" * len(best),
                  f"| items/s | " + " | ".join(f"{v:.1f}" for v in best.values()) + " |", ""]
    lines += ["| task | system | clients | requests/s | items/s | p50 ms | p99 ms | CPU cores | errors | / ceiling | / FastAPI |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for kind, system, c, r in rows:
        base = next((b for k, s, cc, b in rows if k == kind and cc == c and s.startswith("FastAPI")), None)
        vs = f"{r['rps'] / base['rps']:.2f}" if base and base["rps"] else ""
        items = r["rps"] * PER_REQUEST[kind]
        lines.append(f"| {kind} | {system} | {c} | {r['rps']:.1f} | {items:.1f} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | "
                     f"{r['cpu_cores']:.2f} | {r['errors']} | {items / max(ceiling[kind].values()):.2f} | {vs} |")
    (RESULTS / "texts.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
