"""A steady client beside hostile floods (bench/run.sh --hostile): what one tenant's costly requests
do to another's latency, on the bundled repository, with the release binary.

- images: one client sends a 64x48 JPEG to `image_classifier` back to back, alone, then while 4
  clients each send requests of 16 WebPs of 6320x6320 (1.7 KB each, 40 megapixels decoded), and
  while 4 clients each send one such WebP per request (what the per-request budget lets through);
- text: one client sends one short text to TEI's /embed, alone, then while 2 clients each send
  OpenAI /v1/embeddings calls of 2048 texts of 200 words;
- compressed: one client sends an MLP request over HTTP, alone, then while 2 clients each send
  gzip-compressed gRPC ModelInfer calls of a 60 MiB tensor of zeros (about 60 KB on the wire;
  refused by the model's shape once decompressed) and 2 send gzip HTTP bodies of 60 MiB of
  zeros (refused as JSON): what decompression costs the others.
- tenants (`--only tenants`, with a tenant config): one tenant sends gzip MLP requests over HTTP,
  alone, then while 16 clients of another tenant each send gzip bodies of 64 MiB of JSON empty
  strings (65 KB on the wire; decompressed, parsed, then refused by the model's datatype): whether
  one tenant's flood queues in front of another's requests for the decompression places.
- turns (`--only turns`, with a tenant config): one tenant sends short texts to /embed, then
  single-row MLP requests, alone and while another tenant's clients send 2048-text embeddings
  calls (2 clients), then 64-row MLP requests (16 clients): whether one tenant's queued flood
  keeps another's requests waiting behind it in the models' queues.

Reports the steady client's p50, p99 and max, its requests completed, and the server's CPU, and
writes bench/results/hostile.md. Guards the cost rule: the steady client's p99 beside the floods
stays within a small multiple of its idle p99.

Usage: python3 bench/hostile.py [--duration 10] [--binary PATH ...] [--rounds 1] [--only compressed|tenants|turns]
                                [--name hostile]
"""

import argparse
import gzip
import io
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.run import ROOT, RESULTS, WORK, free_port  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def encode(img, fmt, **kw):
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def binary_body(images):
    raw = b"".join(len(i).to_bytes(4, "little") + i for i in images)
    header = json.dumps({"inputs": [{"name": "image", "shape": [len(images)], "datatype": "BYTES",
                                     "parameters": {"binary_data_size": len(raw)}}]}).encode()
    return {"Inference-Header-Content-Length": str(len(header))}, header + raw


def post(url, body, headers):
    req = urllib.request.Request(url, data=body, method="POST", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as e:
        e.read()
        return e.code


def rss_mib(pid):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def cpu_seconds(pid):
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def steady(url, body, headers, duration, stop=None):
    """Latencies (s) of back-to-back requests for `duration` seconds."""
    lat = []
    end = time.time() + duration
    while time.time() < end:
        t = time.perf_counter()
        status = post(url, body, headers)
        lat.append(time.perf_counter() - t)
        assert status == 200, status
    return np.array(lat)


def flood(send, stop, statuses):
    while not stop.is_set():
        statuses.append(send())


def grpc_sender(target, request, compression):
    """A flood's call: one gRPC ModelInfer of `request`, its status code's name."""
    import grpc
    from tritonclient.grpc import service_pb2_grpc
    channel = grpc.insecure_channel(target, options=[("grpc.max_send_message_length", 1 << 30)])
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)

    def send():
        try:
            stub.ModelInfer(request, compression=compression, timeout=60)
            return "OK"
        except grpc.RpcError as e:
            return e.code().name
    return send


