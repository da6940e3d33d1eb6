"""The response cache in the Python package: the server's two tiers, honoured per model by its
`[cache]` config; the same input twice is one engine execution, and a second process sharing Redis
gets a hit without running the model."""

import subprocess
import sys
import time

import numpy as np

import ferrite
from conftest import make_repository
from test_cache import Redis

CACHED = "[cache]\nenabled = true\n"


def repo(tmp_path, name="repo"):
    r = make_repository(tmp_path / name, ("mlp", "mixed"))
    (r / "mlp" / "config.toml").write_text(CACHED)
    return r


def test_the_same_input_twice_runs_once_and_uncached_models_always_run(tmp_path):
    engine = ferrite.Engine(repo(tmp_path), cache_bytes=16 << 20)
    mlp, mixed = engine.model("mlp"), engine.model("mixed")
    x = np.full((1, 512), 0.25, np.float32)
    first = mlp.infer({"input": x})["output"]
    second = mlp.infer({"input": x})["output"]
    np.testing.assert_array_equal(first, second)
    assert mlp.stats() == ferrite.ModelStats(inferences=1, executions=1, cache_hits=1, cache_misses=1)
    inputs = {"ids": np.ones((1, 4), np.int64), "values": np.ones((1, 4), np.float32)}
    mixed.infer(inputs)
    mixed.infer(inputs)
    assert mixed.stats().executions == 2 and mixed.stats().cache_hits == 0, "mixed's config does not enable it"
    stats = engine.cache_stats()
    assert stats["hits"] == 1 and stats["misses"] == 1 and stats["local_entries"] == 1 and stats["redis"] == "off"
    assert ferrite.Engine(repo(tmp_path, "plain")).cache_stats() is None


CHILD = """
import sys, time, numpy as np, ferrite
engine = ferrite.Engine(sys.argv[1], cache_bytes=1 << 20, redis_url=sys.argv[2], redis_timeout_ms=50)
deadline = time.time() + 10
while engine.cache_stats()["redis"] != "ok" and time.time() < deadline:
    time.sleep(0.05)
m = engine.model("mlp")
out = m.infer({"input": np.full((1, 512), 0.5, np.float32)})["output"]
s = m.stats()
print(s.executions, s.cache_hits, engine.cache_stats()["redis_hits"], float(out.sum()))
"""


def test_a_second_process_sharing_redis_gets_a_hit(tmp_path):
    redis = Redis(tmp_path)
    try:
        engine = ferrite.Engine(repo(tmp_path, "a"), cache_bytes=1 << 20, redis_url=redis.url)
        deadline = time.time() + 10
        while engine.cache_stats()["redis"] != "ok" and time.time() < deadline:
            time.sleep(0.05)
        assert engine.cache_stats()["redis"] == "ok"
        out = engine.model("mlp").infer({"input": np.full((1, 512), 0.5, np.float32)})["output"]
        deadline = time.time() + 10
        while redis.keys() == 0 and time.time() < deadline:
            time.sleep(0.05)
        assert redis.keys() == 1
        r = subprocess.run([sys.executable, "-c", CHILD, str(repo(tmp_path, "b")), redis.url],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        executions, hits, redis_hits, total = r.stdout.split()
        assert (executions, hits, redis_hits) == ("0", "1", "1"), r.stdout
        assert abs(float(total) - float(out.sum())) < 1e-4
    finally:
        redis.stop()
