"""Drives one benchmark run (see bench/run.sh): starts each service, loads it with oha, samples the
service's CPU time from /proc, runs the in-process ceiling, and writes a Markdown table."""

import argparse
import json
import os
import platform
import shutil
import socket
import struct
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / "bench" / ".work"
RESULTS = ROOT / "bench" / "results"
CLK_TCK = os.sysconf("SC_CLK_TCK")
# Unpacked by bench/run.sh from the tritonclient 2.51.0 and nvidia-cuda-runtime-cu12 wheels.
PERF_ANALYZER = WORK / "pa" / "tritonclient-2.51.0.data" / "data" / "bin" / "perf_analyzer"
PA_LIBS = WORK / "pa" / "nvidia" / "cuda_runtime" / "lib"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url, proc, timeout=60):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            sys.exit(f"service exited early ({proc.returncode}); see {WORK}")
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except OSError:
            time.sleep(0.2)
    sys.exit(f"service at {url} never became ready")


def tree(pid):
    """pid and all its descendants."""
    pids, todo = [], [pid]
    while todo:
        p = todo.pop()
        pids.append(p)
        try:
            children = Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except OSError:
            children = []
        todo += [int(c) for c in children]
    return pids


def cpu_seconds(pid):
    total = 0
    for p in tree(pid):
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime
        except OSError:
            pass
    return total / CLK_TCK


# A command prefix for the load generators (`bench/run.sh --kinds --pin` puts them on a core of
# their own: ["taskset", "-c", "1"]).
LOADGEN = []


def jpeg_body(path, jpeg, shape=(1,)):
    """Writes to `path` a V2 binary-extension body holding `jpeg` as the BYTES input "image" of
    `shape`; returns its JSON header's length (for Inference-Header-Content-Length)."""
    header = json.dumps({"inputs": [{"name": "image", "shape": list(shape), "datatype": "BYTES",
                                     "parameters": {"binary_data_size": 4 + len(jpeg)}}]}).encode()
    path.write_bytes(header + struct.pack("<I", len(jpeg)) + jpeg)
    return len(header)


def oha_load(url, body, clients, headers=(), lines=False):
    """A load function: oha with `clients` connections; returns (req/s, p50 ms, p99 ms, errors).
    With `lines`, each request's body is the next line of the file `body`."""

    def run(duration):
        cmd_headers = [x for h in headers for x in ("-H", h)]
        out = subprocess.run(
            [*LOADGEN, "oha", "-z", f"{duration}s", "-w", "-c", str(clients), "--no-tui", "--output-format", "json",
             "-m", "POST", "-Z" if lines else "-D", str(body), *cmd_headers, url],
            capture_output=True, text=True, check=True,
        )
        r = json.loads(out.stdout)
        ok = r["statusCodeDistribution"].get("200", 0)
        total = sum(r["statusCodeDistribution"].values()) + sum(r.get("errorDistribution", {}).values())
        return ok / r["summary"]["total"], r["latencyPercentiles"]["p50"] * 1000, r["latencyPercentiles"]["p99"] * 1000, total - ok

    return run


