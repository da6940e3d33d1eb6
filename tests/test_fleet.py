"""A fleet on one machine: three `ferrite` replicas behind HAProxy (Debian's package), health-checked
on /v2/health/ready as a Kubernetes Service's readiness would be, sharing a Redis Cluster (three
masters, three replicas) as the cache's second tier and taking their model configs from etcd.
Rolled one by one with SIGTERM under steady load, no request may fail and none may be answered
with an error; answers computed by one replica are hits on the others, and an etcd revision
reaches every replica."""

import http.client
import json
import os
import shutil
import signal
import subprocess
import threading
import time
import urllib.request

from conftest import Server, free_port, make_repository

HAPROXY = shutil.which("haproxy") or "/usr/sbin/haproxy"

# The balancer's probe: every 500 ms, down after 3 failures, up after 2 successes.
CHECK = "inter 500ms fall 3 rise 2"
BODY = json.dumps({"inputs": [{"name": "input", "shape": [1, 512], "datatype": "FP32", "data": [0.5] * 512}]})
# The steady clients' requests: a few distinct inputs, so answers repeat across replicas.
BODIES = [json.dumps({"inputs": [{"name": "input", "shape": [1, 512], "datatype": "FP32", "data": [i / 8] * 512}]})
          for i in range(8)]


