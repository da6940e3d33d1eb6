"""The pipelines as a Python team writes them first: FastAPI + uvicorn, Pillow or tokenizers for the
pre-processing, onnxruntime for the model, NumPy for the rest; one request, one item, no batching.

Run: RESNET=... BERT=... TOKENIZER=... uvicorn bench.baseline.pipelines:app --workers 2 --port 9000
"""

import io
import os

import numpy as np
import onnxruntime as ort
from fastapi import FastAPI, Request
from PIL import Image
from pydantic import BaseModel
from tokenizers import Tokenizer

resnet = ort.InferenceSession(os.environ["RESNET"], providers=["CPUExecutionProvider"])
bert = ort.InferenceSession(os.environ["BERT"], providers=["CPUExecutionProvider"])
tokenizer = Tokenizer.from_file(os.environ["TOKENIZER"])
tokenizer.no_padding()
tokenizer.enable_truncation(256)
MEAN, STD = np.array([0.485, 0.456, 0.406], np.float32), np.array([0.229, 0.224, 0.225], np.float32)
app = FastAPI()


@app.get("/health")
def health():
    return {"ok": True}


@app.post("/classify")
async def classify(request: Request):
    img = Image.open(io.BytesIO(await request.body())).convert("RGB")
    r = 256 / min(img.size)
    img = img.resize((round(img.width * r), round(img.height * r)), Image.BILINEAR)
    left, top = (img.width - 224) // 2, (img.height - 224) // 2
    x = ((np.asarray(img.crop((left, top, left + 224, top + 224)), np.float32) / 255 - MEAN) / STD).transpose(2, 0, 1)
    logits = resnet.run(None, {resnet.get_inputs()[0].name: x[None]})[0][0]
    p = np.exp(logits - logits.max())
    p /= p.sum()
    top = np.argsort(-p)[:5]
    return {"classes": [f"{p[i]:.6f}:{i}" for i in top]}


class Embed(BaseModel):
    inputs: str | list[str]


@app.post("/embed")
def embed(req: Embed):
    texts = [req.inputs] if isinstance(req.inputs, str) else req.inputs
    enc = tokenizer.encode_batch(texts)
    longest = max(len(e.ids) for e in enc)
    ids = np.array([e.ids + [0] * (longest - len(e.ids)) for e in enc], np.int64)
    mask = np.array([e.attention_mask + [0] * (longest - len(e.ids)) for e in enc], np.int64)
    h = bert.run(None, {"input_ids": ids, "attention_mask": mask})[0]
    m = mask[..., None].astype(np.float32)
    v = (h * m).sum(1) / m.sum(1)
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    return v.tolist()
