"""Two server binaries served at once (bench/run.sh --together A B): both serve the same model
kind side by side, and each load (one client's by default) alternates between them in short
windows, so that this machine's drift (its throughput moves 10-25% between minutes) falls on both
alike. Per binary, model kind and front-end: the median over windows of p50 and p99, requests/s
and the server's CPU microseconds per request, beside the engine's own batch-1 latency in-process
(`ceiling` example) on the same cores. Plans are fixed (`--calibrate false`, `--threads` of the
cores the servers have), so that a calibration that chose differently in one binary's start does
not pass for the change.

With `--beside CASE:CLIENTS` each server also serves CASE's model, which CLIENTS binary-HTTP clients
flood during every window of the measured load: what a change does to a neighbour's requests.

Usage: python3 bench/together.py BINARY_A BINARY_B [--models tiny,mlp,detector320,bert] [--loads bin,grpc]
       [--clients 1] [--windows 8] [--window 2] [--pin] [--beside bert:8] [--name together]
"""

import argparse
import json
import os
import statistics
import threading
import time
from pathlib import Path
import sys

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import bench.kinds as kinds  # noqa: E402
import bench.run as run  # noqa: E402
from bench.run import ROOT, RESULTS, WORK  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--models", default="tiny,mlp,detector320,bert")
    ap.add_argument("--loads", default="bin,grpc")
    ap.add_argument("--clients", default="1", help="concurrent clients of each load, e.g. 1,8,128")
    ap.add_argument("--windows", type=int, default=8, help="windows per binary, model and load")
    ap.add_argument("--window", type=int, default=2, help="seconds of one window")
    ap.add_argument("--pin", action="store_true", help="servers and ceiling on core 0, the client on core 1")
    ap.add_argument("--beside", help="CASE:CLIENTS: a flood of another model on the same server meanwhile")
    ap.add_argument("--name", default="together")
    args = ap.parse_args()
    threads = 1 if args.pin else os.cpu_count()
    if args.pin:
        kinds.pin()
    args.extra = f"--calibrate false --threads {threads}"
    WORK.mkdir(parents=True, exist_ok=True)
    kinds.make_models()
    binaries = {"A": Path(args.a).resolve(), "B": Path(args.b).resolve()}
    beside, beside_clients = (args.beside.split(":") + ["8"])[:2] if args.beside else (None, 0)
    rows, floors = {}, {}
    started = time.time()
    for case in args.models.split(","):
        model = kinds.CASES[case][0]
        _, floors[case], _ = kinds.ceiling(case, 2)
        servers = {}
        try:
            for label, binary in binaries.items():
                kinds.BINARY = binary
                servers[label] = kinds.serve(case, args, log_name=f"together-{label}", beside=beside)
            json_body, bin_body, header_len = kinds.bodies(case, f"together-{case}")
            flood = {}
            if beside:
                _, flood_body, flood_header = kinds.bodies(beside, f"together-{beside}")
                for label, (_, base, _) in servers.items():
                    flood[label] = run.oha_load(f"{base}/v2/models/{kinds.CASES[beside][0]}/infer", flood_body,
                                                int(beside_clients), [f"Inference-Header-Content-Length: {flood_header}"])
            for load, clients in ((x, int(c)) for c in args.clients.split(",") for x in args.loads.split(",")):
                go = {}
                for label, (proc, base, grpc) in servers.items():
                    go[label] = (run.oha_load(f"{base}/v2/models/{model}/infer", bin_body, clients,
                                              [f"Inference-Header-Content-Length: {header_len}"])
                                 if load == "bin" else
                                 run.perf_analyzer_load("grpc", grpc, clients, model, kinds.perf_analyzer_args(case),
                                                        fatal=False, stability=100))
                    go[label](1)  # warm-up
                for w in range(args.windows):
                    # A then B, B then A: neither always follows the other.
                    for label in (("A", "B") if w % 2 == 0 else ("B", "A")):
                        proc = servers[label][0]
                        cpu0 = run.cpu_seconds(proc.pid)
                        flooding = None
                        if beside:
                            # The flood starts first and outlasts the window.
                            flooded, load_flood = {}, flood[label]
                            flooding = threading.Thread(target=lambda: flooded.update(r=load_flood(args.window + 1)))
                            flooding.start()
                            time.sleep(0.5)
                        rps, p50, p99, errors = go[label](args.window)
                        cpu_us = (run.cpu_seconds(proc.pid) - cpu0) / max(1.0, rps * args.window) * 1e6
                        row = {"rps": rps, "p50_ms": p50, "p99_ms": p99, "cpu_us": cpu_us, "errors": errors}
                        if flooding:
                            flooding.join()
                            row["beside_rps"], _, row["beside_p99_ms"], row["beside_errors"] = flooded["r"]
                        rows.setdefault((case, load, clients), {}).setdefault(label, []).append(row)
                        print(json.dumps({"binary": label, "case": case, "load": load, "clients": clients, **row}), flush=True)
        finally:
            for proc, _, _ in servers.values():
                proc.terminate()
                proc.wait(30)
    write(args, binaries, rows, floors, threads, time.time() - started)


