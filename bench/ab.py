"""Two server binaries side by side (bench/run.sh --ab A B): alternated in rounds on the same model
kinds and loads, pinned (the server on core 0, the load generators on core 1), so that a change is
measured against the same machine minutes rather than against another run's. Per binary and load:
requests/s, server CPU microseconds, context switches (all the server's threads, voluntary and not),
system calls (`perf stat`, when perf is installed), page faults and the mean batch size per request, the median
over rounds; per model, the server's peak and final resident memory. Context switches, system
calls and batch sizes depend little on how fast the machine runs that minute; throughput and CPU
do, so read those through the spread of their rounds (shown).

The pipelines of bench/pipelines.py are cases too: `text` (its load `embed`: TEI's /embed, one
sentence a request; `embedmixed`, `embedmixed16`: sentences of many lengths, one and 16 a request;
`embedlong`: 32 passages of 200 words a request) and `images` (its load `bin`: one JPEG a request
over V2 binary).

Usage: python3 bench/ab.py BINARY_A BINARY_B [--models tiny,mlp,detector320,text] [--clients 8,128]
       [--loads bin,grpc,pahttp,json,tenants,embed,embedlong] [--rounds 3] [--duration 3] [--name ab] [--no-pin]
"""

import argparse
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import bench.kinds as kinds  # noqa: E402
import bench.pipelines as pipelines  # noqa: E402
import bench.run as run  # noqa: E402
from bench.run import ROOT, RESULTS, WORK  # noqa: E402


def context_switches(pid):
    n = 0
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            for line in Path(f"/proc/{pid}/task/{t}/status").read_text().splitlines():
                if "ctxt_switches" in line:
                    n += int(line.split()[1])
        except OSError:
            pass  # a thread that ended meanwhile
    return n


