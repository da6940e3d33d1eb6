"""Hostile input through the real binary: each item of DESIGN.md's "Defaults that keep users safe"
and Triton's L0_input_validation themes gets a 4xx, the server stays live, and its memory stays
flat over 100 repeats. Slow senders (headers and bodies) are cut off."""

import gzip
import http.client
import json
import os
import re
import socket
import time
import zlib

import struct

import msgpack
import numpy as np
import pytest

MLP = "/v2/models/mlp/infer"
MAX_BODY = 1 << 20
JSON = {"Content-Type": "application/json"}


def mlp_body(**over):
    inp = {"name": "input", "shape": [1, 512], "datatype": "FP32", "data": [0.5] * 512}
    inp.update(over)
    return json.dumps({"inputs": [inp]}).encode()


def deep_json(depth):
    return b'{"inputs":[{"name":"input","shape":[1,512],"datatype":"FP32","data":' + b"[" * depth + b"]" * depth + b"}]}"


def deep_msgpack(depth):
    # {"inputs": [[[[...]]]]}: fixmap(1), "inputs", then `depth` one-element arrays around an empty one.
    return b"\x81" + msgpack.packb("inputs") + b"\x91" * depth + b"\x90"


def lookup_binary(ids, text):
    """ids INT64 [1,2] and text BYTES [1,1] for the lookup model, with the binary extension."""
    header = json.dumps({"inputs": [
        {"name": "ids", "shape": [1, 2], "datatype": "INT64", "parameters": {"binary_data_size": 16}},
        {"name": "text", "shape": [1, 1], "datatype": "BYTES", "parameters": {"binary_data_size": 4 + len(text)}}]}).encode()
    return {"Inference-Header-Content-Length": str(len(header))}, header + struct.pack("<2q", *ids) + struct.pack("<I", len(text)) + text


LOOKUP = "/v2/models/lookup/infer"

