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
  for its data, found wrong at its end;
- gRPC, shared memory: 8 M empty strings as BYTES read from a registered region (32 MB), named in
  a message of a few hundred bytes (the server runs with `--shared-memory system`).

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
import numpy as np

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


SHM_CASE = "gRPC, shared memory: 8 M strings as BYTES (a 32 MB region)"


def costs_of(pid, send, times):
    """The server's median CPU-seconds for `send`, and its last answer."""
    costs, answer = [], None
    for _ in range(times):
        before = cpu_seconds(pid)
        answer = send()
        time.sleep(0.3)
        costs.append(cpu_seconds(pid) - before)
    return statistics.median(costs), answer


def from_shared_memory(pid, grpc_port, times):
    """An inference whose input is 8 M empty strings as BYTES in a registered region (zeros: each a
    4-byte length of 0), which the MLP's FP32 input refuses."""
    import tritonclient.grpc as grpcclient
    import tritonclient.utils.shared_memory as shm
    n, key = 8_000_000, f"/ferrite-refused-{os.getpid()}"
    region = shm.create_shared_memory_region("refused", key, 4 * n)
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
    try:
        client.register_system_shared_memory("refused", key, 4 * n)
        shm.set_shared_memory_region(region, [np.zeros(4 * n, dtype=np.uint8)])

        def infer():
            i = grpcclient.InferInput("input", [1, n], "BYTES")
            i.set_shared_memory("refused", 4 * n)
            try:
                client.infer("mlp", [i])
                return 200, b"served"
            except Exception as e:  # noqa: BLE001 (the refusal is the answer measured)
                return e.status(), e.message().encode()[:80]
        return costs_of(pid, infer, times)
    finally:
        client.unregister_system_shared_memory()
        shm.destroy_shared_memory_region(region)


def measure(binary, cases, times):
    WORK.mkdir(parents=True, exist_ok=True)
    port = free_port()
    log = open(WORK / "refused.log", "w")
    grpc_port = free_port()
    proc = subprocess.Popen([binary, "serve", "--model-repository", str(ROOT / "models"), "--http-port", str(port),
                             "--grpc-port", str(grpc_port), "--metrics-port", str(free_port()), "--log", "warn",
                             "--shared-memory", "system"], stdout=log, stderr=log)
    out = []
    try:
        wait_ready(f"http://127.0.0.1:{port}/v2/health/ready", proc, timeout=300)
        time.sleep(2)
        for name, body, headers in cases:
            def post():
                req = urllib.request.Request(f"http://127.0.0.1:{port}/v2/models/mlp/infer", data=body,
                                             method="POST", headers=headers)
                try:
                    with urllib.request.urlopen(req, timeout=300) as r:
                        return r.status, r.read()[:80]
                except urllib.error.HTTPError as e:
                    return e.code, e.read()[:80]
            out.append((name, *costs_of(proc.pid, post, times)))
        out.append((SHM_CASE, *from_shared_memory(proc.pid, grpc_port, times)))
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
             "and a gRPC call whose input it refuses in shared memory, each sent one at a time; the server's "
             "CPU-seconds per request (median).", "",
             "| body (gzip on the wire) | " + " | ".join(f"`{b}` CPU-s" for b in labels)
             + " | ratio (last / first) | answer (last) |",
             "|---|" + "---:|" * len(labels) + "---:|---|"]
    named = [f"{name} ({len(body) >> 10} KB)" for name, body, _ in cases] + [SHM_CASE]
    for i, name in enumerate(named):
        costs = [runs[b][i][1] for b in labels]
        status, text = runs[labels[-1]][i][2]
        ratio = costs[-1] / costs[0] if costs[0] else float("nan")
        lines.append(f"| {name} | " + " | ".join(f"{c:.2f}" for c in costs)
                     + f" | {ratio:.2f} | {status} {text.decode(errors='replace')} |")
    text = "\n".join(lines) + "\n"
    print(text)
    (RESULTS / f"{args.name}.md").write_text(text)


if __name__ == "__main__":
    main()
