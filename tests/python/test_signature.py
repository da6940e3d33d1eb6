"""Typed signatures generated from a model: dataclasses per model (names by the stated rule,
originals kept), validation on construction with the server's messages, the typed call path,
and Pydantic models for JSON bodies (through the FastAPI example, with its OpenAPI schema and 422s);
mypy --strict on the examples."""

import dataclasses
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import ferrite
from ferrite._signature import Signature

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def mixed():
    return ferrite.Model.load(ROOT / "models" / "mixed")


def test_the_naming_rule_is_stated_and_reversible():
    assert ferrite.field_name("input_ids") == "input_ids"
    assert ferrite.field_name("images") == "images"
    assert ferrite.field_name("sigmoid_0.tmp_0") == "sigmoid_0_2e_tmp_0"
    assert ferrite.field_name("input:0") == "input_3a_0"
    assert ferrite.field_name("0") == "t_0" and ferrite.field_name("class") == "class_"
    spec = lambda n: ferrite.TensorSpec(n, "FP32", (-1, 2))  # noqa: E731
    sig = Signature("my-model", [spec("a.b"), spec("a_2e_b"), spec("x")], [spec("y:0")], optional=["x"])
    fields = [f.name for f in dataclasses.fields(sig.Inputs)]
    assert fields == ["a_2e_b", "a_2e_b_2", "x"], "a collision gets a suffix"
    assert [sig.tensor_name(f) for f in fields] == ["a.b", "a_2e_b", "x"]
    assert dataclasses.fields(sig.Inputs)[0].metadata["tensor"] == "a.b"
    assert sig.Inputs.__name__ == "MyModelInputs" and sig.Outputs.__name__ == "MyModelOutputs"
    assert dataclasses.fields(sig.Inputs)[2].default is None, "optional inputs default to None"


def test_typed_inputs_validate_with_the_servers_messages(mixed):
    sig = mixed.signature
    ids, values = np.ones((2, 4), np.int64), np.ones((2, 4), np.float32)
    sig.Inputs(ids=ids, values=values)
    with pytest.raises(TypeError, match="unexpected keyword argument 'extra'"):
        sig.Inputs(ids=ids, values=values, extra=ids)
    with pytest.raises(TypeError, match="values"):
        sig.Inputs(ids=ids)
    with pytest.raises(ferrite.InvalidInput, match=r"input 'values': expected datatype FP32, got FP64"):
        sig.Inputs(ids=ids, values=values.astype(np.float64))
    with pytest.raises(ferrite.InvalidInput, match=r"input 'ids': expected shape \[-1, 4\], got \[2, 3\]"):
        sig.Inputs(ids=np.ones((2, 3), np.int64), values=values)
    # The server (engine) says the same for the dict form.
    with pytest.raises(ferrite.InvalidInput, match=r"input 'ids': expected shape \[-1, 4\], got \[2, 3\]"):
        mixed.infer({"ids": np.ones((2, 3), np.int64), "values": values})


def test_the_typed_path_returns_typed_outputs(mixed):
    sig = mixed.signature
    ids = np.arange(8, dtype=np.int64).reshape(2, 4)
    values = np.linspace(0, 1, 8, dtype=np.float32).reshape(2, 4)
    out = mixed.infer(sig.Inputs(ids=ids, values=values))
    assert isinstance(out, sig.Outputs)
    np.testing.assert_allclose(out.weighted, values * ids, rtol=1e-6)
    np.testing.assert_array_equal(out.ids_sum, ids.sum(axis=1, keepdims=True))
    plain = mixed.infer({"ids": ids, "values": values})
    np.testing.assert_array_equal(plain["weighted"], out.weighted)
    import asyncio
    out = asyncio.run(mixed.infer_async(sig.Inputs(ids=ids, values=values)))
    np.testing.assert_array_equal(out.ids_sum, plain["ids_sum"])


def test_pydantic_models_validate_json_bodies(mixed):
    Request, Response = mixed.pydantic_models()
    body = Request.model_validate({"ids": [[1, 2, 3, 4]], "values": {"shape": [1, 4], "datatype": "FP32", "data": [1, 1, 1, 1]}})
    inputs = body.to_inputs()
    assert inputs["ids"].dtype == np.int64 and inputs["values"].shape == (1, 4)
    resp = Response.from_outputs(mixed.infer(inputs))
    assert resp.model_dump(by_alias=True) == {"weighted": [[1.0, 2.0, 3.0, 4.0]], "ids_sum": [[10]]}
    import pydantic
    with pytest.raises(pydantic.ValidationError, match=r"expected shape \[-1, 4\], got \[1, 3\]"):
        Request.model_validate({"ids": [[1, 2, 3]], "values": [[1.0, 1.0, 1.0, 1.0]]})
    with pytest.raises(pydantic.ValidationError):
        Request.model_validate({"ids": [[1, 2, 3, 4]]})
    schema = Request.model_json_schema()
    assert set(schema["required"]) == {"ids", "values"}


def test_the_fastapi_example_uses_the_generated_models(monkeypatch):
    from fastapi.testclient import TestClient

    monkeypatch.setenv("FERRITE_MODEL", str(ROOT / "models" / "mlp"))
    sys.path.insert(0, str(ROOT))
    from examples import fastapi_app

    client = TestClient(fastapi_app.app)
    x = np.random.default_rng(3).standard_normal((2, 512)).astype(np.float32)
    r = client.post("/infer", json={"input": x.tolist()})
    assert r.status_code == 200, r.text
    direct = fastapi_app.model.infer({"input": x})["output"]
    np.testing.assert_allclose(np.array(r.json()["output"], np.float32), direct, rtol=1e-5, atol=1e-5)
    bad = client.post("/infer", json={"input": [[1.0, 2.0]]})
    assert bad.status_code == 422 and "expected shape [-1, 512], got [1, 2]" in bad.text
    openapi = client.get("/openapi.json").json()
    assert "input" in str(openapi["components"]["schemas"])


def test_mypy_strict_on_the_examples():
    r = subprocess.run([sys.executable, "-m", "mypy", "--strict", "--ignore-missing-imports", str(ROOT / "examples")],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