CASES = [
    # (what, path, extra headers, body, expected status)
    ("malformed JSON", MLP, JSON, b'{"inputs": [', 400),
    ("JSON that is not an object", MLP, JSON, b"[1, 2, 3]", 400),
    ("invalid UTF-8", MLP, JSON, b"\xff\xfe\xfd", 400),
    ("wrong datatype", MLP, JSON, mlp_body(datatype="INT32", data=[1] * 512), 400),
    ("unknown datatype", MLP, JSON, mlp_body(datatype="FP99"), 400),
    ("data shorter than the shape", MLP, JSON, mlp_body(data=[1.0, 2.0]), 400),
    ("data of the wrong JSON type", MLP, JSON, mlp_body(data=["a"] * 512), 400),
    ("negative dim", MLP, JSON, mlp_body(shape=[-1, 512]), 400),
    ("zero batch", MLP, JSON, mlp_body(shape=[0, 512], data=[]), 400),
    ("overflowing dims", MLP, JSON, mlp_body(shape=[2**62, 2**62], data=[]), 400),
    ("dims past u64", MLP, JSON, b'{"inputs":[{"name":"input","shape":[1e30],"datatype":"FP32","data":[]}]}', 400),
    ("elements over the cap", MLP, JSON, mlp_body(shape=[1, 1 << 30], data=[]), 400),
    ("duplicate input names", "/v2/models/mixed/infer", JSON, json.dumps({"inputs": [
        {"name": "ids", "shape": [1, 4], "datatype": "INT64", "data": [1, 2, 3, 4]},
        {"name": "ids", "shape": [1, 4], "datatype": "INT64", "data": [1, 2, 3, 4]},
        {"name": "values", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}).encode(), 400),
    ("unknown input name", MLP, JSON, mlp_body(name="../input"), 400),
    ("too many tensors", MLP, JSON, json.dumps({"inputs": [
        {"name": f"i{i}", "shape": [1], "datatype": "FP32", "data": [1]} for i in range(300)]}).encode(), 400),
    ("unknown output requested", MLP, JSON,
     json.dumps({"inputs": json.loads(mlp_body())["inputs"], "outputs": [{"name": "/etc/passwd"}]}).encode(), 400),
    ("priority out of range", MLP, JSON,
     json.dumps({"inputs": json.loads(mlp_body())["inputs"], "parameters": {"priority": 99}}).encode(), 400),
    ("250,000-deep JSON nesting", MLP, JSON, deep_json(250_000), 400),
    ("250,000-deep MessagePack nesting", MLP, {"Content-Type": "application/msgpack"}, deep_msgpack(250_000), 400),
    ("MessagePack garbage", MLP, {"Content-Type": "application/msgpack"}, b"\xc1\xc1\xc1", 400),
    ("binary header length past the body", MLP, {"Inference-Header-Content-Length": "999999"}, mlp_body(), 400),
    ("binary header length not a number", MLP, {"Inference-Header-Content-Length": "-1"}, mlp_body(), 400),
    ("binary_data_size past the body", MLP, {"Inference-Header-Content-Length": str(len(json.dumps({"inputs": [
        {"name": "input", "shape": [1, 512], "datatype": "FP32", "parameters": {"binary_data_size": 2048}}]})))},
     json.dumps({"inputs": [{"name": "input", "shape": [1, 512], "datatype": "FP32",
                             "parameters": {"binary_data_size": 2048}}]}).encode() + b"\0" * 16, 400),
    ("body over the limit", MLP, JSON, b" " * (MAX_BODY + 1), 413),
    ("gzip bomb", MLP, {**JSON, "Content-Encoding": "gzip"}, gzip.compress(b" " * (64 << 20), 9), 413),
    ("deflate bomb", MLP, {**JSON, "Content-Encoding": "deflate"}, zlib.compress(b" " * (64 << 20), 9), 413),
    ("corrupt gzip", MLP, {**JSON, "Content-Encoding": "gzip"}, b"\x1f\x8b\x08\x00garbage", 400),
    ("unknown Content-Encoding", MLP, {**JSON, "Content-Encoding": "br"}, b"{}", 415),
    ("unknown model", "/v2/models/nope/infer", JSON, mlp_body(), 404),
    ("unknown version", "/v2/models/mlp/versions/9/infer", JSON, mlp_body(), 404),
    ("non-numeric version", "/v2/models/mlp/versions/latest/infer", JSON, mlp_body(), 404),
    ("path-like model name", "/v2/models/..%2F..%2Fetc%2Fpasswd/infer", JSON, mlp_body(), 404),
    ("dot-dot segments", "/v2/models/../../etc/passwd/infer", JSON, mlp_body(), 404),
    ("path-like version", "/v2/models/mlp/versions/..%2F1/infer", JSON, mlp_body(), 404),
    ("BYTES element not UTF-8 (binary extension)", LOOKUP, *lookup_binary([1, 2], b"\xff\xfe"), 400),
    ("index out of the model's table", LOOKUP, *lookup_binary([1, 12], b"hi"), 400),
]


def send(server, method, path, headers=None, body=None, timeout=30):
    conn = http.client.HTTPConnection(server.url, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


@pytest.fixture(scope="module")
def hardened(tmp_path_factory):
    from conftest import Server, make_repository
    repo = make_repository(tmp_path_factory.mktemp("hostile"), models=("mlp", "mixed", "identity", "lookup"))
    s = Server(repo, "--max-body-bytes", str(MAX_BODY), "--http-header-timeout-secs", "1",
               "--http-body-timeout-secs", "1")
    yield s
    s.stop()


@pytest.mark.parametrize("what,path,headers,body,expected", CASES, ids=[c[0] for c in CASES])
def test_hostile_input_gets_a_clear_4xx(hardened, what, path, headers, body, expected):
    status, answer = send(hardened, "POST", path, headers, body)
    assert status == expected, (what, answer[:300])
    assert json.loads(answer)["error"], "every refusal carries a message"
    assert send(hardened, "GET", "/v2/health/live")[0] == 200


def test_requests_failing_in_a_model_are_warned_of_a_line_a_second(hardened):
    """A client sending request after request that fails in the model cannot fill the log: one
    warning a second, the next saying how many were left out."""
    headers, body = lookup_binary([1, 12], b"hi")

    def lines():
        return [x for x in hardened.logs().splitlines() if "request failed in the backend" in x]

    before = len(lines())
    started = time.time()
    for _ in range(50):
        assert send(hardened, "POST", LOOKUP, headers, body)[0] == 400
    took = time.time() - started
    time.sleep(1.1)
    assert send(hardened, "POST", LOOKUP, headers, body)[0] == 400
    new = lines()[before:]
    assert 1 <= len(new) <= int(took) + 3, new
    assert re.search(r"left_out=[1-9]", re.sub(r"\x1b\[[0-9;]*m", "", new[-1])), new[-1]


def test_memory_stays_flat_over_100_repeats(hardened):
    def round_():
        for _, path, headers, body, expected in CASES:
            assert send(hardened, "POST", path, headers, body)[0] == expected
    for _ in range(5):
        round_()
    before = rss_kib(hardened.proc.pid)
    for _ in range(100):
        round_()
    after = rss_kib(hardened.proc.pid)
    print(f"\nRSS over 100 rounds of {len(CASES)} hostile requests: {before} KiB -> {after} KiB")
    assert after - before < 32 * 1024, f"RSS grew from {before} KiB to {after} KiB"
    assert send(hardened, "POST", MLP, JSON, mlp_body())[0] == 200


def test_gzip_and_deflate_bodies_are_accepted(hardened):
    for encoding, pack in (("gzip", gzip.compress), ("deflate", zlib.compress)):
        status, answer = send(hardened, "POST", MLP, {**JSON, "Content-Encoding": encoding}, pack(mlp_body()))
        assert status == 200, answer
        assert json.loads(answer)["outputs"][0]["shape"] == [1, 10]


def test_nan_and_infinity_round_trip(hardened):
    values = [float("nan"), float("inf"), float("-inf"), 1.5]
    body = json.dumps({"inputs": [{"name": "fp32_in", "shape": [1, 3], "datatype": "FP32", "data": values[:3]},
                                  {"name": "fp64_in", "shape": [1, 3], "datatype": "FP64", "data": values[1:]}],
                       "outputs": [{"name": "fp32_out"}, {"name": "fp64_out"}]})
    # The identity model takes every dtype; fill the others with zeros.
    req = json.loads(body)
    for dt, n in (("bool", "BOOL"), ("uint8", "UINT8"), ("uint16", "UINT16"), ("uint32", "UINT32"),
                  ("uint64", "UINT64"), ("int8", "INT8"), ("int16", "INT16"), ("int32", "INT32"),
                  ("int64", "INT64"), ("fp16", "FP16"), ("bf16", "BF16"), ("bytes", "BYTES")):
        data = [False] * 3 if n == "BOOL" else ["a"] * 3 if n == "BYTES" else [0] * 3
        req["inputs"].append({"name": f"{dt}_in", "shape": [1, 3], "datatype": n, "data": data})
    status, answer = send(hardened, "POST", "/v2/models/identity/infer", JSON, json.dumps(req).encode())
    assert status == 200, answer
    outs = {o["name"]: np.array(o["data"], dtype=np.float64) for o in json.loads(answer)["outputs"]}
    np.testing.assert_array_equal(outs["fp32_out"], values[:3])
    np.testing.assert_array_equal(outs["fp64_out"], values[1:])


def test_slow_headers_are_cut_off(hardened):
    """Slowloris: connections that trickle their request head are closed after the header timeout,
    while other clients are served."""
    socks = []
    for _ in range(50):
        s = socket.create_connection(("127.0.0.1", hardened.port))
        s.sendall(b"POST /v2/models/mlp/infer HTTP/1.1\r\nHost: x\r\n")
        socks.append(s)
    start = time.time()
    assert send(hardened, "POST", MLP, JSON, mlp_body())[0] == 200
    closed = 0
    deadline = start + 5
    for s in socks:
        s.settimeout(max(0.1, deadline - time.time()))
        try:
            while True:
                s.sendall(b"X-Slow: 1\r\n")
                data = s.recv(4096)
                if not data or data.startswith(b"HTTP/1.1 408"):
                    closed += 1
                    break
        except (ConnectionError, BrokenPipeError):
            closed += 1
        except socket.timeout:
            pass
        finally:
            s.close()
    assert closed == len(socks), f"only {closed} of {len(socks)} slow connections were closed"
    assert time.time() - start < 6


def test_slow_body_gets_408(hardened):
    s = socket.create_connection(("127.0.0.1", hardened.port))
    s.sendall(b"POST /v2/models/mlp/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: 1000\r\n\r\n{\"inputs\"")
    s.settimeout(5)
    start = time.time()
    answer = s.recv(4096)
    s.close()
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert time.time() - start < 3


def test_a_request_head_over_64_kib_gets_431(hardened):
    """The head is read into the connection's buffer, bounded at 64 KiB (hyper's default held about
    400 KiB a connection): a head over it is refused with 431, one just under it is served."""
    # hyper answers 431 as soon as the buffer is full and closes: the rest of the head may meet a
    # closed socket, so the answer is read whatever became of the send.
    sock = socket.create_connection(("127.0.0.1", hardened.port))
    body = mlp_body()
    try:
        sock.sendall(b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nX-Padding: %s\r\n"
                     b"Content-Length: %d\r\n\r\n" % (MLP.encode(), b"a" * (70 << 10), len(body)) + body)
    except (BrokenPipeError, ConnectionResetError):
        pass
    sock.settimeout(5)
    try:
        answer = sock.recv(4096)
    except ConnectionResetError:
        answer = b""  # refused before its answer could be read: a refusal too
    finally:
        sock.close()
    assert answer == b"" or answer.startswith(b"HTTP/1.1 431"), answer[:200]
    status, answer = send(hardened, "POST", MLP, {**JSON, "X-Padding": "a" * (60 << 10)}, mlp_body())
    assert status == 200, answer[:200]


def closed_within(sock, seconds):
    """Whether the server closes `sock` (EOF or reset) within `seconds`."""
    sock.settimeout(seconds)
    try:
        return sock.recv(1) == b""
    except ConnectionError:
        return True
    except socket.timeout:
        return False


def test_connections_that_never_send_a_byte_are_closed(hardened):
    socks = [socket.create_connection(("127.0.0.1", hardened.port)) for _ in range(50)]
    start = time.time()
    assert send(hardened, "POST", MLP, JSON, mlp_body())[0] == 200
    assert all(closed_within(s, max(0.1, start + 4 - time.time())) for s in socks), "idle connections stayed open"
    assert time.time() - start < 5
    for s in socks:
        s.close()


def test_a_listener_holds_at_most_its_connection_cap(start_server):
    # The header timeout (10 s) is far beyond the waits below: a close seen here is the cap's.
    s = start_server("--http-max-connections", "20", "--http-header-timeout-secs", "10", models=("mlp",))
    held = [socket.create_connection(("127.0.0.1", s.port)) for _ in range(20)]
    time.sleep(0.3)
    extra = [socket.create_connection(("127.0.0.1", s.port)) for _ in range(10)]
    # Past the cap a connection is closed at once, not left to hang.
    assert all(closed_within(x, 2.0) for x in extra)
    assert not any(closed_within(h, 0.05) for h in held[:3]), "connections under the cap were kept"
    for h in held:
        h.close()
    time.sleep(0.3)
    assert send(s, "POST", MLP, JSON, mlp_body())[0] == 200


def head_of(n, extra=b"", model=b"mlp"):
    """A request's head (to `model`, MLP's by default) stating an `n`-byte body."""
    return (b"POST /v2/models/%s/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n%s"
            b"Content-Length: %d\r\n\r\n" % (model, extra, n))


def h2_events(sock, conn, done, timeout=60):
    """`conn`'s events as they come, until `done()` or for `timeout` s, each batch's replies (acks,
    window updates the caller made) sent after it."""
    sock.settimeout(1)
    deadline = time.time() + timeout
    while not done() and time.time() < deadline:
        try:
            data = sock.recv(1 << 16)
        except socket.timeout:
            continue
        assert data, "the connection closed"
        yield from conn.receive_data(data)
        sock.sendall(conn.data_to_send())


def test_request_bytes_in_flight_are_bounded_before_buffering(start_server):
    s = start_server("--max-body-bytes", "1048576", "--max-inflight-body-bytes", "1500000", models=("mlp",))
    # One client states a 1 MB body and sends 900 KB of it: the bytes it sent are held.
    slow = socket.create_connection(("127.0.0.1", s.port))
    slow.sendall(head_of(1_000_000) + b"{\"inputs\"" + b" " * 900_000)
    time.sleep(0.3)
    # Another 1 MB body does not fit beside them: refused at once, before any of it is read (the
    # client sends only the head and gets its answer).
    other = socket.create_connection(("127.0.0.1", s.port))
    other.sendall(head_of(1_000_000))
    other.settimeout(5)
    answer = other.recv(4096)
    other.close()
    assert answer.startswith(b"HTTP/1.1 503") and b"in flight" in answer and b"retry-after: 1" in answer.lower(), answer
    # Small requests still fit (and requests without a body hold nothing); so does a small gzip
    # body, but not one that decompresses past what is left: its output is held as it is written.
    assert send(s, "POST", MLP, JSON, mlp_body())[0] == 200
    assert all(send(s, "GET", "/v2/models/mlp")[0] == 200 for _ in range(5))
    gz = {**JSON, "Content-Encoding": "gzip"}
    assert send(s, "POST", MLP, gz, gzip.compress(mlp_body()))[0] == 200
    bomb = send(s, "POST", MLP, gz, gzip.compress(b" " * 1_000_000))
    assert bomb[0] == 503 and b"in flight" in bomb[1], bomb
    # Once the slow body is gone, large ones fit again.
    slow.close()
    time.sleep(0.3)
    assert send(s, "POST", MLP, JSON, b" " * 1_000_000)[0] == 400
    assert send(s, "POST", MLP, gz, gzip.compress(b" " * 1_000_000))[0] == 400


def test_bodies_stated_large_and_sent_slowly_hold_only_what_they_sent(start_server):
    """A request holds the bytes its body has sent, not what its head says it will send: before,
    seventeen heads stating 64 MB bodies (or stating gzip, which held a decompressed body's worth
    more) held a 1 GiB budget for the body timeout, and every other request got 503, again and
    again, at the cost of a few hundred bytes."""
    s = start_server("--max-body-bytes", "1048576", "--max-inflight-body-bytes", str(4 << 20), models=("mlp",))
    held = []
    for i in range(20):
        c = socket.create_connection(("127.0.0.1", s.port))
        gz = b"Content-Encoding: gzip\r\n" if i % 2 else b""
        c.sendall(head_of(100 if gz else 1_000_000, gz) + b"\x1f")
        held.append(c)
    time.sleep(0.5)
    for c in held:
        c.setblocking(False)
        with pytest.raises(BlockingIOError):
            c.recv(4096)  # not refused: still sending
    assert send(s, "POST", MLP, JSON, mlp_body())[0] == 200
    assert send(s, "POST", MLP, JSON, b" " * 1_000_000)[0] == 400  # read whole, then found not JSON
    for c in held:
        c.close()


def test_keep_alive_connections_idle_past_the_timeout_are_closed(start_server):
    s = start_server("--http-idle-timeout-secs", "1", models=("mlp",))
    conn = http.client.HTTPConnection(s.url, timeout=10)
    conn.request("POST", MLP, mlp_body(), JSON)
    assert conn.getresponse().read()
    # Idle, with no request in flight: closed after the idle timeout.
    assert closed_within(conn.sock, 3.0), "an idle keep-alive connection stayed open"
    conn.close()
    # A connection in use is not cut: requests one after the other, each under the timeout.
    conn = http.client.HTTPConnection(s.url, timeout=10)
    for _ in range(4):
        conn.request("POST", MLP, mlp_body(), JSON)
        r = conn.getresponse()
        r.read()
        assert r.status == 200
        time.sleep(0.5)
    conn.close()


def sockets_of(pid):
    """The sockets the process holds; an fd closed between listing and reading it is not one."""
    count = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            count += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
        except FileNotFoundError:
            pass
    return count


def idle_sockets_of(pid):
    """The sockets a server holds with no client connected: the fewest seen over half a second (the
    connection of its readiness probe may not be closed yet on its side: a count taken then was one
    over, and the test waiting for it saw the count fall below and failed)."""
    seen = []
    for _ in range(5):
        seen.append(sockets_of(pid))
        time.sleep(0.1)
    return min(seen)


def test_answers_a_client_does_not_read_are_dropped_with_its_connection(start_server, tmp_path):
    """A client that sends requests with large answers and never reads them: each connection is
    closed once its writes have made no progress for the idle timeout, and the memory of the
    answers it held goes with it (before, six such connections held 300 MB for good)."""
    from conftest import make_repository
    repo = make_repository(tmp_path / "repo", ("scale",))
    (repo / "scale" / "config.toml").write_text("max_batch_size = 2000000\n")
    s = start_server("--http-idle-timeout-secs", "3", "--max-body-bytes", str(64 << 20), repository=repo)
    rows = 1_000_000  # 16 MB in and 16 MB out: more than the sockets' buffers hold
    x = np.ones((rows, 4), np.float32).tobytes()
    header = json.dumps({"inputs": [{"name": "x", "shape": [rows, 4], "datatype": "FP32",
                                     "parameters": {"binary_data_size": len(x)}}],
                         "parameters": {"binary_data_output": True}}).encode()
    listening = idle_sockets_of(s.proc.pid)
    socks = []
    for _ in range(6):
        sock = socket.create_connection(("127.0.0.1", s.port))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.sendall(b"POST /v2/models/scale/infer HTTP/1.1\r\nHost: x\r\nInference-Header-Content-Length: %d\r\n"
                     b"Content-Length: %d\r\n\r\n" % (len(header), len(header) + len(x)) + header + x)
        socks.append(sock)
    try:
        # Computed, answered, never read: the server lets each connection go (the socket reads
        # nothing, so the client cannot see it close), and the answers' memory with it.
        time.sleep(1)
        held, open_ = rss_kib(s.proc.pid), sockets_of(s.proc.pid) - listening
        assert open_ >= 3, f"only {open_} of the connections were open a second after their requests"
        deadline = time.time() + 20
        while sockets_of(s.proc.pid) > listening and time.time() < deadline:
            time.sleep(0.2)
        assert sockets_of(s.proc.pid) == listening, "connections whose answers were never read stayed open"
        # (Part of what they held goes back to the pools that bodies and outputs reuse, not to the system.)
        gone = held - rss_kib(s.proc.pid)
        assert gone > 16 * 1024, f"{open_} unread 16 MB answers closed, {gone} KiB given back"
        # A client that reads slowly but steadily gets its whole answer.
        conn = http.client.HTTPConnection(s.url, timeout=30)
        conn.request("POST", "/v2/models/scale/infer", header + x, {"Inference-Header-Content-Length": str(len(header))})
        resp = conn.getresponse()
        got = 0
        while chunk := resp.read(4 << 20):
            got += len(chunk)
            time.sleep(0.3)
        assert resp.status == 200 and got > len(x)
    finally:
        for sock in socks:
            sock.close()


def h2_request_held_without_window(port, path, headers, body, window=0):
    """Opens an HTTP/2 connection that grants the server no window for its answers (SETTINGS
    INITIAL_WINDOW_SIZE 0, or `window` bytes a stream, never a WINDOW_UPDATE) and sends one
    request on it, whole."""
    import h2.config
    import h2.connection
    import h2.settings
    sock = socket.create_connection(("127.0.0.1", port))
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
    conn.initiate_connection()
    conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: window})
    sock.sendall(conn.data_to_send())
    h2_send(sock, conn, path, headers, body)
    return sock, conn


def h2_send(sock, conn, path, headers, body):
    """Sends one request on a new stream of `conn`, as fast as the server's windows allow."""
    sid = conn.get_next_available_stream_id()
    conn.send_headers(sid, [(":method", "POST"), (":scheme", "http"), (":path", path), (":authority", "x"),
                            ("content-length", str(len(body))), *headers])
    while body:
        n = min(conn.local_flow_control_window(sid), conn.max_outbound_frame_size, len(body))
        if n:
            conn.send_data(sid, body[:n], end_stream=n == len(body))
            body = body[n:]
        else:  # (what arrives meanwhile is kept for the caller)
            conn.early_events = getattr(conn, "early_events", []) + conn.receive_data(sock.recv(1 << 16))
        sock.sendall(conn.data_to_send())


def answer_pings(clients):
    """Takes what the server sent on each connection and acks its pings, as a live client would."""
    for sock, conn in clients:
        sock.setblocking(False)
        try:
            while data := sock.recv(1 << 16):
                conn.receive_data(data)
        except (BlockingIOError, OSError):
            pass
        try:
            sock.sendall(conn.data_to_send())
        except OSError:
            pass


@pytest.mark.parametrize("listener", ["grpc", "http"])
def test_answers_a_client_grants_no_http2_window_for_are_dropped_with_its_connection(start_server, tmp_path, listener):
    """An HTTP/2 client that acks the server's frames but never opens a window for its answers:
    each connection is closed once it has taken no bytes of them for the idle timeout, and the
    answers go with it (before, a gRPC call's answer counted as a call in flight: held for good)."""
    from conftest import make_repository
    from tritonclient.grpc import service_pb2
    repo = make_repository(tmp_path / "repo", ("scale",))
    (repo / "scale" / "config.toml").write_text("max_batch_size = 2000000\n")
    s = start_server("--http-idle-timeout-secs", "5", "--max-body-bytes", str(64 << 20),
                     "--max-inflight-body-bytes", str(256 << 20), repository=repo)
    rows = 1_000_000  # 16 MB in and 16 MB out
    x = np.ones((rows, 4), np.float32).tobytes()
    if listener == "grpc":
        req = service_pb2.ModelInferRequest(model_name="scale", raw_input_contents=[x])
        t = req.inputs.add()
        t.name, t.datatype = "x", "FP32"
        t.shape.extend([rows, 4])
        msg = req.SerializeToString()
        port, path, body = s.grpc_port, "/inference.GRPCInferenceService/ModelInfer", b"\0" + struct.pack(">I", len(msg)) + msg
        headers = [("content-type", "application/grpc"), ("te", "trailers")]
    else:
        header = json.dumps({"inputs": [{"name": "x", "shape": [rows, 4], "datatype": "FP32",
                                         "parameters": {"binary_data_size": len(x)}}],
                             "parameters": {"binary_data_output": True}}).encode()
        port, path, body = s.port, "/v2/models/scale/infer", header + x
        headers = [("inference-header-content-length", str(len(header)))]
    listening = idle_sockets_of(s.proc.pid)
    clients = [h2_request_held_without_window(port, path, headers, body) for _ in range(4)]
    try:
        time.sleep(0.5)
        answer_pings(clients)
        held, open_ = rss_kib(s.proc.pid), sockets_of(s.proc.pid) - listening
        assert open_ == 4, f"{open_} of the 4 connections were open a second after their requests"
        deadline = time.time() + 20
        while sockets_of(s.proc.pid) > listening and time.time() < deadline:
            answer_pings(clients)
            time.sleep(0.2)
        assert sockets_of(s.proc.pid) == listening, "connections that granted no window for their answers stayed open"
        if listener == "grpc":  # (an HTTP answer's buffers go back to the body pool, trimmed later)
            gone = held - rss_kib(s.proc.pid)
            assert gone > 16 * 1024, f"4 unsent 16 MB answers closed, {gone} KiB given back"
        # A client opening its window a little at a time, for longer than the timeout in all, gets
        # its whole answer.
        sock, conn = h2_request_held_without_window(port, path, headers, body)
        clients.append((sock, conn))
        assert len(slowly_taken(sock, conn, step=1 << 20, pause=0.4)) > len(x)
    finally:
        for sock, _ in clients:
            sock.close()


def computed(s, n, meanwhile=lambda: None):
    """Waits (60 s at most) until the `decoded` pipeline has computed `n` requests."""
    deadline = time.time() + 60
    while time.time() < deadline:
        stats = http.client.HTTPConnection(s.url, timeout=10)
        stats.request("GET", "/v2/models/decoded/stats")
        if json.loads(stats.getresponse().read())["model_stats"][0]["inference_count"] >= n:
            return
        meanwhile()
        time.sleep(0.2)


GRPC_HEADERS = [("content-type", "application/grpc"), ("te", "trailers")]


def decoded_server(start_server, tmp_path, idle=30, budget=32 << 20, side=1500):
    """A server of a pipeline decoding an image to UINT8 pixels, 32 MB of bytes in flight, and a
    1,500x1,500 PNG of a few KB (6.75 MB decoded) as one BYTES element."""
    import io
    from PIL import Image
    repo = tmp_path / "repo"
    (repo / "decoded").mkdir(parents=True)
    (repo / "decoded" / "config.toml").write_text(
        '[[steps]]\nop = "decode_image"\n[[steps]]\nop = "normalize"\ndtype = "UINT8"\nlayout = "NHWC"\n')
    s = start_server("--max-inflight-body-bytes", str(budget), "--http-idle-timeout-secs", str(idle), repository=repo)
    png = io.BytesIO()
    Image.new("RGB", (side, side), (9, 8, 7)).save(png, "PNG")
    return s, struct.pack("<I", len(png.getvalue())) + png.getvalue()


def grpc_decoded_message(raw):
    """A length-prefixed gRPC ModelInferRequest of `raw` for the decoding pipeline."""
    from tritonclient.grpc import service_pb2
    req = service_pb2.ModelInferRequest(model_name="decoded", raw_input_contents=[raw])
    t = req.inputs.add()
    t.name, t.datatype = "image", "BYTES"
    t.shape.extend([1])
    msg = req.SerializeToString()
    return b"\0" + struct.pack(">I", len(msg)) + msg


@pytest.mark.parametrize("listener", ["grpc", "http"])
def test_answers_held_for_a_client_count_against_the_bytes_in_flight(start_server, tmp_path, listener):
    """Small requests with large answers (a 1,500x1,500 PNG of a few KB decoded to 6.75 MB), many
    streams on one HTTP/2 connection that opens no window for them: the answers held count against
    --max-inflight-body-bytes, so past it the next ones are refused (503 / UNAVAILABLE) and their
    memory freed, instead of every answer being held (before: all twelve, 81 MB)."""
    import h2.events
    s, raw = decoded_server(start_server, tmp_path)
    if listener == "grpc":
        port, path, body = s.grpc_port, "/inference.GRPCInferenceService/ModelInfer", grpc_decoded_message(raw)
        headers = GRPC_HEADERS
    else:
        header = json.dumps({"inputs": [{"name": "image", "shape": [1], "datatype": "BYTES",
                                         "parameters": {"binary_data_size": len(raw)}}],
                             "parameters": {"binary_data_output": True}}).encode()
        port, path, body = s.port, "/v2/models/decoded/infer", header + raw
        headers = [("inference-header-content-length", str(len(header)))]
    sock, conn = h2_request_held_without_window(port, path, headers, body)
    for _ in range(11):
        h2_send(sock, conn, path, headers, body)
    # Each stream's answer: its HTTP status, and for gRPC, a refusal's grpc-status in headers alone.
    answered, refused = {}, 0
    for event in h2_events(sock, conn, lambda: len(answered) >= 12):
        if isinstance(event, h2.events.ResponseReceived):
            got = dict(event.headers)
            answered[event.stream_id] = got
            refused += got[":status"] == "503" or got.get("grpc-status") == "14"
    sock.close()
    assert len(answered) == 12, f"{len(answered)} of 12 streams answered"
    # 32 MB of budget, 6.75 MB an answer held: at most four kept.
    assert refused >= 8, f"{refused} of 12 answers refused"
    # The connection gone, its answers' bytes are free again.
    time.sleep(0.5)
    sock, conn = h2_request_held_without_window(port, path, headers, body)
    assert len(slowly_taken(sock, conn, step=8 << 20, pause=0)) > 1500 * 1500 * 3
    sock.close()


def test_a_streams_answers_held_for_it_count_against_the_bytes_in_flight(start_server, tmp_path):
    """The same on one ModelStreamInfer stream: twelve requests answered while the client opens no
    window, then it reads them all: past the budget, the answers are errors of their own (the
    stream goes on) rather than twelve held (before: all twelve answered, 81 MB held)."""
    from tritonclient.grpc import service_pb2
    s, raw = decoded_server(start_server, tmp_path)
    sock, conn = h2_request_held_without_window(s.grpc_port, "/inference.GRPCInferenceService/ModelStreamInfer",
                                                GRPC_HEADERS, grpc_decoded_message(raw) * 12)
    computed(s, 12)  # all twelve answered
    data = slowly_taken(sock, conn, step=128 << 20, pause=0)
    sock.close()
    answers = []
    while data:
        n = struct.unpack(">I", data[1:5])[0]
        answers.append(service_pb2.ModelStreamInferResponse.FromString(data[5:5 + n]))
        data = data[5 + n:]
    assert len(answers) == 12, len(answers)
    refused = [a for a in answers if "answer bytes in flight" in a.error_message]
    # Four held in the budget, and the one the stream has handed on to be sent.
    assert len(refused) >= 7 and all(len(a.infer_response.raw_output_contents) == 0 for a in refused), \
        [a.error_message for a in answers]
    assert all(a.infer_response.raw_output_contents[0] for a in answers if not a.error_message)


def test_streams_whose_answers_are_not_taken_hold_them_in_the_budget_and_are_closed(start_server, tmp_path):
    """Thirty ModelStreamInfer streams of one request each on a connection that opens no window:
    each stream's answer holds its bytes of the budget until the client takes it (before, the one
    answer a stream had handed on to be sent held none: 200 MB past a 32 MB budget), and a
    connection whose answers wait on the client counts as idle however many streams are open on
    it (before, an open stream kept it, and those answers, for good)."""
    s, raw = decoded_server(start_server, tmp_path, idle=3)
    path, body = "/inference.GRPCInferenceService/ModelStreamInfer", grpc_decoded_message(raw)
    before = rss_kib(s.proc.pid)
    sock, conn = h2_request_held_without_window(s.grpc_port, path, GRPC_HEADERS, body)
    for _ in range(29):
        h2_send(sock, conn, path, GRPC_HEADERS, body)
    computed(s, 30, lambda: answer_pings([(sock, conn)]))  # all thirty answered
    grew = (rss_kib(s.proc.pid) - before) >> 10
    assert grew < 64, f"{grew} MB held for thirty answers not taken, past a budget of 32"
    closed, deadline = False, time.time() + 15
    while not closed and time.time() < deadline:  # a live client: it acks the server's pings
        time.sleep(0.2)
        sock.setblocking(False)
        try:
            data = sock.recv(1 << 16)
            closed = not data
            conn.receive_data(data)
            sock.sendall(conn.data_to_send())
        except BlockingIOError:
            pass
        except OSError:
            closed = True
    sock.close()
    assert closed, "a connection whose streams' answers were never taken stayed open"
    # Its answers' bytes are free again: a fresh large answer is served whole.
    sock, conn = h2_request_held_without_window(s.grpc_port, "/inference.GRPCInferenceService/ModelInfer",
                                                GRPC_HEADERS, body)
    assert len(slowly_taken(sock, conn, step=8 << 20, pause=0)) > 1500 * 1500 * 3
    sock.close()


@pytest.mark.parametrize("way", ["http1", "http2", "grpc", "grpc-stream"])
def test_answers_hold_their_bytes_in_flight_until_written(start_server, tmp_path, way):
    """Thirty 6.75 MB answers a client takes no more of than its first bytes: hyper ends an
    answer's body once it has its last bytes, and h2 buffers them whatever their size, so an
    answer whose body held its bytes of the budget gave them back while all of it waited on the
    client (HTTP/1: thirty connections not reading; HTTP/2: a window of the answer's first frame
    and a byte; gRPC: a byte). Before, all thirty were kept, 200 MB past a budget of 32; now the
    bytes hold the budget until written, and the rest are refused."""
    s, raw = decoded_server(start_server, tmp_path)
    header = json.dumps({"inputs": [{"name": "image", "shape": [1], "datatype": "BYTES",
                                     "parameters": {"binary_data_size": len(raw)}}],
                         "parameters": {"binary_data_output": True}}).encode()
    http_path, http_headers = "/v2/models/decoded/infer", [("inference-header-content-length", str(len(header)))]
    # One answer taken whole, for the length of its JSON header: an HTTP answer's first piece.
    conn = http.client.HTTPConnection(s.url, timeout=30)
    conn.request("POST", http_path, header + raw, dict(http_headers))
    got = conn.getresponse()
    assert got.status == 200 and len(got.read()) > 1500 * 1500 * 3
    json_len = int(got.getheader("inference-header-content-length"))
    time.sleep(0.5)
    before = rss_kib(s.proc.pid)
    socks = []
    try:
        if way == "http1":
            for _ in range(30):
                c = socket.create_connection(("127.0.0.1", s.port))
                c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                c.sendall(b"POST %s HTTP/1.1\r\nHost: x\r\nInference-Header-Content-Length: %d\r\n"
                          b"Content-Length: %d\r\n\r\n" % (http_path.encode(), len(header), len(header + raw))
                          + header + raw)
                socks.append(c)
        else:
            if way == "http2":
                port, path, body, headers, window = s.port, http_path, header + raw, http_headers, json_len + 1
            else:
                path = "/inference.GRPCInferenceService/" + ("ModelStreamInfer" if way == "grpc-stream" else "ModelInfer")
                port, body, headers, window = s.grpc_port, grpc_decoded_message(raw), GRPC_HEADERS, 1
            sock, conn = h2_request_held_without_window(port, path, headers, body, window)
            socks.append(sock)
            for _ in range(29):
                h2_send(sock, conn, path, headers, body)
        computed(s, 31)  # all thirty (and the first) computed
        time.sleep(0.5)
        grew = (rss_kib(s.proc.pid) - before) >> 10
        assert grew < 64, f"{grew} MB held for thirty answers not taken, past a budget of 32"
    finally:
        for c in socks:
            c.close()


@pytest.mark.parametrize("listener", ["grpc", "http"])
def test_small_answers_count_against_the_bytes_in_flight_too(start_server, tmp_path, listener):
    """150 answers of 48 KB each (a 128x128 PNG decoded) on one HTTP/2 connection that takes only
    their first bytes: small answers hold their bytes of the budget until written as large ones
    do, so past a budget of 4 MB they are refused (before, answers under 64 KiB held none: all 150
    kept, and 1,024 streams a connection could each keep one)."""
    import h2.events
    s, raw = decoded_server(start_server, tmp_path, budget=4 << 20, side=128)
    if listener == "grpc":
        port, path, body, headers, window = (s.grpc_port, "/inference.GRPCInferenceService/ModelInfer",
                                             grpc_decoded_message(raw), GRPC_HEADERS, 1)
    else:
        header = json.dumps({"inputs": [{"name": "image", "shape": [1], "datatype": "BYTES",
                                         "parameters": {"binary_data_size": len(raw)}}],
                             "parameters": {"binary_data_output": True}}).encode()
        conn = http.client.HTTPConnection(s.url, timeout=30)
        conn.request("POST", "/v2/models/decoded/infer", header + raw, {"Inference-Header-Content-Length": str(len(header))})
        got = conn.getresponse()
        assert got.status == 200 and len(got.read()) > 128 * 128 * 3
        port, path, body, window = s.port, "/v2/models/decoded/infer", header + raw, int(got.getheader("inference-header-content-length")) + 1
        headers = [("inference-header-content-length", str(len(header)))]
    sock, conn = h2_request_held_without_window(port, path, headers, body, window)
    for _ in range(149):
        h2_send(sock, conn, path, headers, body)
    answered, refused, events = 0, 0, getattr(conn, "early_events", [])
    sock.settimeout(1)
    deadline = time.time() + 60
    while answered < 150 and time.time() < deadline:
        for event in events:
            if isinstance(event, h2.events.ResponseReceived):
                got = dict(event.headers)
                answered += 1
                refused += got[":status"] == "503" or got.get("grpc-status") == "14"
        sock.sendall(conn.data_to_send())
        try:
            data = sock.recv(1 << 16)
        except socket.timeout:
            events = []
            continue
        assert data, "the connection closed"
        events = conn.receive_data(data)
    sock.close()
    assert answered == 150, f"{answered} of 150 streams answered"
    # 4 MB of budget, 48 KB an answer: about 85 held.
    assert refused >= 50, f"{refused} of 150 answers refused"


def slowly_taken(sock, conn, step, pause):
    """The answer on `conn`'s stream 1, granting the server `step` bytes of window every `pause` s."""
    import h2.events
    got, ended = [], False
    sock.setblocking(True)
    sock.settimeout(30)
    while not ended:
        conn.increment_flow_control_window(step)
        conn.increment_flow_control_window(step, 1)
        sock.sendall(conn.data_to_send())
        taken = 0
        while taken < step and not ended:
            data = sock.recv(1 << 16)
            assert data, "the server closed the connection of a client taking its answer slowly"
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.DataReceived):
                    got.append(event.data)
                    taken += event.flow_controlled_length
                ended |= isinstance(event, (h2.events.StreamEnded, h2.events.StreamReset))
            sock.sendall(conn.data_to_send())
        time.sleep(pause)
    return b"".join(got)


