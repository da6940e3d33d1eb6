"""Model configs from a real etcd (Debian's etcd-server, started here on free ports with a
temporary data dir): a change of several keys in one transaction applies whole, and serving never
stops while etcd is stopped and restarted."""

import base64
import json
import shutil
import signal
import subprocess
import threading
import time
import urllib.request

import pytest

from conftest import free_port
from test_lifecycle import SCALE, call, infer, wait_for

ETCD = shutil.which("etcd")


class Etcd:
    def __init__(self, data_dir, log):
        self.client, self.peer = free_port(), free_port()
        self.data_dir, self.log = data_dir, log
        self.start()

    def start(self):
        c, p = f"http://127.0.0.1:{self.client}", f"http://127.0.0.1:{self.peer}"
        self.proc = subprocess.Popen(
            [ETCD, "--name", "ferrite-test", "--data-dir", str(self.data_dir),
             "--listen-client-urls", c, "--advertise-client-urls", c,
             "--listen-peer-urls", p, "--initial-advertise-peer-urls", p,
             "--initial-cluster", f"ferrite-test={p}"],
            stdout=self.log, stderr=subprocess.STDOUT)
        wait_for(self.healthy, timeout=30, what="etcd")

    def healthy(self):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.client}/health", timeout=1) as r:
                return json.loads(r.read()).get("health") == "true"
        except OSError:
            return False

    def put(self, **configs):
        """Puts every `model=config` in one transaction (etcd's JSON gateway)."""
        b64 = lambda s: base64.b64encode(s.encode()).decode()  # noqa: E731
        ops = [{"request_put": {"key": b64(f"/ferrite/models/{m}"), "value": b64(v)}} for m, v in configs.items()]
        req = urllib.request.Request(f"http://127.0.0.1:{self.client}/v3/kv/txn",
                                     data=json.dumps({"success": ops}).encode(), method="POST")
        with urllib.request.urlopen(req, timeout=10) as r:
            assert json.loads(r.read())["succeeded"]

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(30)


@pytest.fixture
def etcd(tmp_path):
    log = open(tmp_path / "etcd.log", "w")
    e = Etcd(tmp_path / "etcd-data", log)
    yield e
    if e.proc.poll() is None:
        e.stop()
    log.close()


def batch(url, model):
    return call(url, "GET", f"/v2/models/{model}/config")[1]["max_batch_size"]


def test_a_transaction_of_several_keys_applies_whole(start_server, tmp_path, etcd):
    repo = tmp_path / "repo"
    for m in ("a", "b"):
        (repo / m / "1").mkdir(parents=True)
        shutil.copy(SCALE / "1" / "model.onnx", repo / m / "1" / "model.onnx")
    etcd.put(a="max_batch_size = 4", b="max_batch_size = 4")
    s = start_server("--config-source", f"etcd://127.0.0.1:{etcd.client}/ferrite", repository=repo)
    assert batch(s.url, "a") == 4 and batch(s.url, "b") == 4

    # Readers check, in both orders, that no one sees one key of the change without the other.
    torn, stop = [], threading.Event()

    def reader():
        flip = False
        while not stop.is_set():
            first, second = ("a", "b") if flip else ("b", "a")
            x = batch(s.url, first)
            y = batch(s.url, second)
            if x == 8 and y != 8:
                torn.append((first, x, second, y))
            flip = not flip

    readers = [threading.Thread(target=reader) for _ in range(2)]
    for r in readers:
        r.start()
    time.sleep(0.3)
    etcd.put(a="max_batch_size = 8", b="max_batch_size = 8")
    wait_for(lambda: batch(s.url, "a") == 8 and batch(s.url, "b") == 8, what="the change")
    time.sleep(0.3)
    stop.set()
    for r in readers:
        r.join()
    assert not torn, torn[:3]
    # A change in which one model's config is bad is refused whole: the good key of the same
    # transaction is not applied either, the index names the model and why, and both serve on.
    etcd.put(a="max_batch_size = 2", b="max_batch_size = \"lots\"")
    wait_for(lambda: "refused whole" in json.dumps(call(s.url, "POST", "/v2/repository/index", b"{}")[1]),
             what="the refusal in the index")
    reasons = json.dumps(call(s.url, "POST", "/v2/repository/index", b"{}")[1])
    assert "model 'b'" in reasons and "config.toml" in reasons, reasons
    assert batch(s.url, "a") == 8 and batch(s.url, "b") == 8
    assert infer(s.url, model="a")[0] == 200 and infer(s.url, model="b")[0] == 200
    # The next good revision applies.
    etcd.put(a="max_batch_size = 2", b="max_batch_size = 2")
    wait_for(lambda: batch(s.url, "a") == 2 and batch(s.url, "b") == 2, what="the next change")


