"""TLS on every listener, and mutual TLS: real certificates (trustme), real clients (curl,
tritonclient over gRPC, urllib)."""

import ssl
import subprocess
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import trustme
from tritonclient.utils import InferenceServerException

BODY = '{"inputs":[{"name":"input","shape":[1,512],"datatype":"FP32","data":[%s]}]}' % ",".join(["0.5"] * 512)


@pytest.fixture
def pki(tmp_path):
    """A CA, a server certificate for 127.0.0.1, and a client certificate, as PEM files."""
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1")
    client = ca.issue_cert("client@example.com")
    files = {
        "ca": tmp_path / "ca.pem",
        "cert": tmp_path / "server.pem",
        "key": tmp_path / "server.key",
        "client_cert": tmp_path / "client.pem",
        "client_key": tmp_path / "client.key",
    }
    ca.cert_pem.write_to_path(files["ca"])
    server.private_key_pem.write_to_path(files["key"])
    with open(files["cert"], "wb") as f:
        for blob in server.cert_chain_pems:
            f.write(blob.bytes())
    client.private_key_pem.write_to_path(files["client_key"])
    with open(files["client_cert"], "wb") as f:
        for blob in client.cert_chain_pems:
            f.write(blob.bytes())
    return files


def curl(*args):
    out = subprocess.run(["curl", "-sS", "-o", "/dev/null", "-w", "%{http_code}", *args],
                         capture_output=True, text=True, timeout=30)
    return out.stdout.strip(), out.stderr


def grpc_infer(url, **tls):
    client = grpcclient.InferenceServerClient(url, ssl=True, **tls)
    x = grpcclient.InferInput("input", [1, 512], "FP32")
    x.set_data_from_numpy(np.full((1, 512), 0.5, np.float32))
    return client.infer("mlp", [x]).as_numpy("output")


def test_tls_on_every_listener(start_server, pki):
    ctx = ssl.create_default_context(cafile=str(pki["ca"]))
    s = start_server("--tls-cert", str(pki["cert"]), "--tls-key", str(pki["key"]), ssl_context=ctx)
    url = f"https://{s.url}/v2/models/mlp/infer"
    code, _ = curl("--cacert", str(pki["ca"]), "-H", "Content-Type: application/json", "-d", BODY, url)
    assert code == "200"
    # HTTP/2 over TLS (ALPN) too.
    code, _ = curl("--http2", "--cacert", str(pki["ca"]), f"https://{s.url}/v2/health/ready")
    assert code == "200"
    # Plain HTTP to the TLS port gets no answer, and an unknown CA is refused by the client.
    code, _ = curl(f"http://{s.url}/v2/health/ready")
    assert code == "000"
    code, err = curl(f"https://{s.url}/v2/health/ready")
    assert code == "000" and "certificate" in err.lower()
    # gRPC over TLS with tritonclient.
    out = grpc_infer(s.grpc_url, root_certificates=str(pki["ca"]))
    assert out.shape == (1, 10)
    # The metrics listener too.
    with urllib.request.urlopen(s.metrics_url.replace("http:", "https:"), context=ctx, timeout=10) as r:
        assert b"ferrite_requests_total" in r.read()


def test_mutual_tls_requires_a_client_certificate(start_server, pki):
    ctx = ssl.create_default_context(cafile=str(pki["ca"]))
    ctx.load_cert_chain(str(pki["client_cert"]), str(pki["client_key"]))
    s = start_server("--tls-cert", str(pki["cert"]), "--tls-key", str(pki["key"]),
                     "--tls-client-ca", str(pki["ca"]), ssl_context=ctx)
    url = f"https://{s.url}/v2/models/mlp/infer"
    mine = ["--cert", str(pki["client_cert"]), "--key", str(pki["client_key"])]
    code, _ = curl("--cacert", str(pki["ca"]), *mine, "-d", BODY, url)
    assert code == "200"
    code, _ = curl("--cacert", str(pki["ca"]), "-d", BODY, url)
    assert code == "000", "no client certificate, no answer"
    # A certificate from another CA is refused too.
    other = trustme.CA().issue_cert("intruder@example.com")
    with other.cert_chain_pems[0].tempfile() as c, other.private_key_pem.tempfile() as k:
        code, _ = curl("--cacert", str(pki["ca"]), "--cert", c, "--key", k, "-d", BODY, url)
    assert code == "000"

    out = grpc_infer(s.grpc_url, root_certificates=str(pki["ca"]),
                     private_key=str(pki["client_key"]), certificate_chain=str(pki["client_cert"]))
    assert out.shape == (1, 10)
    with pytest.raises(InferenceServerException):
        grpc_infer(s.grpc_url, root_certificates=str(pki["ca"]))


def test_bad_tls_files_stop_the_server_at_start(start_server, pki, tmp_path):
    bad = tmp_path / "bad.pem"
    bad.write_text("not a certificate\n")
    with pytest.raises(RuntimeError, match="--tls-cert"):
        start_server("--tls-cert", str(bad), "--tls-key", str(pki["key"]))
