"""The pipelines as a Python team writes them first: FastAPI + uvicorn, Pillow or tokenizers for the
pre-processing, onnxruntime for the model, NumPy for the rest; one request, one item, no batching.

Run: RESNET=... BERT=... RERANKER=... CLASSIFIER=... TOKENIZER=... uvicorn bench.baseline.pipelines:app --workers 2 --port 9000
"""

import io
import os

import numpy as np
import onnxruntime as ort
from fastapi import FastAPI, Request
from PIL import Image
from pydantic import BaseModel
from tokenizers import Tokenizer

def session(var):
    """The model in the file the environment names, or None (each benchmark loads what it needs)."""
    return ort.InferenceSession(os.environ[var], providers=["CPUExecutionProvider"]) if var in os.environ else None


resnet = session("RESNET")
bert = session("BERT")
reranker = session("RERANKER")
classifier = session("CLASSIFIER")
LABELS = ["negative", "neutral", "positive"]
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


def encode(texts, pairs=None):
    enc = tokenizer.encode_batch(list(zip(texts, pairs)) if pairs else texts)
    longest = max(len(e.ids) for e in enc)
    pad = lambda rows: np.array([r + [0] * (longest - len(r)) for r in rows], np.int64)  # noqa: E731
    return enc, pad([e.ids for e in enc]), pad([e.attention_mask for e in enc]), pad([e.type_ids for e in enc])


class Rerank(BaseModel):
    query: str
    texts: list[str]


@app.post("/rerank")
def rerank(req: Rerank):
    _, ids, mask, types = encode([req.query] * len(req.texts), req.texts)
    logits = reranker.run(None, {"input_ids": ids, "attention_mask": mask, "token_type_ids": types})[0][:, 0]
    scores = 1 / (1 + np.exp(-logits))
    order = np.argsort(-scores, kind="stable")
    return [{"index": int(i), "score": float(scores[i])} for i in order]


class Predict(BaseModel):
    inputs: str


@app.post("/predict")
def predict(req: Predict):
    _, ids, mask, _ = encode([req.inputs])
    logits = classifier.run(None, {"input_ids": ids, "attention_mask": mask})[0][0]
    p = np.exp(logits - logits.max())
    p /= p.sum()
    return [{"score": float(p[i]), "label": LABELS[i]} for i in np.argsort(-p)]
