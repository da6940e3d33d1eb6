"""The live page, /dashboard: self-contained (fetches nothing from elsewhere), rendered in headless
Chromium (Debian's package) from the server's own statistics, its numbers moving under load."""

import re
import shutil
import subprocess
import threading
import time
import urllib.request

import numpy as np
import pytest
import tritonclient.http as httpclient

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def dump(url):
    r = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=5000",
                        "--dump-dom", url], capture_output=True, text=True, timeout=120)
    return r.stdout


def row(dom, model):
    """The cells of the model's row (version 1) as text."""
    m = re.search(rf'<tr data-model="{model}" data-version="1">(.*?)</tr>', dom, re.S)
    assert m, dom[-3000:]
    return [re.sub(r"<[^>]+>", "", c) for c in re.findall(r"<td[^>]*>(.*?)</td>", m.group(1), re.S)]


def test_the_live_page_renders_and_its_numbers_move_under_load(start_server, tmp_path):
    if CHROMIUM is None:
        pytest.skip("chromium is not installed (apt-get install chromium); .ci/run installs it")
    s = start_server(models=("mlp", "mixed"))
    with urllib.request.urlopen(f"http://{s.url}/dashboard", timeout=10) as r:
        page = r.read()
        assert r.headers["Content-Type"].startswith("text/html")
    assert not re.search(rb'(src|href)="(https?:)?//', page), "the page fetches nothing from elsewhere"
    # One request, then the page: every model's row, the mlp's count, no error.
    c = httpclient.InferenceServerClient(s.url, concurrency=4)
    x = httpclient.InferInput("input", [1, 512], "FP32")
    x.set_data_from_numpy(np.ones((1, 512), np.float32))
    c.infer("mlp", [x])
    dom = dump(f"http://{s.url}/dashboard")
    assert '<p id="error"></p>' in dom, re.search(r'<p id="error">.*?</p>', dom).group(0)
    cells = row(dom, "mlp")
    header = re.findall(r"<th[^>]*>(.*?)</th>", dom)
    at = {name: i for i, name in enumerate(header)}
    assert cells[at["state"]].startswith("READY") and cells[at["requests"]] == "1", cells
    assert "inst" in cells[at["plan"]] and "batch" in cells[at["plan"]], cells
    row(dom, "mixed")
    # Under steady load the page shows a rate, latencies and batches, and the count grows.
    stop = threading.Event()

    bad = httpclient.InferInput("input", [1, 3], "FP32")
    bad.set_data_from_numpy(np.ones((1, 3), np.float32))

    def load():
        mine = httpclient.InferenceServerClient(s.url)  # tritonclient's HTTP client is one thread's
        n = 0
        while not stop.is_set():
            n += 1
            try:
                mine.infer("mlp", [bad if n % 10 == 0 else x])
            except Exception:  # noqa: BLE001 - the bad ones are refused
                pass

    threads = [threading.Thread(target=load) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        time.sleep(0.5)
        dom = dump(f"http://{s.url}/dashboard")
    finally:
        stop.set()
        for t in threads:
            t.join()
    cells = row(dom, "mlp")
    assert int(cells[at["requests"]]) > 1, cells
    for column in ("req/s", "p50 ms", "p99 ms", "batch"):
        assert re.fullmatch(r"[0-9.]+", cells[at[column]]) and float(cells[at[column]]) > 0, (column, cells)
    # The refused requests show by their reason.
    assert re.fullmatch(r"[a-z_]+: [0-9]+", cells[at["refused / failed (last minute)"]]), cells