def page_faults(pid):
    """The process's minor page faults so far (all its threads)."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[7])
    except OSError:
        return 0


def system_calls(pid, go):
    """Runs `go()` while perf counts the system calls of process `pid`; (go's result, count or NaN)."""
    if not shutil.which("perf"):
        return go(), math.nan
    perf = subprocess.Popen(["perf", "stat", "-x", ",", "-e", "raw_syscalls:sys_enter", "-p", str(pid)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    time.sleep(0.3)  # attached before the window opens
    try:
        out = go()
    finally:
        perf.send_signal(signal.SIGINT)
        err = perf.communicate(timeout=30)[1]
    for line in err.splitlines():
        if "raw_syscalls" in line and line.split(",")[0].isdigit():
            return out, int(line.split(",")[0])
    return out, math.nan


def counts(base, model):
    with urllib.request.urlopen(f"{base}/v2/models/{model}/stats", timeout=10) as r:
        s = json.loads(r.read())["model_stats"][0]
    return s["inference_count"], s["execution_count"]


# The pipelines of bench/pipelines.py (its repository served whole), each with its one load.
PIPELINES = ("text", "images")


def pipeline_loads(case, base, header_len):
    if case == "images":
        return {"bin": lambda c: run.oha_load(f"{base}/v2/models/images/infer", WORK / "image.bin", c,
                                              [f"Inference-Header-Content-Length: {header_len}"])}
    return {"embed": lambda c: run.oha_load(f"{base}/embed", WORK / "embed.json", c, ["Content-Type: application/json"]),
            # Sentences of many lengths (bench/pipelines.py's mixed_sentences), one a request, and 16.
            "embedmixed": lambda c: run.oha_load(f"{base}/embed", WORK / "embed-mixed.jsonl", c,
                                                 ["Content-Type: application/json"], lines=True),
            "embedmixed16": lambda c: run.oha_load(f"{base}/embed", WORK / "embed-mixed16.jsonl", c,
                                                   ["Content-Type: application/json"], lines=True),
            # 32 passages of 200 words a request (heavy).
            "embedlong": lambda c: run.oha_load(f"{base}/embed", WORK / "embed-long.json", c,
                                                ["Content-Type: application/json"])}


def tenants_load(infer, body, header_len):
    """Binary HTTP from two tenants, half the clients each (`x-tenant: a` and `b`, the server given a
    tenant config): requests of two shares wait in the model's queue and take turns there. Its p50
    and p99 are the worse of the two tenants'."""

    def load(c):
        goes = [run.oha_load(infer, body, max(1, c // 2), [f"Inference-Header-Content-Length: {header_len}",
                                                             f"x-tenant: {tenant}"]) for tenant in "ab"]

        def go(duration):
            with ThreadPoolExecutor(2) as pool:
                outs = list(pool.map(lambda g: g(duration), goes))
            return (sum(o[0] for o in outs), max(o[1] for o in outs), max(o[2] for o in outs),
                    sum(o[3] for o in outs))

        return go

    return load


def loads(case, base, grpc):
    model = kinds.CASES[case][0]
    json_body, bin_body, header_len = kinds.bodies(case, f"ab-{case}")
    infer = f"{base}/v2/models/{model}/infer"
    pa_extra = kinds.perf_analyzer_args(case)
    return {
        "bin": lambda c: run.oha_load(infer, bin_body, c, [f"Inference-Header-Content-Length: {header_len}"]),
        "grpc": lambda c: run.perf_analyzer_load("grpc", grpc, c, model, pa_extra, fatal=False, stability=100),
        # Binary HTTP from the generator gRPC gets: the two protocols compared on one client's cost.
        "pahttp": lambda c: run.perf_analyzer_load("http", base.removeprefix("http://"), c, model, pa_extra,
                                                   fatal=False, stability=100),
        "json": lambda c: run.oha_load(infer, json_body, c, ["Content-Type: application/json"]),
        # Binary HTTP as `bin`, half the clients of each of two tenants.
        "tenants": tenants_load(infer, bin_body, header_len),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--models", default="tiny,mlp,detector320")
    ap.add_argument("--clients", default="8,128")
    ap.add_argument("--loads", default="bin,grpc")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--duration", type=int, default=3)
    ap.add_argument("--name", default="ab")
    ap.add_argument("--extra", default="", help="more `ferrite serve` arguments")
    ap.add_argument("--no-pin", action="store_true", help="the server and the load generators on any core")
    args = ap.parse_args()
    if not args.no_pin:
        kinds.pin()
    WORK.mkdir(parents=True, exist_ok=True)
    kinds.make_models()
    cases = args.models.split(",")
    wanted = args.loads.split(",")
    if "tenants" in wanted:
        # Every tenant's default share; the servers of every load asked for get the config.
        (WORK / "tenants.toml").write_text("[default]\n")
        config = (WORK / "tenants.toml").relative_to(ROOT)  # the servers run in ROOT
        args.extra = f"{args.extra} --tenant-header x-tenant --tenant-config {config}".strip()
    # A case none of whose loads is asked for would be served and measured for memory alone.
    for case in cases:
        own = pipeline_loads(case, "", None) if case in PIPELINES else loads(case, "", "")
        if not set(own) & set(wanted):
            sys.exit(f"{case}: none of its loads ({', '.join(own)}) is in --loads {args.loads}")
    header_len = None  # the image pipeline's V2 binary header, once its bodies are written
    if any(c in PIPELINES for c in cases):
        pipelines.repository()
        header_len = pipelines.bodies(pipelines.photo())
    binaries = {"A": Path(args.a).resolve(), "B": Path(args.b).resolve()}
    clients = [int(c) for c in args.clients.split(",")]
    rows, rss = {}, {}
    started = time.time()
    for r in range(args.rounds):
        # A first, then B first: a machine speeding up or slowing down through a round favours
        # neither (two copies of one binary, one 10 s run each, differed by up to 5%).
        order = list(binaries.items())
        for label, binary in order if r % 2 == 0 else order[::-1]:
            kinds.BINARY = binary
            for case in cases:
                piped = case in PIPELINES
                model = case if piped else kinds.CASES[case][0]
                proc, base, grpc = kinds.serve(case, args, log_name=f"ab-{label}", repo=pipelines.REPO if piped else None)
                try:
                    # Once a server: `loads` writes the case's request bodies.
                    case_loads = pipeline_loads(case, base, header_len) if piped else loads(case, base, grpc)
                    for c in clients:
                        for name, load in case_loads.items():
                            if name not in wanted:
                                continue
                            go = load(c)
                            go(1)  # warm-up
                            (n0, e0), x0, f0 = counts(base, model), context_switches(proc.pid), page_faults(proc.pid)
                            cpu0, t0 = run.cpu_seconds(proc.pid), time.time()
                            (_, p50, p99, errors), calls = system_calls(proc.pid, lambda: go(args.duration))
                            (n1, e1), x1, f1 = counts(base, model), context_switches(proc.pid), page_faults(proc.pid)
                            cpu1, t1 = run.cpu_seconds(proc.pid), time.time()
                            n = max(1, n1 - n0)
                            row = {"rps": n / (t1 - t0), "cpu_us": (cpu1 - cpu0) / n * 1e6, "switches": (x1 - x0) / n,
                                   "syscalls": calls / n, "faults": (f1 - f0) / n, "batch": n / max(1, e1 - e0),
                                   "p50_ms": p50, "p99_ms": p99, "errors": errors}
                            rows.setdefault((case, name, c), {}).setdefault(label, []).append(row)
                            print(json.dumps({"binary": label, "case": case, "load": name, "clients": c, **row}), flush=True)
                    rss.setdefault(case, {}).setdefault(label, []).append(
                        (kinds.status(proc.pid, "VmHWM") / 1024, kinds.status(proc.pid, "VmRSS") / 1024))
                finally:
                    proc.terminate()
                    proc.wait(30)
    write(args, binaries, rows, rss, time.time() - started)


def write(args, binaries, rows, rss, took):
    median = lambda xs, f: statistics.median(x[f] for x in xs)  # noqa: E731
    lines = [
        f"# Two binaries side by side (`{args.name}`)",
        "",
        f"`bench/ab.py` on {os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}, {took / 60:.1f} min: A = `{binaries['A'].name}`, "
        f"B = `{binaries['B'].name}`, in {args.rounds} rounds, A first then B first by turns; batch-1 requests for {args.duration} s per load "
        f"(oha for binary HTTP `bin`, perf_analyzer for gRPC `grpc` and binary HTTP `pahttp`), {'not pinned' if args.no_pin else 'the server pinned to core 0 and the load generators to core 1'}. "
        "Each cell: the median over rounds; `switches`: context switches of all the server's threads per request; "
        "`syscalls`: the server's system calls per request; `faults`: its page faults per request; `batch`: requests per batch run. `ferrite serve` arguments: "
        f"`{args.extra or '(defaults)'}`.",
        "",
        "| model | load | clients | req/s A | req/s B | B/A | rounds' req/s A; B | CPU µs/req A | B | switches/req A | B | syscalls/req A | B | faults/req A | B | batch A | B | p50 ms A | B | p99 ms A | B |",
        "|---|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for (case, load, c), by in rows.items():
        a, b = by.get("A", []), by.get("B", [])
        if not a or not b:
            continue
        spread = f"{', '.join(str(round(x['rps'])) for x in a)}; {', '.join(str(round(x['rps'])) for x in b)}"
        lines.append(
            f"| {case} | {load} | {c} | {median(a, 'rps'):.0f} | {median(b, 'rps'):.0f} | {median(b, 'rps') / median(a, 'rps'):.2f} | {spread} | "
            f"{median(a, 'cpu_us'):.0f} | {median(b, 'cpu_us'):.0f} | {median(a, 'switches'):.2f} | {median(b, 'switches'):.2f} | "
            f"{median(a, 'syscalls'):.2f} | {median(b, 'syscalls'):.2f} | "
            f"{median(a, 'faults'):.1f} | {median(b, 'faults'):.1f} | "
            f"{median(a, 'batch'):.1f} | {median(b, 'batch'):.1f} | {median(a, 'p50_ms'):.3f} | {median(b, 'p50_ms'):.3f} | {median(a, 'p99_ms'):.2f} | {median(b, 'p99_ms'):.2f} |"
        )
    lines += [
        "",
        "Resident memory of the server per model, after all its loads (MB, median over rounds): the peak (VmHWM) and what it held at the end (VmRSS).",
        "",
        "| model | peak A | peak B | end A | end B |",
        "|---|---:|---:|---:|---:|",
    ]
    for case, by in rss.items():
        a, b = by.get("A", []), by.get("B", [])
        if a and b:
            m = lambda xs, i: statistics.median(x[i] for x in xs)  # noqa: E731
            lines.append(f"| {case} | {m(a, 0):.0f} | {m(b, 0):.0f} | {m(a, 1):.0f} | {m(b, 1):.0f} |")
    path = RESULTS / f"{args.name}.md"
    path.write_text("\n".join(lines) + "\n")
    print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
