"""A Python model as a Python team serves it without a server: FastAPI + uvicorn wrapping the same
`model.py` (its `execute` called with one request per HTTP request), V2 JSON bodies.

Run: MODEL_PY=bench/.work/python/repo/identity_py/1/model.py uvicorn bench.baseline.python_model:app --port 9000
"""

import importlib.util
import os
import sys
from pathlib import Path

import numpy as np
from fastapi import FastAPI

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "crates" / "ferrite-core" / "python"))
import triton_python_backend_utils as pb_utils  # noqa: E402

from bench.baseline.bodies import InferRequest  # noqa: E402

spec = importlib.util.spec_from_file_location("model", os.environ["MODEL_PY"])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
model = module.TritonPythonModel()
app = FastAPI()


@app.post("/v2/models/{name}/infer")
def infer(name: str, req: InferRequest):
    t = req.inputs[0]
    x = np.asarray(t.data, dtype=np.float32).reshape(t.shape)
    (response,) = model.execute([pb_utils.InferenceRequest(name, [], [pb_utils.Tensor(t.name, x)])])
    out = response.output_tensors()[0]
    y = out.as_numpy()
    return {"model_name": name,
            "outputs": [{"name": out.name(), "datatype": "FP32", "shape": list(y.shape), "data": y.ravel().tolist()}]}
