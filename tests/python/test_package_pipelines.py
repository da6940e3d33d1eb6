"""Pipelines in-process: the package serves the bundled image and text pipelines as models, with
encoded images and texts in (NumPy object arrays of bytes) and the same answers as the server."""

import io
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import ferrite

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    repo = tmp_path_factory.mktemp("pipelines") / "models"
    for m in ("tiny_cnn", "image_classifier", "text_encoder", "text_embedder"):
        shutil.copytree(ROOT / "models" / m, repo / m)
    e = ferrite.Engine(str(repo))
    yield e
    e.close()


def jpeg(seed):
    img = Image.fromarray(np.random.default_rng(seed).integers(0, 255, (40, 48, 3), dtype=np.uint8))
    buf = io.BytesIO()
    img.save(buf, "JPEG")
    return buf.getvalue()


def test_pipelines_are_models_of_the_package(engine):
    assert {"image_classifier", "text_embedder"} <= set(engine.models)
    meta = engine.model("text_embedder").metadata
    assert meta.platform == "ensemble"
    assert meta.inputs == (ferrite.TensorSpec("text", "BYTES", (-1,)),)


def test_images_and_texts_in_answers_out(engine):
    classes = engine.model("image_classifier").infer({"image": np.array([jpeg(0), jpeg(1)], dtype=object)})["classes"]
    assert classes.shape == (2, 3)
    labels = (ROOT / "models" / "image_classifier" / "labels.txt").read_text().split()
    for row in classes:
        scores = [float(e.decode().split(":")[0]) for e in row]
        assert scores == sorted(scores, reverse=True) and all(e.decode().split(":")[2] in labels for e in row)
    out = engine.model("text_embedder").infer({"text": np.array([b"hello world", b"the cat eats"], dtype=object)})
    assert out["embedding"].shape == (2, 32) and out["embedding"].dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(out["embedding"], axis=1), 1, atol=1e-5)
    assert out["token_count"].tolist() == [4, 5]


def test_a_corrupt_image_is_an_invalid_input_naming_the_step(engine):
    with pytest.raises(ferrite.InvalidInput, match="step 'decode_image'"):
        engine.model("image_classifier").infer({"image": np.array([b"\xff\xd8 not a jpeg"], dtype=object)})