def test_the_grpc_listener_closes_silent_connections_and_holds_its_cap(start_server):
    s = start_server("--http-max-connections", "10", "--http-header-timeout-secs", "1", models=("mlp",))
    silent = [socket.create_connection(("127.0.0.1", s.grpc_port)) for _ in range(10)]
    time.sleep(0.3)
    extra = socket.create_connection(("127.0.0.1", s.grpc_port))
    assert closed_within(extra, 1.0), "a connection over the cap was kept"
    assert all(closed_within(x, 3.0) for x in silent), "silent gRPC connections stayed open"
    import tritonclient.grpc as grpcclient
    assert grpcclient.InferenceServerClient(s.grpc_url).is_server_live()


def slow_grpc_request(rows):
    from tritonclient.grpc import service_pb2
    req = service_pb2.ModelInferRequest(model_name="slow", raw_input_contents=[np.full((rows, 512), 0.25, np.float32).tobytes()])
    t = req.inputs.add()
    t.name, t.datatype = "x", "FP32"
    t.shape.extend([rows, 512])
    return req


def test_grpc_message_bytes_in_flight_share_the_body_budget(start_server, tmp_path):
    import grpc
    from concurrent.futures import ThreadPoolExecutor
    from tritonclient.grpc import service_pb2_grpc
    from conftest import make_repository
    repo = make_repository(tmp_path / "repo", ("slow",))
    (repo / "slow" / "config.toml").write_text("max_batch_size = 512\n")
    s = start_server("--max-inflight-body-bytes", "1500000", repository=repo)
    stub = service_pb2_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(s.grpc_url))
    # A 1 MB message whose answer takes seconds holds its bytes until it is answered...
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(stub.ModelInfer, slow_grpc_request(500), timeout=120)
        time.sleep(0.5)
        assert not held.done()
        # ...so a second one does not fit beside it: refused with a retry hint, not buffered.
        with pytest.raises(grpc.RpcError) as refused:
            stub.ModelInfer(slow_grpc_request(500), timeout=30)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value
        assert "in flight" in refused.value.details()
        assert dict(refused.value.trailing_metadata()).get("retry-after") == "1"
        # Small messages still fit; once the first is answered, its bytes are free again.
        assert stub.ModelInfer(slow_grpc_request(1), timeout=60).raw_output_contents
        assert held.result().raw_output_contents
    # A stream's messages hold their bytes until answered too (before, each was freed once whole:
    # a stream could hold 256 messages, 16 GiB at the largest, past any budget). Past the budget a
    # stream is not read further until there is room (its client's window closes meanwhile),
    # rather than ending: before, it ended UNAVAILABLE, the requests behind those in flight lost.
    def holding(room):
        """A client whose body, stated and partly sent, holds all but `room` KiB of the budget."""
        sock = socket.create_connection(("127.0.0.1", s.port))
        sent = 1_500_000 - (room << 10) - 100
        sock.sendall(head_of(sent + 100, model=b"slow") + b" " * sent)
        time.sleep(0.5)
        return sock

    # While another client's body holds all of it, four messages sent at once wait; once that
    # client has gone, all four are answered...
    with ThreadPoolExecutor(1) as pool:
        holder = holding(0)
        stream = pool.submit(lambda: list(stub.ModelStreamInfer(iter([slow_grpc_request(10)] * 4), timeout=120)))
        time.sleep(1.5)
        assert not stream.done(), stream.exception()
        holder.close()
        answers = stream.result()
    assert len(answers) == 4 and all(a.infer_response.raw_output_contents for a in answers), answers
    # ...but a stream holding part of a message waits a second at most (streams each holding part
    # of one would wait for each other), then ends as before: a 600 KB message with 300 KiB free.
    holder = holding(300)
    began = time.time()
    with pytest.raises(grpc.RpcError) as refused:
        list(stub.ModelStreamInfer(iter([slow_grpc_request(300)]), timeout=60))
    waited = time.time() - began
    holder.close()
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE and "in flight" in refused.value.details()
    assert 1 <= waited < 10, waited
    # A gzip message (1 KB) decompressing to more than the room left waits that second too, and is
    # answered once the other client has gone (before, its stream ended at once)...
    zipped = service_pb2_grpc.GRPCInferenceServiceStub(
        grpc.insecure_channel(s.grpc_url, compression=grpc.Compression.Gzip))
    with ThreadPoolExecutor(1) as pool:
        holder = holding(300)
        stream = pool.submit(lambda: list(zipped.ModelStreamInfer(iter([slow_grpc_request(300)]), timeout=60)))
        time.sleep(0.3)
        assert not stream.done(), stream.exception()
        holder.close()
        answers = stream.result()
    assert len(answers) == 1 and answers[0].infer_response.raw_output_contents, answers
    # ...and ends as the plain one does when no room comes.
    holder = holding(300)
    with pytest.raises(grpc.RpcError) as refused:
        list(zipped.ModelStreamInfer(iter([slow_grpc_request(300)]), timeout=60))
    holder.close()
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE and "in flight" in refused.value.details()
    # ...and a stream sending each after the last one's answer is served, more than the budget in
    # all, is answered whole.
    import queue
    answered = queue.Queue()

    def one_by_one():
        for _ in range(4):
            yield slow_grpc_request(300)
            answered.get(timeout=60)

    answers = []
    for a in stub.ModelStreamInfer(one_by_one(), timeout=120):
        answers.append(a)
        answered.put(1)
    assert len(answers) == 4 and all(not a.error_message for a in answers), [a.error_message for a in answers]


