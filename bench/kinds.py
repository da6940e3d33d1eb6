"""The benchmark of model kinds (bench/run.sh --kinds): for each kind users serve (a tiny model, an
MLP, a ResNet-style CNN, a detector with variable H/W at 320 and 640, a BERT-style encoder), the
engine's own ceiling in-process (the best over batch sizes, instances x threads and spinning),
then the Ferrite server at 1, 8 and 128 concurrent batch-1 clients over REST-binary (oha), gRPC
(perf_analyzer) and, for the small models, REST-JSON (oha), with its CPU, resident memory and
threads. Writes bench/results/kinds.md with each model's ratio to its ceiling and the targets that
fall short. Guards against defaults tuned on one model that lose on another.

Usage: python3 bench/kinds.py [--duration 10] [--models tiny,mlp,...] [--clients 1,8,128] [--extra ARGS]
"""

import argparse
import json
import math
import os
import platform
import re
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import bench.run  # noqa: E402
from bench.run import ROOT, RESULTS, WORK, cpu_seconds, free_port, oha_load, perf_analyzer_load, wait_ready  # noqa: E402

# With --pin: the server and the in-process ceiling on core 0, the load generators on core 1, so
# neither blurs the other's figure (one core of the server against one core of the engine).
SERVER_CPUS = []
# The server binary (bench/ab.py points it at each binary it compares).
BINARY = ROOT / "target/release/ferrite"

KINDS = WORK / "kinds"

# name -> (model directory, inputs as (name, datatype, shape without batch), JSON too?)
CASES = {
    "tiny": ("tiny", [("input", "FP32", [16])], True),
    "mlp": ("mlp", [("input", "FP32", [512])], True),
    "resnet": ("resnet", [("images", "FP32", [3, 224, 224])], False),
    "detector320": ("detector", [("images", "FP32", [3, 320, 320])], False),
    "detector640": ("detector", [("images", "FP32", [3, 640, 640])], False),
    "yolo320": ("yolo", [("images", "FP32", [3, 320, 320])], False),
    "bert": ("bert", [("input_ids", "INT64", [128]), ("attention_mask", "INT64", [128])], False),
}
# Models with variable H/W: the ceiling is told the size they are served at.
VARIABLE_HW = ("detector", "yolo")
TARGET_RATIO, TARGET_RATIO_JSON, TARGET_P50_EXTRA_MS, TARGET_RSS_EXTRA_MB = 0.85, 0.7, 0.15, 60


def pin():
    """The server (and the in-process ceiling) on core 0, the load generators on core 1."""
    SERVER_CPUS[:] = ["taskset", "-c", "0"]
    bench.run.LOADGEN[:] = ["taskset", "-c", "1"]


def make_models():
    """Writes the model kinds (bench/make_models.py) unless they are there."""
    if not (KINDS / "yolo/1/model.onnx").exists():
        subprocess.run([sys.executable, str(ROOT / "bench/make_models.py"), str(KINDS)], check=True)


def perf_analyzer_args(case):
    """perf_analyzer's input arguments for `case`: each input's shape, and the values oha's bodies
    hold (`values`), so both load generators run the model on the same data."""
    inputs = CASES[case][1]
    data = WORK / f"perf_analyzer-data-{case}.json"
    WORK.mkdir(exist_ok=True)
    data.write_text(json.dumps({"data": [{i: values(d, math.prod(s), i) for i, d, s in inputs}]}))
    return ["--input-data", str(data), *[x for i, _, s in inputs for x in ("--shape", f"{i}:{','.join(map(str, s))}")]]


def status(pid, key):
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def values(datatype, n, name=""):
    """An input's values in every load generator's requests: spread floats, token ids, and an
    attention mask of ones (a mask of other values made the BERT-style encoder 11% slower a run
    than the ceiling's ones; perf_analyzer's zeros ran at the ones' speed)."""
    if datatype == "FP32":
        return [round((i % 97) / 97 - 0.5, 4) for i in range(n)]
    if "mask" in name:
        return [1] * n
    return [1 + i % 1000 for i in range(n)]


