"""The server's own instructions per request, per front-end (bench/run.sh --instructions A [B]):
each binary serves one model under callgrind (valgrind) while one client sends a fixed number of
batch-1 requests over V2 JSON and binary HTTP (oha) and gRPC (perf_analyzer); the instructions
executed in the server's user space between zeroing the counters and dumping them, divided by the
requests the model's statistics counted, sorted into the buckets `bench/profile.py` uses; and the
calls into the C library's allocator a request, by who made them (Rust's allocator, or C++'s
`operator new`: ONNX Runtime's own, within the run), since allocations are a cost the issue names.

Instruction counts do not move with the machine's pace or with what the other core does, so a
change of a few percent in the server's own cost shows here where throughput on this machine
(20-30% run to run) cannot show it. They still move a little between rounds, since how often the
server's threads wake and poll depends on timing (the binaries alternate, the rounds are shown).
The batcher's idle spin after a lone request (`spin_for_next`, 50-500 µs of watching for the
next one) is not counted: it is time spent waiting, and how much of it runs depends on timing. What they leave out: the kernel (system calls, wake-ups:
`bench/ab.py` counts those), cache misses and stalls, and the batcher's behaviour under many
clients (one client makes batches of one). The plan is fixed (`--calibrate false --threads 1`), so
ONNX Runtime's own share is the same for both binaries.

Usage: python3 bench/instructions.py BINARY_A [BINARY_B] [--models tiny,mlp] [--loads json,bin,grpc]
       [--requests 300] [--rounds 2] [--name instructions] [--float32-values]

--float32-values: the JSON bodies' FP32 values written as tritonclient writes a float32 tensor's
(numpy's tolist, then json.dumps: each the float32's value as a double, 17 significant digits),
instead of the 4-decimal values of `bench/kinds.py`.
"""

import argparse
import collections
import glob
import json
import os
import statistics
import struct
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import bench.kinds as kinds  # noqa: E402
from bench.profile import BUCKETS, bucket  # noqa: E402
from bench.run import PA_LIBS, PERF_ANALYZER, RESULTS, ROOT, WORK  # noqa: E402

SERVER_ARGS = "--calibrate false --threads 1"


def inference_count(base, model):
    with urllib.request.urlopen(f"{base}/v2/models/{model}/stats", timeout=30) as r:
        return json.loads(r.read())["model_stats"][0]["inference_count"]


def send(case, load, base, grpc, n):
    """`n` batch-1 requests from one client over `load`; fails on any error."""
    model = kinds.CASES[case][0]
    json_body, bin_body, header_len = kinds.bodies(case, f"instructions-{case}")
    if load == "grpc":
        cmd = [str(PERF_ANALYZER), "-m", model, "-i", "grpc", "-u", grpc, "--concurrency-range", "1",
               "--request-count", str(n), *kinds.perf_analyzer_args(case)]
        subprocess.run(cmd, check=True, capture_output=True, env=dict(os.environ, LD_LIBRARY_PATH=str(PA_LIBS)))
        return
    body, headers = (json_body, ["-H", "Content-Type: application/json"]) if load == "json" else \
        (bin_body, ["-H", f"Inference-Header-Content-Length: {header_len}"])
    out = subprocess.run(["oha", "-n", str(n), "-c", "1", "--no-tui", "--output-format", "json", "-m", "POST", "-D",
                          str(body), *headers, f"{base}/v2/models/{model}/infer"], check=True, capture_output=True, text=True)
    codes = json.loads(out.stdout)["statusCodeDistribution"]
    if set(codes) != {"200"}:
        sys.exit(f"{case} over {load}: answers {codes}")


# The C library's allocation entry points, and who calls them: Rust's global allocator shims, or
# C++'s `operator new` (ONNX Runtime's own, per run) and anything else.
ALLOCATORS = {"malloc", "calloc", "realloc", "posix_memalign", "aligned_alloc", "memalign"}
RUST_ALLOC = "__rustc::__rdl_"
CXX_ALLOC = "operator new"
ALLOC_ROWS = ("allocations a request: Rust", "allocations a request: C++ (ONNX Runtime's run)",
              "allocations a request: other")


def exclusive_costs(path):
    """Instructions spent in each function itself (not in what it calls), by (object, function);
    and the calls into the C library's allocator, by who made them (`ALLOC_ROWS`)."""
    costs, allocs = collections.Counter(), collections.Counter()
    obj = fn = callee = None
    after_call = False
    with open(path, errors="replace") as f:
        for line in f:
            if line.startswith("ob="):
                obj = line[3:].strip()
            elif line.startswith("fn="):
                fn = (obj, line[3:].strip())
            elif line.startswith("cfn="):
                callee = line[4:].strip()
            elif line.startswith("calls="):
                after_call = True  # the next cost line is the callee's inclusive cost
                if callee in ALLOCATORS and fn:
                    caller = fn[1]
                    row = 0 if caller.startswith(RUST_ALLOC) else 1 if caller.startswith(CXX_ALLOC) else 2
                    allocs[ALLOC_ROWS[row]] += int(line.split()[0][len("calls="):])
            elif line[:1].isdigit() or line[:1] in "+-*":
                parts = line.split()
                if after_call:
                    after_call = False
                elif len(parts) >= 2 and fn:
                    costs[fn] += int(parts[1])
    return costs, allocs


