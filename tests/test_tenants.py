"""Per-tenant limits through the real binary: a noisy tenant is throttled with 429 + Retry-After
while a quiet one is served in full, over HTTP and gRPC."""

import http.client
import json
import threading
import time

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from test_metrics import scrape, value

BODY = json.dumps({"inputs": [{"name": "input", "shape": [1, 512], "datatype": "FP32", "data": [0.5] * 512}]})
TENANTS = """
[default]
rate = 30
burst = 10
max_concurrent = 4

[tenants.quiet]
rate = 50
burst = 20
"""


def post(url, tenant):
    conn = http.client.HTTPConnection(url, timeout=30)
    headers = {"Content-Type": "application/json"}
    if tenant:
        headers["X-Tenant"] = tenant
    conn.request("POST", "/v2/models/mlp/infer", BODY, headers)
    r = conn.getresponse()
    r.read()
    conn.close()
    return r.status, r.getheader("Retry-After")


@pytest.fixture
def server(start_server, tmp_path):
    cfg = tmp_path / "tenants.toml"
    cfg.write_text(TENANTS)
    return start_server("--tenant-header", "x-tenant", "--tenant-config", str(cfg), models=("mlp",))


def test_a_noisy_tenant_cannot_starve_a_quiet_one(server):
    stop = time.time() + 3
    noisy, quiet = [], []

    def flood():
        while time.time() < stop:
            noisy.append(post(server.url, "noisy"))

    threads = [threading.Thread(target=flood) for _ in range(8)]
    for t in threads:
        t.start()
    while time.time() < stop:
        quiet.append(post(server.url, "quiet"))
        time.sleep(0.05)  # ~20 req/s, under its rate of 50
    for t in threads:
        t.join()
    assert quiet and all(s == 200 for s, _ in quiet), quiet
    codes = [s for s, _ in noisy]
    assert set(codes) <= {200, 429}
    # About burst + 3 s x 30 req/s get through; the rest are refused with a Retry-After.
    assert 0 < codes.count(200) <= 10 + 3 * 30 + 10, codes.count(200)
    assert codes.count(429) > codes.count(200)
    assert all(ra and int(ra) >= 1 for s, ra in noisy if s == 429)
    m = scrape(server.metrics_url)
    counted = sum(value(m, "ferrite_tenant_refusals_total", tenant="other", limit=lim)
                  for lim in ("rate", "concurrency"))
    assert counted == codes.count(429)
    assert value(m, "ferrite_requests_total", model="mlp", version="1", outcome="failure",
                 reason="throttled") == codes.count(429)


def test_tenant_limits_apply_over_grpc(server):
    client = grpcclient.InferenceServerClient(server.grpc_url)
    x = grpcclient.InferInput("input", [1, 512], "FP32")
    x.set_data_from_numpy(np.full((1, 512), 0.5, np.float32))
    refused = 0
    for _ in range(40):  # burst 10 at 30/s: a tight loop runs out
        try:
            client.infer("mlp", [x], headers={"x-tenant": "grpc-tenant"})
        except InferenceServerException as e:
            assert e.status() == "StatusCode.RESOURCE_EXHAUSTED", e
            refused += 1
    assert refused > 0
    # Another tenant is untouched.
    client.infer("mlp", [x], headers={"x-tenant": "someone-else"})


def test_tenants_are_bound_to_credentials(start_server, tmp_path):
    """A client limited as 'limited' cannot escape by claiming the listed tenant 'quiet', and the
    token bound to 'quiet' acts for it whatever header it sends, over HTTP and gRPC."""
    cfg = tmp_path / "tenants.toml"
    cfg.write_text("[default]\nrate = 1\nburst = 2\n[tenants.quiet]\nrate = 1000\nburst = 1000\n")
    tokens = tmp_path / "tokens"
    tokens.write_text("quiet-token-0123456789 infer tenant=quiet\nplain-token-0123456789 infer\n")
    s = start_server("--tenant-header", "x-tenant", "--tenant-config", str(cfg), "--auth-token-file", str(tokens),
                     models=("mlp",))

    def post_as(token, tenant):
        conn = http.client.HTTPConnection(s.url, timeout=30)
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {token}"}
        if tenant:
            headers["X-Tenant"] = tenant
        conn.request("POST", "/v2/models/mlp/infer", BODY, headers)
        r = conn.getresponse()
        body = r.read()
        conn.close()
        return r.status, body

    # The plain token claiming the listed tenant is refused, not given its limits.
    status, body = post_as("plain-token-0123456789", "quiet")
    assert status == 403 and b"bound" in body, (status, body)
    # Claiming an unlisted tenant gets the default limits: 2 of 30 pass.
    got = [post_as("plain-token-0123456789", "limited")[0] for _ in range(30)]
    assert got.count(200) <= 3 and got.count(429) >= 27, got
    # The bound token is 'quiet' whatever it claims: 30 of 30 pass.
    assert [post_as("quiet-token-0123456789", "limited")[0] for _ in range(30)] == [200] * 30
    # gRPC: the same binding.
    c = grpcclient.InferenceServerClient(s.grpc_url)
    i = grpcclient.InferInput("input", [1, 512], "FP32")
    i.set_data_from_numpy(np.full((1, 512), 0.5, np.float32))
    with pytest.raises(InferenceServerException, match="bound"):
        c.infer("mlp", [i], headers={"authorization": "Bearer plain-token-0123456789", "x-tenant": "quiet"})
    for _ in range(10):
        c.infer("mlp", [i], headers={"authorization": "Bearer quiet-token-0123456789", "x-tenant": "limited"})


