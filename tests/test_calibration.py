"""The calibration at load, through the real binary: each model's plan (instances x threads,
spinning, batch limit) is measured and shown in its config, over HTTP and gRPC; a model with
variable H/W is calibrated too; config values win; `--calibrate false` turns it off."""

import json
import os
import urllib.request

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient


def config(server, model):
    with urllib.request.urlopen(f"http://{server.url}/v2/models/{model}/config", timeout=10) as r:
        return {k: v["string_value"] for k, v in json.loads(r.read())["parameters"].items()}


def test_models_are_calibrated_at_load_and_show_the_choice(start_server, tmp_path):
    env = dict(os.environ, FERRITE_CALIBRATE="true")
    s = start_server(models=("mlp", "fpn", "mixed"), env=env)
    for model in ("mlp", "fpn"):
        p = config(s, model)
        assert "calibrated" in p, p
        assert int(p["batch_merge_limit"]) >= 1 and p["spinning"] in ("true", "false")
        assert any("calibrated" in line and model in line for line in s.logs().splitlines())
    # The chosen plan is what runs: instance_group count and threads agree with the choice.
    with urllib.request.urlopen(f"http://{s.url}/v2/models/mlp/config", timeout=10) as r:
        cfg = json.loads(r.read())
    chosen = config(s, "mlp")["calibrated"]
    assert chosen.startswith(f"{cfg['instance_group'][0]['count']} instance(s) x {config(s, 'mlp')['intra_op_thread_count']} thread(s)")
    # Single-threaded instances on a budget of more come with a solo instance on all of it.
    threads = int(config(s, "mlp")["intra_op_thread_count"])
    budget = len(os.sched_getaffinity(0))
    if threads < budget:
        assert "solo instance x" in chosen and config(s, "mlp")["solo_instance_threads"] == str(budget), chosen
    else:
        assert "solo" not in chosen and "solo_instance_threads" not in config(s, "mlp"), chosen
    g = grpcclient.InferenceServerClient(s.grpc_url).get_model_config("fpn", as_json=True)
    assert "calibrated" in g["config"]["parameters"]
    # The variable-H/W model's limit is for rows of the size it was measured at (one channel,
    # H = W of 224, 128 or 64), scaled to other sizes; a fixed-size model's holds for all.
    at = int(config(s, "fpn")["batch_merge_limit_row_elements"])
    assert at in (224 * 224, 128 * 128, 64 * 64) and f"at rows of {at} elements" in config(s, "fpn")["calibrated"]
    assert "batch_merge_limit_row_elements" not in config(s, "mlp")
    # Served as before: a variable-H/W request through tritonclient.
    c = httpclient.InferenceServerClient(s.url)
    x = np.arange(24, dtype=np.float32).reshape(1, 1, 4, 6)
    i = httpclient.InferInput("images", list(x.shape), "FP32")
    i.set_data_from_numpy(x)
    maps = c.infer("fpn", [i]).as_numpy("maps")
    assert maps.shape == (1, 2, 4, 6) and maps[0, 1, 0, 0] == (0 + 1 + 6 + 7) / 4


def test_config_values_win_and_the_flag_turns_it_off(start_server, tmp_path):
    from conftest import make_repository

    repo = make_repository(tmp_path / "pinned", ("mlp", "fpn"))
    (repo / "mlp" / "config.toml").write_text("instance_count = 1\n[onnxruntime]\nspinning = false\nintra_op_thread_count = 1\n")
    (repo / "fpn" / "config.toml").write_text("calibrate = false\n")
    s = start_server(repository=repo, env=dict(os.environ, FERRITE_CALIBRATE="true"))
    p = config(s, "mlp")
    # Everything but the batch limit was fixed by the config: only the limit is measured.
    assert p["intra_op_thread_count"] == "1" and p["spinning"] == "false"
    assert p["calibrated"].startswith("1 instance(s) x 1 thread(s), spinning false"), p
    # Instances and threads fixed by the config: no solo instance is added beside them.
    assert "solo" not in p["calibrated"] and "solo_instance_threads" not in p, p
    assert "calibrated" not in config(s, "fpn")
    off = start_server("--calibrate", "false", models=("mlp",), env=dict(os.environ, FERRITE_CALIBRATE="true"))
    assert "calibrated" not in config(off, "mlp")


def test_spinning_within_runs_is_asked_for_and_taken_only_by_slow_models(start_server, tmp_path):
    """`--spin-in-run`: a model whose one-row run takes 2 ms or more on two threads spins within
    its runs; the MLP (microseconds) does not; a config's `spinning = false` keeps a slow one out.
    The answers are the model's own (onnxruntime in-process)."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper
    from conftest import make_repository

    # A 7x7 convolution of 3 into 128 channels over 320x320 (3.9 GFLOP a row: 13 ms on two cores
    # here, ten times the fastest CPU's 2 ms), averaged to 128 numbers.
    rng = np.random.default_rng(0)
    w = rng.standard_normal((128, 3, 7, 7)).astype(np.float32) / 10
    graph = helper.make_graph(
        [helper.make_node("Conv", ["images", "w"], ["maps"], pads=[3, 3, 3, 3]),
         helper.make_node("GlobalAveragePool", ["maps"], ["pooled"]),
         helper.make_node("Flatten", ["pooled"], ["features"])],
        "slow",
        [helper.make_tensor_value_info("images", TensorProto.FLOAT, [1, 3, 320, 320])],
        [helper.make_tensor_value_info("features", TensorProto.FLOAT, [1, 128])],
        [helper.make_tensor("w", TensorProto.FLOAT, w.shape, w.tobytes(), raw=True)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    repo = make_repository(tmp_path / "spin", ("mlp",))
    for name in ("slow", "slow_quiet"):
        (repo / name / "1").mkdir(parents=True)
        onnx.save(model, repo / name / "1" / "model.onnx")
    (repo / "slow_quiet" / "config.toml").write_text("[onnxruntime]\nspinning = false\n")
    s = start_server("--spin-in-run", "--calibrate", "false", "--threads", "2", repository=repo)
    assert config(s, "slow")["spin_in_run"] == "true", s.logs()
    assert config(s, "slow_quiet")["spin_in_run"] == "false"
    assert config(s, "mlp")["spin_in_run"] == "false"
    assert "threads spin within runs" in s.logs() and "runs too short to spin within" in s.logs()
    x = rng.standard_normal((1, 3, 320, 320)).astype(np.float32)
    expected = ort.InferenceSession(str(repo / "slow" / "1" / "model.onnx")).run(None, {"images": x})[0]
    c = grpcclient.InferenceServerClient(s.grpc_url)
    for _ in range(3):
        i = grpcclient.InferInput("images", list(x.shape), "FP32")
        i.set_data_from_numpy(x)
        np.testing.assert_allclose(c.infer("slow", [i]).as_numpy("features"), expected, rtol=1e-4, atol=1e-5)
    # Without the flag nothing spins within runs.
    s2 = start_server("--calibrate", "false", "--threads", "2", repository=repo)
    assert config(s2, "slow")["spin_in_run"] == "false"