def perf_analyzer_load(protocol, url, clients, model="mlp", extra=(), fatal=True, stability=50):
    """A load function: Triton's perf_analyzer at fixed concurrency (binary tensors on HTTP);
    `extra` are more perf_analyzer arguments (input shapes, input data). Without `fatal`, a run
    that gives no result reports NaN instead of ending the benchmark."""

    def run(duration):
        csv = WORK / f"perf_analyzer-{model}.csv"  # one per model: loads on several models run at once
        try:
            out = subprocess.run(
                [*LOADGEN, str(PERF_ANALYZER), "-m", model, "-i", protocol, "-u", url, "--concurrency-range", str(clients),
                 *extra,
                 # Three windows that agree within `stability`% make a result; they add up to `duration`.
                 "--measurement-mode", "time_windows", "--measurement-interval", str(max(duration * 1000 // 3, 500)),
                 "--stability-percentage", str(stability), "--max-trials", "10", "-f", str(csv)],
                capture_output=True, text=True, env=dict(os.environ, LD_LIBRARY_PATH=str(PA_LIBS)),
                # Ten windows at most (`--max-trials`), and its start, with room: beyond that it has hung (seen
                # once against the tiny model at 128 gRPC clients, growing to 6 GB).
                timeout=10 * max(duration, 1.5) + 60,
            )
        except subprocess.TimeoutExpired as e:
            out = subprocess.CompletedProcess(e.cmd, -1, f"timed out after {e.timeout:.0f} s", "")
            csv.unlink(missing_ok=True)
        if not csv.exists():
            if not fatal:
                print(f"perf_analyzer gave no result: {out.stdout[-300:]}", file=sys.stderr)
                return float("nan"), float("nan"), float("nan"), 0
            sys.exit(f"perf_analyzer failed: {out.stdout[-2000:]} {out.stderr[-2000:]}")
        header, row = csv.read_text().splitlines()[:2]
        r = dict(zip(header.split(","), row.split(",")))
        csv.unlink()
        return float(r["Inferences/Second"]), float(r["p50 latency"]) / 1000, float(r["p99 latency"]) / 1000, 0

    return run


def measure(name, cmd, ready_url, load, args, env=None):
    log = open(WORK / f"{name}.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    try:
        wait_ready(ready_url, proc)
        load(2)  # warm-up
        cpu0, t0 = cpu_seconds(proc.pid), time.time()
        rps, p50, p99, errors = load(args.duration)
        cpu = (cpu_seconds(proc.pid) - cpu0) / (time.time() - t0)
    finally:
        proc.terminate()
        proc.wait(30)
    row = {"name": name, "rps": rps, "p50_ms": p50, "p99_ms": p99, "cpu_cores": cpu, "errors": errors}
    print(json.dumps(row), flush=True)
    return row


def mlp_repo(repo, config=""):
    """A repository at `repo` of the bundled MLP, with `config` as its config.toml."""
    (repo / "mlp" / "1").mkdir(parents=True, exist_ok=True)
    model = repo / "mlp" / "1" / "model.onnx"
    if not model.exists():
        shutil.copy(ROOT / "models/mlp/1/model.onnx", model)
    (repo / "mlp" / "config.toml").write_text(config)
    return repo


def ferrite(name, args, load_for, extra=(), repo=None):
    """Starts Ferrite and measures it; `load_for(http_base, grpc_address)` picks the load."""
    port, grpc_port = free_port(), free_port()
    cmd = [str(ROOT / "target/release/ferrite"), "serve", "--model-repository", str(repo or WORK / "repo"),
           "--http-port", str(port), "--grpc-port", str(grpc_port), "--metrics-port", "0", "--log", "warn", *extra]
    base = f"http://127.0.0.1:{port}"
    return measure(name, cmd, f"{base}/v2/health/ready", load_for(base, f"127.0.0.1:{grpc_port}"), args)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--duration", type=int, default=20)
    ap.add_argument("--clients", type=int, default=128)
    ap.add_argument("--name", default="mlp")
    ap.add_argument("--variants", action="store_true", help="also measure batching settings (for defaults)")
    args = ap.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    RESULTS.mkdir(parents=True, exist_ok=True)

    body = WORK / "mlp_request.json"
    body.write_text(json.dumps({"inputs": [{"name": "input", "shape": [1, 512], "datatype": "FP32",
                                            "data": [round((i % 97) / 97 - 0.5, 4) for i in range(512)]}]}))
    mlp_repo(WORK / "repo")

    infer = "/v2/models/mlp/infer"
    json_load = lambda base, _: oha_load(base + infer, body, args.clients, ["Content-Type: application/json"])
    # The same tensor as the JSON body, with Triton's binary extension: a JSON header, then raw bytes.
    header = json.dumps({"inputs": [{"name": "input", "shape": [1, 512], "datatype": "FP32",
                                     "parameters": {"binary_data_size": 2048}}],
                         "outputs": [{"name": "output", "parameters": {"binary_data": True}}]}).encode()
    values = [round((i % 97) / 97 - 0.5, 4) for i in range(512)]
    binary_body = WORK / "mlp_request.bin"
    binary_body.write_bytes(header + struct.pack("<512f", *values))
    binary_load = lambda base, _: oha_load(base + infer, binary_body, args.clients,
                                           [f"Inference-Header-Content-Length: {len(header)}"])

    rows = [ferrite("ferrite REST-JSON (oha)", args, json_load)]
    rows.append(ferrite("ferrite REST-binary (oha)", args, binary_load))
    rows.append(ferrite("ferrite REST-binary (perf_analyzer)", args,
                        lambda base, _: perf_analyzer_load("http", base.removeprefix("http://"), args.clients)))
    rows.append(ferrite("ferrite gRPC (perf_analyzer)", args,
                        lambda _, grpc_addr: perf_analyzer_load("grpc", grpc_addr, args.clients)))
    # Tracing cost: on with nothing sampled, and on with every request sampled (exported to an
    # address where nothing listens, so the export is attempted and fails after serialising).
    dead = f"http://127.0.0.1:{free_port()}"
    rows.append(ferrite("ferrite REST-JSON, tracing on, 0% sampled", args, json_load,
                        ["--otlp-endpoint", dead, "--trace-sample-rate", "0"]))
    rows.append(ferrite("ferrite REST-JSON, tracing on, 100% sampled", args, json_load,
                        ["--otlp-endpoint", dead, "--trace-sample-rate", "1"]))
    variants = []
    if args.variants:
        # The batching defaults are chosen from this grid: throughput under load vs latency alone.
        for delay in (0, 200, 500, 1000):
            cfg = mlp_repo(WORK / f"repo-d{delay}", f"[dynamic_batching]\nmax_queue_delay_microseconds = {delay}\n")
            for clients in (args.clients, 1):
                load = lambda base, _, c=clients: oha_load(base + infer, body, c, ["Content-Type: application/json"])
                variants.append(ferrite(f"delay {delay} us, {clients} clients", args, load, repo=cfg))
        variants.append(ferrite("spinning threads, 128 clients", args, json_load, ["--spin"]))

    port = free_port()
    workers = str(os.cpu_count() or 1)
    env = dict(os.environ, MODEL=str(ROOT / "models/mlp/1/model.onnx"))
    base = f"http://127.0.0.1:{port}"
    baseline = measure(
        "fastapi+onnxruntime (oha)",
        [sys.executable, "-m", "uvicorn", "bench.baseline.app:app", "--port", str(port), "--workers", workers,
         "--log-level", "warning"],
        f"{base}/docs", oha_load(base + infer, body, args.clients, ["Content-Type: application/json"]), args, env=env,
    )
    rows.append(baseline)

    out = subprocess.run([str(ROOT / "target/release/examples/ceiling"), str(ROOT / "models/mlp/1/model.onnx"), "3"],
                         capture_output=True, text=True, check=True).stdout
    ceiling = max((json.loads(line) for line in out.splitlines()), key=lambda r: r["rows_per_sec"])
    print(json.dumps({"ceiling": ceiling}), flush=True)

    f = rows[0]
    lines = [
        f"# Benchmark: `{args.name}`",
        "",
        f"`bench/run.sh` on {platform.machine()}, {os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}: "
        f"{args.clients} concurrent clients (oha), batch-1 V2 JSON requests to the `mlp` model "
        f"(512 -> 2048 -> 2048 -> 10) for {args.duration} s each; the load generator shares the machine.",
        "REST-JSON rows send V2 JSON; REST-binary rows send the same tensor with Triton's binary extension;",
        "perf_analyzer (tritonclient 2.51.0) drives gRPC and REST-binary at the same concurrency.",
        "CPU is the service's own CPU time per second of wall time (cores busy), all its processes.",
        "",
        "| service | req/s | p50 ms | p99 ms | CPU cores | errors |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['name']} | {r['rps']:.0f} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {r['cpu_cores']:.2f} | {r['errors']} |")
    lines += [
        f"| engine alone, in-process (batch {ceiling['batch']}) | {ceiling['rows_per_sec']:.0f} rows/s | | | | |",
        "",
        "| ratio | value |",
        "|---|---:|",
        f"| Ferrite / baseline throughput | {f['rps'] / baseline['rps']:.1f}x |",
        f"| Ferrite p99 / baseline p99 | {f['p99_ms'] / baseline['p99_ms']:.3f} |",
        f"| Ferrite / engine ceiling throughput | {f['rps'] / ceiling['rows_per_sec']:.2f} |",
        f"| Ferrite REST-binary / REST-JSON throughput (both oha) | {rows[1]['rps'] / f['rps']:.2f} |",
        f"| Ferrite gRPC / REST-binary throughput (both perf_analyzer) | {rows[3]['rps'] / rows[2]['rps']:.2f} |",
        f"| tracing on (0% sampled) / off, REST-JSON throughput | {rows[4]['rps'] / f['rps']:.2f} |",
        f"| tracing on (100% sampled) / off, REST-JSON throughput | {rows[5]['rps'] / f['rps']:.2f} |",
        "",
        f"Bar (issue 2): throughput >= 10x baseline: **{'met' if f['rps'] >= 10 * baseline['rps'] else 'NOT met'}**; "
        f"p99 <= 1/5 of baseline: **{'met' if f['p99_ms'] <= baseline['p99_ms'] / 5 else 'NOT met'}**.",
    ]
    if variants:
        lines += ["", "## Batching settings (for the defaults)", "",
                  "| ferrite setting | req/s | p50 ms | p99 ms | CPU cores |", "|---|---:|---:|---:|---:|"]
        for r in variants:
            lines.append(f"| {r['name']} | {r['rps']:.0f} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {r['cpu_cores']:.2f} |")
    path = RESULTS / f"{args.name}.md"
    path.write_text("\n".join(lines) + "\n")
    print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
