"""The memory benchmark (bench/run.sh --memory): what the server holds per model kind with its
weights shared between a model's sessions (`[onnxruntime] share_weights`, the default) and without,
at load and under 8 batch-1 clients, beside ONNX Runtime's own need in-process for the same plan.
Each kind is served twice as configured here: with the plan the calibration picks (what a user
gets), and with 3 instances fixed (where sharing matters most: 2 cores give 2 single-threaded
instances and the solo one). Writes bench/results/memory.md.

Usage: python3 bench/memory.py [--duration 5] [--models mlp,resnet,detector320,bert]
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.kinds import CASES, KINDS, bodies, engine_rss, measure, status, urllib_get  # noqa: E402
from bench.run import ROOT, RESULTS, WORK, free_port, oha_load, wait_ready  # noqa: E402

PLANS = {"calibrated": "", "3 instances": "instance_count = 3\ncalibrate = false\nsolo_instance = false\n"}


def serve(case, plan, share):
    model = CASES[case][0]
    repo = WORK / f"memory-{model}"
    (repo / model / "1").mkdir(parents=True, exist_ok=True)
    onnx = repo / model / "1" / "model.onnx"
    if not onnx.exists():
        os.link(KINDS / model / "1/model.onnx", onnx)
    (repo / model / "config.toml").write_text(f"{PLANS[plan]}[onnxruntime]\nshare_weights = {str(share).lower()}\n")
    port = free_port()
    cmd = [str(ROOT / "target/release/ferrite"), "serve", "--model-repository", str(repo), "--http-port", str(port),
           "--grpc-port", str(free_port()), "--metrics-port", "0", "--log", "info"]
    log = open(WORK / f"memory-{case}.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    base = f"http://127.0.0.1:{port}"
    wait_ready(f"{base}/v2/models/{model}/ready", proc, timeout=120)
    return proc, base


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--duration", type=int, default=5)
    ap.add_argument("--models", default="mlp,resnet,detector320,bert")
    args = ap.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    if not (KINDS / "bert/1/model.onnx").exists():
        subprocess.run([sys.executable, str(ROOT / "bench/make_models.py"), str(KINDS)], check=True)
    started, rows = time.time(), []
    for case in args.models.split(","):
        model = CASES[case][0]
        _, bin_body, header_len = bodies(case, f"memory-{case}")
        for plan in PLANS:
            for share in (False, True):
                proc, base = serve(case, plan, share)
                try:
                    time.sleep(1)
                    idle = status(proc.pid, "VmRSS") / 1024
                    load = oha_load(f"{base}/v2/models/{model}/infer", bin_body, 8,
                                    [f"Inference-Header-Content-Length: {header_len}"])
                    r = measure(proc, load, args.duration)
                    config = json.loads(urllib_get(f"{base}/v2/models/{model}/config"))
                finally:
                    proc.terminate()
                    proc.wait(30)
                parameters = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
                sessions = int(config.get("instance_group", [{}])[0].get("count", 1))
                sessions += 1 if "solo_instance_threads" in parameters else 0
                if plan != "calibrated":
                    # The plan fixed here, for the in-process figure (engine_rss reads the calibrated one).
                    parameters["calibrated"] = "3 instance(s) x 1 thread(s)"
                engine, engine_plan = engine_rss(case, parameters)
                row = {"case": case, "plan": plan, "share": share, "sessions": sessions, "idle_mb": idle,
                       "peak_mb": r["rss_mb"], "rps": r["rps"], "errors": r["errors"], "engine_mb": engine,
                       "engine_plan": engine_plan}
                print(json.dumps(row), flush=True)
                rows.append(row)
    write(rows, time.time() - started)


def write(rows, took):
    lines = [
        "# Memory per model kind, weights shared or not (`memory`)",
        "",
        f"`bench/run.sh --memory` on {platform.machine()}, {os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}, "
        f"{took / 60:.1f} min. Resident memory of the server with one model loaded: after load (idle) and the peak "
        "under 8 batch-1 clients (REST-binary, oha); `share_weights = false` gives each ONNX Runtime session its "
        "own copy of the weights, `true` (the default) one copy per model for its matrix and embedding weights "
        "when it has two sessions or more. ONNX Runtime in-process: the `ceiling` example's peak RSS for the "
        "plan and batch limit the server chose (one instance per plan instance, each with its own weights).",
        "",
        "| model | plan | sessions | share_weights | idle MB | peak MB (8 clients) | req/s | errors | ONNX Runtime in-process MB |",
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
    lines += ["", "Sharing's difference at load (MB, same plan only): " + "; ".join(saved) + "."]
    (RESULTS / "memory.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {RESULTS / 'memory.md'}")


if __name__ == "__main__":
    main()