def scenario(name, pid, steady_req, flood_req, flooders, duration):
    """`flood_req`: an HTTP request (url, body, headers) each flooder sends, or a list of senders
    (one a flooder)."""
    idle = steady(*steady_req, duration)
    stop = threading.Event()
    statuses = []
    senders = flood_req if isinstance(flood_req, list) else [lambda: post(*flood_req)] * flooders
    threads = [threading.Thread(target=flood, args=(send, stop, statuses)) for send in senders]
    cpu = cpu_seconds(pid)
    for t in threads:
        t.start()
    busy = steady(*steady_req, duration)
    stop.set()
    for t in threads:
        t.join()
    cpu = cpu_seconds(pid) - cpu
    row = lambda lat: (np.percentile(lat, 50) * 1e3, np.percentile(lat, 99) * 1e3, lat.max() * 1e3, len(lat))  # noqa: E731
    codes = {c: statuses.count(c) for c in sorted(set(statuses), key=str)}
    return name, row(idle), row(busy), codes, cpu


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--duration", type=float, default=10)
    ap.add_argument("--binary", action="append",
                    help="a ferrite binary to measure (default: this tree's, built); give several to compare them")
    ap.add_argument("--rounds", type=int, default=1, help="rounds over the binaries, alternating")
    ap.add_argument("--only", choices=["compressed", "tenants", "turns"], help="that scenario alone")
    ap.add_argument("--name", default="hostile")
    args = ap.parse_args()
    binaries = [Path(b) for b in args.binary or [ROOT / "target" / "release" / "ferrite"]]
    if not args.binary:
        subprocess.run(["cargo", "build", "--release", "--locked", "--bin", "ferrite"], check=True, cwd=ROOT)
    rows, rss = [], (None, None, None)
    try:
        for r in range(args.rounds):
            for binary in binaries:
                label = f"{binary.name}, round {r + 1}: " if len(binaries) > 1 or args.rounds > 1 else ""
                got, rss = measure(args, binary)
                rows += [(label + name, *rest) for name, *rest in got]
    finally:
        if rows:
            write(args, binaries, rows, rss)


def measure(args, binary):
    """The scenarios' rows for one server of `binary`, and its resident memory around the text flood."""
    repo = WORK / "hostile"
    shutil.rmtree(repo, ignore_errors=True)
    shutil.copytree(ROOT / "models", repo)
    port, grpc, metrics = free_port(), free_port(), free_port()
    log = open(WORK / "hostile.log", "w")
    tenants = []
    if args.only in ("tenants", "turns"):
        (WORK / "tenants.toml").write_text("[default]\n")
        tenants = ["--tenant-header", "x-tenant", "--tenant-config", str(WORK / "tenants.toml")]
    proc = subprocess.Popen([str(binary), "serve", "--model-repository", str(repo), "--http-port", str(port),
                             "--grpc-port", str(grpc), "--metrics-port", str(metrics), *tenants], stdout=log, stderr=log)
    base = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            urllib.request.urlopen(f"{base}/v2/health/ready", timeout=1)
            break
        except OSError:
            time.sleep(0.1)
    rss_before = rss_after = rss_later = None
    rows = []
    json_h = {"Content-Type": "application/json"}
    one = json.dumps({"inputs": "a short text to embed"}).encode()
    words = " ".join(["word"] * 200)
    many = json.dumps({"model": "text_embedder", "input": [f"{i} {words}" for i in range(2048)]}).encode()
    try:
        if args.only == "compressed":
            rows = [compressed(base, f"127.0.0.1:{grpc}", proc.pid, args.duration)]
            return rows, (None, None, None)
        if args.only == "tenants":
            rows = [tenants_apart(base, proc.pid, args.duration)]
            return rows, (None, None, None)
        if args.only == "turns":
            rows = turns(base, proc.pid, args.duration, (one, many, json_h))
            return rows, (None, None, None)
        small = encode(Image.new("RGB", (64, 48), (120, 30, 200)), "JPEG")
        bomb = encode(Image.new("RGB", (6320, 6320), (10, 20, 30)), "WEBP", lossless=True)
        h, b = binary_body([small])
        fh, fb = binary_body([bomb] * 16)
        one_h, one_b = binary_body([bomb])
        url = f"{base}/v2/models/image_classifier/infer"
        rows = [scenario("images: 4 clients of 16 WebP bombs", proc.pid, (url, b, h), (url, fb, fh), 4, args.duration),
                scenario("images: 4 clients of 1 WebP bomb (within the limits)", proc.pid, (url, b, h),
                         (url, one_b, one_h), 4, args.duration)]
        rss_before = rss_mib(proc.pid)
        rows.append(scenario("text: 2 clients of 2048-text embeddings", proc.pid, (f"{base}/embed", one, json_h),
                             (f"{base}/v1/embeddings", many, json_h), 2, args.duration))
        rss_after = rss_mib(proc.pid)
        rows.append(compressed(base, f"127.0.0.1:{grpc}", proc.pid, args.duration))
        time.sleep(30)
        rss_later = rss_mib(proc.pid)
        return rows, (rss_before, rss_after, rss_later)
    finally:
        proc.terminate()
        proc.wait()