TWO_TENANTS = "[tenants.noisy]\nrate = 1000\nburst = 1000\n[tenants.quiet]\nrate = 1000\nburst = 1000\n"


TENANT_TOKENS = "quiet-token-0123456789 infer tenant=quiet\nnoisy-token-0123456789 infer tenant=noisy\n" \
                "plain-token-0123456789 infer\n"


def acting_as(who, tokens):
    """The headers of a request acting for `who`: a listed tenant, a name made up ("guest-N"), or
    none (""); with `tokens` (`TENANT_TOKENS`), the listed tenants' own tokens, else the one bound
    to no tenant, which may name any tenant the config does not list."""
    if not tokens:
        return {"X-Tenant": who} if who else {}
    if who in ("quiet", "noisy"):
        return {"Authorization": f"Bearer {who}-token-0123456789"}
    return {"Authorization": "Bearer plain-token-0123456789", **({"X-Tenant": who} if who else {})}


def tenants_server(start_server, tmp_path, flooder, *args, **kwargs):
    """A server with the tenants noisy and quiet listed; with tokens (`TENANT_TOKENS`) where the
    `flooder` makes names up, as a token bound to no tenant may."""
    cfg = tmp_path / "tenants.toml"
    cfg.write_text(TWO_TENANTS)
    tokens = tmp_path / "tokens"
    tokens.write_text(TENANT_TOKENS)
    with_tokens = ("--auth-token-file", str(tokens)) if flooder == "made-up" else ()
    return start_server(*args, "--tenant-header", "x-tenant", "--tenant-config", str(cfg), *with_tokens, **kwargs)


