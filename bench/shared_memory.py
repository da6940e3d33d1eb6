"""Tensors through Triton's system shared memory against the same tensors in the request
(bench/run.sh --shared-memory): one server (`--shared-memory system`) per model kind, pinned as
`--kinds --pin` pins (server and in-process ceiling on core 0, perf_analyzer on core 1), and
perf_analyzer over gRPC and HTTP with `--shared-memory none` and `system` alternated in rounds.
Reports throughput, latency and the server's CPU per request of each, and the ratio shm / request.

Usage: bench/run.sh --shared-memory [--models detector320,resnet,mlp] [--clients 1,8] [--rounds 2]
       [--duration 5] [--name shared-memory]
"""

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import bench.kinds as kinds  # noqa: E402
from bench.run import RESULTS, ROOT, WORK, perf_analyzer_load  # noqa: E402

# Output regions perf_analyzer makes per output: the detector's map at 320x320 is 400 KB.
OUTPUT_BYTES = 8 << 20


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="detector320,resnet,mlp")
    ap.add_argument("--clients", default="1,8")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--duration", type=int, default=5)
    ap.add_argument("--name", default="shared-memory")
    args = ap.parse_args()
    args.extra = "--shared-memory system"
    kinds.pin()
    WORK.mkdir(parents=True, exist_ok=True)
    kinds.make_models()
    started = time.time()
    rows = []
    for case in args.models.split(","):
        model = kinds.CASES[case][0]
        _, _, points = kinds.ceiling(case, 1.0)
        proc, base, grpc = kinds.serve(case, args, log_name="shared-memory")
        try:
            for clients in [int(c) for c in args.clients.split(",")]:
                for protocol, url in (("grpc", grpc), ("http", base.removeprefix("http://"))):
                    seen = {"none": [], "system": []}
                    for _ in range(args.rounds):
                        for mode in seen:
                            extra = [*kinds.perf_analyzer_args(case), "--shared-memory", mode]
                            if mode == "system":
                                extra += ["--output-shared-memory-size", str(OUTPUT_BYTES)]
                            load = perf_analyzer_load(protocol, url, clients, model, extra, fatal=False, stability=100)
                            r = kinds.measure(proc, load, args.duration)
                            r["cpu_us"] = r["cpu"] / r["rps"] * 1e6 if r["rps"] > 0 else float("nan")
                            seen[mode].append(r)
                            print(json.dumps({"case": case, "protocol": protocol, "clients": clients, "mode": mode, **r}),
                                  flush=True)
                    rows.append({"case": case, "protocol": protocol, "clients": clients, "seen": seen,
                                 "reachable": kinds.reachable(points, clients)})
        finally:
            proc.terminate()
            proc.wait(30)
    write(rows, args, time.time() - started)


def write(rows, args, took):
    med = lambda runs, key: statistics.median(r[key] for r in runs)  # noqa: E731
    lines = [
        f"# Tensors through shared memory against the request (`{args.name}`)",
        "",
        f"`bench/run.sh --shared-memory` on {platform.machine()}, {os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}, "
        f"{took / 60:.1f} min. One `ferrite serve --shared-memory system` per model on core 0, perf_analyzer on core 1 "
        f"with its zero inputs, `--shared-memory none` (tensors in the request) and `system` (inputs and outputs "
        f"in POSIX shared memory, {OUTPUT_BYTES >> 20} MiB output regions) alternated in {args.rounds} rounds of "
        f"{args.duration} s. Each cell the median over rounds; `/ reachable`: against the engine alone in-process "
        "on that core, at its best batch of no more rows than there are clients.",
        "",
        "| model | protocol | clients | req/s request | req/s shm | shm / request | / reachable request | shm | "
        "CPU µs/req request | shm | p50 ms request | shm | p99 ms request | shm | rounds' req/s request; shm |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        a, b = row["seen"]["none"], row["seen"]["system"]
        ra, rb = med(a, "rps"), med(b, "rps")
        spread = ", ".join(f"{r['rps']:.0f}" for r in a) + "; " + ", ".join(f"{r['rps']:.0f}" for r in b)
        lines.append(
            f"| {row['case']} | {row['protocol']} | {row['clients']} | {ra:.0f} | {rb:.0f} | {rb / ra:.2f} | "
            f"{ra / row['reachable']:.2f} | {rb / row['reachable']:.2f} | {med(a, 'cpu_us'):.0f} | {med(b, 'cpu_us'):.0f} | "
            f"{med(a, 'p50_ms'):.2f} | {med(b, 'p50_ms'):.2f} | {med(a, 'p99_ms'):.2f} | {med(b, 'p99_ms'):.2f} | {spread} |")
    path = RESULTS / f"{args.name}.md"
    path.write_text("\n".join(lines) + "\n")
    print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