def compressed(base, grpc_target, pid, duration):
    import grpc
    from tritonclient.grpc import service_pb2
    request = service_pb2.ModelInferRequest(model_name="mlp")
    t = request.inputs.add()
    t.name, t.datatype = "input", "FP32"
    t.shape.extend([1, (60 << 20) // 4])
    request.raw_input_contents.append(bytes(60 << 20))
    url = f"{base}/v2/models/mlp/infer"
    body = json.dumps({"inputs": [{"name": "input", "shape": [1, 512], "datatype": "FP32",
                                   "data": [0.5] * 512}]}).encode()
    gz = gzip.compress(bytes(60 << 20))
    gz_h = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
    senders = [grpc_sender(grpc_target, request, grpc.Compression.Gzip) for _ in range(2)]
    senders += [lambda: post(url, gz, gz_h)] * 2
    return scenario("compressed: 2 gRPC clients of 60 MiB gzip messages, 2 HTTP of 60 MiB gzip bodies", pid,
                    (url, body, {"Content-Type": "application/json"}), senders, 4, duration)


def tenants_apart(base, pid, duration):
    url = f"{base}/v2/models/mlp/infer"
    body = json.dumps({"inputs": [{"name": "input", "shape": [1, 512], "datatype": "FP32",
                                   "data": [0.5] * 512}]}).encode()
    gz_h = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
    n = (64 << 20) // 3 - 40
    bomb = gzip.compress(b'{"inputs":[{"name":"input","datatype":"BYTES","shape":[%d],"data":[' % n
                         + b'"",' * (n - 1) + b'""]}]}')
    senders = [lambda: post(url, bomb, {**gz_h, "x-tenant": "flood"})] * 16
    return scenario(f"tenants: 16 clients of one tenant's gzip bodies of 64 MiB of JSON ({len(bomb) >> 10} KB each)",
                    pid, (url, gzip.compress(body), {**gz_h, "x-tenant": "quiet"}), senders, 16, duration)


def turns(base, pid, duration, text):
    """Another tenant's flood in a model's queue: the quiet tenant's one request at a time beside
    the flood tenant's 2048-text embeddings calls (2 clients), then beside its 64-row MLP requests
    (16 clients)."""
    one, many, json_h = text
    quiet, flood = {**json_h, "x-tenant": "quiet"}, {**json_h, "x-tenant": "flood"}
    url = f"{base}/v2/models/mlp/infer"
    row = json.dumps({"inputs": [{"name": "input", "shape": [1, 512], "datatype": "FP32", "data": [0.5] * 512}]})
    rows64 = json.dumps({"inputs": [{"name": "input", "shape": [64, 512], "datatype": "FP32",
                                     "data": [0.5] * (64 * 512)}]})
    return [scenario("turns: another tenant's 2 clients of 2048-text embeddings", pid,
                     (f"{base}/embed", one, quiet), (f"{base}/v1/embeddings", many, flood), 2, duration),
            scenario("turns: another tenant's 16 clients of 64-row MLP requests", pid,
                     (url, row.encode(), quiet), (url, rows64.encode(), flood), 16, duration)]


def write(args, binaries, rows, rss):
    rss_before, rss_after, rss_later = rss
    command = f"python3 bench/hostile.py --duration {args.duration:g}" + (f" --only {args.only}" if args.only else "")
    command += f" --rounds {args.rounds}" if args.rounds > 1 else ""
    names = ", ".join(f"`{b.name}`" for b in binaries)
    lines = ["# A steady client beside hostile floods", "",
             f"`{command}` ({names}), {time.strftime('%Y-%m-%d')}, "
             f"{os.cpu_count()} CPUs, release binary on the bundled repository; the steady client sends one "
             "request at a time, alone and then beside the floods.", "",
             "| load | steady p50 / p99 / max idle (ms) | beside the flood (ms) | p99 multiple | steady requests idle / beside | flood answers | server CPU-s beside |",
             "|---|---|---|---|---|---|---|"]
    for name, idle, busy, codes, cpu in rows:
        lines.append(f"| {name} | {idle[0]:.1f} / {idle[1]:.1f} / {idle[2]:.1f} | {busy[0]:.1f} / {busy[1]:.1f} / "
                     f"{busy[2]:.1f} | {busy[1] / idle[1]:.1f}x | {idle[3]} / {busy[3]} | {codes} | {cpu:.1f} |")
    if rss_before is not None:
        lines += ["", f"Resident memory around the text floods: {rss_before:.0f} MiB before, {rss_after:.0f} MiB "
                  f"right after, {rss_later:.0f} MiB 30 s later (freed memory is handed back every 20 s)."]
    text = "\n".join(lines) + "\n"
    print(text)
    (RESULTS / f"{args.name}.md").write_text(text)


if __name__ == "__main__":
    main()