def flood_of(flooder, i):
    """Who the `i`th request of a flood acts for: a new name each where it makes them up."""
    return f"guest-{i}" if flooder == "made-up" else flooder


@pytest.mark.parametrize("flooder", ["noisy", "", "made-up"])
def test_a_tenant_holds_at_most_half_the_request_bytes_in_flight(start_server, tmp_path, flooder):
    """One tenant holding large bodies (all sent but their last bytes) cannot take the whole
    budget of bytes in flight: past half of it its own requests are refused, and another
    tenant's are served (before, four such bodies held all of it and every other request got
    503). Where tenants are configured, requests naming none (`flooder` "") hold their bytes
    within a share of their own as one more tenant would: they took the whole budget, and every
    tenant's requests got 503. So do those of a token bound to no tenant, naming a new tenant each
    ("made-up"): each name held a share of its own, and two of them the whole budget."""
    tokens = flooder == "made-up"
    s = tenants_server(start_server, tmp_path, flooder, "--max-inflight-body-bytes", str(32 << 20), models=("mlp",))
    slow, refused = [], 0
    for i in range(4):  # 8 MiB each, all but 100 bytes sent: two fill the tenant's half of 32 MiB
        named = acting_as(flood_of(flooder, i), tokens)
        c = socket.create_connection(("127.0.0.1", s.port))
        c.sendall(head_of(8 << 20, b"".join(b"%s: %s\r\n" % (k.encode(), v.encode()) for k, v in named.items())))
        c.settimeout(0.5)
        try:
            answer = c.recv(4096)
            assert answer.startswith(b"HTTP/1.1 503") and b"in flight" in answer, answer
            refused += 1
            c.close()
        except socket.timeout:
            c.sendall(b"{\"inputs\"" + b" " * ((8 << 20) - 110))
            slow.append(c)
            time.sleep(0.3)
    assert (len(slow), refused) == (2, 2)
    # The other tenants still find room; the flooder's share does not. Requests naming none share
    # one with names made up under a token; without tokens a name is taken on trust, its own.
    full = {"noisy": ["noisy"], "": [""], "made-up": ["", "guest-9"]}[flooder]
    for other in ("quiet", "noisy", "", "guest-9"):
        status = send(s, "POST", MLP, {**JSON, **acting_as(other, tokens)}, mlp_body())[0]
        assert status == (503 if other in full else 200), other
    for c in slow:
        c.close()
    time.sleep(0.3)
    assert send(s, "POST", MLP, {**JSON, **acting_as(flood_of(flooder, 9), tokens)}, mlp_body())[0] == 200


