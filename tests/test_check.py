"""`ferrite check` through the real binary: every model loaded and validated as `serve` would,
one row per model version, exit 0 only when all load; no listener opened."""

import subprocess

from conftest import BIN, make_repository


def check(repo, *args):
    return subprocess.run([BIN, "check", "--model-repository", str(repo), *args], capture_output=True, text=True, timeout=120)


def test_a_good_repository_passes_with_a_row_per_model(tmp_path):
    repo = make_repository(tmp_path / "repo", ("mlp", "mixed", "fpn"))
    r = check(repo)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split()[:3] == ["MODEL", "VERSION", "STATE"]
    rows = {line.split()[0]: line for line in lines[1:]}
    assert set(rows) == {"mlp", "mixed", "fpn"}
    assert "READY" in rows["mlp"] and "input:FP32[-1,512]" in rows["mlp"] and "output:FP32[-1,10]" in rows["mlp"]
    # Variable H/W: loaded with no warm-up it cannot run, shown with its variable dims.
    assert "READY" in rows["fpn"] and "[-1,1,-1,-1]" in rows["fpn"]


def test_a_broken_model_fails_the_check_and_says_why(tmp_path):
    repo = make_repository(tmp_path / "repo", ("mlp", "mixed"))
    (repo / "mixed" / "config.toml").write_text("max_batch_size = -3\n")
    (repo / "corrupt" / "1").mkdir(parents=True)
    (repo / "corrupt" / "1" / "model.onnx").write_bytes(b"not an onnx file")
    r = check(repo)
    assert r.returncode == 1, r.stdout + r.stderr
    rows = {line.split()[0]: line for line in r.stdout.splitlines()[1:]}
    assert "READY" in rows["mlp"]
    assert "UNAVAILABLE" in rows["mixed"] and "config.toml" in rows["mixed"], rows["mixed"]
    assert "UNAVAILABLE" in rows["corrupt"] and "cannot load" in rows["corrupt"], rows["corrupt"]


def test_an_unreadable_repository_exits_2(tmp_path):
    r = check(tmp_path / "missing")
    assert r.returncode == 2 and "cannot read model repository" in r.stderr, r.stderr


def test_a_config_pbtxt_is_read(tmp_path):
    repo = make_repository(tmp_path / "repo", ("mlp",))
    (repo / "mlp" / "config.pbtxt").write_text('name: "mlp"\nmax_batch_size: 8\ninput [ { name: "input" dims: [ 512 ] } ]\n')
    r = check(repo)
    assert r.returncode == 0, r.stdout + r.stderr
    row = r.stdout.splitlines()[1]
    assert "READY" in row and "max 8" in row and "dynamic" not in row, row
    (repo / "mlp" / "config.pbtxt").write_text('name: "mlp"\nensemble_scheduling { }\n')
    r = check(repo)
    assert r.returncode == 1 and "'ensemble_scheduling' is not supported" in r.stdout, r.stdout
