"""What a large body the model refuses costs the server: bodies a hostile client sends cheaply (gzip,
a few KB on the wire) that the MLP (one FP32 input, [-1, 512]) refuses, each sent a few times, one
at a time, to each binary; reports the server's CPU-seconds per body (median) and the answer.

- datatype: 8 M JSON empty strings as BYTES (24 MB, 24 KB of gzip);
- elements: 22 M JSON empty strings as BYTES (64 MiB, 63 KB of gzip: the body of
  `bench/hostile.py --only tenants`), more elements than a request may hold;
- FP64: 3 M numbers as FP64 (24 MB: `bench/large_bodies.py`'s body before it changed);
- MessagePack: 8 M empty strings as BYTES (8 MB, 8 KB of gzip);
- data: 64 rows of the MLP's FP32 input (its batch limit) in 700-digit numbers, and one number
  too many (23 MB: `bench/large_bodies.py`'s body and one more number): a body the model takes but
  for its data, found wrong at its end.

Usage: python3 bench/refused.py --binary [LABEL=]PATH --binary ... [--times 3] [--name refused]
(writes bench/results/<name>.md)
"""

import argparse
import gzip
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import msgpack

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.run import RESULTS, ROOT, WORK, cpu_seconds, free_port, wait_ready  # noqa: E402


def strings(n):
    return b'{"inputs":[{"name":"input","datatype":"BYTES","shape":[%d],"data":[' % n + b'"",' * (n - 1) + b'""]}]}'


def bodies():
    json_h = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
    fp64 = json.dumps({"inputs": [{"name": "input", "shape": [5859, 512], "datatype": "FP64",
                                   "data": [0.123456] * (5859 * 512)}]}).encode()
    packed = msgpack.packb({"inputs": [{"name": "input", "datatype": "BYTES", "shape": [8_000_000],
                                        "data": [""] * 8_000_000}]})
    number = b"0." + b"1234567" * 100
    surplus = (b'{"inputs":[{"name":"input","datatype":"FP32","shape":[64,512],"data":['
               + b",".join([number] * (64 * 512 + 1)) + b"]}]}")
    return [
        ("datatype: 8 M strings as BYTES, JSON", strings(8_000_000), json_h),
        ("elements: 22 M strings as BYTES, JSON", strings((64 << 20) // 3 - 40), json_h),
        ("FP64: 3 M numbers, JSON", fp64, json_h),
        ("MessagePack: 8 M strings as BYTES", packed, {"Content-Type": "application/msgpack", "Content-Encoding": "gzip"}),
        ("data: 64 rows of 700-digit numbers and one too many, JSON", surplus, json_h),
    ]


def measure(binary, cases, times):
    WORK.mkdir(parents=True, exist_ok=True)
    port = free_port()
    log = open(WORK / "refused.log", "w")
    proc = subprocess.Popen([binary, "serve", "--model-repository", str(ROOT / "models"), "--http-port", str(port),
                             "--grpc-port", str(free_port()), "--metrics-port", str(free_port()), "--log", "warn"],
                            stdout=log, stderr=log)
    out = []
    try:
        wait_ready(f"http://127.0.0.1:{port}/v2/health/ready", proc, timeout=300)
        time.sleep(2)
        for name, body, headers in cases:
            costs, answer = [], None
            for _ in range(times):
                before = cpu_seconds(proc.pid)
                req = urllib.request.Request(f"http://127.0.0.1:{port}/v2/models/mlp/infer", data=body,
                                             method="POST", headers=headers)
                try:
                    with urllib.request.urlopen(req, timeout=300) as r:
                        answer = (r.status, r.read()[:80])
                except urllib.error.HTTPError as e:
                    answer = (e.code, e.read()[:80])
                time.sleep(0.3)
                costs.append(cpu_seconds(proc.pid) - before)
            out.append((name, statistics.median(costs), answer))
    finally:
        proc.terminate()
        proc.wait(30)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--binary", action="append", required=True)
    ap.add_argument("--times", type=int, default=3)
    ap.add_argument("--name", default="refused")
    args = ap.parse_args()
    cases = [(name, gzip.compress(body), headers) for name, body, headers in bodies()]
    labels = [b.split("=", 1)[0] if "=" in b else b for b in args.binary]
    runs = {label: measure(b.split("=", 1)[-1], cases, args.times) for label, b in zip(labels, args.binary)}
    lines = [f"# What a refused large body costs the server (`{args.name}`)", "",
             f"`python3 bench/refused.py {' '.join('--binary ' + b for b in args.binary)} --times {args.times}`, "
             f"{platform.machine()}, {os.cpu_count()} cores, the bundled repository: gzip bodies the MLP refuses, "
             "each sent one at a time; the server's CPU-seconds per body (median).", "",
             "| body (gzip on the wire) | " + " | ".join(f"`{b}` CPU-s" for b in labels)
             + " | ratio (last / first) | answer (last) |",
             "|---|" + "---:|" * len(labels) + "---:|---|"]
    for i, (name, body, _) in enumerate(cases):
        costs = [runs[b][i][1] for b in labels]
        status, text = runs[labels[-1]][i][2]
        ratio = costs[-1] / costs[0] if costs[0] else float("nan")
        lines.append(f"| {name} ({len(body) >> 10} KB) | " + " | ".join(f"{c:.2f}" for c in costs)
                     + f" | {ratio:.2f} | {status} {text.decode(errors='replace')} |")
    text = "\n".join(lines) + "\n"
    print(text)
    (RESULTS / f"{args.name}.md").write_text(text)


if __name__ == "__main__":
    main()