@pytest.mark.parametrize("flooder", ["noisy", "", "made-up"])
def test_a_tenant_holds_at_most_half_the_grpc_bytes_in_flight(start_server, tmp_path, flooder):
    """As over HTTP: a tenant's 1 MB messages held in a slow model take at most half the budget,
    and another tenant's message of the same size is served beside them; so are requests naming
    no tenant, or each a made-up one under a token bound to none, where tenants are configured."""
    import grpc
    from concurrent.futures import ThreadPoolExecutor
    from tritonclient.grpc import service_pb2_grpc
    from conftest import make_repository
    repo = make_repository(tmp_path / "repo", ("slow",))
    (repo / "slow" / "config.toml").write_text("max_batch_size = 512\n")
    tokens = flooder == "made-up"
    s = tenants_server(start_server, tmp_path, flooder, "--max-inflight-body-bytes", "3200000", repository=repo)
    stub = service_pb2_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(s.grpc_url))

    def metadata(who):
        return [(k.lower(), v) for k, v in acting_as(who, tokens).items()]

    with ThreadPoolExecutor(3) as pool:
        calls = []
        # All three sent while the first runs (500 rows: 0.66 s on two threads of a fast core), so
        # the first still holds its bytes when the third comes.
        for i in range(3):  # before, all three fit the budget (3 MB of 3.2) and were held
            calls.append(pool.submit(stub.ModelInfer, slow_grpc_request(500), timeout=120,
                                     metadata=metadata(flood_of(flooder, i))))
            time.sleep(0.1)
        assert stub.ModelInfer(slow_grpc_request(500), timeout=120, metadata=metadata("quiet")).raw_output_contents
        codes = [c.exception().code() if c.exception() else grpc.StatusCode.OK for c in calls]
    assert codes == [grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAVAILABLE], codes


def threads(pid):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("Threads:"):
            return int(line.split()[1])


def grpc_status(sock, conn, timeout=60):
    """The grpc-status a call on `conn`'s only stream ended with (in its headers or trailers)."""
    import h2.events
    sock.settimeout(1)
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            data = sock.recv(1 << 16)
        except socket.timeout:
            continue
        if not data:
            return "closed"
        for event in conn.receive_data(data):
            if isinstance(event, (h2.events.ResponseReceived, h2.events.TrailersReceived)):
                if "grpc-status" in dict(event.headers):
                    return dict(event.headers)["grpc-status"]
        sock.sendall(conn.data_to_send())
    return "no answer"


def test_compressed_grpc_messages_wait_their_turn_without_a_thread(start_server):
    """Each compressed gRPC message waiting for its turn to be decompressed held a thread
    (`block_in_place`): 600 at once, 16 KB each, took all 512 of tokio's blocking pool, and with it
    the runtime's hand-over of its I/O threads: a plain request waited 8.8 s. They now wait without
    one: a hundred at once leave the server's threads as they were, a plain request is answered
    beside them, and each is answered in turn (past the decoding limit: RESOURCE_EXHAUSTED)."""
    import h2.config
    import h2.connection
    import tritonclient.grpc as grpcclient
    from tritonclient.grpc import service_pb2
    s = start_server("--grpc-max-decoding-message-size", str(8 << 20), models=("mlp",))
    req = service_pb2.ModelInferRequest(model_name="mlp", raw_input_contents=[bytes(16 << 20)])
    t = req.inputs.add()
    t.name, t.datatype = "input", "FP32"
    t.shape.extend([(4 << 20) // 512, 512])
    msg = gzip.compress(req.SerializeToString())
    body = b"\1" + struct.pack(">I", len(msg)) + msg
    idle = threads(s.proc.pid)
    calls = []
    for _ in range(100):
        sock = socket.create_connection(("127.0.0.1", s.grpc_port))
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        conn.initiate_connection()
        sock.sendall(conn.data_to_send())
        h2_send(sock, conn, "/inference.GRPCInferenceService/ModelInfer", [*GRPC_HEADERS, ("grpc-encoding", "gzip")], body)
        calls.append((sock, conn))
    time.sleep(0.5)
    held = threads(s.proc.pid) - idle
    x = grpcclient.InferInput("input", [1, 512], "FP32")
    x.set_data_from_numpy(np.full((1, 512), 0.5, np.float32))
    began = time.time()
    assert grpcclient.InferenceServerClient(s.grpc_url).infer("mlp", [x]).as_numpy("output").shape == (1, 10)
    plain = time.time() - began
    statuses = [grpc_status(sock, conn) for sock, conn in calls]
    for sock, _ in calls:
        sock.close()
    print(f"\n100 compressed messages waiting: {held} threads more than idle; a plain request in {plain:.3f} s")
    assert held < 20, f"{held} threads held by 100 waiting messages"
    assert statuses == ["8"] * 100, statuses


def test_grpc_connections_with_no_call_open_are_closed_when_idle(start_server):
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc
    s = start_server("--http-idle-timeout-secs", "1", models=("mlp",))
    channel = grpc.insecure_channel(s.grpc_url)
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    states = []
    channel.subscribe(states.append)
    assert stub.ServerLive(service_pb2.ServerLiveRequest(), timeout=10).live
    # With no call open the server closes the connection: the channel leaves READY.
    deadline = time.time() + 5
    while time.time() < deadline and states[-1:] in ([grpc.ChannelConnectivity.READY], []):
        time.sleep(0.1)
    assert states[-1] != grpc.ChannelConnectivity.READY, states
    # An open stream is a call in flight: quiet for longer than the timeout, it is not cut.
    req = service_pb2.ModelInferRequest(model_name="mlp", raw_input_contents=[np.zeros((1, 512), np.float32).tobytes()])
    t = req.inputs.add()
    t.name, t.datatype = "input", "FP32"
    t.shape.extend([1, 512])

    def slowly():
        yield req
        time.sleep(2.5)
        yield req

    answers = list(stub.ModelStreamInfer(slowly(), timeout=30))
    assert len(answers) == 2 and not any(a.error_message for a in answers)
    channel.close()


def peak_rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))


