"""A FastAPI service that validates requests with Pydantic and runs them on the Ferrite engine
in-process: no second server, no serialisation between the app and the engine, and concurrent
requests share one dynamic batcher. `/predict` has hand-written models; `/infer` uses the ones
generated from the model (`model.pydantic_models()`): its body is the model's inputs by name,
checked against their dtype and shape, and documented in the OpenAPI page.

Run: FERRITE_MODEL=models/mlp uvicorn examples.fastapi_app:app --port 9000
"""

import os
from typing import Any, List

import numpy as np
from fastapi import FastAPI, HTTPException
from pydantic import BaseModel, Field

import ferrite

model = ferrite.Model.load(os.environ.get("FERRITE_MODEL", "models/mlp"))
spec = model.metadata.inputs[0]
width = spec.shape[-1]
app = FastAPI(title="mlp via ferrite")
# Made at run time from the model's metadata, so mypy cannot see them as types.
Request, Response = model.pydantic_models()


class Features(BaseModel):
    rows: List[List[float]] = Field(min_length=1, max_length=64)


class Scores(BaseModel):
    model: str
    version: str
    scores: List[List[float]]


@app.post("/predict", response_model=Scores)
async def predict(body: Features) -> Scores:
    if any(len(r) != width for r in body.rows):
        raise HTTPException(status_code=422, detail=f"every row needs {width} features")
    x = np.asarray(body.rows, dtype=np.float32)
    try:
        out = await model.infer_async({spec.name: x})
    except ferrite.InvalidInput as e:
        raise HTTPException(status_code=400, detail=str(e))
    except ferrite.Unavailable as e:
        raise HTTPException(status_code=503, detail=str(e))
    meta = model.metadata
    return Scores(model=meta.name, version=meta.version, scores=out[meta.outputs[0].name].tolist())


@app.post("/infer", response_model=Response)
async def infer(body: Request) -> Any:  # type: ignore[valid-type]
    try:
        out = await model.infer_async(body.to_inputs())  # type: ignore[attr-defined]
    except ferrite.InvalidInput as e:
        raise HTTPException(status_code=400, detail=str(e))
    except ferrite.Unavailable as e:
        raise HTTPException(status_code=503, detail=str(e))
    return Response.from_outputs(out)
