"""The memory benchmark (bench/run.sh --memory): what the server holds per model kind with its
weights shared between a model's sessions (`[onnxruntime] share_weights`, the default) and without,
at load and under 8 batch-1 clients, beside ONNX Runtime's own need in-process for the same plan.
Each kind is served twice as configured here: with the plan the calibration picks (what a user
gets), and with 3 instances fixed (where sharing matters most: 2 cores give 2 single-threaded
instances and the solo one). Then the models of `--together` served by one server with the plans
its calibration picks, each under 8 gRPC clients at once (perf_analyzer), beside ONNX Runtime
holding the same plans in one process. Writes bench/results/memory.md.

Usage: python3 bench/memory.py [--duration 5] [--models mlp,resnet,detector320,bert]
                               [--together mlp,detector320,yolo320]
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.kinds import (CASES, KINDS, bodies, engine_plan, engine_rss, make_models, measure,  # noqa: E402
                         perf_analyzer_args, status, urllib_get)
from bench.run import ROOT, RESULTS, WORK, free_port, oha_load, perf_analyzer_load, wait_ready  # noqa: E402

# Batch-1 clients a load has: no batch the server runs holds more rows than that, so ONNX Runtime's
# figure runs each plan at its batch limit or at this many rows, whichever is less. At the limit
# itself it counted arenas grown to batches the server never runs under that load (a
# YOLOv8n-sized detector's limit at 320x320 is 15).
CLIENTS = 8

PLANS = {"calibrated": "", "3 instances": "instance_count = 3\ncalibrate = false\nsolo_instance = false\n"}


def serve(cases, config, name):
    """One server over a repository of the models of `cases`, each with `config`; returns the
    process, its HTTP base URL and its gRPC address once every model is ready."""
    repo = WORK / f"memory-{name}"
    for case in cases:
        model = CASES[case][0]
        (repo / model / "1").mkdir(parents=True, exist_ok=True)
        onnx = repo / model / "1" / "model.onnx"
        if not onnx.exists():
            os.link(KINDS / model / "1/model.onnx", onnx)
        (repo / model / "config.toml").write_text(config)
    port, grpc_port = free_port(), free_port()
    cmd = [str(ROOT / "target/release/ferrite"), "serve", "--model-repository", str(repo), "--http-port", str(port),
           "--grpc-port", str(grpc_port), "--metrics-port", "0", "--log", "info"]
    log = open(WORK / f"memory-{name}.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    base = f"http://127.0.0.1:{port}"
    for case in cases:
        wait_ready(f"{base}/v2/models/{CASES[case][0]}/ready", proc, timeout=300)
    return proc, base, f"127.0.0.1:{grpc_port}"


def plan_of(base, case):
    """The model's chosen plan as engine_plan reads it, and its session count."""
    config = json.loads(urllib_get(f"{base}/v2/models/{CASES[case][0]}/config"))
    parameters = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
    sessions = int(config.get("instance_group", [{}])[0].get("count", 1))
    sessions += 1 if "solo_instance_threads" in parameters else 0
    return parameters, sessions