def write(args, binaries, rows, floors, threads, took):
    med = lambda xs, f: statistics.median(x[f] for x in xs)  # noqa: E731
    lines = [
        f"# Two binaries served at once (`{args.name}`)",
        "",
        f"`bench/together.py` on {os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}, {took / 60:.1f} min: A = `{binaries['A'].name}`, "
        f"B = `{binaries['B'].name}`, both serving the model at once with a fixed plan (`{args.extra}`); each load of batch-1 "
        f"requests (oha for binary HTTP, perf_analyzer for gRPC) alternates between them in {args.windows} windows of "
        f"{args.window} s each ({'pinned: servers and ceiling on core 0, the client on core 1' if args.pin else 'not pinned'}). "
        "Each cell: the median over windows; CPU: the server's, per request. In-process: the engine's own batch-1 latency "
        f"(`ceiling` example, {threads} thread(s)).",
        "",
        "| model | load | clients | in-process ms | p50 ms A | p50 ms B | B - A µs | p50 over in-process A; B µs | windows' p50 B - A µs | p99 ms A | B | req/s A | B | CPU µs/req A | B |",
        "|---|---|---:|---:|---:|---:|---:|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for (case, load, clients), by in rows.items():
        a, b = by.get("A", []), by.get("B", [])
        if not a or not b:
            continue
        pa, pb, floor = med(a, "p50_ms"), med(b, "p50_ms"), floors[case]
        diffs = ", ".join(f"{(y['p50_ms'] - x['p50_ms']) * 1000:+.0f}" for x, y in zip(a, b))
        lines.append(
            f"| {case} | {load} | {clients} | {floor:.3f} | {pa:.3f} | {pb:.3f} | {(pb - pa) * 1000:+.0f} | "
            f"{(pa - floor) * 1000:+.0f}; {(pb - floor) * 1000:+.0f} | {diffs} | {med(a, 'p99_ms'):.2f} | {med(b, 'p99_ms'):.2f} | "
            f"{med(a, 'rps'):.0f} | {med(b, 'rps'):.0f} | {med(a, 'cpu_us'):.0f} | {med(b, 'cpu_us'):.0f} |"
        )
    if args.beside:
        lines += [
            "",
            f"Beside each window, {args.beside.split(':')[-1]} binary-HTTP clients flooded `{args.beside.split(':')[0]}` on the "
            "same server (the CPU column counts both loads). The flood, median over windows:",
            "",
            "| model | load | clients | flood req/s A | B | flood p99 ms A | B |",
            "|---|---|---:|---:|---:|---:|---:|",
        ]
        for (case, load, clients), by in rows.items():
            a, b = by.get("A", []), by.get("B", [])
            if a and b:
                lines.append(f"| {case} | {load} | {clients} | {med(a, 'beside_rps'):.1f} | {med(b, 'beside_rps'):.1f} | "
                             f"{med(a, 'beside_p99_ms'):.1f} | {med(b, 'beside_p99_ms'):.1f} |")
    path = RESULTS / f"{args.name}.md"
    path.write_text("\n".join(lines) + "\n")
    print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