def measure(label, binary, case, loads, n):
    out = WORK / f"instructions-{label}-{case}"
    for old in glob.glob(f"{out}.*"):
        os.unlink(old)
    kinds.BINARY = binary
    kinds.SERVER_CPUS[:] = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}.%p", "--compress-strings=no",
                            "--dump-instr=no", "--toggle-collect=*spin_for_next*", "--collect-atstart=yes"]
    args = argparse.Namespace(extra=SERVER_ARGS)
    proc, base, grpc = kinds.serve(case, args, log_name=f"instructions-{label}")
    model = kinds.CASES[case][0]
    rows = {}
    try:
        for load in loads:
            send(case, load, base, grpc, 20)  # warm-up: connections, first-run allocations
            before = inference_count(base, model)
            subprocess.run(["callgrind_control", "-z", str(proc.pid)], check=True, capture_output=True)
            send(case, load, base, grpc, n)
            dumped = set(glob.glob(f"{out}.*"))
            subprocess.run(["callgrind_control", "-d", str(proc.pid)], check=True, capture_output=True)
            requests = inference_count(base, model) - before
            path = (set(glob.glob(f"{out}.*")) - dumped).pop()
            shares = collections.Counter()
            costs, allocs = exclusive_costs(path)
            for (obj, fn), c in costs.items():
                shares[bucket(Path(obj or "?").name, fn)] += c
            rows[load] = {"requests": requests, "per_request": {b: c / requests for b, c in shares.items()},
                          "allocations": {k: n / requests for k, n in allocs.items()}}
            total = sum(rows[load]["per_request"].values())
            print(json.dumps({"binary": label, "case": case, "load": load, "requests": requests, "instructions": round(total)}),
                  flush=True)
    finally:
        proc.terminate()
        proc.wait(60)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("binaries", nargs="+")
    ap.add_argument("--models", default="tiny,mlp")
    ap.add_argument("--loads", default="json,bin,grpc")
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--name", default="instructions")
    ap.add_argument("--float32-values", action="store_true")
    args = ap.parse_args()
    if args.float32_values:
        short = kinds.values
        kinds.values = lambda datatype, n: [struct.unpack("<f", struct.pack("<f", x))[0] if datatype == "FP32" else x
                                            for x in short(datatype, n)]
    if len(args.binaries) > 2:
        ap.error("one binary, or two to compare")
    WORK.mkdir(parents=True, exist_ok=True)
    kinds.make_models()
    binaries = dict(zip("AB", (Path(b).resolve() for b in args.binaries)))
    started = time.time()
    results = collections.defaultdict(list)
    for _ in range(args.rounds):
        for case in args.models.split(","):
            for label, binary in binaries.items():
                results[(label, case)].append(measure(label, binary, case, args.loads.split(","), args.requests))
    write(args, binaries, results, time.time() - started)


def write(args, binaries, results, took):
    names = [b for b, _ in BUCKETS] + ["other"]
    onnx = BUCKETS[0][0]
    lines = [
        f"# The server's own instructions per request (`{args.name}`)",
        "",
        f"`bench/instructions.py` on {time.strftime('%Y-%m-%d')}, {took / 60:.1f} min: "
        + ", ".join(f"{label} = `{b.name}`" for label, b in binaries.items())
        + f"; `ferrite serve {SERVER_ARGS}` under callgrind, one client sending {args.requests} batch-1 requests per "
        f"front-end (oha for JSON and binary HTTP, perf_analyzer for gRPC), {args.rounds} rounds"
        + (", FP32 values as tritonclient writes them (17 digits)" if args.float32_values else "")
        + ". Each cell: user-space "
        "instructions per request, in thousands, the median over rounds, sorted into `bench/profile.py`'s buckets; the "
        "kernel is not counted; the last rows count calls into the C library's allocator a request (not thousands), "
        "by who made them: Rust's allocator, C++'s `operator new` (ONNX Runtime, within the run), anything else. Counts move by a few percent between rounds (how often threads wake and poll depends on "
        "timing), so read a difference against the rounds' spread.",
        "",
    ]
    for case in args.models.split(","):
        cols = [(label, load) for load in args.loads.split(",") for label in binaries if (label, case) in results]
        lines += [f"## {case}", "", "| where | " + " | ".join(f"{load} {label}" for label, load in cols) + " |",
                  "|---|" + "---:|" * len(cols)]
        rounds = {c: [r[c[1]]["per_request"] for r in results[(c[0], case)]] for c in cols}
        median = lambda xs: statistics.median(xs) / 1e3  # noqa: E731
        totals = {c: [sum(r.values()) for r in rounds[c]] for c in cols}
        owns = {c: [sum(r.values()) - r.get(onnx, 0.0) for r in rounds[c]] for c in cols}
        own = {c: median(owns[c]) for c in cols}
        lines.append("| **all** | " + " | ".join(f"**{median(totals[c]):.1f}**" for c in cols) + " |")
        lines.append("| **the server's own (all but ONNX Runtime)** | " + " | ".join(f"**{own[c]:.1f}**" for c in cols) + " |")
        lines.append("| rounds' own | " + " | ".join(", ".join(f"{x / 1e3:.1f}" for x in owns[c]) for c in cols) + " |")
        for b in names:
            lines.append(f"| {b} | " + " | ".join(f"{median([r.get(b, 0.0) for r in rounds[c]]):.1f}" for c in cols) + " |")
        # Counts, not thousands of instructions.
        for a in ALLOC_ROWS:
            lines.append(f"| {a} | " + " | ".join(
                f"{statistics.median(r[c[1]].get('allocations', {}).get(a, 0.0) for r in results[(c[0], case)]):.1f}"
                for c in cols) + " |")
        if len(binaries) == 2:
            ratios = []
            for load in args.loads.split(","):
                if ("A", load) in own and ("B", load) in own:
                    ratios.append(f"{load} {own[('B', load)] / own[('A', load)]:.3f}")
            lines += ["", "The server's own instructions, B / A: " + ", ".join(ratios) + "."]
        lines.append("")
    path = RESULTS / f"{args.name}.md"
    path.write_text("\n".join(lines))
    print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