def slow_repository(tmp_path, dynamic_batching=""):
    """The slow model alone: one instance, one 64-row request a batch (at least a tenth of a second
    on one core)."""
    from conftest import make_repository
    repo = make_repository(tmp_path / "repo", ("slow",))
    (repo / "slow" / "config.toml").write_text(
        "max_batch_size = 64\ninstance_count = 1\nthreads = 1\ncalibrate = false\nsolo_instance = false\n"
        "[dynamic_batching]\n" + dynamic_batching)
    return repo


def slow_infer(s, protocol, tenant, priority=0, timeout_us=None, rows=64):
    """One request of `rows` rows (64: a whole batch) to the slow model as `tenant`: a callable
    that sends it and raises what the server answers, by a client it closes then. Call it on the
    thread that made it (tritonclient's HTTP client is not to be shared across threads)."""
    import tritonclient.http as httpclient
    if protocol == "http":
        c, i, timeout = httpclient.InferenceServerClient(s.url, network_timeout=120), httpclient.InferInput, {}
    else:
        c, i, timeout = grpcclient.InferenceServerClient(s.grpc_url), grpcclient.InferInput, {"client_timeout": 120}
    x = i("x", [rows, 512], "FP32")
    x.set_data_from_numpy(np.full((rows, 512), 0.25, np.float32))

    def send():
        try:
            c.infer("slow", [x], headers={"x-tenant": tenant} if tenant else {}, priority=priority, timeout=timeout_us,
                    **timeout)
        finally:
            c.close()
    return send


