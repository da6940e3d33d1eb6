"""The baseline: the inference service a Python team writes first. FastAPI + uvicorn + onnxruntime,
Pydantic validation, one session per worker process, the same V2 JSON body as Ferrite takes.

Run: MODEL=models/mlp/1/model.onnx uvicorn bench.baseline.app:app --workers 2 --port 9000
"""

import os

import numpy as np
import onnxruntime as ort
from fastapi import FastAPI

from bench.baseline.bodies import InferRequest

MODEL = os.environ.get("MODEL", "models/mlp/1/model.onnx")
session = ort.InferenceSession(MODEL, providers=["CPUExecutionProvider"])
input_name = session.get_inputs()[0].name
app = FastAPI()


@app.post("/v2/models/{model}/infer")
def infer(model: str, req: InferRequest):
    x = np.asarray(req.inputs[0].data, dtype=np.float32).reshape(req.inputs[0].shape)
    (y,) = session.run(None, {input_name: x})
    return {
        "model_name": model,
        "outputs": [{"name": "output", "datatype": "FP32", "shape": list(y.shape), "data": y.ravel().tolist()}],
    }
