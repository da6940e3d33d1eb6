"""Prometheus metrics after known traffic, read with prometheus_client's own text parser; and
structured JSON logs."""

import json
import subprocess
import time
import urllib.request

import numpy as np
import pytest
import tritonclient.http as httpclient
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.utils import InferenceServerException

from conftest import BIN, make_repository


def scrape(url):
    with urllib.request.urlopen(url) as r:
        assert r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def value(samples, name, **labels):
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def infer(c, x):
    i = httpclient.InferInput("input", list(x.shape), "FP32")
    i.set_data_from_numpy(x)
    return c.infer("mlp", [i])


def test_counts_histograms_and_failure_reasons(start_server, tmp_path):
    repo = make_repository(tmp_path / "repo", ("mlp",))
    s = start_server("--metrics-on-http", repository=repo)
    c = httpclient.InferenceServerClient(s.url)
    for n in (1, 2, 3):
        infer(c, np.ones((n, 512), np.float32))
    for bad in (np.ones((1, 3), np.float32), np.ones((100, 512), np.float32)):
        with pytest.raises(InferenceServerException):
            infer(c, bad)
    # A 1 µs timeout almost always expires first; either outcome is counted below.
    late = httpclient.InferInput("input", [1, 512], "FP32")
    late.set_data_from_numpy(np.ones((1, 512), np.float32))
    try:
        c.infer("mlp", [late], timeout=1)
    except InferenceServerException as e:
        assert e.status() == "504"
    m = scrape(s.metrics_url)
    mv = {"model": "mlp", "version": "1"}
    ok = value(m, "ferrite_requests_total", **mv, outcome="success", reason="")
    invalid = value(m, "ferrite_requests_total", **mv, outcome="failure", reason="invalid")
    timeouts = value(m, "ferrite_requests_total", **mv, outcome="failure", reason="timeout")
    assert invalid == 2
    assert ok + timeouts == 4 and ok >= 3
    assert value(m, "ferrite_request_duration_seconds_count", **mv) == ok + invalid + timeouts
    executions = value(m, "ferrite_executions_total", **mv)
    assert value(m, "ferrite_batch_size_count", **mv) == executions
    assert value(m, "ferrite_compute_duration_seconds_count", **mv) == executions
    assert value(m, "ferrite_inferences_total", **mv) == 6 + (1 if ok == 4 else 0)
    assert value(m, "ferrite_queue_duration_seconds_count", **mv) == ok
    assert value(m, "ferrite_batch_size_bucket", **mv, le="2") >= 2  # the batches of 1 and 2 rows
    assert value(m, "ferrite_model_ready", **mv) == 1
    assert value(m, "ferrite_pending_requests", **mv) == 0
    assert value(m, "ferrite_model_load_duration_seconds", **mv) > 0
    assert value(m, "process_resident_memory_bytes") > 0
    assert ("process_cpu_seconds_total", ()) in m
    # Also on the HTTP port when asked.
    assert value(scrape(f"http://{s.url}/metrics"), "ferrite_executions_total", **mv) == executions


def test_cache_metrics(start_server, tmp_path):
    repo = make_repository(tmp_path / "repo", ("mlp",))
    (repo / "mlp" / "config.toml").write_text("[cache]\nenabled = true\n")
    s = start_server(repository=repo)
    c = httpclient.InferenceServerClient(s.url)
    for _ in range(3):
        infer(c, np.ones((1, 512), np.float32))
    m = scrape(s.metrics_url)
    assert value(m, "ferrite_cache_misses_total", model="mlp", version="1") == 1
    assert value(m, "ferrite_cache_hits_total", model="mlp", version="1") == 2


def test_json_logs_one_line_per_request_without_tensor_data(tmp_path):
    from conftest import Server

    repo = make_repository(tmp_path / "repo", ("mixed",))
    s = Server(repo, "--log-format", "json", "--log", "info,ferrite_core=debug")
    try:
        c = httpclient.InferenceServerClient(s.url)
        ids = httpclient.InferInput("ids", [1, 4], "INT64")
        ids.set_data_from_numpy(np.array([[7, 7, 7, 1234567]], np.int64))
        values = httpclient.InferInput("values", [1, 4], "FP32")
        values.set_data_from_numpy(np.ones((1, 4), np.float32))
        c.infer("mixed", [ids, values], request_id="req-42")
        time.sleep(0.2)
    finally:
        s.stop()
    lines = [json.loads(line) for line in s.log_path.read_text().splitlines() if line.strip()]
    requests = [l for l in lines if l.get("fields", {}).get("message") == "request"]
    assert len(requests) == 1, lines
    f = requests[0]["fields"]
    assert f["model"] == "mixed" and f["id"] == "req-42" and f["outcome"] == "success"
    assert "1234567" not in s.log_path.read_text()


def test_desired_replicas_follow_the_load(start_server):
    s = start_server("--scale-capacity-rps", "20", "--scale-window-secs", "3", "--scale-min-replicas", "1",
                     "--scale-max-replicas", "50", models=("mlp",))
    desired = lambda: value(scrape(s.metrics_url), "ferrite_desired_replicas")  # noqa: E731
    assert desired() == 1, "idle: the minimum"
    x = np.zeros((1, 512), np.float32)
    stop = time.time() + 4
    counts = []

    def load():
        c = httpclient.InferenceServerClient(s.url)
        n = 0
        while time.time() < stop:
            infer(c, x)
            n += 1
        counts.append(n)

    import threading
    threads = [threading.Thread(target=load) for _ in range(4)]
    for t in threads:
        t.start()
    time.sleep(3)
    under_load = desired()
    for t in threads:
        t.join()
    rate = sum(counts) / 4
    assert rate > 60, f"the load generator managed only {rate:.0f} req/s"
    # ceil(rate / 20) over the window, give or take the window's edges.
    assert under_load >= 3 and abs(under_load - rate / 20) <= max(2, rate / 20 * 0.5), (under_load, rate)
    deadline = time.time() + 10
    while desired() != 1 and time.time() < deadline:
        time.sleep(0.5)
    assert desired() == 1, "back to the minimum once the load is gone"
