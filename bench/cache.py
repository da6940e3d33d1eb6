"""Response-cache benchmark: a 90%-hit workload on `mlp` at 128 concurrent clients, uncached vs
tier 1 only vs tier 1 + Redis, in one run. Writes bench/results/cache.md.

The bodies come from a file oha reads line by line: 9 of every 10 lines are one of 30 hot
requests, the 10th is unique. Entries live 1 s (--cache-ttl 1) and the file is long enough that a
unique line comes back only after it expired, so about 90% of lookups can hit. The measured hit
rate is read from the server's statistics and reported.

Run: bench/run.sh --cache   (it builds, installs oha and calls this with the same interpreter)
"""

import argparse
import json
import os
import platform
import random
import subprocess
import time

import run as common  # bench/run.py

ROOT = common.ROOT
WORK = common.WORK


def bodies(path, lines=60000):
    rng = random.Random(0)

    def body(seed):
        r = random.Random(seed)
        data = [round(r.uniform(-1, 1), 2) for _ in range(512)]
        return json.dumps({"inputs": [{"name": "input", "shape": [1, 512], "datatype": "FP32", "data": data}]},
                          separators=(",", ":"))

    hot = [body(i) for i in range(30)]
    with open(path, "w") as f:
        for i in range(lines):
            f.write((body(1_000_000 + i) if i % 10 == 9 else rng.choice(hot)) + "\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--duration", type=int, default=20)
    ap.add_argument("--clients", type=int, default=128)
    args = ap.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    lines = WORK / "cache_bodies.txt"
    if not lines.exists():
        bodies(lines)
    repos = {}
    for name, cached in (("uncached", False), ("cached", True)):
        repos[name] = common.mlp_repo(WORK / f"repo-{name}", "[cache]\nenabled = true\n" if cached else "")

    redis_port = common.free_port()
    redis = subprocess.Popen(["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "",
                              "--appendonly", "no"], stdout=subprocess.DEVNULL)
    time.sleep(0.5)
    rows = []
    try:
        for label, repo, extra in [
            ("uncached", repos["uncached"], []),
            ("tier 1 (in-process)", repos["cached"], ["--cache-ttl", "1"]),
            ("tier 1 + Redis", repos["cached"], ["--cache-ttl", "1", "--cache-redis-url", f"redis://127.0.0.1:{redis_port}/"]),
        ]:
            hit_rate = {}

            def load_for(base, _grpc, hit_rate=hit_rate):
                run = common.oha_load(base + "/v2/models/mlp/infer", lines, args.clients,
                                      ["Content-Type: application/json"], lines=True)

                def measured(duration):
                    r = run(duration)
                    with common.urllib.request.urlopen(base + "/v2/models/mlp/stats") as resp:
                        s = json.loads(resp.read())["model_stats"][0]["inference_stats"]
                    hits, misses = s["cache_hit"]["count"], s["cache_miss"]["count"]
                    hit_rate["value"] = hits / (hits + misses) if hits + misses else 0.0
                    return r

                return measured

            row = common.ferrite(label, args, load_for, extra, repo=repo)
            row["hit_rate"] = hit_rate.get("value", 0.0)
            rows.append(row)
    finally:
        redis.kill()

    base = rows[0]
    out = [
        "# Benchmark: response cache",
        "",
        f"`bench/run.sh --cache` on {platform.machine()}, {os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}: "
        f"{args.clients} concurrent oha clients, batch-1 JSON requests to `mlp`, {args.duration} s each, one run. "
        "9 of 10 requests repeat one of 30 hot inputs, 1 of 10 is new; entries live 1 s. The hit rate is the "
        "server's own count (over the warm-up and the run).",
        "",
        "| ferrite | req/s | p50 ms | p99 ms | CPU cores | hit rate | errors |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        out.append(f"| {r['name']} | {r['rps']:.0f} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {r['cpu_cores']:.2f} | "
                   f"{r['hit_rate']:.0%} | {r['errors']} |")
    out += ["", "| ratio to uncached | throughput | p99 |", "|---|---:|---:|"]
    for r in rows[1:]:
        out.append(f"| {r['name']} | {r['rps'] / base['rps']:.2f}x | {r['p99_ms'] / base['p99_ms']:.2f} |")
    path = common.RESULTS / "cache.md"
    path.write_text("\n".join(out) + "\n")
    print("\n".join(out))


if __name__ == "__main__":
    main()