def test_serving_goes_on_while_etcd_is_down(start_server, tmp_path, etcd):
    repo = tmp_path / "repo"
    (repo / "a" / "1").mkdir(parents=True)
    shutil.copy(SCALE / "1" / "model.onnx", repo / "a" / "1" / "model.onnx")
    etcd.put(a="max_batch_size = 4")
    s = start_server("--config-source", f"etcd://127.0.0.1:{etcd.client}/ferrite", repository=repo)
    etcd.stop()
    deadline = time.time() + 3
    while time.time() < deadline:
        assert infer(s.url, model="a")[0] == 200
    assert batch(s.url, "a") == 4, "the last good config keeps serving"
    wait_for(lambda: "config source unreachable" in s.logs(), what="the warning")
    etcd.start()
    etcd.put(a="max_batch_size = 16")
    wait_for(lambda: batch(s.url, "a") == 16, timeout=30, what="the change after etcd came back")
    assert infer(s.url, model="a")[0] == 200


def test_etcd_unreachable_at_start_is_a_clear_error(tmp_path):
    from conftest import BIN
    port = free_port()
    out = subprocess.run([BIN, "serve", "--model-repository", str(tmp_path), "--http-port", "0", "--grpc-port", "0",
                          "--no-metrics", "--config-source", f"etcd://127.0.0.1:{port}/ferrite"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "--config-source" in out.stderr, out.stderr


def gauge(server, name):
    text = urllib.request.urlopen(server.metrics_url, timeout=5).read().decode()
    return next(int(float(line.split()[1])) for line in text.splitlines() if line.startswith(name + " "))


def test_a_revision_reaches_every_replica_and_one_that_cannot_apply_it_says_so(start_server, tmp_path, etcd):
    # Three replicas follow one etcd; the third holds a model 'a' of fixed shape, which cannot
    # take the batched config the other two apply.
    repos = []
    for i, model in enumerate((SCALE, SCALE, SCALE.parent / "fixed")):
        repo = tmp_path / f"repo{i}"
        (repo / "a" / "1").mkdir(parents=True)
        shutil.copy(model / "1" / "model.onnx", repo / "a" / "1" / "model.onnx")
        repos.append(repo)
    etcd.put(a="max_batch_size = 0")
    source = ("--config-source", f"etcd://127.0.0.1:{etcd.client}/ferrite")
    replicas = [start_server(*source, repository=r) for r in repos]
    first = [gauge(s, "ferrite_config_revision") for s in replicas]
    assert all(r > 0 for r in first) and all(gauge(s, "ferrite_config_refused_revision") == 0 for s in replicas)
    etcd.put(a="max_batch_size = 4")
    wait_for(lambda: all(gauge(s, "ferrite_config_revision") > first[i] for i, s in enumerate(replicas[:2])),
             what="the revision on the replicas that can apply it")
    revision = gauge(replicas[0], "ferrite_config_revision")
    assert gauge(replicas[1], "ferrite_config_revision") == revision
    assert batch(replicas[0].url, "a") == 4 and batch(replicas[1].url, "a") == 4
    wait_for(lambda: gauge(replicas[2], "ferrite_config_refused_revision") == revision, what="the refusal")
    assert gauge(replicas[2], "ferrite_config_revision") < revision
    assert "config change refused" in replicas[2].logs()
    # It serves on with the configs it had.
    assert batch(replicas[2].url, "a") == 0