def served_in_order(s, protocol, asked, apart=0.03):
    """Sends `asked` ((name, tenant, priority[, timeout µs[, rows]]), each from a thread of its own, whose
    client is made, used and closed there) `apart` seconds apart; the names in the order their
    answers came, and each refused one's error."""
    done, refused, lock = [], {}, threading.Lock()

    def run(name, how, ready, go):
        send = slow_infer(s, protocol, *how)
        ready.set()
        go.wait(60)
        try:
            send()
            with lock:
                done.append(name)
        except Exception as e:  # noqa: BLE001 - what the server answered is the result
            with lock:
                refused[name] = str(e)

    threads, turns = [], []
    for name, *how in asked:
        ready, go = threading.Event(), threading.Event()
        threads.append(threading.Thread(target=run, args=(name, how, ready, go)))
        threads[-1].start()
        assert ready.wait(60)
        turns.append(go)
    for go in turns:
        go.set()
        time.sleep(apart)
    for t in threads:
        t.join(timeout=120)
    return done, refused


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_tenant_asks_for_no_higher_priority_than_its_config_gives(start_server, tmp_path, protocol):
    """Any client could ask for a model's highest priority level and have its requests run ahead of
    everyone's queued before them. A tenant's `highest_priority` now bounds what its requests may
    ask for: a request of `[default]` (at most level 2) asking for level 1 waits behind a level-2
    request queued before it, while the listed tenant `vip` (any level) still runs first."""
    repo = slow_repository(tmp_path, "priority_levels = 2\ndefault_priority_level = 2\n")
    cfg = tmp_path / "tenants.toml"
    cfg.write_text("[default]\nhighest_priority = 2\n[tenants.vip]\n")
    s = start_server("--tenant-header", "x-tenant", "--tenant-config", str(cfg), repository=repo)
    # Two requests keep the instance busy; the rest queue behind them, 30 ms apart. The guest's
    # requests are one tenant's, so they run in the order of their levels, then of their coming
    # (another tenant's would take turns with them).
    asked = [("busy-1", "guest", 0), ("busy-2", "guest", 0), ("earlier", "guest", 2), ("jumper", "guest", 1),
             ("vip", "vip", 1)]
    done, refused = served_in_order(s, protocol, asked)
    assert sorted(done) == sorted(n for n, _, _ in asked), (done, refused)
    # vip's level 1 runs first of those queued; the guest's ask for level 1 is served at level 2,
    # behind the level-2 request queued before it (before, it ran second: ahead of 'earlier').
    queued = [n for n in done if n not in ("busy-1",)]
    assert queued.index("vip") < queued.index("earlier") < queued.index("jumper"), done


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_tenants_take_turns_in_a_models_queue(start_server, tmp_path, protocol):
    """A model's queue was first come, first served: one tenant's flood of queued requests kept
    another's waiting behind all of it. Tenants' requests now take turns (by rows): the quiet
    tenant's one request runs after at most one more of the noisy tenant's, not after all six."""
    cfg = tmp_path / "tenants.toml"
    cfg.write_text("[default]\n")
    s = start_server("--tenant-header", "x-tenant", "--tenant-config", str(cfg), repository=slow_repository(tmp_path))
    asked = [(f"noisy-{i}", "noisy", 0) for i in range(7)] + [("quiet", "quiet", 0)]
    # All queued while noisy-0 runs (a 64-row batch: 0.14 s on one thread of a fast core), so the
    # order is the queue's, not the arrivals'.
    done, refused = served_in_order(s, protocol, asked, apart=0.01)
    assert not refused and len(done) == len(asked), (done, refused)
    # noisy-0 runs at once; noisy-1 was next in turn when quiet came (before: quiet ran last).
    assert done.index("quiet") <= 2, done


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_tenants_short_request_goes_ahead_of_anothers_long_one_queued_level(start_server, tmp_path, protocol):
    """Turns went by the rows a tenant had run before its request: a tenant that came (starting
    level with the one waiting) tied with the other's next request, and the tie went to the older,
    so a short request waited for a whole batch of another's. In a text flood (pipeline batches
    of 32 long texts on every worker) a lone short text so waited 60-90 ms where it took 1 ms alone.
    Turns now go by the rows run once the request has run: the quiet tenant's 8-row request goes
    ahead of the noisy tenant's queued 64-row ones, right after the one running."""
    cfg = tmp_path / "tenants.toml"
    cfg.write_text("[default]\n")
    s = start_server("--tenant-header", "x-tenant", "--tenant-config", str(cfg), repository=slow_repository(tmp_path))
    # Each batch of 64 rows takes at least a tenth of a second: all are queued while noisy-0 runs.
    asked = [(f"noisy-{i}", "noisy", 0) for i in range(4)] + [("quiet", "quiet", 0, None, 8)]
    done, refused = served_in_order(s, protocol, asked, apart=0.01)
    assert not refused and len(done) == len(asked), (done, refused)
    assert done.index("quiet") == 1, done


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_tenant_holds_at_most_half_of_a_models_queue(start_server, tmp_path, protocol):
    """A model's queue has `max_queue_size` places per priority level, and a tenant's flood could
    take them all: every other tenant's request was then refused 'queue full'. A tenant's requests
    now hold at most half of them, so another tenant's still queue."""
    cfg = tmp_path / "tenants.toml"
    cfg.write_text("[default]\n")
    repo = slow_repository(tmp_path, "max_queue_size = 4\n")
    s = start_server("--tenant-header", "x-tenant", "--tenant-config", str(cfg), repository=repo)
    # noisy-0 runs; noisy-1 and -2 hold two places, half of the four; -3 and -4 are refused.
    asked = [(f"noisy-{i}", "noisy", 0) for i in range(5)] + [("quiet", "quiet", 0)]
    done, refused = served_in_order(s, protocol, asked, apart=0.01)
    assert "quiet" in done, (done, refused)
    assert sorted(refused) == ["noisy-3", "noisy-4"], (done, refused)
    assert all("queue full for this tenant" in e for e in refused.values()), refused


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_tenants_deadline_is_judged_by_the_work_whose_turn_comes_first(start_server, tmp_path, protocol):
    """A request whose timeout the work queued ahead of it cannot meet is refused at once. The work
    ahead was every row queued at its level, though another tenant's flood no longer runs ahead of
    it: the quiet tenant's request, with time for four batches, was refused behind six of the noisy
    tenant's. It is now judged by the rows whose turns come first, admitted and served in time."""
    cfg = tmp_path / "tenants.toml"
    cfg.write_text("[default]\n")
    s = start_server("--tenant-header", "x-tenant", "--tenant-config", str(cfg), repository=slow_repository(tmp_path))
    alone = time.perf_counter()
    slow_infer(s, protocol, "quiet")()
    batch = time.perf_counter() - alone
    asked = [(f"noisy-{i}", "noisy", 0) for i in range(7)] + [("quiet", "quiet", 0, int(4 * batch * 1e6))]
    done, refused = served_in_order(s, protocol, asked)
    assert "quiet" in done, (done, refused, batch)