def test_grpc_messages_of_many_small_fields_are_refused_before_decoding(start_server):
    """What prost makes of a message is not its size: an empty `inputs` entry is 2 bytes on the
    wire and a few hundred once decoded (one 64 MiB message took 10 GB), an empty TEI text 2 and
    24. Such messages are refused (RESOURCE_EXHAUSTED) before they are decoded, whether the call's
    body captured them (a large unary ModelInfer), or tonic read them (a stream's, TEI's)."""
    import grpc
    import tritonclient.grpc as grpcclient
    s = start_server("--grpc-max-decoding-message-size", str(8 << 20), models=("mlp", "text_encoder", "text_embedder"))
    empties = b"\x0a\x03mlp" + b"\x2a\x00" * (2 << 20)  # model_name, then 2M empty inputs: 4 MiB
    texts = b"\x0a\x01q" + b"\x12\x00" * (2 << 20)  # RerankRequest: query, then 2M empty texts
    options = [("grpc.max_send_message_length", -1)]
    before = peak_rss_kib(s.proc.pid)
    with grpc.insecure_channel(s.grpc_url, options=options) as channel:
        calls = [
            lambda: channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")(empties, timeout=60),
            lambda: list(channel.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer")(iter([empties]),
                                                                                                    timeout=60)),
            lambda: channel.unary_unary("/tei.v1.Rerank/Rerank")(texts, timeout=60),
        ]
        for call in calls:
            with pytest.raises(grpc.RpcError) as e:
                call()
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value.details()
            assert "once decoded" in e.value.details()
    grown = (peak_rss_kib(s.proc.pid) - before) >> 10
    print(f"\npeak RSS grew {grown} MB over three 4 MiB messages of empty entries")
    assert grown < 100, f"peak RSS grew {grown} MB"
    x = grpcclient.InferInput("input", [1, 512], "FP32")
    x.set_data_from_numpy(np.full((1, 512), 0.5, np.float32))
    assert grpcclient.InferenceServerClient(s.grpc_url).infer("mlp", [x]).as_numpy("output").shape == (1, 10)


def test_text_api_lists_are_bounded_as_they_are_read(start_server):
    """A text API's body of 16 MiB of empty strings was read whole before its texts were counted,
    through serde's untagged enums, which buffer every value first: 22 bytes of memory a byte of
    body (64 MiB took 1.4 GB, on an I/O thread, for seconds). Lists are now refused past the most
    any call takes (2048), as they are read; a load request's parameter values (JSON values: ten
    bytes a byte) are not kept."""
    s = start_server(models=("text_encoder", "text_embedder"))
    n = (16 << 20) // 3
    before = peak_rss_kib(s.proc.pid)
    for path, body, status in [
        ("/embed", b'{"inputs":[' + b'"",' * n + b'""]}', 422),
        ("/v1/embeddings", b'{"model":"text_embedder","input":[' + b'"",' * n + b'""]}', 400),
        ("/rerank", b'{"query":"q","texts":[' + b'"",' * n + b'""]}', 422),
        ("/decode", b'{"ids":[' + b"[]," * n + b"[]]}", 422),
    ]:
        got, answer = send(s, "POST", path, JSON, body)
        assert got == status, (path, answer[:300])
        assert b"2048" in answer, (path, answer[:300])
    # A load request's parameters are refused by name; their values are not kept.
    got, answer = send(s, "POST", "/v2/repository/models/text_encoder/load", JSON,
                       b'{"parameters":{"a":[' + b"[]," * n + b"[]]}}")
    assert got == 501, answer[:300]
    grown = (peak_rss_kib(s.proc.pid) - before) >> 10
    print(f"\npeak RSS grew {grown} MB over five 16 MiB bodies of empty entries")
    assert grown < 100, f"peak RSS grew {grown} MB"
    got, answer = send(s, "POST", "/embed", JSON, json.dumps({"inputs": ["a cat", "a dog"]}).encode())
    assert got == 200 and len(json.loads(answer)) == 2, answer[:300]


def test_v2_body_lists_and_parameters_are_bounded_as_they_are_read(start_server):
    """A V2 body's parameters, inputs, outputs and shapes were read whole before they were
    counted: a 64 MiB body of `"a":0` parameters took 1.3 GB (MessagePack's, 48 MiB, 2 GB), of
    shape dims 0.6 GB, of named inputs 0.3 GB. Each is now refused as it is read past what any
    request may hold (256 parameters an object, 256 inputs or outputs, 64 dims)."""
    s = start_server(models=("mlp",))
    n = 16 << 20
    bodies = [
        (JSON, b'{"parameters":{' + b'"a":0,' * (n // 6) + b'"a":0},"inputs":[]}', b"256 parameters"),
        (JSON, b'{"inputs":[{"name":"input","datatype":"FP32","data":[],"shape":[' + b"1," * (n // 2) + b"1]}]}",
         b"64 dims"),
        (JSON, b'{"inputs":[' + b'{"name":"a","shape":[],"datatype":"FP32","data":[]},' * (n // 52) + b"{}]}",
         b"256 inputs or outputs"),
        (JSON, b'{"inputs":[],"outputs":[' + b'{"name":"a"},' * (n // 13) + b'{"name":"a"}]}', b"256 inputs or outputs"),
        ({"Content-Type": "application/msgpack"}, b"\x82" + msgpack.packb("inputs") + b"\x90" + msgpack.packb("parameters")
         + b"\xdf" + struct.pack(">I", n // 3) + b"\xa1a\x00" * (n // 3), b"256 parameters"),
    ]
    before = peak_rss_kib(s.proc.pid)
    for headers, body, why in bodies:
        status, answer = send(s, "POST", MLP, headers, body)
        assert status == 400 and why in answer, answer[:300]
    grown = (peak_rss_kib(s.proc.pid) - before) >> 10
    print(f"\npeak RSS grew {grown} MB over five 16 MiB bodies of small entries")
    assert grown < 100, f"peak RSS grew {grown} MB"
    assert send(s, "POST", MLP, JSON, mlp_body())[0] == 200


def test_large_bodies_are_decoded_a_core_at_a_time(start_server):
    """The bytes in flight bound how many bodies are held, not how many are decoded at once, and
    a body may decode to many times its bytes: 8 MiB of JSON empty strings is a BYTES tensor of
    90 MB. Sixteen such bodies at once took 1 GB (release build); large bodies are now decoded
    one a core at a time."""
    import concurrent.futures
    s = start_server(models=("mlp",))
    n = (8 << 20) // 3
    body = b'{"inputs":[{"name":"input","datatype":"BYTES","shape":[%d],"data":[' % n + b'"",' * (n - 1) + b'""]}]}'
    before = peak_rss_kib(s.proc.pid)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: send(s, "POST", MLP, JSON, body, timeout=120), range(8)))
    assert all(status == 400 and b"expected datatype FP32" in answer for status, answer in answers), answers[0]
    grown = (peak_rss_kib(s.proc.pid) - before) >> 10
    print(f"\npeak RSS grew {grown} MB over eight 8 MiB bodies of empty strings at once")
    # The bodies held (64 MiB), and one decoding a core (90 MB each); all eight at once: 670 MB.
    cores = min(8, len(os.sched_getaffinity(0)))
    assert grown < 64 + 100 * cores + 60, f"peak RSS grew {grown} MB ({cores} cores)"


def echo_repository(tmp_path):
    """A repository of `echo`: an Identity model over strings `[N, S]`."""
    import onnx
    from onnx import TensorProto, helper
    repo = tmp_path / "repo"
    (repo / "echo" / "1").mkdir(parents=True)
    graph = helper.make_graph([helper.make_node("Identity", ["text"], ["out"])], "echo",
                              [helper.make_tensor_value_info("text", TensorProto.STRING, ["N", "S"])],
                              [helper.make_tensor_value_info("out", TensorProto.STRING, ["N", "S"])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    onnx.save(model, repo / "echo" / "1" / "model.onnx")
    return repo


def test_what_a_request_decodes_to_is_held_in_the_bytes_in_flight(start_server, tmp_path):
    """A body's bytes are held in the bytes in flight until it is answered, but what it decoded to
    was not: a BYTES element of JSON's three bytes (`"",`) holds 32 while queued, so requests
    within the budget could hold ten times it. What the inputs hold beyond the bytes already
    charged is now taken from the budget too, over HTTP and gRPC (calls and streams) alike: a
    request decoding to more than the budget can spare now is refused to retry (503 / UNAVAILABLE,
    with a retry hint), and one decoding to more than the whole budget, which no retry would
    serve, for good (413 / RESOURCE_EXHAUSTED, no hint)."""
    import tritonclient.grpc as grpcclient
    s = start_server("--max-inflight-body-bytes", str(32 << 20), repository=echo_repository(tmp_path))

    def body(n):
        return b'{"inputs":[{"name":"text","datatype":"BYTES","shape":[1,%d],"data":[' % n + b'"",' * (n - 1) + b'""]}]}'

    # 0.9 MiB decoding to 10 MB, within the budget; 4.2 MiB decoding to 45 MB, past the whole of it.
    small, large = body(300_000), body(1_400_000)
    ok = send(s, "POST", "/v2/models/echo/infer", JSON, small, timeout=120)
    assert ok[0] == 200, ok[1][:300]
    never = b"more than this server ever holds for all requests at once (33554432 bytes)"
    conn = http.client.HTTPConnection(s.url, timeout=120)
    conn.request("POST", "/v2/models/echo/infer", body=large, headers=JSON)
    answer = conn.getresponse()
    assert answer.status == 413 and never in answer.read(), answer.status
    assert answer.getheader("Retry-After") is None, "not to be retried"
    conn.close()
    # While another client's 28 MiB body (stated 31) holds most of the budget, the small one does
    # not fit now: to retry. Once that client has gone, it fits again.
    holder = socket.create_connection(("127.0.0.1", s.port))
    holder.sendall(head_of(31 << 20, model=b"echo") + b" " * (28 << 20))
    time.sleep(0.5)
    conn = http.client.HTTPConnection(s.url, timeout=120)
    conn.request("POST", "/v2/models/echo/infer", body=small, headers=JSON)
    answer = conn.getresponse()
    assert answer.status == 503 and b"too many request bytes in flight" in answer.read(), answer.status
    assert answer.getheader("Retry-After") == "1"
    conn.close()
    holder.close()
    time.sleep(0.3)
    assert send(s, "POST", "/v2/models/echo/infer", JSON, small, timeout=120)[0] == 200
    client = grpcclient.InferenceServerClient(s.grpc_url)

    def grpc(n):
        x = grpcclient.InferInput("text", [1, n], "BYTES")
        x.set_data_from_numpy(np.full((1, n), b"", dtype=np.object_))
        return client.infer("echo", [x])

    assert grpc(300_000).as_numpy("out").shape == (1, 300_000)
    # 5.6 MB on the wire (4 bytes an element), 45 MB decoded.
    with pytest.raises(Exception) as refused:
        grpc(1_400_000)
    assert "RESOURCE_EXHAUSTED" in str(refused.value) and never.decode() in str(refused.value), refused.value
    # A stream's messages alike: the large one answered with the error, the stream going on.
    import queue
    answers = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    for n in (1_400_000, 300_000):
        x = grpcclient.InferInput("text", [1, n], "BYTES")
        x.set_data_from_numpy(np.full((1, n), b"", dtype=np.object_))
        client.async_stream_infer("echo", [x])
        result, error = answers.get(timeout=120)
        if n > 300_000:
            assert error is not None and never.decode() in str(error), (result, error)
        else:
            assert error is None and result.as_numpy("out").shape == (1, n), error
    client.stop_stream()
    # Given back once answered: the small ones again.
    assert send(s, "POST", "/v2/models/echo/infer", JSON, small, timeout=120)[0] == 200


def test_a_large_body_the_model_would_refuse_is_refused_before_its_data_is_decoded(start_server):
    """A large body's inputs (past the 256 KiB decoded off the I/O threads) are checked against the
    model, name, datatype and shape, before their data is decoded: before, 4.2 MiB of JSON empty
    strings sent as BYTES to the MLP (FP32) were decoded to 45 MB first, and refused for what they
    decoded to (413 under a 32 MiB budget), or, within it, after paying for it."""
    s = start_server("--max-inflight-body-bytes", str(32 << 20), models=("mlp",))
    n = 1_400_000
    strings = {"name": "input", "datatype": "BYTES", "shape": [1, n]}
    body = json.dumps({"inputs": [{**strings, "data": [""] * n}]}).encode()
    wrong = b"input 'input': expected datatype FP32, got BYTES"
    for headers, sent in ((JSON, body), ({**JSON, "Content-Encoding": "gzip"}, gzip.compress(body)),
                          ({"Content-Type": "application/msgpack"}, msgpack.packb({"inputs": [{**strings, "data": [""] * n}]}))):
        status, text = send(s, "POST", "/v2/models/mlp/infer", headers, sent, timeout=120)
        assert status == 400 and wrong in text, (headers, status, text[:300])
    # A shape the model does not take likewise (the numbers would fit the budget and the limits).
    status, text = send(s, "POST", "/v2/models/mlp/infer", JSON,
                        json.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": [n],
                                                "data": [0] * n}]}).encode(), timeout=120)
    assert status == 400 and b"expected shape [-1, 512], got [1400000]" in text, (status, text[:300])
    # What the model takes is served as before (430 KB of JSON).
    body = json.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": [64, 512],
                                   "data": [0.123456789] * (64 * 512)}]}).encode()
    assert len(body) > 256 << 10
    status, text = send(s, "POST", "/v2/models/mlp/infer", JSON, body, timeout=120)
    assert status == 200 and json.loads(text)["outputs"][0]["shape"][0] == 64, (status, text[:300])


