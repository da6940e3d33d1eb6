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


def test_a_pipeline_step_reading_a_name_no_step_writes_fails_the_load_naming_both(tmp_path):
    """The detector pipeline a user writes from the README, with normalize's output left at its
    default: it used to load READY with an extra client input 'images' that every request then
    lacked; now the load fails, naming the step, the name and what was written."""
    repo = make_repository(tmp_path / "repo", ("yolo_v8",))
    (repo / "detect").mkdir()
    steps = ('[[steps]]\nop = "decode_image"\n[[steps]]\nop = "resize"\nsize = [64, 64]\n'
             '[[steps]]\nop = "normalize"\n{output}[[steps]]\nop = "model"\nmodel = "yolo_v8"\n')
    (repo / "detect" / "config.toml").write_text(steps.format(output=""))
    r = check(repo)
    assert r.returncode == 1, r.stdout + r.stderr
    row = next(line for line in r.stdout.splitlines() if line.startswith("detect"))
    assert "UNAVAILABLE" in row and "step 'model' (model): no earlier step writes 'images' (written so far: pixels)" in row, row
    (repo / "detect" / "config.toml").write_text(steps.format(output='output = "images"\n'))
    r = check(repo)
    assert r.returncode == 0, r.stdout + r.stderr
    row = next(line for line in r.stdout.splitlines() if line.startswith("detect"))
    assert row.split()[2:4] == ["READY", "image:BYTES[-1]"], row


def test_a_zipmap_serves_as_its_probabilities_and_other_non_tensors_are_refused(tmp_path):
    """skl2onnx ends classifiers with a ZipMap (probabilities as a list of {class: probability})
    unless told not to: it serves as the FP32[N, classes] tensor it was made from (the converters'
    own models: tests/test_tabular.py). An output that is some other sequence is refused by name."""
    import onnx
    from onnx import TensorProto, helper

    def save(name, nodes, output):
        probs = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 2])
        graph = helper.make_graph(nodes, name, [probs], [output])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.onnx.ml", 3)])
        model.ir_version = 8
        (tmp_path / "repo" / name / "1").mkdir(parents=True)
        onnx.save(model, tmp_path / "repo" / name / "1" / "model.onnx")

    save("forest", [helper.make_node("ZipMap", ["x"], ["output_probability"], domain="ai.onnx.ml",
                                     classlabels_strings=["no", "yes"])],
         helper.make_value_info("output_probability", helper.make_sequence_type_proto(
             helper.make_map_type_proto(TensorProto.STRING, helper.make_tensor_type_proto(TensorProto.FLOAT, [])))))
    save("listed", [helper.make_node("SequenceConstruct", ["x"], ["rows"])],
         helper.make_value_info("rows", helper.make_sequence_type_proto(helper.make_tensor_type_proto(TensorProto.FLOAT, None))))
    r = check(tmp_path / "repo")
    assert r.returncode == 1, r.stdout + r.stderr
    rows = {line.split()[0]: line for line in r.stdout.splitlines()[1:] if line.strip()}
    assert rows["forest"].split()[2] == "READY" and "output_probability:FP32[-1,2]" in rows["forest"], rows
    assert "'rows' is a" in rows["listed"] and "only tensors are supported" in rows["listed"], rows


def test_a_bad_step_value_is_one_row_naming_the_step_and_its_line_and_values_take_any_case(tmp_path):
    repo = make_repository(tmp_path / "repo", ("yolo_v8",))
    (repo / "detect").mkdir()
    text = ('[[steps]]\nop = "decode_image"\n[[steps]]\nop = "resize"\nmode = "Longer_Side"\nsize = [64]\n'
            '[[steps]]\nname = "letterbox"\nop = "pad"\nvalue = 114\nanchor = "{anchor}"\n'
            '[[steps]]\nop = "normalize"\nchannels = "bgr"\noutput = "images"\n[[steps]]\nop = "model"\nmodel = "yolo_v8"\n')
    (repo / "detect" / "config.toml").write_text(text.format(anchor="Center"))
    r = check(repo)
    assert r.returncode == 0, r.stdout + r.stderr
    (repo / "detect" / "config.toml").write_text(text.format(anchor="middle"))
    r = check(repo)
    assert r.returncode == 1, r.stdout + r.stderr
    rows = [line for line in r.stdout.splitlines() if line.startswith("detect")]
    assert len(rows) == 1 and "config.toml line 11: step 3 'letterbox' (pad): unknown variant `middle`" in rows[0], r.stdout
