"""KServe's Python SDK (the client KServe users already have) against the real binary, REST and
gRPC: server and model readiness (the V2 health bodies it parses), and the same models the
tritonclient tests use, answering the same values. The client runs in a process of its own
(kserve_client.py says why)."""

import subprocess
import sys
from pathlib import Path

from conftest import Server, make_repository


def test_the_kserve_sdk_over_rest_and_grpc(tmp_path):
    s = Server(make_repository(tmp_path / "repo", ("mlp", "mixed", "fpn")))
    try:
        r = subprocess.run([sys.executable, str(Path(__file__).with_name("kserve_client.py")), s.url, s.grpc_url],
                           capture_output=True, text=True, timeout=120)
    finally:
        s.stop()
    assert r.returncode == 0, r.stdout + r.stderr
    assert "kserve sdk: ok" in r.stdout
