"""Memory a burst leaves behind (bench/run.sh --bursts): per model kind, the server's resident
memory idle, at the peak of a burst of large requests (8 clients), and every 10 s after it, both
when the server then goes idle and when small requests go on (one client, one request every 50 ms).
A burst is what a hostile or an unusual client sends within the limits: the largest batches, a
detector's large images, an encoder's longest texts; ONNX Runtime's arena grows to it. Each binary
given is measured in turn on the same requests, so a change is read side by side.

Writes bench/results/bursts.md.

Usage: python3 bench/bursts.py [BINARY ...] [--models mlp,resnet,detector,bert_var] [--burst 10] [--after 40]
       (no binary: target/release/ferrite)
"""

import argparse
import json
import os
import platform
import struct
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.kinds import KINDS, make_models, status, values  # noqa: E402
from bench.run import RESULTS, ROOT, WORK, free_port, wait_ready  # noqa: E402

# kind -> (inputs as (name, datatype, shape of one row), small rows and shapes, burst rows and shapes):
# a shape's -1 is the variable dim each request sets.
KINDS_BURST = {
    "mlp": ([("input", "FP32", [512])], (1, {}), (64, {})),
    "resnet": ([("images", "FP32", [3, 224, 224])], (1, {}), (16, {})),
    "detector": ([("images", "FP32", [3, -1, -1])], (1, {"images": [3, 320, 320]}), (2, {"images": [3, 800, 800]})),
    "bert_var": ([("input_ids", "INT64", [-1]), ("attention_mask", "INT64", [-1])],
                 (1, {"input_ids": [16], "attention_mask": [16]}),
                 (16, {"input_ids": [384], "attention_mask": [384]})),
}


def body(kind, rows, shapes):
    """A Triton binary-extension request of `rows` rows; returns (headers, body)."""
    inputs, header, raw = KINDS_BURST[kind][0], [], b""
    for name, dt, shape in inputs:
        shape = shapes.get(name, shape)
        n = rows * int(eval("*".join(map(str, shape))))
        data = struct.pack(f"<{n}{'f' if dt == 'FP32' else 'q'}", *values(dt, n, name))
        header.append({"name": name, "shape": [rows, *shape], "datatype": dt, "parameters": {"binary_data_size": len(data)}})
        raw += data
    head = json.dumps({"inputs": header, "parameters": {"binary_data_output": True}}).encode()
    return {"Inference-Header-Content-Length": str(len(head)), "Content-Type": "application/octet-stream"}, head + raw


def post(url, headers, data):
    req = urllib.request.Request(url, data, headers)
    with urllib.request.urlopen(req, timeout=120) as r:
        r.read()


def rss_mb(pid):
    return status(pid, "VmRSS") / 1024


def serve(binary, kind):
    repo = WORK / f"bursts-{kind}"
    (repo / kind / "1").mkdir(parents=True, exist_ok=True)
    onnx = repo / kind / "1" / "model.onnx"
    if not onnx.exists():
        os.link(KINDS / kind / "1/model.onnx", onnx)
    port = free_port()
    log = open(WORK / f"bursts-{kind}.log", "w")
    proc = subprocess.Popen([str(binary), "serve", "--model-repository", str(repo), "--http-port", str(port),
                             "--grpc-port", str(free_port()), "--metrics-port", "0", "--log", "info"],
                            stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    base = f"http://127.0.0.1:{port}"
    wait_ready(f"{base}/v2/models/{kind}/ready", proc, timeout=180)
    return proc, f"{base}/v2/models/{kind}/infer"


def run_one(binary, kind, then, burst_s, after_s):
    _, (small_rows, small_shapes), (big_rows, big_shapes) = KINDS_BURST[kind]
    small, big = body(kind, small_rows, small_shapes), body(kind, big_rows, big_shapes)
    proc, url = serve(binary, kind)
    try:
        for _ in range(50):
            post(url, *small)
        time.sleep(1)
        idle = rss_mb(proc.pid)
        stop, peak, answered = threading.Event(), [idle], [0]

        def flood():
            while not stop.is_set():
                post(url, *big)
                answered[0] += 1

        threads = [threading.Thread(target=flood) for _ in range(8)]
        for t in threads:
            t.start()
        end = time.time() + burst_s
        while time.time() < end:
            peak[0] = max(peak[0], rss_mb(proc.pid))
            time.sleep(0.2)
        stop.set()
        for t in threads:
            t.join()
        after, steady = [rss_mb(proc.pid)], [0]
        quiet = threading.Event()

        def trickle():
            while not quiet.wait(0.05):
                post(url, *small)
                steady[0] += 1

        trickler = threading.Thread(target=trickle)
        if then == "small requests":
            trickler.start()
        for _ in range(int(after_s // 10)):
            time.sleep(10)
            after.append(rss_mb(proc.pid))
        quiet.set()
        if trickler.is_alive():
            trickler.join()
        return {"idle": idle, "peak": peak[0], "after": after, "burst_answers": answered[0], "steady": steady[0]}
    finally:
        proc.terminate()
        proc.wait(30)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("binaries", nargs="*", default=[str(ROOT / "target/release/ferrite")])
    ap.add_argument("--models", default=",".join(KINDS_BURST))
    ap.add_argument("--burst", type=float, default=10)
    ap.add_argument("--after", type=float, default=40)
    args = ap.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    make_models()
    started, rows = time.time(), []
    for kind in args.models.split(","):
        for then in ("idle", "small requests"):
            for binary in args.binaries:
                r = run_one(binary, kind, then, args.burst, args.after)
                r.update(kind=kind, then=then, binary=binary)
                print(json.dumps(r), flush=True)
                rows.append(r)
    names = {b: Path(b).name for b in args.binaries}
    steps = "".join(f" +{10 * (i + 1)} s |" for i in range(int(args.after // 10)))
    lines = [
        "# Memory a burst leaves behind (`bursts`)", "",
        f"`python3 bench/bursts.py {' '.join(names.values())} --burst {args.burst:g} --after {args.after:g}` on "
        f"{platform.machine()}, {os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}, "
        f"{(time.time() - started) / 60:.1f} min. Resident memory (MB) of the server with one model kind "
        "loaded (its calibrated plan): idle after 50 small requests, the peak during a burst of 8 clients "
        "sending the largest requests below for the burst's seconds, at its end, and every 10 s after, "
        "with the server then idle or answering one small request every 50 ms.", "",
        "| kind | small request | burst request |", "|---|---|---|"]
    for kind in args.models.split(","):
        _, (sr, ss), (br, bs) = KINDS_BURST[kind]
        shape = lambda rows, shapes: ", ".join(  # noqa: E731
            f"{n} {[rows, *shapes.get(n, s)]}" for n, _, s in KINDS_BURST[kind][0])
        lines.append(f"| {kind} | {shape(sr, ss)} | {shape(br, bs)} |")
    lines += ["", f"| kind | then | binary | idle | burst peak | burst end |{steps} burst answers | small answers after |",
              "|---|---|---|---:|---:|---:|" + "---:|" * int(args.after // 10) + "---:|---:|"]
    for r in rows:
        lines.append(f"| {r['kind']} | {r['then']} | {names[r['binary']]} | {r['idle']:.0f} | {r['peak']:.0f} | "
                     + " | ".join(f"{v:.0f}" for v in r["after"]) + f" | {r['burst_answers']} | {r['steady']} |")
    text = "\n".join(lines) + "\n"
    print(text)
    (RESULTS / "bursts.md").write_text(text)


if __name__ == "__main__":
    main()
