"""Memory over a long run: the detector with variable H/W served for `--minutes` under 128 clients
(64 sending 320x320 images, 64 sending 640x640 ones, over REST-binary), the server's resident
memory sampled every 5 s. Flat means: after the first minute (arenas and buffers grown to what the
load needs), RSS grows by less than 5%. Writes bench/results/<name>.md.

Usage (after bench/run.sh has built the release binary): python3 bench/soak.py [--minutes 5]"""

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.kinds import KINDS, bodies, serve, status  # noqa: E402
from bench.run import RESULTS, oha_load  # noqa: E402

FLAT = 0.05


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=5)
    ap.add_argument("--name", default="soak")
    ap.add_argument("--extra", default="", help="more `ferrite serve` arguments")
    args = ap.parse_args()
    if not (KINDS / "detector/1/model.onnx").exists():
        subprocess.run([sys.executable, str(Path(__file__).parent / "make_models.py"), str(KINDS)], check=True)
    seconds = int(args.minutes * 60)
    loads = []
    for case in ("detector320", "detector640"):
        _, body, header_len = bodies(case, f"soak-{case}")
        loads.append((case, body, header_len))
    proc, base, _ = serve("detector320", args, "soak")
    url = f"{base}/v2/models/detector/infer"
    samples, results, done = [], {}, threading.Event()

    def sample():
        start = time.time()
        while not done.wait(5):
            samples.append((time.time() - start, status(proc.pid, "VmRSS") / 1024, status(proc.pid, "Threads")))

    def load(case, body, header_len):
        results[case] = oha_load(url, body, 64, [f"Inference-Header-Content-Length: {header_len}"])(seconds)

    try:
        idle = status(proc.pid, "VmRSS") / 1024
        threads = [threading.Thread(target=load, args=x) for x in loads] + [threading.Thread(target=sample)]
        for t in threads:
            t.start()
        for t in threads[:-1]:
            t.join()
        done.set()
        threads[-1].join()
    finally:
        proc.terminate()
        proc.wait(30)
    after_first = [s for s in samples if s[0] >= 60] or samples
    base_rss, last_rss, peak = after_first[0][1], after_first[-1][1], max(s[1] for s in samples)
    growth = (last_rss - base_rss) / base_rss
    lines = [
        f"# Memory over {args.minutes:g} minutes (`{args.name}`)",
        "",
        f"`bench/soak.py` on {time.strftime('%Y-%m-%d')}: the detector (variable H/W) under 64 clients sending "
        "3x320x320 and 64 sending 3x640x640 batch-1 requests over REST-binary at once, for "
        f"{args.minutes:g} minutes; `ferrite serve {args.extra or '(defaults)'}`. Idle before the load: "
        f"{idle:.0f} MB.",
        "",
        "| | 320x320 | 640x640 |",
        "|---|---:|---:|",
        "| req/s | " + " | ".join(f"{results[c][0]:.1f}" for c, _, _ in loads) + " |",
        "| p50 ms | " + " | ".join(f"{results[c][1]:.0f}" for c, _, _ in loads) + " |",
        "| p99 ms | " + " | ".join(f"{results[c][2]:.0f}" for c, _, _ in loads) + " |",
        "| errors | " + " | ".join(f"{results[c][3]}" for c, _, _ in loads) + " |",
        "",
        "| minute | RSS MB | threads |",
        "|---:|---:|---:|",
    ]
    for minute in range(1, int(args.minutes) + 1):
        at = [s for s in samples if s[0] <= minute * 60]
        if at:
            lines.append(f"| {minute} | {at[-1][1]:.0f} | {at[-1][2]} |")
    verdict = "flat" if growth < FLAT else "NOT flat"
    lines += ["", f"Peak {peak:.0f} MB. From the end of minute 1 ({base_rss:.0f} MB) to the end ({last_rss:.0f} MB): "
              f"{growth * 100:+.1f}% ({verdict}; the bar is < {FLAT * 100:.0f}%)."]
    path = RESULTS / f"{args.name}.md"
    path.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(json.dumps({"growth": growth, "peak_mb": peak}))


if __name__ == "__main__":
    main()
