"""Where the server's time goes, per front-end: `perf record` samples the release binary while
8 clients send batch-1 requests over REST-JSON and REST-binary (oha) and gRPC (perf_analyzer), to a
model whose own run is small (so the server's costs show), then sorts the samples into buckets by
library and symbol. Writes bench/results/<name>.md: CPU microseconds per request in each bucket.

Usage (after bench/run.sh has built the release binary): python3 bench/profile.py [--name profile]
[--model tiny|mlp] [--duration 8] [--clients 8] [--pin] (--pin: the server on core 0, the load generators
on core 1, as `bench/kinds.py --pin` measures the share of one core's ceiling)"""

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.kinds import CASES, bodies, make_models, perf_analyzer_args, pin, serve  # noqa: E402
from bench.run import RESULTS, WORK, cpu_seconds, oha_load, perf_analyzer_load  # noqa: E402

# (bucket, test on "dso symbol"), first match wins; order matters.
BUCKETS = [
    ("ONNX Runtime (the model's run)", r"libonnxruntime|onnxruntime::|Mlas|mlas"),
    # In a VM, samples taken while interrupts were off land where they are turned back on: the
    # scheduler's switch-in and wake-up paths, i.e. threads sleeping and being woken.
    ("kernel: context switches, wake-ups", r"\[kernel.*(finish_task_switch|_raw_spin_unlock_irq|schedule|try_to_wake_up|futex)"),
    ("kernel: TCP, epoll, other syscalls", r"\[kernel"),
    ("thread hand-offs in user space (futex, condvar, park)", r"futex|pthread_cond|parking|park|Condvar|sched_yield|__lll_"),
    ("clock reads", r"clock_gettime|Instant::now|vdso"),
    ("allocation and copies", r"malloc|free|realloc|memcpy|memmove|memset|_int_|alloc::|cfree|RawVec|Bytes.*clone|bytes::"),
    ("JSON / MessagePack codec", r"serde_json|rmp|ryu|itoa|http::json|http::msgpack|core::num::dec2flt|::fmt::"),
    ("protobuf", r"prost|tonic_prost|grpc::convert"),
    ("HTTP/1 and HTTP/2 framing (hyper, h2, tonic)", r"hyper|h2::|tonic|http::header|httparse|tower|axum"),
    ("async runtime (tokio)", r"tokio|mio::"),
    ("batcher, queue, checks (ferrite-core)", r"ferrite_core"),
    ("ferrite-server (other)", r"ferrite_server|ferrite::"),
]


def bucket(dso, sym):
    line = f"{dso} {sym}"
    for name, pattern in BUCKETS:
        if re.search(pattern, line):
            return name
    return "other"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--name", default="profile")
    ap.add_argument("--model", default="tiny", choices=sorted(CASES))
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--duration", type=int, default=8)
    ap.add_argument("--extra", default="", help="more `ferrite serve` arguments")
    ap.add_argument("--pin", action="store_true", help="server on core 0, load generators on core 1")
    args = ap.parse_args()
    if args.pin:
        pin()
    make_models()
    case = args.model
    model, inputs, _ = CASES[case]
    json_body, bin_body, header_len = bodies(case, f"profile-{case}")
    rows = []
    proc, base, grpc = serve(case, args, "profile")
    try:
        infer = f"{base}/v2/models/{model}/infer"
        pa_extra = perf_analyzer_args(case)
        loads = [
            ("REST-JSON (oha)", oha_load(infer, json_body, args.clients, ["Content-Type: application/json"])),
            ("REST-binary (oha)", oha_load(infer, bin_body, args.clients, [f"Inference-Header-Content-Length: {header_len}"])),
            ("gRPC (perf_analyzer)", perf_analyzer_load("grpc", grpc, args.clients, model=model, extra=pa_extra, fatal=False)),
        ]
        for name, load in loads:
            load(2)
            # perf samples the server during the load (it starts first and stops before the end).
            data = WORK / f"perf-{case}-{name.split()[0]}.data"
            cpu0, t0 = cpu_seconds(proc.pid), time.time()
            sampler = subprocess.Popen(["perf", "record", "-F", "2999", "-g", "-p", str(proc.pid), "-o", str(data), "--",
                                        "sleep", str(args.duration - 2)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            rps, p50, p99, errors = load(args.duration)
            sampler.wait()
            cpu = (cpu_seconds(proc.pid) - cpu0) / (time.time() - t0)
            shares = report(data)
            per_request_us = cpu / rps * 1e6 if rps == rps and rps > 0 else float("nan")
            row = {"front_end": name, "rps": rps, "p50_ms": p50, "cpu_cores": cpu, "cpu_us_per_request": per_request_us,
                   "shares": shares}
            print(json.dumps(row), flush=True)
            rows.append(row)
    finally:
        proc.terminate()
        proc.wait(30)
    write(args, case, rows)


def report(data):
    out = subprocess.run(["perf", "report", "-i", str(data), "--no-children", "--sort", "dso,sym", "--stdio", "-q",
                          "-g", "none", "--percent-limit", "0.01"], capture_output=True, text=True).stdout
    shares = {}
    for line in out.splitlines():
        m = re.match(r"\s*([\d.]+)%\s+(\S+)\s+\[[.kHu]\]\s+(.*)", line)
        if m:
            b = bucket(m.group(2), m.group(3))
            shares[b] = shares.get(b, 0.0) + float(m.group(1))
    return shares


def write(args, case, rows):
    names = [b for b, _ in BUCKETS] + ["other"]
    lines = [
        f"# Where the server's time goes, per front-end (`{args.name}`)",
        "",
        f"`bench/profile.py --model {case}` on {time.strftime('%Y-%m-%d')}: {args.clients} clients sending batch-1 "
        f"requests for {args.duration} s per front-end{' (pinned: the server on core 0, the load generators on core 1)' if args.pin else ''}; `perf record -g` at 2999 Hz on the server process "
        f"(`ferrite serve {args.extra or '(defaults)'}`). Each cell: CPU microseconds per request spent there "
        "(the share of samples times the process's CPU time per request).",
        "",
        "| where | " + " | ".join(r["front_end"] for r in rows) + " |",
        "|---|" + "---:|" * len(rows),
        "| requests/s | " + " | ".join(f"{r['rps']:.0f}" for r in rows) + " |",
        "| p50 ms | " + " | ".join(f"{r['p50_ms']:.2f}" for r in rows) + " |",
        "| CPU cores used | " + " | ".join(f"{r['cpu_cores']:.2f}" for r in rows) + " |",
        "| **CPU µs per request** | " + " | ".join(f"**{r['cpu_us_per_request']:.0f}**" for r in rows) + " |",
    ]
    for b in names:
        cells = []
        for r in rows:
            total = sum(r["shares"].values()) or 1.0
            cells.append(f"{r['shares'].get(b, 0.0) / total * r['cpu_us_per_request']:.1f}")
        lines.append(f"| {b} | " + " | ".join(cells) + " |")
    (RESULTS / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
