"""Fleet benchmark: one, two and three `ferrite` replicas behind HAProxy, sharing a Redis Cluster
(three masters) as the cache's second tier, under a Zipf-distributed workload on `mlp`. Writes
bench/results/fleet.md.

What it reports per fleet size: throughput and latency through the balancer (oha, 128 clients),
the hit ratio over every replica, how many hits came from Redis (answers computed on another
replica, or evicted locally), the misses answered by an identical request already computing
(coalescing) and the rows actually computed per request. On this machine's two cores the
throughput is expected flat: the replicas share the cores; the point is what the shared tier and
coalescing save.

Entries live 2 s, so hot keys expire while in demand and many clients miss them at once: the
thundering herd that coalescing absorbs.

Run: bench/run.sh --fleet [--duration 20]
"""

import argparse
import json
import os
import platform
import random
import shutil
import subprocess
import time
import urllib.request

import run as common  # bench/run.py

ROOT = common.ROOT
WORK = common.WORK
HAPROXY = shutil.which("haproxy") or "/usr/sbin/haproxy"


def zipf_bodies(path, distinct=2000, lines=60000, s=1.1):
    """`lines` request bodies drawn from `distinct` inputs with Zipf(s) popularity."""
    rng = random.Random(0)
    weights = [1 / (k + 1) ** s for k in range(distinct)]

    def body(seed):
        r = random.Random(seed)
        data = [round(r.uniform(-1, 1), 2) for _ in range(512)]
        return json.dumps({"inputs": [{"name": "input", "shape": [1, 512], "datatype": "FP32", "data": data}]},
                          separators=(",", ":"))

    cache = {}
    with open(path, "w") as f:
        for k in rng.choices(range(distinct), weights, k=lines):
            if k not in cache:
                cache[k] = body(k)
            f.write(cache[k] + "\n")