class HAProxy:
    def __init__(self, tmp_path, backends):
        self.port = free_port()
        self.stats_port = free_port()
        servers = "\n".join(f"    server r{i} 127.0.0.1:{p} check {CHECK}" for i, p in enumerate(backends))
        cfg = tmp_path / "haproxy.cfg"
        cfg.write_text(f"""global
    maxconn 256
defaults
    mode http
    timeout connect 1s
    timeout client 30s
    timeout server 30s
    option http-keep-alive
frontend fleet
    bind 127.0.0.1:{self.port}
    default_backend replicas
backend replicas
    balance roundrobin
    option httpchk GET /v2/health/ready
    http-check expect status 200
{servers}
frontend stats
    bind 127.0.0.1:{self.stats_port}
    stats enable
    stats uri /stats
""")
        self.proc = subprocess.Popen([HAPROXY, "-db", "-f", str(cfg)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def up(self):
        """The names of the servers HAProxy sends requests to now."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.stats_port}/stats;csv", timeout=2) as r:
                rows = [line.split(",") for line in r.read().decode().splitlines()[1:]]
        except OSError:  # not listening yet
            return set()
        return {row[1] for row in rows if row[0] == "replicas" and row[1].startswith("r") and row[17] == "UP"}

    def wait_up(self, names, timeout=30):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if names <= self.up():
                return
            time.sleep(0.1)
        raise AssertionError(f"HAProxy did not see {names} up: {self.up()}")

    def stop(self):
        self.proc.terminate()
        self.proc.wait(10)


class Load:
    """Steady clients on kept-alive connections to the balancer, each recording every answer."""

    def __init__(self, port, clients=4):
        self.port, self.stop, self.lock = port, threading.Event(), threading.Lock()
        self.answers, self.errors = 0, []
        self.threads = [threading.Thread(target=self.loop) for _ in range(clients)]
        for t in self.threads:
            t.start()

    def loop(self):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        n = 0
        while not self.stop.is_set():
            n += 1
            try:
                conn.request("POST", "/v2/models/mlp/infer", BODIES[n % len(BODIES)], {"Content-Type": "application/json"})
                r = conn.getresponse()
                body = r.read()
                ok = r.status == 200 and len(json.loads(body)["outputs"][0]["data"]) == 10
                with self.lock:
                    if ok:
                        self.answers += 1
                    else:
                        self.errors.append((r.status, body[:200]))
                if r.getheader("connection", "").lower() == "close":
                    conn.close()
            except Exception as e:  # noqa: BLE001
                with self.lock:
                    self.errors.append(repr(e))
                conn.close()
            time.sleep(0.002)

    def finish(self):
        self.stop.set()
        for t in self.threads:
            t.join(60)


def revision(server):
    text = urllib.request.urlopen(server.metrics_url, timeout=5).read().decode()
    return next(int(float(line.split()[1])) for line in text.splitlines() if line.startswith("ferrite_config_revision "))


def redis_hits(server):
    with urllib.request.urlopen(f"http://{server.url}/v2/models/mlp/stats", timeout=5) as r:
        return json.loads(r.read())["cache"]["redis_hits"]


def test_a_fleet_rolls_under_load_with_no_failed_request(tmp_path):
    from test_etcd import Etcd
    from test_redis_cluster import RedisCluster
    repo = make_repository(tmp_path / "repo", ("mlp",))
    etcd_log = open(tmp_path / "etcd.log", "w")
    etcd = Etcd(tmp_path / "etcd-data", etcd_log)
    (tmp_path / "redis").mkdir()
    cluster = RedisCluster(tmp_path / "redis")
    etcd.put(mlp="[cache]\nenabled = true\n")
    args = ("--config-source", f"etcd://127.0.0.1:{etcd.client}/ferrite", "--cache-redis-url", cluster.url,
            "--cache-redis-timeout-ms", "50")
    # The grace outlasts the balancer's 3 failed probes 500 ms apart.
    env = dict(os.environ, FERRITE_SHUTDOWN_GRACE_SECS="2.5")
    ports = [free_port() for _ in range(3)]
    replicas = [Server(repo, *args, env=env, port=p) for p in ports]
    lb = HAProxy(tmp_path, ports)
    load = None
    try:
        names = {f"r{i}" for i in range(3)}
        lb.wait_up(names)
        load = Load(lb.port)
        time.sleep(1)
        for i, port in enumerate(ports):
            before = load.answers
            old = replicas[i]
            sigterm = time.time()
            old.proc.send_signal(signal.SIGTERM)
            # Readiness goes off at once, while the replica still answers what reaches it.
            assert old.proc.wait(30) == 0, old.logs()
            took = time.time() - sigterm
            assert took >= 2.5, f"r{i} exited {took:.2f} s after SIGTERM, before its grace"
            assert "requests failed at shutdown" not in old.logs()
            replicas[i] = Server(repo, *args, env=env, port=port)
            lb.wait_up(names)
            assert load.answers > before, "the fleet kept answering through the roll"
        time.sleep(0.5)
        # A new revision reaches every replica while they serve.
        first = [revision(r) for r in replicas]
        etcd.put(mlp="max_batch_size = 16\n[cache]\nenabled = true\n")
        deadline = time.time() + 20
        while time.time() < deadline and not all(revision(r) > f for r, f in zip(replicas, first)):
            time.sleep(0.1)
        assert len({revision(r) for r in replicas}) == 1 and revision(replicas[0]) > first[0]
        time.sleep(0.5)
        load.finish()
        assert not load.errors, load.errors[:10]
        assert load.answers > 100
        # Each restarted replica found answers the others had computed in the shared tier.
        assert all(redis_hits(r) > 0 for r in replicas), [redis_hits(r) for r in replicas]
    finally:
        if load:
            load.finish()
        lb.stop()
        for r in replicas:
            r.stop()
        cluster.stop()
        etcd.stop()
        etcd_log.close()


def test_readiness_goes_off_before_requests_are_refused(start_server):
    s = start_server(models=("mlp",), env=dict(os.environ, FERRITE_SHUTDOWN_GRACE_SECS="3"))
    conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=10)
    conn.request("POST", "/v2/models/mlp/infer", BODY)
    first = conn.getresponse()
    first.read()
    assert first.status == 200 and first.getheader("connection") != "close"
    s.proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    ready = http.client.HTTPConnection("127.0.0.1", s.port, timeout=10)
    ready.request("GET", "/v2/health/ready")
    assert ready.getresponse().status == 503
    # TEI's health route says it too, in TEI's words.
    health = http.client.HTTPConnection("127.0.0.1", s.port, timeout=10)
    health.request("GET", "/health")
    tei = health.getresponse()
    assert (tei.status, json.loads(tei.read())) == (503, {"error": "unhealthy", "error_type": "Unhealthy"})
    # During the grace a request is still served, and its kept-alive connection is told to close
    # after it, so the client's next request opens a connection through the balancer.
    conn.request("POST", "/v2/models/mlp/infer", BODY)
    during = conn.getresponse()
    during.read()
    assert during.status == 200
    assert during.getheader("connection") == "close"
    assert s.proc.wait(30) == 0
    logs = s.logs()
    assert logs.index("still serving for the grace") < logs.index("grace over")


def test_calls_in_flight_at_sigterm_finish_over_grpc_and_http(start_server, tmp_path):
    import numpy as np
    import tritonclient.grpc as grpcclient

    from conftest import make_repository as repository
    repo = repository(tmp_path / "slow", ("mlp",))
    # Each request waits a second in the queue: still in flight when the signal comes.
    (repo / "mlp" / "config.toml").write_text("[dynamic_batching]\nmax_queue_delay_microseconds = 1000000\n")
    s = start_server(repository=repo)
    g = grpcclient.InferenceServerClient(s.grpc_url)
    x = grpcclient.InferInput("input", [1, 512], "FP32")
    x.set_data_from_numpy(np.ones((1, 512), np.float32))
    results = {}

    def grpc_call():
        results["grpc"] = g.infer("mlp", [x]).as_numpy("output").shape

    def http_call():
        conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=30)
        conn.request("POST", "/v2/models/mlp/infer", BODY)
        r = conn.getresponse()
        r.read()
        results["http"] = (r.status, r.getheader("connection"))

    threads = [threading.Thread(target=grpc_call), threading.Thread(target=http_call)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    s.proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(30)
    assert results == {"grpc": (1, 10), "http": (200, "close")}, results
    assert s.proc.wait(30) == 0


def test_an_open_stream_at_sigterm_gets_its_answers_then_unavailable(start_server, tmp_path):
    """A client's ModelStreamInfer stream, open and with a request in flight when the server stops:
    the request is answered, then the stream ends with UNAVAILABLE (so the client knows to go
    elsewhere with what it sends next), and the stream does not hold the process up."""
    import numpy as np
    import tritonclient.grpc as grpcclient

    from conftest import make_repository as repository
    repo = repository(tmp_path / "slow", ("mlp",))
    (repo / "mlp" / "config.toml").write_text("[dynamic_batching]\nmax_queue_delay_microseconds = 1000000\n")
    s = start_server("--shutdown-grace-secs", "0.5", repository=repo)
    g = grpcclient.InferenceServerClient(s.grpc_url)
    x = grpcclient.InferInput("input", [1, 512], "FP32")
    x.set_data_from_numpy(np.ones((1, 512), np.float32))
    got = []
    g.start_stream(callback=lambda result, error: got.append((result, error)))
    g.async_stream_infer("mlp", [x], request_id="in-flight")
    time.sleep(0.3)
    started = time.time()
    s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(30) == 0
    took = time.time() - started
    deadline = time.time() + 10
    while len(got) < 2 and time.time() < deadline:
        time.sleep(0.05)
    g.stop_stream()
    (answer, none), (nothing, error) = got[:2]
    assert none is None and answer.get_response().id == "in-flight" and answer.as_numpy("output").shape == (1, 10)
    assert nothing is None and error.status() == "StatusCode.UNAVAILABLE" and "stopping" in error.message(), error
    # The grace, the queued second and the drain: about 1.5 s, far from the 30 s exit timeout.
    assert took < 6, took
