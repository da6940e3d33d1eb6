"""Proof under load, through the real binary: overload at 4x the sustainable rate, and SIGTERM in
the middle of load. The `slow` test model costs several milliseconds a row, so a Python client can
outrun it."""

import http.client
import json
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import make_repository
from test_metrics import scrape, value

SLOW = """max_batch_size = 1
instance_count = 1
threads = 1
[dynamic_batching]
max_queue_size = 16
"""
BODY = json.dumps({"inputs": [{"name": "x", "shape": [1, 512], "datatype": "FP32", "data": [0.25] * 512}]})
HEADERS = {"Content-Type": "application/json"}


def slow_repository(tmp_path):
    repo = make_repository(tmp_path / "repo", ("slow",))
    (repo / "slow" / "config.toml").write_text(SLOW)
    return repo


class Client:
    """One keep-alive connection per thread."""

    def __init__(self, url):
        self.url = url
        self.local = threading.local()

    def post(self, path="/v2/models/slow/infer", fresh=False):
        if fresh or not hasattr(self.local, "conn"):
            self.local.conn = http.client.HTTPConnection(self.url, timeout=30)
        conn = self.local.conn
        try:
            conn.request("POST", path, BODY, HEADERS if not fresh else {**HEADERS, "Connection": "close"})
            resp = conn.getresponse()
            resp.read()
            return resp.status, resp.getheader("Retry-After")
        except Exception:
            del self.local.conn
            raise


def sustainable_rate(client, seconds=2.0, threads=4):
    done = []
    stop = time.time() + seconds

    def loop():
        while time.time() < stop:
            assert client.post()[0] == 200
            done.append(1)

    with ThreadPoolExecutor(threads) as pool:
        for f in [pool.submit(loop) for _ in range(threads)]:
            f.result()
    return len(done) / seconds


def test_overload_at_4x_is_refused_cleanly_and_recovers(start_server, tmp_path):
    s = start_server("--max-concurrent-requests", "24", repository=slow_repository(tmp_path))
    client = Client(s.url)
    rate = sustainable_rate(client)
    assert rate > 20, f"the slow model served only {rate:.0f} req/s"
    before = scrape(s.metrics_url)

    # Open loop: requests are sent on schedule at 4x the rate, whether or not earlier ones returned.
    target, seconds = 4 * rate, 8.0
    results, lock = [], threading.Lock()

    def one():
        t = time.time()
        try:
            status, retry_after = client.post()
        except Exception as e:  # noqa: BLE001 - any transport failure is a lost request
            status, retry_after = repr(e), None
        with lock:
            results.append((status, retry_after, time.time() - t))

    start = time.time()
    with ThreadPoolExecutor(64) as pool:
        n = 0
        while (now := time.time()) < start + seconds:
            due = start + n / target
            if due > now:
                time.sleep(due - now)
            pool.submit(one)
            n += 1
    statuses = [r[0] for r in results]
    assert len(results) == n, "every request was answered"
    unexpected = [x for x in statuses if x not in (200, 429, 503)]
    assert not unexpected, unexpected[:5]
    ok, throttled, rejected = statuses.count(200), statuses.count(429), statuses.count(503)
    assert throttled + rejected > 0, "4x the sustainable rate must be refused in part"
    assert ok > 0.5 * rate * seconds, f"only {ok} served at {target:.0f} req/s offered"
    assert all(r[1] for r in results if r[0] in (429, 503)), "every refusal carries Retry-After"
    assert max(r[2] for r in results) < 5.0, "every answer within a bounded time"

    # Every refusal is counted with its reason, and every accepted request succeeded.
    after = scrape(s.metrics_url)
    labels = {"model": "slow", "version": "1"}

    def delta(**kv):
        return value(after, "ferrite_requests_total", **labels, **kv) - value(before, "ferrite_requests_total",
                                                                              **labels, **kv)
    assert delta(outcome="success", reason="") == ok
    assert delta(outcome="failure", reason="throttled") == throttled
    assert delta(outcome="failure", reason="rejected") == rejected

    # It recovers at once.
    t = time.time()
    assert client.post()[0] == 200
    assert time.time() - t < 1.0
    print(f"\noverload: sustainable {rate:.0f} req/s, offered {target:.0f} for {seconds:.0f} s: "
          f"{ok} ok, {throttled} x 429, {rejected} x 503")


def test_sigterm_under_load_completes_accepted_work_and_refuses_new(start_server, tmp_path):
    s = start_server("--exit-timeout-secs", "20", repository=slow_repository(tmp_path))
    client = Client(s.url)
    results, lock = [], threading.Lock()
    stop = threading.Event()

    def loop():
        while not stop.is_set():
            sent = time.time()
            try:
                status = client.post(fresh=True)[0]
            except ConnectionRefusedError:
                status = "refused"
            except (ConnectionResetError, http.client.RemoteDisconnected):
                # Connections still in the kernel's backlog when the listener closes are reset.
                status = "reset"
            except Exception as e:  # noqa: BLE001
                status = repr(e)
            with lock:
                results.append((sent, status))
            if status in ("refused", "reset"):
                return

    threads = [threading.Thread(target=loop) for _ in range(12)]
    for t in threads:
        t.start()
    time.sleep(1.5)
    sigterm = time.time()
    s.proc.send_signal(signal.SIGTERM)
    code = s.proc.wait(20)
    exited = time.time()
    stop.set()
    for t in threads:
        t.join(30)
    assert code == 0
    assert exited - sigterm < 10, "exit well before the deadline"
    unexpected = [r for r in results if r[1] not in (200, 503, "refused", "reset")]
    assert not unexpected, unexpected[:5]
    # Requests sent clearly before the signal were accepted, and all completed.
    early = [r for r in results if r[0] < sigterm - 0.05]
    assert early and all(r[1] == 200 for r in early), [r for r in early if r[1] != 200][:5]
    # While draining, new requests got a clear 503; after the listener closed, a refused connection.
    assert any(r[1] == 503 for r in results if r[0] > sigterm)
    assert "requests failed at shutdown" not in s.logs()
