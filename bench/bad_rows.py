"""What requests that fail on their own, or answers of many sizes, cost the requests batched with
them: two binaries side by side on the pipelines bench's repository (bench/pipelines.py).

- images: 16 clients (oha) send a 640x480 JPEG to the image classifier pipeline, alone, then beside
  one client sending the same JPEG cut short (refused at decode, after decoding what is there)
  back to back;
- sizes: a pre-processing pipeline answering each image's pixels (decode, resize the shorter side
  to 256, normalize), 8 clients sending a landscape JPEG beside 8 sending a portrait one, so a
  batch holds answers of two sizes.

Writes bench/results/<name>.md with each binary's good requests a second, p99 and the refused
ones, the median over rounds.

Usage: python3 bench/bad_rows.py A B [--rounds 2] [--duration 8] [--name bad-rows-ab]
"""

import argparse
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench import pipelines  # noqa: E402
from bench.run import RESULTS, WORK, free_port, jpeg_body, oha_load, wait_ready  # noqa: E402


def hostile(url, path, header_len, stop, answers):
    body = path.read_bytes()
    headers = {"Inference-Header-Content-Length": str(header_len)}
    while not stop.is_set():
        try:
            with urllib.request.urlopen(urllib.request.Request(url, body, headers), timeout=60) as r:
                answers.append(r.status)
        except urllib.error.HTTPError as e:
            answers.append(e.code)


def measure(loads, duration):
    out = {}
    for name, (runs, bad) in loads.items():
        stop, answers, threads = threading.Event(), [], []
        if bad:
            threads = [threading.Thread(target=hostile, args=(*bad, stop, answers))]
        for t in threads:
            t.start()
        results = []
        with_threads = [threading.Thread(target=lambda r=r: results.append(r(duration))) for r in runs]
        for t in with_threads:
            t.start()
        for t in with_threads:
            t.join()
        stop.set()
        for t in threads:
            t.join()
        out[name] = (sum(r[0] for r in results), max(r[2] for r in results), len(answers) / duration,
                     sum(r[3] for r in results))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--duration", type=float, default=8)
    ap.add_argument("--name", default="bad-rows-ab")
    args = ap.parse_args()
    pipelines.repository()
    (pipelines.REPO / "sizes").mkdir(exist_ok=True)
    (pipelines.REPO / "sizes" / "config.toml").write_text(
        '[[steps]]\nop = "decode_image"\n[[steps]]\nop = "resize"\nmode = "shorter_side"\nsize = [256]\n'
        '[[steps]]\nop = "normalize"\n')
    landscape, portrait = pipelines.photo(640, 480), pipelines.photo(480, 640, seed=1)
    h_land = jpeg_body(WORK / "landscape.bin", landscape)
    h_port = jpeg_body(WORK / "portrait.bin", portrait)
    h_bad = jpeg_body(WORK / "cut.bin", landscape[: len(landscape) * 6 // 10])
    started = time.time()
    rows = {}
    for _ in range(args.rounds):
        for binary in (args.a, args.b):
            port, grpc, metrics = free_port(), free_port(), free_port()
            log = open(WORK / "bad_rows.log", "w")
            proc = subprocess.Popen([binary, "serve", "--model-repository", str(pipelines.REPO), "--http-port",
                                     str(port), "--grpc-port", str(grpc), "--metrics-port", str(metrics)],
                                    stdout=log, stderr=log)
            base = f"http://127.0.0.1:{port}"
            try:
                wait_ready(f"{base}/v2/health/ready", proc, timeout=300)
                images, sizes = f"{base}/v2/models/images/infer", f"{base}/v2/models/sizes/infer"
                good = oha_load(images, WORK / "landscape.bin", 16, [f"Inference-Header-Content-Length: {h_land}"])
                loads = {
                    "images, alone": ([good], None),
                    "images, beside 1 client of cut JPEGs": ([good], (images, WORK / "cut.bin", h_bad)),
                    "sizes, landscape and portrait": ([
                        oha_load(sizes, WORK / "landscape.bin", 8, [f"Inference-Header-Content-Length: {h_land}"]),
                        oha_load(sizes, WORK / "portrait.bin", 8, [f"Inference-Header-Content-Length: {h_port}"])],
                        None),
                }
                for name, r in measure(loads, args.duration).items():
                    rows.setdefault((name, binary), []).append(r)
            finally:
                proc.terminate()
                proc.wait()
    took = (time.time() - started) / 60
    a, b = Path(args.a).name, Path(args.b).name
    lines = [f"# Two binaries side by side (`{args.name}`)", "",
             f"`bench/bad_rows.py` on 2 cores, {time.strftime('%Y-%m-%d')}, {took:.1f} min: A = `{a}`, B = `{b}`, "
             f"alternated in {args.rounds} rounds of {args.duration:g} s a load, not pinned; the median over rounds. "
             "`good/s`: the good clients' answers a second; `refused/s`: the cut JPEGs answered (400) a second.", "",
             "| load | good/s A | good/s B | B/A | rounds A; B | p99 ms A | p99 ms B | refused/s A | refused/s B | errors A | B |",
             "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    for name in dict.fromkeys(n for n, _ in rows):
        ra, rb = rows[(name, args.a)], rows[(name, args.b)]
        med = lambda rs, i: float(np.median([r[i] for r in rs]))  # noqa: E731
        lines.append(
            f"| {name} | {med(ra, 0):.0f} | {med(rb, 0):.0f} | {med(rb, 0) / med(ra, 0):.2f} | "
            f"{', '.join(f'{r[0]:.0f}' for r in ra)}; {', '.join(f'{r[0]:.0f}' for r in rb)} | {med(ra, 1):.0f} | "
            f"{med(rb, 1):.0f} | {med(ra, 2):.0f} | {med(rb, 2):.0f} | {med(ra, 3):.0f} | {med(rb, 3):.0f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    (RESULTS / f"{args.name}.md").write_text(text)


if __name__ == "__main__":
    main()