def bodies(case, name):
    """The batch-1 request bodies of `case`: V2 JSON, and Triton's binary extension."""
    model, inputs, _ = CASES[case]
    n = lambda shape: int(eval("*".join(map(str, shape))))  # noqa: E731
    json_body = {"inputs": [{"name": i, "shape": [1, *s], "datatype": d, "data": values(d, n(s), i)} for i, d, s in inputs]}
    header = json.dumps({
        "inputs": [{"name": i, "shape": [1, *s], "datatype": d, "parameters": {"binary_data_size": n(s) * 4 * (2 if d == "INT64" else 1)}}
                   for i, d, s in inputs],
        "parameters": {"binary_data_output": True},
    }).encode()
    raw = b"".join(struct.pack(f"<{n(s)}{'f' if d == 'FP32' else 'q'}", *values(d, n(s), i)) for i, d, s in inputs)
    (WORK / f"{name}.json").write_text(json.dumps(json_body))
    (WORK / f"{name}.bin").write_bytes(header + raw)
    return WORK / f"{name}.json", WORK / f"{name}.bin", len(header)


def ceiling(case, secs):
    model, inputs, _ = CASES[case]
    cmd = [*SERVER_CPUS, str(ROOT / "target/release/examples/ceiling"), str(KINDS / model / "1/model.onnx"), str(secs)]
    if model in VARIABLE_HW:
        cmd.append(",".join(map(str, inputs[0][2])))
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    points = [json.loads(line) for line in out.splitlines()]
    best = max(points, key=lambda p: p["rows_per_sec"])
    single = [p for p in points if p["batch"] == 1 and p["instances"] == 1]
    floor_ms = 1000 / max(p["rows_per_sec"] for p in single)
    return best, floor_ms, points


def reachable(points, clients):
    """The ceiling `clients` batch-1 clients can reach: the best point whose batches (all instances
    together) hold no more rows than there are clients."""
    fit = [p["rows_per_sec"] for p in points if p["batch"] * p["instances"] <= clients]
    return max(fit) if fit else min(p["rows_per_sec"] for p in points)


def engine_plan(case, parameters, most=None):
    """The plan and batch limit the server chose (from its config's parameters), as the ceiling's
    CEILING_MODELS entry `MODEL.onnx|INSTANCES,THREADS,BATCH[|DIMS]` and in words; with `most`, the
    batch at most that (what a load of `most` batch-1 clients can form)."""
    model, inputs, _ = CASES[case]
    m = re.match(r"(\d+) instance\(s\) x (\d+) thread", parameters.get("calibrated", ""))
    instances, threads = (int(m.group(1)), int(m.group(2))) if m else (1, int(parameters.get("intra_op_thread_count", 1)))
    batch = max(1, int(parameters.get("batch_merge_limit", 1)))
    # A variable-size model's limit was measured at rows of `at` elements: the server scales it
    # to the rows served (as many elements a batch), and so does the plan it is compared with.
    at = int(parameters.get("batch_merge_limit_row_elements", 0))
    if at:
        batch = max(1, batch * at // sum(math.prod(dims) for _, _, dims in inputs))
    if most is not None:
        batch = min(batch, most)
    entry = f"{KINDS / model / '1/model.onnx'}|{instances},{threads},{batch}"
    if model in VARIABLE_HW:
        entry += "|" + ",".join(map(str, inputs[0][2]))
    return entry, f"{instances} x {threads} threads, batch {batch}"


def engine_rss(plans, secs=2.0):
    """ONNX Runtime's own peak RSS in-process, MB, holding every plan of `plans` (engine_plan's
    entries) at once and running each at its batch limit."""
    cmd = [*SERVER_CPUS, str(ROOT / "target/release/examples/ceiling"), str(secs)]
    env = dict(os.environ, CEILING_MODELS=";".join(plans))
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env).stdout
    return json.loads(out.splitlines()[-1])["peak_rss_mb"]


