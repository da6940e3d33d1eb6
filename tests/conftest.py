"""Starts the real `ferrite` binary for end-to-end tests."""

import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BIN = os.environ.get("FERRITE_BIN", str(ROOT / "target" / "debug" / "ferrite"))
# The servers of the end-to-end tests run with the plan a model's config gives, not one measured
# at load, so what they assert of batching does not depend on timing; test_calibration.py turns
# the calibration on.
os.environ.setdefault("FERRITE_CALIBRATE", "false")
# No balancer is probing the test servers, so SIGTERM need not wait for one to notice (the fleet
# tests, behind HAProxy, give the grace back).
os.environ.setdefault("FERRITE_SHUTDOWN_GRACE_SECS", "0")


# Ports free_port has handed out in this run (and ones reserved beside them).
GIVEN_PORTS = set()


def free_port():
    """A free port this run has not handed out before: the kernel may give the same free port to
    two binds in a row, and two servers (or Redis nodes) of one test would then collide."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in GIVEN_PORTS:
            GIVEN_PORTS.add(port)
            return port


def http_call(url, call):
    """`call(client)` on a tritonclient HTTP client made for it and let go of on the caller's
    thread. The client closes itself again when collected, and its gevent pool refuses that on
    another thread than its own: a warning in the test log, under whichever test runs then. An
    error is raised without its traceback, whose frames hold the client: handed to another thread
    (a pool's future), it was collected there."""
    import tritonclient.http as httpclient
    client = httpclient.InferenceServerClient(url)
    try:
        return call(client)
    except Exception as e:  # noqa: BLE001 - raised again below, without the client
        error = e.with_traceback(None)
        error.__context__ = None
    finally:
        client.close()
    del client
    raise error


def make_repository(dest: Path, models=("mlp", "mixed", "identity", "fixed")):
    """A repository with copies of bundled (models/) and test (tests/models/) models."""
    for name in models:
        src = ROOT / "models" / name
        if not src.exists():
            src = ROOT / "tests" / "models" / name
        shutil.copytree(src, dest / name)
    return dest


class Server:
    def __init__(self, repository: Path, *args, env=None, ssl_context=None, port=None):
        # A port found free can be taken (by any connection's local port) before the server binds
        # it: a start that fails on exactly that is retried on fresh ports.
        for attempt in range(3):
            try:
                self._start(repository, args, env, ssl_context, port)
                return
            except RuntimeError as e:
                if "Address already in use" not in str(e) or attempt == 2:
                    raise

    def _start(self, repository, args, env, ssl_context, port=None):
        self.port = port or free_port()
        self.url = f"127.0.0.1:{self.port}"
        self.grpc_port = free_port()
        self.grpc_url = f"127.0.0.1:{self.grpc_port}"
        self.metrics_port = free_port()
        self.metrics_url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        self.log_path = repository.parent / f"ferrite-{self.port}.log"
        self.log = open(self.log_path, "w")
        cmd = [BIN, "serve", "--model-repository", str(repository), "--http-port", str(self.port),
               "--grpc-port", str(self.grpc_port), "--metrics-port", str(self.metrics_port), *args]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.time() + 60
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ferrite exited with {self.proc.returncode}: {self.logs()}")
            try:
                scheme = "https" if ssl_context else "http"
                ready = f"{scheme}://{self.url}/v2/health/ready"
                with urllib.request.urlopen(ready, timeout=1, context=ssl_context) as r:
                    if r.status == 200:
                        return
            except urllib.error.HTTPError as e:
                if e.code == 401:  # up, and behind --auth-token-file
                    return
                time.sleep(0.1)
            except OSError:
                time.sleep(0.1)
        logs = self.logs()
        self.stop()
        raise RuntimeError("ferrite did not become ready: " + logs)

    def logs(self):
        self.log.flush()
        return self.log_path.read_text()

    def stop(self, sig=signal.SIGTERM, timeout=30):
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    repo = make_repository(tmp_path_factory.mktemp("repo"))
    s = Server(repo)
    yield s
    s.stop()


@pytest.fixture
def start_server(tmp_path):
    """Starts extra servers for a test; stops them afterwards."""
    started = []

    def start(*args, models=("mlp", "mixed"), repository=None, env=None, ssl_context=None):
        repo = repository or make_repository(tmp_path / f"repo{len(started)}", models)
        s = Server(repo, *args, env=env, ssl_context=ssl_context)
        started.append(s)
        return s

    yield start
    for s in started:
        s.stop()