def redis_cluster(work):
    """Three masters on free ports (with free bus ports), joined; returns (ports, processes)."""
    ports, procs = [], []
    while len(ports) < 3:
        p = common.free_port()
        if p + 10000 < 65536:
            ports.append(p)
    for p in ports:
        d = work / f"redis-{p}"
        d.mkdir(parents=True, exist_ok=True)
        procs.append(subprocess.Popen(
            ["redis-server", "--port", str(p), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
             "--cluster-config-file", "nodes.conf", "--save", "", "--appendonly", "no", "--dir", str(d)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    time.sleep(0.5)
    subprocess.run(["redis-cli", "--cluster", "create", *[f"127.0.0.1:{p}" for p in ports], "--cluster-yes"],
                   check=True, capture_output=True, timeout=60)
    deadline = time.time() + 30
    while time.time() < deadline:
        info = subprocess.run(["redis-cli", "-p", str(ports[0]), "cluster", "info"], capture_output=True, text=True).stdout
        if "cluster_state:ok" in info:
            return ports, procs
        time.sleep(0.2)
    raise RuntimeError("the Redis Cluster did not come up")


def haproxy(work, backends):
    port = common.free_port()
    servers = "\n".join(f"    server r{i} 127.0.0.1:{p} check inter 500ms fall 3 rise 2" for i, p in enumerate(backends))
    cfg = work / "haproxy.cfg"
    cfg.write_text(f"""global
    maxconn 4096
defaults
    mode http
    timeout connect 1s
    timeout client 30s
    timeout server 30s
    option http-keep-alive
frontend fleet
    bind 127.0.0.1:{port}
    default_backend replicas
backend replicas
    balance roundrobin
    option httpchk GET /v2/health/ready
    http-check expect status 200
{servers}
""")
    return port, subprocess.Popen([HAPROXY, "-db", "-f", str(cfg)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def scrape(port, metric):
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/dashboard/metrics", timeout=5).read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(metric + "{"))


def reading(ports):
    """Counters summed over the replicas."""
    total = {"hits": 0, "misses": 0, "redis_hits": 0, "rows": 0, "coalesced": 0, "fleet_answered": 0, "fleet_missed": 0}
    for p in ports:
        with urllib.request.urlopen(f"http://127.0.0.1:{p}/v2/models/mlp/stats", timeout=5) as r:
            body = json.loads(r.read())
        s = body["model_stats"][0]
        total["hits"] += s["inference_stats"]["cache_hit"]["count"]
        total["misses"] += s["inference_stats"]["cache_miss"]["count"]
        total["rows"] += s["inference_count"]
        total["redis_hits"] += body["cache"]["redis_hits"]
        total["fleet_answered"] += body["cache"]["fleet_answered"]
        total["fleet_missed"] += body["cache"]["fleet_missed"]
        total["coalesced"] += scrape(p, "ferrite_cache_coalesced_total")
    return total


def fleet(n, args, repo, redis_url, lines):
    ports, procs = [], []
    for i in range(n):
        port, grpc = common.free_port(), common.free_port()
        log = open(WORK / f"fleet-{n}-{i}.log", "w")
        procs.append(subprocess.Popen(
            [str(ROOT / "target/release/ferrite"), "serve", "--model-repository", str(repo), "--http-port", str(port),
             "--grpc-port", str(grpc), "--metrics-port", "0", "--log", "warn", "--cache-ttl", "2",
             "--cache-redis-url", redis_url, "--cache-redis-timeout-ms", "20", "--shutdown-grace-secs", "0"],
            stdout=log, stderr=subprocess.STDOUT))
        ports.append(port)
    lb_port, lb = haproxy(WORK, ports)
    try:
        for port, proc in zip(ports, procs):
            common.wait_ready(f"http://127.0.0.1:{port}/v2/health/ready", proc)
        time.sleep(1.5)  # HAProxy's two good checks
        load = common.oha_load(f"http://127.0.0.1:{lb_port}/v2/models/mlp/infer", lines, args.clients,
                               ["Content-Type: application/json"], lines=True)
        load(2)
        before = reading(ports)
        cpu0, t0 = sum(common.cpu_seconds(p.pid) for p in procs), time.time()
        rps, p50, p99, errors = load(args.duration)
        cpu = (sum(common.cpu_seconds(p.pid) for p in procs) - cpu0) / (time.time() - t0)
        after = reading(ports)
    finally:
        lb.terminate()
        for p in procs:
            p.terminate()
        for p in procs + [lb]:
            p.wait(30)
    d = {k: after[k] - before[k] for k in after}
    lookups = d["hits"] + d["misses"]
    row = {"replicas": n, "rps": rps, "p50_ms": p50, "p99_ms": p99, "errors": errors, "cpu_cores": cpu,
           "hit_ratio": d["hits"] / lookups if lookups else 0.0,
           "redis_share": d["redis_hits"] / d["hits"] if d["hits"] else 0.0,
           "coalesced": d["coalesced"], "misses": d["misses"],
           "fleet_answered": d["fleet_answered"], "fleet_missed": d["fleet_missed"],
           "rows_per_request": d["rows"] / lookups if lookups else 0.0}
    print(json.dumps(row), flush=True)
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--duration", type=int, default=20)
    ap.add_argument("--clients", type=int, default=128)
    args = ap.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    lines = WORK / "fleet_bodies.txt"
    if not lines.exists():
        zipf_bodies(lines)
    repo = common.mlp_repo(WORK / "repo-fleet", "[cache]\nenabled = true\n")
    shutil.rmtree(WORK / "fleet-redis", ignore_errors=True)
    redis_ports, redis = redis_cluster(WORK / "fleet-redis")
    rows = []
    try:
        for n in (1, 2, 3):
            subprocess.run(["redis-cli", "-c", "-p", str(redis_ports[0]), "flushall"], capture_output=True)
            for p in redis_ports:
                subprocess.run(["redis-cli", "-p", str(p), "flushall"], capture_output=True)
            rows.append(fleet(n, args, repo, f"redis+cluster://127.0.0.1:{redis_ports[0]}", lines))
    finally:
        for p in redis:
            p.kill()
    out = [
        "# Benchmark: a fleet behind HAProxy sharing a Redis Cluster",
        "",
        f"`bench/run.sh --fleet` on {platform.machine()}, {os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}: "
        f"{args.clients} oha clients through HAProxy (round robin, health checks on /v2/health/ready) to 1-3 "
        f"replicas, {args.duration} s each after a 2 s warm-up, one run. Batch-1 JSON requests to `mlp`, "
        "drawn from 2,000 inputs with Zipf(1.1) popularity; the response cache on, entries living 2 s, a Redis "
        "Cluster of three masters as the shared tier. Counters are summed over the replicas for the measured "
        "interval. The replicas share this machine's cores with HAProxy, oha and Redis: throughput is not "
        "expected to grow with them here.",
        "",
        "| replicas | req/s | p50 ms | p99 ms | errors | server CPU cores | hit ratio | hits from Redis | misses | coalesced | hot misses answered by another replica / not in time | rows computed per request |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        out.append(f"| {r['replicas']} | {r['rps']:.0f} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {r['errors']} | "
                   f"{r['cpu_cores']:.2f} | {r['hit_ratio']:.1%} | {r['redis_share']:.1%} | {r['misses']:.0f} | "
                   f"{r['coalesced']:.0f} ({r['coalesced'] / r['misses'] if r['misses'] else 0:.1%} of misses) | "
                   f"{r['fleet_answered']:.0f} / {r['fleet_missed']:.0f} | "
                   f"{r['rows_per_request']:.3f} |")
    out += ["", "Hits from Redis: the share of hits answered by the shared tier (computed by another replica, "
            "or by this one before its own entry went); coalesced: misses answered by an identical request "
            "already computing on the same replica, so never computed again; hot misses answered by another "
            "replica: a hot key's miss whose key another replica had taken in Redis, answered from its result "
            "(not in time: waited, then computed here too)."]
    path = common.RESULTS / "fleet.md"
    path.write_text("\n".join(out) + "\n")
    print("\n".join(out))


if __name__ == "__main__":
    main()