def test_an_answer_past_all_the_budget_could_ever_hold_is_refused_for_good(start_server, tmp_path):
    """An answer holds its bytes in flight until its client has taken them; one the budget cannot
    take is refused, 503 / UNAVAILABLE to retry. One larger than the whole budget, which no retry
    would serve, was told the same for ever; it is now refused for good (413 / RESOURCE_EXHAUSTED,
    no retry hint), over HTTP, gRPC calls and streams."""
    import onnx
    import tritonclient.grpc as grpcclient
    from onnx import TensorProto, helper
    repo = tmp_path / "repo"
    (repo / "zeros" / "1").mkdir(parents=True)
    graph = helper.make_graph([helper.make_node("ConstantOfShape", ["shape"], ["out"])], "zeros",
                              [helper.make_tensor_value_info("shape", TensorProto.INT64, [2])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["H", "W"])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    onnx.save(model, repo / "zeros" / "1" / "model.onnx")
    s = start_server("--max-inflight-body-bytes", str(4 << 20), repository=repo)

    def body(h, w):
        return json.dumps({"inputs": [{"name": "shape", "datatype": "INT64", "shape": [2], "data": [h, w]}],
                          "outputs": [{"name": "out", "parameters": {"binary_data": True}}]}).encode()

    # 1 MiB of zeros is answered; 8 MiB never fits a budget of 4.
    status, answer = send(s, "POST", "/v2/models/zeros/infer", JSON, body(256, 1024))
    assert status == 200 and len(answer) > 1 << 20, (status, answer[:200])
    conn = http.client.HTTPConnection(s.url, timeout=60)
    conn.request("POST", "/v2/models/zeros/infer", body=body(2048, 1024), headers=JSON)
    answer = conn.getresponse()
    text = answer.read()
    assert answer.status == 413 and b"this request's answer holds 8388" in text, (answer.status, text[:300])
    assert b"more than this server ever holds for all requests at once (4194304 bytes)" in text, text
    assert answer.getheader("Retry-After") is None
    conn.close()
    client = grpcclient.InferenceServerClient(s.grpc_url)

    def shape(h, w):
        x = grpcclient.InferInput("shape", [2], "INT64")
        x.set_data_from_numpy(np.array([h, w], dtype=np.int64))
        return [x]

    assert client.infer("zeros", shape(256, 1024)).as_numpy("out").shape == (256, 1024)
    with pytest.raises(Exception) as refused:
        client.infer("zeros", shape(2048, 1024))
    assert "RESOURCE_EXHAUSTED" in str(refused.value) and "answer holds" in str(refused.value), refused.value
    import queue
    answers = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    for h in (2048, 256):
        client.async_stream_infer("zeros", shape(h, 1024))
        result, error = answers.get(timeout=60)
        if h > 256:
            assert error is not None and "more than this server ever holds" in str(error), (result, error)
        else:
            assert error is None and result.as_numpy("out").shape == (h, 1024), error
    client.stop_stream()


def test_a_stream_message_sharing_its_frame_holds_what_it_decodes_to(start_server, tmp_path):
    """The messages of a stream that end in one HTTP/2 frame have their bytes held once, by the
    first; what the others decoded to was held nowhere. Two messages in one 16 KB frame, the second
    of 7,000 empty strings (224 KB decoded) under a 64 KiB budget: it was answered; now it is
    refused, as a message of its own would be, and the first is answered."""
    import h2.config
    import h2.connection
    import h2.events
    from tritonclient.grpc import service_pb2
    s = start_server("--max-inflight-body-bytes", str(64 << 10), repository=echo_repository(tmp_path))

    def message(n, id):
        req = service_pb2.ModelInferRequest(model_name="echo", id=id)
        t = req.inputs.add()
        t.name, t.datatype = "text", "BYTES"
        t.shape.extend([1, n])
        t.contents.bytes_contents.extend([b""] * n)
        raw = req.SerializeToString()
        return b"\0" + struct.pack(">I", len(raw)) + raw

    frame = message(1, "small") + message(7000, "large")
    sock = socket.create_connection(("127.0.0.1", s.grpc_port))
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
    conn.initiate_connection()
    sock.sendall(conn.data_to_send())
    assert len(frame) <= conn.max_outbound_frame_size, len(frame)
    sid = conn.get_next_available_stream_id()
    conn.send_headers(sid, [(":method", "POST"), (":scheme", "http"), (":authority", "x"),
                            (":path", "/inference.GRPCInferenceService/ModelStreamInfer"), *GRPC_HEADERS])
    conn.send_data(sid, frame)
    sock.sendall(conn.data_to_send())
    data, answers = b"", {}
    for event in h2_events(sock, conn, lambda: len(answers) >= 2):
        if isinstance(event, h2.events.DataReceived):
            data += event.data
            conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
        while len(data) >= 5 and len(data) >= 5 + struct.unpack(">I", data[1:5])[0]:
            n = struct.unpack(">I", data[1:5])[0]
            answer = service_pb2.ModelStreamInferResponse.FromString(data[5:5 + n])
            answers[answer.infer_response.id] = answer.error_message
            data = data[5 + n:]
    sock.close()
    assert answers.get("small") == "", answers
    assert "more than this server ever holds" in answers.get("large", "answered"), answers