def together(cases, duration):
    """The models of `cases` in one server, each under CLIENTS gRPC clients at once."""
    proc, base, grpc = serve(cases, "", "together")
    try:
        time.sleep(1)
        idle = status(proc.pid, "VmRSS") / 1024
        loads = [perf_analyzer_load("grpc", grpc, CLIENTS, CASES[c][0], perf_analyzer_args(c), fatal=False) for c in cases]
        results = [None] * len(cases)

        def each(duration):
            def one(i):
                results[i] = loads[i](duration)
            threads = [threading.Thread(target=one, args=(i,)) for i in range(len(cases))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            return sum(r[0] for r in results), float("nan"), float("nan"), sum(r[3] for r in results)

        r = measure(proc, each, duration)
        plans = [plan_of(base, c) for c in cases]
    finally:
        proc.terminate()
        proc.wait(30)
    entries = [engine_plan(c, p, most=CLIENTS) for c, (p, _) in zip(cases, plans)]
    engine = engine_rss([e for e, _ in entries])
    # The same instances run at batch 1: the least ONNX Runtime needs to serve these models at all.
    engine1 = engine_rss([engine_plan(c, p, most=1)[0] for c, (p, _) in zip(cases, plans)])
    row = {"cases": cases, "idle_mb": idle, "peak_mb": r["rss_mb"], "engine_mb": engine, "engine1_mb": engine1,
           "models": [{"case": c, "plan": words, "sessions": n, "rps": x[0], "p99_ms": x[2]}
                      for c, (_, words), (_, n), x in zip(cases, entries, plans, results)]}
    print(json.dumps(row), flush=True)
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--duration", type=int, default=5)
    ap.add_argument("--models", default="mlp,resnet,detector320,bert")
    ap.add_argument("--together", default="mlp,detector320,yolo320")
    args = ap.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    make_models()
    started, rows = time.time(), []
    for case in filter(None, args.models.split(",")):
        model = CASES[case][0]
        _, bin_body, header_len = bodies(case, f"memory-{case}")
        for plan in PLANS:
            for share in (False, True):
                config = f"{PLANS[plan]}[onnxruntime]\nshare_weights = {str(share).lower()}\n"
                proc, base, _ = serve([case], config, case)
                try:
                    time.sleep(1)
                    idle = status(proc.pid, "VmRSS") / 1024
                    load = oha_load(f"{base}/v2/models/{model}/infer", bin_body, CLIENTS,
                                    [f"Inference-Header-Content-Length: {header_len}"])
                    r = measure(proc, load, args.duration)
                    parameters, sessions = plan_of(base, case)
                finally:
                    proc.terminate()
                    proc.wait(30)
                if plan != "calibrated":
                    # The plan fixed here, for the in-process figure (engine_plan reads the calibrated one).
                    parameters["calibrated"] = "3 instance(s) x 1 thread(s)"
                entry, words = engine_plan(case, parameters, most=CLIENTS)
                engine = engine_rss([entry])
                row = {"case": case, "plan": plan, "share": share, "sessions": sessions, "idle_mb": idle,
                       "peak_mb": r["rss_mb"], "rps": r["rps"], "errors": r["errors"], "engine_mb": engine,
                       "engine_plan": words}
                print(json.dumps(row), flush=True)
                rows.append(row)
    joint = together(args.together.split(","), args.duration) if args.together else None
    write(rows, joint, time.time() - started)


def write(rows, joint, took):
    lines = [
        "# Memory per model kind, weights shared or not (`memory`)",
        "",
        f"`bench/run.sh --memory` on {platform.machine()}, {os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}, "
        f"{took / 60:.1f} min. Resident memory of the server with one model loaded: after load (idle) and the peak "
        f"under {CLIENTS} batch-1 clients (REST-binary, oha); `share_weights = false` gives each ONNX Runtime session its "
        "own copy of the weights, `true` (the default) one copy per model for its matrix and embedding weights "
        "when it has two sessions or more. ONNX Runtime in-process: the `ceiling` example's peak RSS for the "
        "plan the server chose (one instance per plan instance, each with its own weights), run at its batch "
        f"limit or at {CLIENTS} rows where that is less (the most its clients' requests make).",
        "",
        f"| model | plan | sessions | share_weights | idle MB | peak MB ({CLIENTS} clients) | req/s | errors | ONNX Runtime in-process MB |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['case']} | {r['plan']} | {r['sessions']} | {str(r['share']).lower()} | {r['idle_mb']:.0f} | "
                     f"{r['peak_mb']:.0f} | {r['rps']:.0f} | {r['errors']} | {r['engine_mb']:.0f} ({r['engine_plan']}) |")
    saved = []
    for off, on in zip(rows[0::2], rows[1::2]):
        if off["sessions"] == on["sessions"]:
            saved.append(f"{on['case']} {on['plan']} ({on['sessions']} sessions) {on['idle_mb'] - off['idle_mb']:+.0f}")
        else:
            saved.append(f"{on['case']} {on['plan']}: not compared (the calibration chose {off['sessions']} and "
                         f"{on['sessions']} sessions)")
    if saved:
        lines += ["", "Sharing's difference at load (MB, same plan only): " + "; ".join(saved) + "."]
    if joint:
        over = joint["peak_mb"] - joint["engine_mb"]
        lines += [
            "", "## Models together", "",
            f"{', '.join(joint['cases'])} in one server with the plans its calibration chose, each under {CLIENTS} gRPC "
            "clients at once (perf_analyzer, batch 1, the detectors at 320x320), against ONNX Runtime holding "
            "the same plans in one process (the `ceiling` example with `CEILING_MODELS`: every instance of the "
            f"plan alive, each with its own weights, each run at its batch limit or at {CLIENTS} rows where that "
            "is less; the server's solo instance, a session more per model where `sessions` says so, is not in "
            "it). Target: the server's peak <= ONNX Runtime's + 60 MB.", "",
            "| model | plan | sessions | req/s | p99 ms |", "|---|---|---:|---:|---:|",
            *[f"| {m['case']} | {m['plan']} | {m['sessions']} | {m['rps']:.0f} | {m['p99_ms']:.0f} |" for m in joint["models"]],
            "", f"Server: {joint['idle_mb']:.0f} MB idle, {joint['peak_mb']:.0f} MB peak under load. ONNX Runtime "
            f"in-process: {joint['engine_mb']:.0f} MB at the plans' batches, {joint['engine1_mb']:.0f} MB with "
            f"the same instances at batch 1. The server's excess over the first: {over:+.0f} MB "
            f"({'within' if over <= 60 else 'over'} the target); over the second: "
            f"{joint['peak_mb'] - joint['engine1_mb']:+.0f} MB.",
        ]
    (RESULTS / "memory.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {RESULTS / 'memory.md'}")


if __name__ == "__main__":
    main()
