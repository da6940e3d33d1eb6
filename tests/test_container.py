"""The container image (Containerfile), built and run here without any registry: the runtime base
is made locally from Debian's packages (scripts/container-base), the binary is the one the other
tests run (this checkout's debug build, stripped: building a release one for it took 392 s of a
1,004 s run of the suite; the Containerfile's own build stage makes that one). The image is
started with podman, or, where podman cannot start containers (a sandbox that refuses its
rlimits, say), its exported root filesystem is run with the image's own config (entrypoint,
environment, user) under chroot; the test prints which. Checks: size under 150 MB, no shell,
readiness, an inference, and a process that is not root."""

import json
import os
import shutil
import subprocess
import tarfile
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient

from conftest import BIN, ROOT, free_port, make_repository

IMAGE = "localhost/ferrite:test"
BASE = "localhost/ferrite-base:cc"
# A release binary's image is about 60 MB, a debug one's about 85.
MAX_BYTES = 150_000_000


def run(cmd, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, **kw)


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    if shutil.which("podman") is None:
        pytest.skip("podman is not installed (apt-get install podman); .ci/run installs it")
    ctx = tmp_path_factory.mktemp("context")
    (ctx / "dist").mkdir()
    shutil.copy(BIN, ctx / "dist" / "ferrite")
    assert run(["strip", str(ctx / "dist" / "ferrite")]).returncode == 0
    import onnxruntime
    (lib,) = (Path(onnxruntime.__file__).parent / "capi").glob("libonnxruntime.so.1.*")
    shutil.copy(lib, ctx / "dist" / "libonnxruntime.so")
    r = run([str(ROOT / "scripts" / "container-base"), BASE], timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    r = run(["podman", "build", "-q", "-f", str(ROOT / "Containerfile"), "--build-arg", f"RUNTIME_IMAGE={BASE}",
             "--build-arg", "FERRITE_FROM=prebuilt", "-t", IMAGE, str(ctx)], timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    return IMAGE


def inspect(image, what):
    return run(["podman", "image", "inspect", image, "--format", what]).stdout.strip()


def exported_rootfs(image, dest):
    cid = run(["podman", "create", image]).stdout.strip()
    try:
        tar = dest.with_suffix(".tar")
        assert run(["podman", "export", "-o", str(tar), cid]).returncode == 0
    finally:
        run(["podman", "rm", "-f", cid])
    with tarfile.open(tar) as t:
        t.extractall(dest, filter="fully_trusted")
    return dest


class Started:
    """The image running: with podman when it can, else its rootfs under chroot."""

    def __init__(self, image, repo, args, tmp_path):
        self.name = f"ferrite-test-{os.getpid()}"
        r = run(["podman", "run", "-d", "--name", self.name, "--network", "host",
                 "-v", f"{repo}:/models:ro", image, *args], timeout=120)
        if r.returncode == 0:
            self.how, self.proc = "podman", None
            self.pid = int(inspect_container(self.name, "{{.State.Pid}}"))
            return
        run(["podman", "rm", "-f", self.name])
        self.how = "unpacked rootfs under chroot"
        print(f"podman cannot start containers here ({r.stderr.strip()}); running the image's rootfs with its config")
        config = json.loads(inspect(image, "{{json .Config}}"))
        rootfs = exported_rootfs(image, tmp_path / "rootfs")
        shutil.copytree(repo, rootfs / "models", dirs_exist_ok=True)
        env = dict(e.split("=", 1) for e in config["Env"])
        self.log = open(tmp_path / "rootfs.log", "w")
        self.proc = subprocess.Popen(["chroot", f"--userspec={config['User']}", str(rootfs),
                                      *config["Entrypoint"], *args], env=env, stdout=self.log, stderr=subprocess.STDOUT)
        self.pid = self.proc.pid

    def logs(self):
        if self.proc is None:
            r = run(["podman", "logs", self.name])
            return r.stdout + r.stderr
        return Path(self.log.name).read_text()

    def stop(self):
        if self.proc is None:
            run(["podman", "rm", "-f", "-t", "5", self.name], timeout=60)
        else:
            self.proc.terminate()
            self.proc.wait(timeout=40)


def inspect_container(name, what):
    return run(["podman", "inspect", name, "--format", what]).stdout.strip()


def test_the_image_is_small_and_configured(image, tmp_path):
    size = int(inspect(image, "{{.Size}}"))
    print(f"{image}: {size / 1e6:.1f} MB uncompressed")
    assert size < MAX_BYTES
    config = json.loads(inspect(image, "{{json .Config}}"))
    assert config["User"] == "65532:65532"
    assert set(config["ExposedPorts"]) == {"8000/tcp", "8001/tcp", "8002/tcp"}
    env = dict(e.split("=", 1) for e in config["Env"])
    assert env["FERRITE_HOST"] == "0.0.0.0" and env["FERRITE_LOG_FORMAT"] == "json"
    assert config["Entrypoint"] == ["/usr/local/bin/ferrite", "serve", "--model-repository", "/models"]
    rootfs = exported_rootfs(image, tmp_path / "rootfs")
    assert not any((rootfs / p).exists() for p in ("bin/sh", "usr/bin/sh", "bin/bash")), "no shell in the image"


def test_the_image_serves_as_a_non_root_user(image, tmp_path):
    repo = make_repository(tmp_path / "repo", ("mlp",))
    for p in [repo, *repo.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    http_port, grpc_port, metrics_port = free_port(), free_port(), free_port()
    s = Started(image, repo, ["--http-port", str(http_port), "--grpc-port", str(grpc_port),
                              "--metrics-port", str(metrics_port)], tmp_path)
    print(f"started with {s.how}")
    try:
        deadline = time.time() + 120
        ready = None
        while time.time() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/v2/health/ready", timeout=2) as r:
                    ready = json.loads(r.read())
                    break
            except OSError:
                time.sleep(0.5)
        assert ready == {"ready": True}, s.logs()
        c = httpclient.InferenceServerClient(f"127.0.0.1:{http_port}")
        i = httpclient.InferInput("input", [1, 512], "FP32")
        i.set_data_from_numpy(np.ones((1, 512), np.float32))
        assert c.infer("mlp", [i]).as_numpy("output").shape == (1, 10)
        uid = next(line.split()[1] for line in Path(f"/proc/{s.pid}/status").read_text().splitlines()
                   if line.startswith("Uid:"))
        assert uid == "65532", f"the server runs as uid {uid}"
        assert '"level":"INFO"' in s.logs(), "JSON logs"
    finally:
        s.stop()
