"""Can a few large requests stall everyone else? Small batch-1 requests to the MLP from 8 clients,
alone and then beside 2 clients that keep posting 23 MB JSON bodies (64 rows of numbers written
with 700 digits each, which the server reads whole and then runs: the work is the body, not the
model). Reports the small requests' throughput,
p50 and p99 in both phases and their ratio. Guards against decompression and JSON work on the
async I/O threads.

Usage: python3 bench/large_bodies.py [--duration 10] [--label NAME] (appends to
bench/results/large_bodies.md)
"""

import argparse
import http.client
import json
import os
import platform
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.run import RESULTS, ROOT, WORK, free_port, wait_ready  # noqa: E402

SMALL = json.dumps({"inputs": [{"name": "input", "shape": [1, 512], "datatype": "FP32", "data": [0.25] * 512}]})
# 64 rows of the MLP's 512 numbers, each written with 700 digits (23 MB): read whole, then run. (Until
# 2026-12-07 the body was 3 M numbers of FP64, parsed whole and then refused; a large body's header
# is now checked against the model first, so that one is refused before its data is read:
# bench/refused.py.)
LARGE = ('{"inputs":[{"name":"input","shape":[64,512],"datatype":"FP32","data":['
         + ",".join(["0." + "1234567" * 100] * (64 * 512)) + "]}]}").encode()


def client(port, body, stop, latencies, statuses):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    while not stop.is_set():
        t = time.perf_counter()
        try:
            conn.request("POST", "/v2/models/mlp/infer", body, {"Content-Type": "application/json"})
            r = conn.getresponse()
            r.read()
        except (OSError, http.client.HTTPException):
            conn.close()
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            continue
        latencies.append(time.perf_counter() - t)
        statuses.append(r.status)
    conn.close()


def phase(port, duration, large_clients):
    stop = threading.Event()
    small, small_status, large, large_status = [], [], [], []
    threads = [threading.Thread(target=client, args=(port, SMALL, stop, small, small_status)) for _ in range(8)]
    threads += [threading.Thread(target=client, args=(port, LARGE, stop, large, large_status)) for _ in range(large_clients)]
    for t in threads:
        t.start()
    time.sleep(duration)
    stop.set()
    for t in threads:
        t.join()
    small.sort()
    pct = lambda p: small[min(len(small) - 1, int(len(small) * p))] * 1000  # noqa: E731
    return {"rps": len(small) / duration, "p50": pct(0.5), "p99": pct(0.99), "large": len(large),
            "large_status": sorted(set(large_status)), "ok": small_status.count(200) == len(small_status)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--duration", type=int, default=10)
    ap.add_argument("--label", default="current")
    args = ap.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    port, grpc_port = free_port(), free_port()
    log = open(WORK / "large_bodies.log", "w")
    proc = __import__("subprocess").Popen(
        [str(ROOT / "target/release/ferrite"), "serve", "--model-repository", str(ROOT / "models"), "--http-port",
         str(port), "--grpc-port", str(grpc_port), "--metrics-port", "0", "--log", "warn", "--calibrate", "false"],
        stdout=log, stderr=log)
    try:
        wait_ready(f"http://127.0.0.1:{port}/v2/health/ready", proc)
        phase(port, 2, 0)
        alone = phase(port, args.duration, 0)
        beside = phase(port, args.duration, 2)
    finally:
        proc.terminate()
        proc.wait(30)
    row = (f"| {args.label} | {alone['rps']:.0f} | {alone['p50']:.2f} | {alone['p99']:.2f} | {beside['rps']:.0f} | "
           f"{beside['p50']:.2f} | {beside['p99']:.2f} | {beside['p99'] / alone['p99']:.1f}x | {beside['large']} |")
    print(json.dumps({"alone": alone, "beside": beside}))
    path = RESULTS / "large_bodies.md"
    if not path.exists():
        path.write_text(
            "# Large bodies beside small requests\n\n"
            f"`bench/large_bodies.py` on {platform.machine()}, {os.cpu_count()} cores: 8 clients send batch-1 MLP "
            "requests (V2 JSON), alone and then beside 2 clients posting 23 MB JSON bodies that are read whole "
            f"and run (64 rows of 700-digit numbers), {args.duration} s each.\n\n"
            "| build | small req/s alone | p50 ms | p99 ms | small req/s beside large | p50 ms | p99 ms | p99 beside / alone | large bodies parsed |\n"
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|\n")
    with path.open("a") as f:
        f.write(row + "\n")
    print(row)


if __name__ == "__main__":
    main()