def serve(case, args, log_name="kinds", beside=None, repo=None):
    """The server on `case`'s model (and on `beside`'s too, when given, from one repository), or
    on the repository `repo` as it is, ready when its model `case` is."""
    if repo is None:
        models = [CASES[c][0] for c in (case, beside) if c]
        model = models[0]
        repo = WORK / f"repo-{'-'.join(dict.fromkeys(models))}"
        for m in models:
            if not (repo / m / "1" / "model.onnx").exists():
                (repo / m / "1").mkdir(parents=True, exist_ok=True)
                os.link(KINDS / m / "1/model.onnx", repo / m / "1" / "model.onnx")
    else:
        model = case
    port, grpc_port = free_port(), free_port()
    cmd = [*SERVER_CPUS, str(BINARY), "serve", "--model-repository", str(repo), "--http-port", str(port),
           "--grpc-port", str(grpc_port), "--metrics-port", "0", "--log", "info", *args.extra.split()]
    log = open(WORK / f"{log_name}-{case}.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    base = f"http://127.0.0.1:{port}"
    wait_ready(f"{base}/v2/models/{model}/ready", proc, timeout=120)
    return proc, base, f"127.0.0.1:{grpc_port}"


def measure(proc, load, duration):
    """Runs `load` for `duration` s after a 2 s warm-up; samples the server's RSS meanwhile."""
    load(2)
    peak, done = [0], threading.Event()

    def sample():
        while not done.wait(0.2):
            peak[0] = max(peak[0], status(proc.pid, "VmRSS"))

    t = threading.Thread(target=sample)
    t.start()
    cpu0, t0 = cpu_seconds(proc.pid), time.time()
    try:
        rps, p50, p99, errors = load(duration)
    finally:
        done.set()
        t.join()
    cpu = (cpu_seconds(proc.pid) - cpu0) / (time.time() - t0)
    return {"rps": rps, "p50_ms": p50, "p99_ms": p99, "errors": errors, "cpu": cpu, "rss_mb": peak[0] / 1024,
            "threads": status(proc.pid, "Threads")}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--duration", type=int, default=10)
    ap.add_argument("--models", default=",".join(CASES))
    ap.add_argument("--clients", default="1,8,128")
    ap.add_argument("--ceiling-secs", type=float, default=1.0)
    ap.add_argument("--extra", default="", help="more `ferrite serve` arguments")
    ap.add_argument("--name", default="kinds")
    ap.add_argument("--pin", action="store_true", help="server and ceiling on core 0, load generators on core 1")
    args = ap.parse_args()
    if args.pin:
        pin()
    WORK.mkdir(parents=True, exist_ok=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    make_models()
    clients = [int(c) for c in args.clients.split(",")]
    started = time.time()
    results = {}
    for case in args.models.split(","):
        model, inputs, small = CASES[case]
        best, floor_ms, points = ceiling(case, args.ceiling_secs)
        print(json.dumps({"case": case, "ceiling": best, "batch1_ms": floor_ms}), flush=True)
        json_body, bin_body, header_len = bodies(case, f"kinds-{case}")
        pa_extra = perf_analyzer_args(case)
        proc, base, grpc = serve(case, args)
        infer = f"{base}/v2/models/{model}/infer"
        try:
            idle = {"rss_mb": status(proc.pid, "VmRSS") / 1024, "threads": status(proc.pid, "Threads")}
            config = json.loads(urllib_get(f"{base}/v2/models/{model}/config"))
            rows = []
            for c in clients:
                loads = [("REST-binary (oha)", oha_load(infer, bin_body, c, [f"Inference-Header-Content-Length: {header_len}"])),
                         # Slow models under 128 clients give few answers per window: wide windows,
                         # and a run that still gives none is reported, not fatal.
                         ("gRPC (perf_analyzer)", perf_analyzer_load("grpc", grpc, c, model, pa_extra, fatal=False,
                                                                     stability=100))]
                if small:
                    loads.append(("REST-JSON (oha)", oha_load(infer, json_body, c, ["Content-Type: application/json"])))
                for proto, load in loads:
                    r = measure(proc, load, args.duration)
                    r.update(proto=proto, clients=c, ratio=r["rps"] / best["rows_per_sec"],
                             reachable=r["rps"] / reachable(points, c))
                    print(json.dumps({"case": case, **r}), flush=True)
                    rows.append(r)
        finally:
            proc.terminate()
            proc.wait(30)
        parameters = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        entry, plan = engine_plan(case, parameters)
        rss = engine_rss([entry])
        results[case] = {"ceiling": best, "batch1_ms": floor_ms, "idle": idle, "rows": rows, "parameters": parameters,
                         "engine_rss_mb": rss, "engine_plan": plan,
                         "onnx_mb": (KINDS / model / "1/model.onnx").stat().st_size / 2**20,
                         "request_mb": Path(bin_body).stat().st_size / 2**20}
    write(results, args, time.time() - started)


def urllib_get(url):
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def write(results, args, took):
    lines = [
        f"# Benchmark of model kinds (`{args.name}`)",
        "",
        f"`bench/run.sh --kinds` on {platform.machine()}, {os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}, "
        f"{took / 60:.1f} min: batch-1 requests from 1, 8 and 128 concurrent clients for {args.duration} s each "
        + ("(pinned: the server and the in-process ceiling on core 0, the load generators on core 1). "
           if args.pin else "(load generators on the same machine). ")
        + "`ferrite serve` arguments: "
        f"`{args.extra or '(defaults)'}`. Ceiling: the engine alone in-process (`ceiling` example), the best over "
        "batch sizes, 1 instance x all cores or 1 single-threaded instance per core, spinning off/on. "
        "Targets: >= 0.85 of the ceiling at 8 and 128 clients over binary/gRPC (>= 0.7 over JSON for the "
        "small models); at 1 client p50 <= in-process batch-1 latency + 0.15 ms; peak RSS under 128 clients <= "
        "ONNX Runtime's own in-process peak RSS for the plan and batch limit the server chose + 60 MB. "
        "`/ reachable`: the ratio to the best in-process point whose batches hold no more rows than there are "
        "clients (8 batch-1 clients cannot form a batch of 128).",
        "",
    ]
    short = []
    for case, r in results.items():
        c, p = r["ceiling"], r["parameters"]
        lines += [
            f"## {case}",
            "",
            f"Ceiling {c['rows_per_sec']:.0f} rows/s (batch {c['batch']}, {c['instances']} x {c['threads']} threads, "
            f"spinning {c['spinning']}); in-process batch-1 latency {r['batch1_ms']:.3f} ms. Server idle: "
            f"{r['idle']['rss_mb']:.0f} MB RSS, {r['idle']['threads']} threads; model file {r['onnx_mb']:.1f} MB; "
            f"ONNX Runtime in-process for the chosen plan ({r['engine_plan']}): {r['engine_rss_mb']:.0f} MB peak RSS; "
            f"one request {r['request_mb']:.2f} MB. Chosen: "
            + (f"calibrated: {p['calibrated']}." if "calibrated" in p else
               f"intra-op threads {p.get('intra_op_thread_count')}, spinning {p.get('spinning')}, "
               f"batch merge limit {p.get('batch_merge_limit')} (not calibrated)."),
            "",
            "| load | clients | req/s | / ceiling | / reachable | p50 ms | p99 ms | CPU cores | CPU µs/req | peak RSS MB | threads | errors |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for x in r["rows"]:
            per_request = x["cpu"] / x["rps"] * 1e6 if x["rps"] > 0 else float("nan")
            lines.append(f"| {x['proto']} | {x['clients']} | {x['rps']:.0f} | {x['ratio']:.2f} | {x['reachable']:.2f} | {x['p50_ms']:.2f} | "
                         f"{x['p99_ms']:.2f} | {x['cpu']:.2f} | {per_request:.0f} | {x['rss_mb']:.0f} | {x['threads']} | {x['errors']} |")
            if x["rps"] != x["rps"]:
                short.append(f"{case} {x['proto']} at {x['clients']} clients: no result from the load generator")
            elif x["clients"] >= 8:
                target = TARGET_RATIO_JSON if "JSON" in x["proto"] else TARGET_RATIO
                if x["ratio"] < target:
                    short.append(f"{case} {x['proto']} at {x['clients']} clients: {x['ratio']:.2f} of the ceiling (target {target})")
            if x["clients"] >= 128 and x["rss_mb"] > r["engine_rss_mb"] + TARGET_RSS_EXTRA_MB:
                in_flight = x["clients"] * r["request_mb"]
                short.append(f"{case} {x['proto']} at {x['clients']} clients: peak RSS {x['rss_mb']:.0f} MB vs "
                             f"in-process {r['engine_rss_mb']:.0f} MB + 60 (the clients' requests in flight: "
                             f"{in_flight:.0f} MB)")
            if x["clients"] == 1 and x["p50_ms"] > r["batch1_ms"] + TARGET_P50_EXTRA_MS:
                short.append(f"{case} {x['proto']} at 1 client: p50 {x['p50_ms']:.2f} ms vs in-process "
                             f"{r['batch1_ms']:.2f} ms + 0.15")
        lines.append("")
    lines += ["## Short of the targets", ""] + ([f"- {s}" for s in short] or ["- none"])
    path = RESULTS / f"{args.name}.md"
    path.write_text("\n".join(lines) + "\n")
    print(f"wrote {path.relative_to(ROOT)}")
    print("\n".join(short))


if __name__ == "__main__":
    main()
