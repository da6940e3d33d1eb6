"""Crash reports. A fatal signal cannot be caused on demand inside ONNX Runtime, so the test
delivers a real SIGSEGV to a model's worker thread (tgkill) while it runs a batch: the process
dies, and leaves a report with the time, versions, signal, the model, version and worker thread
that was running with its batch's input names, dtypes and shapes (never the data), and the native
backtrace; in Python also every Python thread's stack. The server names the report at its next
start. (A panic inside a batch is survived: tests/engine.rs a_bad_row_or_a_panic_...)"""

import ctypes
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from conftest import BIN, free_port, make_repository

SYS_TGKILL = 234  # x86_64


def worker_thread(pid, name, timeout=30):
    deadline = time.time() + timeout
    while time.time() < deadline:
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                if (task / "comm").read_text().strip() == name:
                    return int(task.name)
            except OSError:
                continue
        time.sleep(0.05)
    raise AssertionError(f"no thread {name} in {pid}")


def busy_worker(pid, model, timeout=30):
    """A worker thread of `model` that is running (state R) now: inside a batch. Which instance
    gets the work depends on the load and the machine (a solo instance may take lone batches)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                name = (task / "comm").read_text().strip()
                state = (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if name.startswith(f"ferrite-{model}-") and state == "R":
                return int(task.name), name
        time.sleep(0.01)
    raise AssertionError(f"no running worker of {model} in {pid}")


def segfault(pid, tid):
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.syscall(SYS_TGKILL, pid, tid, signal.SIGSEGV) == 0, ctypes.get_errno()


def check_report(text, thread):
    assert text.startswith("Ferrite crash report\nferrite 0.1.0\nonnxruntime 1.31."), text[:200]
    assert "signal 11 (SIGSEGV)" in text and "time " in text
    assert f"model 'slow' version 1 on worker thread {thread}" in text, text
    assert "input 'x' FP32 [64, 512]" in text, text
    backtrace = text.split("native backtrace:\n", 1)[1]
    assert backtrace.count("\n") >= 3, backtrace


def test_the_server_leaves_a_report_and_names_it_at_the_next_start(tmp_path):
    crashes = tmp_path / "crashes"
    repo = make_repository(tmp_path / "repo", ("slow",))
    args = [BIN, "serve", "--model-repository", str(repo), "--crash-dir", str(crashes), "--grpc-port", str(free_port()),
            "--metrics-port", str(free_port())]
    port = free_port()
    proc = subprocess.Popen(args + ["--http-port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    import tritonclient.http as httpclient
    c = httpclient.InferenceServerClient(f"127.0.0.1:{port}")
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            if c.is_server_ready():
                break
        except Exception:
            time.sleep(0.2)
    worker_thread(proc.pid, "ferrite-slow-0")

    def load():
        x = np.ones((64, 512), np.float32)
        own = httpclient.InferenceServerClient(f"127.0.0.1:{port}")  # a client is not shared by threads
        for _ in range(20):
            try:
                i = httpclient.InferInput("x", [64, 512], "FP32")
                i.set_data_from_numpy(x)
                own.infer("slow", [i])
            except Exception:
                return

    # Three callers keep a request always queued behind the running batch (about 0.4 s each), so
    # a worker goes from batch to batch: the signal goes to one seen running, inside a batch.
    for _ in range(3):
        threading.Thread(target=load, daemon=True).start()
    time.sleep(1.0)
    tid, thread = busy_worker(proc.pid, "slow")
    segfault(proc.pid, tid)
    assert proc.wait(timeout=60) == -signal.SIGSEGV
    report = crashes / f"ferrite-crash-{proc.pid}.txt"
    check_report(report.read_text(), thread)
    assert "1.0, 1.0" not in report.read_text(), "no tensor data"
    # The next start names it.
    again = subprocess.Popen(args + ["--http-port", str(free_port())], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
    try:
        deadline, seen = time.time() + 60, ""
        while time.time() < deadline and str(report) not in seen:
            line = again.stdout.readline()
            if not line:
                break
            seen += line
        assert "crash report from an earlier run" in seen and str(report) in seen, seen
    finally:
        again.terminate()
        again.wait(timeout=60)


CHILD = r"""
import sys, threading, time, numpy as np, ferrite
engine = ferrite.Engine(sys.argv[1], crash_dir=sys.argv[2])
print("report", ferrite.enable_crash_reports(sys.argv[2]), flush=True)
m = engine.model("slow")
def load():
    while True:
        m.infer({"x": np.ones((64, 512), np.float32)})
for _ in range(3):
    threading.Thread(target=load, name="inference-caller", daemon=True).start()
while True:
    time.sleep(0.01)
"""


def test_the_python_package_adds_every_python_threads_stack(tmp_path):
    crashes = tmp_path / "crashes"
    repo = make_repository(tmp_path / "repo", ("slow",))
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(repo), str(crashes)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    line = child.stdout.readline()
    assert line.startswith("report "), line + child.stderr.read()
    worker_thread(child.pid, "ferrite-slow-0")
    time.sleep(1.5)
    tid, thread = busy_worker(child.pid, "slow")
    segfault(child.pid, tid)
    assert child.wait(timeout=60) == -signal.SIGSEGV
    text = (crashes / f"ferrite-crash-{child.pid}.txt").read_text()
    check_report(text, thread)
    # faulthandler's dump follows: the Python threads, with the caller's frames.
    python = text.split("native backtrace:\n", 1)[1]
    assert "Fatal Python error" in python or "most recent call first" in python, python[-2000:]
    assert "in load" in python and "<string>" in python, python[-2000:]
