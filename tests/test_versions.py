"""The version handshake: the binary and the wheel check the ONNX Runtime library they load
(version against the supported range, with an error that says what was found, what is needed and
how to install it) and report Ferrite's and ONNX Runtime's versions: `ferrite --version`, `GET /v2`,
the gRPC ServerMetadata, `ferrite.__version__`, `ferrite.check_environment()`. An old library is a
stand-in compiled here: a shared object whose OrtGetApiBase reports 1.16.3."""

import io
import json
import os
import subprocess
import sys
import urllib.request

import grpc
import pytest

from conftest import BIN, ROOT, Server, make_repository

FAKE_ORT = r"""
typedef struct { const void *(*GetApi)(unsigned); const char *(*GetVersionString)(void); } OrtApiBase;
static const void *get_api(unsigned v) { (void)v; return 0; }
static const char *version(void) { return "1.16.3"; }
static const OrtApiBase base = { get_api, version };
const OrtApiBase *OrtGetApiBase(void) { return &base; }
"""


@pytest.fixture(scope="module")
def old_ort(tmp_path_factory):
    d = tmp_path_factory.mktemp("old_ort")
    (d / "fake.c").write_text(FAKE_ORT)
    lib = d / "libonnxruntime.so.1.16.3"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(lib), str(d / "fake.c")], check=True)
    return lib


def test_ferrite_version_names_both(tmp_path):
    r = subprocess.run([BIN, "--version"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "ferrite 0.1.0"
    assert lines[1].startswith("onnxruntime 1.31.") and "libonnxruntime.so" in lines[1], lines


def test_an_old_library_is_refused_with_what_to_install(old_ort, tmp_path):
    for args in (["serve", "--model-repository", str(tmp_path)], ["check", "--model-repository", str(tmp_path)]):
        r = subprocess.run([BIN, *args, "--onnxruntime-lib", str(old_ort)], capture_output=True, text=True, timeout=60)
        assert r.returncode == 2, r.stdout + r.stderr
        assert "ONNX Runtime 1.16.3 found at" in r.stderr and "needs 1.31" in r.stderr, r.stderr
        assert "pip install onnxruntime==1.31.*" in r.stderr, r.stderr
    r = subprocess.run([BIN, "serve", "--onnxruntime-lib", "/lib/x86_64-linux-gnu/libz.so.1"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "not an ONNX Runtime library" in r.stderr, r.stderr


def test_the_server_reports_both_versions(tmp_path):
    s = Server(make_repository(tmp_path / "repo", ("mlp",)))
    try:
        meta = json.loads(urllib.request.urlopen(f"http://{s.url}/v2", timeout=10).read())
        assert meta["version"] == "0.1.0" and meta["onnxruntime_version"].startswith("1.31.")
        assert {"classification", "model_repository", "statistics", "binary_tensor_data"} <= set(meta["extensions"])
        # gRPC: field 4 of ServerMetadataResponse (Ferrite's addition), read from the raw bytes.
        with grpc.insecure_channel(s.grpc_url) as channel:
            call = channel.unary_unary("/inference.GRPCInferenceService/ServerMetadata",
                                       request_serializer=lambda b: b, response_deserializer=lambda b: b)
            raw = call(b"", timeout=10)
        fields, i = {}, 0
        while i < len(raw):
            key, n = raw[i], raw[i + 1]
            fields.setdefault(key >> 3, []).append(raw[i + 2:i + 2 + n].decode())
            i += 2 + n
        assert fields[1] == ["ferrite"] and fields[2] == ["0.1.0"]
        assert fields[4][0] == meta["onnxruntime_version"]
    finally:
        s.stop()


def run_python(code, env=None):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, **(env or {})))


def test_the_package_reports_and_checks():
    import ferrite
    assert ferrite.__version__ == "0.1.0"
    assert ferrite.onnxruntime_version().startswith("1.31.")
    out = io.StringIO()
    assert ferrite.check_environment(out) is True
    text = out.getvalue()
    for row in ("python", "numpy", "onnxruntime (package)", "onnxruntime (library)", "ferrite"):
        assert row in text, text
    assert "NEEDS" not in text


def test_the_package_refuses_an_old_library_with_what_to_install(old_ort):
    code = ("import ferrite\n"
            f"try:\n    ferrite.Model.load({str(ROOT / 'models' / 'mlp')!r})\nexcept ferrite.InvalidInput as e:\n    print('refused:', e)\n"
            "import sys\nsys.exit(0 if not ferrite.check_environment() else 1)\n")
    r = run_python(code, env={"ORT_DYLIB_PATH": str(old_ort)})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "refused: ONNX Runtime 1.16.3 found at" in r.stdout and "onnxruntime==1.31.*" in r.stdout, r.stdout
    assert "NEEDS" in r.stdout
