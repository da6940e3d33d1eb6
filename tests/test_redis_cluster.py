"""The shared cache tier on a real Redis Cluster (three masters, three replicas, started here with
`redis-server --cluster-enabled yes` and `redis-cli --cluster create`): answers computed by one
replica are hits on another whatever node their slot lives on, a master killed under load fails
over with no failed request, and a URL naming one cluster node as a plain server is said, not
silently degraded."""

import socket
import subprocess
import threading
import time

import numpy as np
import pytest

from conftest import GIVEN_PORTS, free_port
from test_cache import cached_repo, mlp_infer, stats, wait_for


def cluster_port():
    """A free port whose cluster bus port (+10000) is free too, and not another node's."""
    while True:
        p = free_port()
        if p + 10000 < 65536 and p + 10000 not in GIVEN_PORTS:
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", p + 10000))
                    GIVEN_PORTS.add(p + 10000)
                    return p
                except OSError:
                    pass


def kill(procs):
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def cli(port, *args, timeout=10):
    return subprocess.run(["redis-cli", "-p", str(port), *args], capture_output=True, text=True, timeout=timeout).stdout


class RedisCluster:
    def __init__(self, tmp_path, masters=3):
        self.ports = [cluster_port() for _ in range(masters * 2)]
        self.procs = {}
        for p in self.ports:
            d = tmp_path / f"node{p}"
            d.mkdir()
            self.procs[p] = subprocess.Popen(
                ["redis-server", "--port", str(p), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
                 "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "1000", "--save", "",
                 "--appendonly", "no", "--repl-diskless-sync-delay", "0", "--dir", str(d)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for p in self.ports:
            wait_for(lambda: cli(p, "ping").strip() == "PONG", what=f"redis node {p}")
        out = subprocess.run(["redis-cli", "--cluster", "create", *[f"127.0.0.1:{p}" for p in self.ports],
                              "--cluster-replicas", "1", "--cluster-yes"], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stdout + out.stderr
        self.wait_ok()
        # A replica can take over only once it has synced with its master.
        replicas = [p for p in self.ports if "role:slave" in cli(p, "info", "replication")]
        assert len(replicas) == masters
        wait_for(lambda: all("master_link_status:up" in cli(p, "info", "replication") for p in replicas),
                 timeout=30, what="every replica to sync")

    def alive(self):
        return [p for p, proc in self.procs.items() if proc.poll() is None]

    def wait_ok(self, timeout=30):
        wait_for(lambda: all("cluster_state:ok" in cli(p, "cluster", "info") for p in self.alive()),
                 timeout=timeout, what="every node to see the cluster ok")

    def masters(self):
        """Ports of the live masters."""
        nodes = cli(self.alive()[0], "cluster", "nodes").splitlines()
        return [int(n.split()[1].split(":")[1].split("@")[0]) for n in nodes
                if "master" in n.split()[2] and "fail" not in n.split()[2]]

    def keys(self):
        return sum(int(cli(p, "dbsize").strip() or 0) for p in self.masters())

    @property
    def url(self):
        # One seed node is enough: the client learns the others from it.
        return f"redis+cluster://127.0.0.1:{self.ports[0]}"

    def stop(self):
        kill(self.procs.values())


@pytest.fixture
def cluster(tmp_path):
    c = RedisCluster(tmp_path)
    yield c
    c.stop()


def rows(seed, n):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((1, 512)).astype(np.float32) for _ in range(n)]


def test_answers_are_shared_across_replicas_through_every_node(start_server, tmp_path, cluster):
    a = start_server("--cache-redis-url", cluster.url, "--cache-redis-timeout-ms", "50", repository=cached_repo(tmp_path, "a"))
    b = start_server("--cache-redis-url", cluster.url, "--cache-redis-timeout-ms", "50", repository=cached_repo(tmp_path, "b"))
    wait_for(lambda: stats(a)[1]["redis"] == "ok" and stats(b)[1]["redis"] == "ok", what="redis connected")
    xs = rows(1, 30)
    answers = [mlp_infer(a, x).as_numpy("output") for x in xs]
    wait_for(lambda: cluster.keys() == 30, what="the writes to reach the cluster")
    per_master = [int(cli(p, "dbsize").strip()) for p in cluster.masters()]
    assert len(per_master) == 3 and all(n > 0 for n in per_master), per_master
    for x, want in zip(xs, answers):
        assert mlp_infer(b, x).as_numpy("output").tobytes() == want.tobytes()
    m, cache = stats(b)
    assert m["execution_count"] == 0 and cache["redis_hits"] == 30, cache
    assert cache["redis_errors"] == 0 and cache["redis_moved"] == 0


def test_a_cluster_node_given_as_one_server_is_said(start_server, tmp_path, cluster):
    s = start_server("--cache-redis-url", f"redis://127.0.0.1:{cluster.ports[0]}/", "--cache-redis-timeout-ms", "50",
                     repository=cached_repo(tmp_path))
    wait_for(lambda: stats(s)[1]["redis"] == "ok", what="redis connected")
    for x in rows(2, 12):
        assert mlp_infer(s, x).as_numpy("output").shape == (1, 10)
    # Two thirds of the slots live on other nodes: their lookups (and writes) answer MOVED.
    wait_for(lambda: stats(s)[1]["redis_moved"] > 0, what="MOVED replies to be counted")
    assert "answers MOVED" in s.logs() and "redis+cluster://" in s.logs()
    import urllib.request
    metrics = urllib.request.urlopen(s.metrics_url, timeout=5).read().decode()
    assert any(line.startswith("ferrite_cache_redis_moved_total ") and float(line.split()[1]) > 0
               for line in metrics.splitlines())


def test_a_master_killed_under_load_fails_over_with_no_failed_request(start_server, tmp_path, cluster):
    a = start_server("--cache-redis-url", cluster.url, "--cache-redis-timeout-ms", "50", repository=cached_repo(tmp_path, "a"))
    b = start_server("--cache-redis-url", cluster.url, "--cache-redis-timeout-ms", "50", repository=cached_repo(tmp_path, "b"))
    wait_for(lambda: stats(a)[1]["redis"] == "ok" and stats(b)[1]["redis"] == "ok", what="redis connected")
    stop, failures, answered = threading.Event(), [], [0]

    def load(seed):
        rng = np.random.default_rng(seed)
        while not stop.is_set():
            x = rng.standard_normal((1, 512)).astype(np.float32)
            try:
                assert mlp_infer(a if rng.random() < 0.5 else b, x).as_numpy("output").shape == (1, 10)
                answered[0] += 1
            except Exception as e:  # noqa: BLE001
                failures.append(repr(e))

    threads = [threading.Thread(target=load, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    try:
        time.sleep(1)
        victim = cluster.masters()[0]
        cluster.procs[victim].kill()
        # Its replica takes its slots once the others agree it failed (node timeout 1 s).
        wait_for(lambda: len(cluster.masters()) == 3 and victim not in cluster.masters(), timeout=30,
                 what="a replica to be promoted")
        cluster.wait_ok()
        time.sleep(1)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert not failures, failures[:5]
    assert answered[0] > 50
    # After the failover every slot works again: answers computed by a are hits on b. Each try
    # uses rows neither replica has seen (a row b missed once is in b's own tier from then on),
    # and asks b only once a's writes (queued, off the request path) are in the cluster.
    tries = iter(range(100, 1000))

    def all_hit():
        xs = rows(next(tries), 10)
        keys = cluster.keys()
        for x in xs:
            mlp_infer(a, x)
        deadline = time.time() + 2
        while cluster.keys() < keys + 10 and time.time() < deadline:
            time.sleep(0.05)
        before = stats(b)[1]["redis_hits"]
        for x in xs:
            mlp_infer(b, x)
        return stats(b)[1]["redis_hits"] - before == 10

    try:
        wait_for(all_hit, timeout=20, what="every answer of a to be a hit on b after the failover")
    except AssertionError as e:
        raise AssertionError(f"{e}; a: {stats(a)[1]}; b: {stats(b)[1]}") from None


class Sentinel:
    """A master, its replica and one sentinel (quorum 1) watching them as `cache`."""

    def __init__(self, tmp_path):
        self.master, self.replica, self.port = free_port(), free_port(), free_port()
        common = ["--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--repl-diskless-sync-delay", "0"]
        self.procs = {}
        for p, extra in ((self.master, []), (self.replica, ["--replicaof", "127.0.0.1", str(self.master)])):
            d = tmp_path / f"redis{p}"
            d.mkdir()
            self.procs[p] = subprocess.Popen(["redis-server", "--port", str(p), "--dir", str(d), *common, *extra],
                                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for(lambda: "master_link_status:up" in cli(self.replica, "info", "replication"), what="the replica to sync")
        conf = tmp_path / "sentinel.conf"
        conf.write_text(f"port {self.port}\nbind 127.0.0.1\nsentinel monitor cache 127.0.0.1 {self.master} 1\n"
                        "sentinel down-after-milliseconds cache 1000\nsentinel failover-timeout cache 5000\n")
        self.procs[self.port] = subprocess.Popen(["redis-server", str(conf), "--sentinel"],
                                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for(lambda: "num-slaves" in cli(self.port, "sentinel", "master", "cache") and
                 cli(self.port, "sentinel", "replicas", "cache").count("ip") >= 1, what="the sentinel to see both")

    def current(self):
        out = cli(self.port, "sentinel", "get-master-addr-by-name", "cache").split()
        return int(out[1]) if len(out) == 2 else None

    @property
    def url(self):
        return f"redis+sentinel://127.0.0.1:{self.port}/cache"

    def stop(self):
        kill(self.procs.values())


def test_a_sentinel_master_that_fails_over_is_found_again(start_server, tmp_path):
    sentinel = Sentinel(tmp_path)
    try:
        a = start_server("--cache-redis-url", sentinel.url, "--cache-redis-timeout-ms", "50", repository=cached_repo(tmp_path, "a"))
        b = start_server("--cache-redis-url", sentinel.url, "--cache-redis-timeout-ms", "50", repository=cached_repo(tmp_path, "b"))
        wait_for(lambda: stats(a)[1]["redis"] == "ok" and stats(b)[1]["redis"] == "ok", what="redis connected")
        attempts = iter(range(100, 1000))

        def one_hit():
            # A new row each time: when a's write has not reached the master before b asks (a
            # busy machine, a 50 ms timeout), b computes it and its own tier answers it after.
            x = rows(next(attempts), 1)[0]
            before = stats(b)[1]["redis_hits"]
            mlp_infer(a, x)
            time.sleep(0.2)
            mlp_infer(b, x)
            return stats(b)[1]["redis_hits"] - before == 1

        wait_for(one_hit, what="a hit through the master")
        sentinel.procs[sentinel.master].kill()
        wait_for(lambda: sentinel.current() == sentinel.replica, timeout=30, what="the sentinel to promote the replica")
        # Requests are answered throughout; once the servers have found the new master, answers
        # computed by a are hits on b again.

        def all_hit():
            xs = rows(next(attempts), 10)  # new each time: b's own tier would answer the old ones
            before = stats(b)[1]["redis_hits"]
            for x in xs:
                mlp_infer(a, x)
            time.sleep(0.2)
            for x in xs:
                mlp_infer(b, x)
            return stats(b)[1]["redis_hits"] - before == len(xs)

        wait_for(all_hit, timeout=30, what="hits through the new master")
        assert "asking the sentinels again" in a.logs()
    finally:
        sentinel.stop()
