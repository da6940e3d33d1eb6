"""Triton's system shared-memory extension through tritonclient's own shared-memory utilities:
tensors in and out through POSIX shared memory over HTTP and gRPC, mixed with tensors in the
request, and what a client cannot do with it (another tenant's regions, past a region's end, an
object shrunk under the server, the extension while it is off)."""

import json
import os
import urllib.error
import urllib.request

import msgpack
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

CLIENTS = {"http": httpclient, "grpc": grpcclient}


def client(server, protocol):
    url = server.url if protocol == "http" else server.grpc_url
    return CLIENTS[protocol].InferenceServerClient(url)


@pytest.fixture
def regions(request):
    """Creates shared-memory objects for a test (keys unique to it); destroys them after."""
    made = []

    def make(name, byte_size):
        h = shm.create_shared_memory_region(name, f"/ferrite-{os.getpid()}-{request.node.name[:40]}-{name}", byte_size)
        made.append(h)
        return h

    yield make
    for h in made:
        shm.destroy_shared_memory_region(h)


def key_of(handle):
    return handle._shm_key


@pytest.fixture(scope="module")
def shm_server(tmp_path_factory):
    from conftest import Server, make_repository

    root = tmp_path_factory.mktemp("shm")
    repo = make_repository(root / "repo", ("mlp", "mixed"))
    # Requests of 7,000 rows: 14 MB inputs, read into the pooled buffers large bodies use, and
    # 280 KB outputs, written off the I/O threads.
    (repo / "mlp" / "config.toml").write_text("max_batch_size = 8192\n")
    tenants = root / "tenants.toml"
    tenants.write_text("[default]\nrate = 100000\nburst = 100000\n")
    s = Server(repo, "--shared-memory", "system", "--tenant-header", "x-tenant", "--tenant-config", str(tenants))
    yield s
    s.stop()


@pytest.mark.parametrize("rows", [3, 7000])
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_inputs_and_outputs_go_through_shared_memory_and_match_the_request_path(shm_server, regions, protocol, rows):
    c = client(shm_server, protocol)
    mod = CLIENTS[protocol]
    assert "system_shared_memory" in c.get_server_metadata(**({"as_json": True} if protocol == "grpc" else {}))[
        "extensions"]
    x = np.random.default_rng(rows).standard_normal((rows, 512)).astype(np.float32)
    inp, out = regions("in", x.nbytes + 64), regions("out", rows * 10 * 4)
    shm.set_shared_memory_region(inp, [x], offset=64)
    c.unregister_system_shared_memory()
    c.register_system_shared_memory("in", key_of(inp), x.nbytes, offset=64)
    c.register_system_shared_memory("out", key_of(out), rows * 10 * 4)
    status = c.get_system_shared_memory_status(**({"as_json": True} if protocol == "grpc" else {}))
    listed = status if protocol == "http" else list(status["regions"].values())
    assert sorted(r["name"] for r in listed) == ["in", "out"]

    i = mod.InferInput("input", [rows, 512], "FP32")
    i.set_shared_memory("in", x.nbytes)
    o = mod.InferRequestedOutput("output")
    o.set_shared_memory("out", rows * 10 * 4)
    r = c.infer("mlp", [i], outputs=[o])
    got = shm.get_contents_as_numpy(out, np.float32, [rows, 10])
    plain = mod.InferInput("input", [rows, 512], "FP32")
    plain.set_data_from_numpy(x)
    want = c.infer("mlp", [plain]).as_numpy("output")
    np.testing.assert_array_equal(got, want)
    meta = r.get_output("output")
    if protocol == "http":
        # As Triton: no data and no parameters (its C++ client reads parameters as binary data's).
        assert "data" not in meta and "parameters" not in meta, meta
    else:
        assert meta.parameters["shared_memory_region"].string_param == "out"
        assert r.get_response().raw_output_contents == [b""]

    c.unregister_system_shared_memory("in")
    with pytest.raises(InferenceServerException, match="no shared memory region 'in'"):
        c.infer("mlp", [i], outputs=[o])
    c.unregister_system_shared_memory()


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_shared_and_request_tensors_mix_in_one_request(shm_server, regions, protocol):
    """One input in shared memory and one in the request (gRPC: its raw contents are the other
    input's), one output in shared memory and one in the response, each where it belongs."""
    c = client(shm_server, protocol)
    mod = CLIENTS[protocol]
    ids = np.arange(8, dtype=np.int64).reshape(2, 4)
    values = np.linspace(0, 1, 8, dtype=np.float32).reshape(2, 4)
    ids_region, out_region = regions("ids", ids.nbytes), regions("weighted", values.nbytes)
    shm.set_shared_memory_region(ids_region, [ids])
    c.register_system_shared_memory("ids", key_of(ids_region), ids.nbytes)
    c.register_system_shared_memory("weighted", key_of(out_region), values.nbytes)
    try:
        i_ids = mod.InferInput("ids", [2, 4], "INT64")
        i_ids.set_shared_memory("ids", ids.nbytes)
        i_values = mod.InferInput("values", [2, 4], "FP32")
        i_values.set_data_from_numpy(values)
        o_w = mod.InferRequestedOutput("weighted")
        o_w.set_shared_memory("weighted", values.nbytes)
        r = c.infer("mixed", [i_ids, i_values], outputs=[o_w, mod.InferRequestedOutput("ids_sum")])

        p_ids = mod.InferInput("ids", [2, 4], "INT64")
        p_ids.set_data_from_numpy(ids)
        want = c.infer("mixed", [p_ids, i_values])
        np.testing.assert_array_equal(r.as_numpy("ids_sum"), want.as_numpy("ids_sum"))
        np.testing.assert_array_equal(shm.get_contents_as_numpy(out_region, np.float32, [2, 4]),
                                      want.as_numpy("weighted"))
    finally:
        c.unregister_system_shared_memory()


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_client_cannot_reach_past_a_region_or_into_another_tenants(shm_server, regions, protocol):
    c = client(shm_server, protocol)
    mod = CLIENTS[protocol]
    a = {"x-tenant": "a"}
    x = np.ones((1, 512), np.float32)
    region = regions("r", x.nbytes)
    shm.set_shared_memory_region(region, [x])
    c.register_system_shared_memory("r", key_of(region), x.nbytes, headers=a)
    try:
        with pytest.raises(InferenceServerException, match="already registered"):
            c.register_system_shared_memory("r", key_of(region), x.nbytes, headers=a)
        # Past the object; a key that is a path; a region past the object's end.
        with pytest.raises(InferenceServerException, match="go past"):
            c.register_system_shared_memory("big", key_of(region), x.nbytes + 1, headers=a)
        with pytest.raises(InferenceServerException, match="not a POSIX shared memory name"):
            c.register_system_shared_memory("p", "/../../etc/passwd", 8, headers=a)
        i = mod.InferInput("input", [1, 512], "FP32")
        i.set_shared_memory("r", x.nbytes)
        c.infer("mlp", [i], headers=a)
        # Another tenant sees no region of that name, cannot use or unregister it.
        b = {"x-tenant": "b"}
        with pytest.raises(InferenceServerException, match="no shared memory region 'r'"):
            c.infer("mlp", [i], headers=b)
        c.unregister_system_shared_memory(headers=b)
        status = c.get_system_shared_memory_status(headers=b, **({"as_json": True} if protocol == "grpc" else {}))
        assert not (status if protocol == "http" else status.get("regions"))
        # Nor register the object a's region holds, to read or write it through a region of its
        # own (before, it could: the key was all it needed).
        with pytest.raises(InferenceServerException, match="registered by another tenant"):
            c.register_system_shared_memory("mine", key_of(region), x.nbytes, headers=b)
        c.infer("mlp", [i], headers=a)
        # Beyond the region, and a byte size that is not the tensor's.
        past = mod.InferInput("input", [1, 512], "FP32")
        past.set_shared_memory("r", x.nbytes, offset=4)
        with pytest.raises(InferenceServerException, match="go past"):
            c.infer("mlp", [past], headers=a)
        short = mod.InferInput("input", [1, 512], "FP32")
        short.set_shared_memory("r", x.nbytes - 4)
        with pytest.raises(InferenceServerException, match="raw bytes|bytes"):
            c.infer("mlp", [short], headers=a)
        # An output region too small for the answer.
        small = mod.InferRequestedOutput("output")
        small.set_shared_memory("r", 8)
        with pytest.raises(InferenceServerException, match="do not fit"):
            c.infer("mlp", [i], outputs=[small], headers=a)
    finally:
        c.unregister_system_shared_memory(headers=a)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_inputs_in_shared_memory_the_model_would_refuse_are_refused_before_they_are_read(start_server, tmp_path,
                                                                                         regions, protocol):
    """A large request's inputs are checked against the model (name, datatype, shape) before any is
    read from shared memory. gRPC read them first: 8 MiB stated as BYTES for the MLP's FP32 input
    was read, and refused for holding more than a 4 MiB budget has room for, or, within it, after
    paying for the read. HTTP checked them first already."""
    from conftest import make_repository
    repo = make_repository(tmp_path / "repo", ("mlp",))
    (repo / "mlp" / "config.toml").write_text("max_batch_size = 8192\n")
    s = start_server("--shared-memory", "system", "--max-inflight-body-bytes", str(4 << 20), repository=repo)
    c, mod = client(s, protocol), CLIENTS[protocol]
    size = 8 << 20
    region = regions("big", size)
    c.register_system_shared_memory("big", key_of(region), size)

    def infer(datatype, shape, nbytes):
        i = mod.InferInput("input", shape, datatype)
        i.set_shared_memory("big", nbytes)
        return c.infer("mlp", [i])

    for datatype, shape, wrong in (("BYTES", [1, 1 << 20], "expected datatype FP32, got BYTES"),
                                   ("FP32", [size // 4], f"expected shape [-1, 512], got [{size // 4}]")):
        with pytest.raises(InferenceServerException) as refused:
            infer(datatype, shape, size)
        assert wrong in str(refused.value), (protocol, refused.value)
    # What the model takes is read and served (400 KB, past the size that is checked first).
    x = np.random.rand(200, 512).astype(np.float32)
    shm.set_shared_memory_region(region, [x])
    assert infer("FP32", [200, 512], x.nbytes).as_numpy("output").shape[0] == 200
    c.unregister_system_shared_memory()


def test_messagepack_bodies_name_regions_as_json_does(shm_server, regions):
    """A MessagePack request's input and output in shared memory (the JSON parameters), each
    region its tenant's: the output lands in its region and the response carries no data for it."""
    c = client(shm_server, "http")
    x = np.random.default_rng(5).standard_normal((3, 512)).astype(np.float32)
    inp, out = regions("in", x.nbytes), regions("out", 3 * 10 * 4)
    shm.set_shared_memory_region(inp, [x])
    a = {"x-tenant": "a"}
    c.register_system_shared_memory("in", key_of(inp), x.nbytes, headers=a)
    c.register_system_shared_memory("out", key_of(out), 3 * 10 * 4, headers=a)

    def infer(tenant, **data):
        where = {"parameters": {"shared_memory_region": "in", "shared_memory_byte_size": x.nbytes}}
        body = msgpack.packb({
            "inputs": [{"name": "input", "shape": [3, 512], "datatype": "FP32", **(data or where)}],
            "outputs": [{"name": "output", "parameters": {"shared_memory_region": "out",
                                                          "shared_memory_byte_size": 120}}]})
        req = urllib.request.Request(f"http://{shm_server.url}/v2/models/mlp/infer", data=body,
                                     headers={"Content-Type": "application/msgpack", "x-tenant": tenant})
        try:
            with urllib.request.urlopen(req) as r:
                return r.status, msgpack.unpackb(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    try:
        status, answer = infer("a")
        assert status == 200, answer
        assert answer["outputs"][0]["shape"] == [3, 10] and "data" not in answer["outputs"][0]
        plain = httpclient.InferInput("input", [3, 512], "FP32")
        plain.set_data_from_numpy(x)
        np.testing.assert_array_equal(shm.get_contents_as_numpy(out, np.float32, [3, 10]),
                                      c.infer("mlp", [plain]).as_numpy("output"))
        # Another tenant names the same regions: not its own.
        status, answer = infer("b")
        assert status == 404 and "no shared memory region 'in'" in answer["error"], answer
        status, answer = infer("a", data=x.tobytes(),
                               parameters={"shared_memory_region": "in", "shared_memory_byte_size": x.nbytes})
        assert status == 400 and "in shared memory and in the body" in answer["error"], answer
    finally:
        c.unregister_system_shared_memory(headers=a)


def test_an_object_shrunk_under_the_server_fails_its_request_and_the_server_goes_on(shm_server, regions):
    c = client(shm_server, "http")
    x = np.ones((4, 512), np.float32)
    region = regions("gone", x.nbytes)
    c.register_system_shared_memory("gone", key_of(region), x.nbytes)
    try:
        os.truncate(f"/dev/shm/{key_of(region).lstrip('/')}", 0)
        i = httpclient.InferInput("input", [4, 512], "FP32")
        i.set_shared_memory("gone", x.nbytes)
        with pytest.raises(InferenceServerException, match="cannot read"):
            c.infer("mlp", [i])
        assert c.is_server_live()
        plain = httpclient.InferInput("input", [4, 512], "FP32")
        plain.set_data_from_numpy(x)
        assert c.infer("mlp", [plain]).as_numpy("output").shape == (4, 10)
    finally:
        c.unregister_system_shared_memory()


def test_shared_memory_is_off_unless_asked_for(server, regions):
    region = regions("r", 64)
    for protocol in ("http", "grpc"):
        c = client(server, protocol)
        with pytest.raises(InferenceServerException, match="--shared-memory system"):
            c.register_system_shared_memory("r", key_of(region), 64)
        # perf_analyzer clears both kinds of regions before it starts: that answers.
        c.unregister_system_shared_memory()
        c.unregister_cuda_shared_memory()
    with urllib.request.urlopen(f"http://{server.url}/v2") as r:
        assert b"system_shared_memory" not in r.read()
