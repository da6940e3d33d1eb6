"""Pipelines: native steps and chained models, served as models, checked against Python references
(Pillow for images, the tokenizers package for text, NumPy and ONNX Runtime for the rest) through
tritonclient (HTTP and gRPC) and plain HTTP. Tolerances are stated per operation."""

import concurrent.futures
import io
import itertools
import json
import shutil
import urllib.request

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from PIL import Image, ImageOps
from tokenizers import Tokenizer

from conftest import ROOT, Server, http_call, make_repository

MODELS = ROOT / "models"


def encode(img, fmt="PNG", **kw):
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def photo(w, h, seed=0):
    """Smooth gradients with noise: resizing filters differ on it as on photographs."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([x * 255 / max(w - 1, 1), y * 255 / max(h - 1, 1), (x + y) * 127 / max(w + h - 2, 1)], -1)
    return Image.fromarray(np.clip(base + rng.normal(0, 12, (h, w, 3)), 0, 255).astype(np.uint8))


def pipeline(repo, name, steps, outputs=(), extra=""):
    """Writes a pipeline config: steps as (op, {param: value}) pairs."""
    d = repo / name
    d.mkdir(parents=True, exist_ok=True)
    lines = [extra]
    for op, params in steps:
        lines.append("[[steps]]")
        lines.append(f'op = "{op}"')
        lines += [f"{k} = {json.dumps(v)}" for k, v in params.items()]
    for o in outputs:
        lines += ["[[output]]", f'name = "{o}"']
    (d / "config.toml").write_text("\n".join(lines) + "\n")
    return d


def infer(url, model, inputs, outputs=None):
    given = []
    for name, value in inputs.items():
        arr = np.array(value, dtype=object) if isinstance(value, list) else value
        t = httpclient.InferInput(name, list(arr.shape), "BYTES" if arr.dtype == object else
                                  {np.float32: "FP32", np.int64: "INT64"}[arr.dtype.type])
        t.set_data_from_numpy(arr)
        given.append(t)
    asked = [httpclient.InferRequestedOutput(o) for o in outputs] if outputs else None
    return http_call(url, lambda c: c.infer(model, given, outputs=asked))


def pixels(url, model, images):
    return infer(url, model, {"image": images}).as_numpy("pixels")


@pytest.fixture(scope="module")
def image_server(tmp_path_factory):
    """Pipelines that answer with their images' pixels (normalize to UINT8 NHWC), one per operation."""
    repo = tmp_path_factory.mktemp("images")
    raw = ("normalize", {"dtype": "UINT8", "layout": "NHWC"})
    pipeline(repo, "decoded", [("decode_image", {}), raw], extra="max_batch_size = 8")
    for f in ("nearest", "bilinear", "bicubic", "area"):
        # A budget of decoded pixels per request past eight 36-megapixel images (the memory test).
        pipeline(repo, f"exact_{f}", [("decode_image", {"max_request_pixels": 300_000_000}),
                                      ("resize", {"size": [37, 23], "filter": f}), raw])
    pipeline(repo, "shorter", [("decode_image", {}), ("resize", {"mode": "shorter_side", "size": [36]}), raw])
    pipeline(repo, "longer", [("decode_image", {}), ("resize", {"mode": "longer_side", "size": [64]}), raw])
    pipeline(repo, "letterbox", [("decode_image", {}), ("resize", {"mode": "longer_side", "size": [64]}),
                                 ("pad", {"mode": "size", "size": [64, 64], "value": 114}), raw])
    pipeline(repo, "multiple", [("decode_image", {}), ("pad", {"mode": "multiple", "multiple": 32, "anchor": "top_left"}), raw])
    pipeline(repo, "square", [("decode_image", {}), ("pad", {"mode": "square"}), raw])
    pipeline(repo, "crop", [("decode_image", {}), ("crop", {"size": [20, 10]}), raw])
    pipeline(repo, "imagenet", [("decode_image", {}), ("normalize", {"mean": [0.485, 0.456, 0.406],
                                                                      "std": [0.229, 0.224, 0.225]})])
    pipeline(repo, "bgr_nhwc", [("decode_image", {}), ("normalize", {"channels": "BGR", "layout": "NHWC",
                                                                      "scale": 1.0, "mean": [10.0]})])
    pipeline(repo, "small", [("decode_image", {"max_pixels": 10000, "max_bytes": 200000}), raw])
    # One worker whose batches wait 300 ms for more requests: requests sent at once share one.
    # Answers of each image's size, and of one size.
    held = "instance_count = 1\n\n[dynamic_batching]\nmax_queue_delay_microseconds = 300000\n"
    pipeline(repo, "held", [("decode_image", {}), raw], extra=held)
    pipeline(repo, "held_fixed", [("decode_image", {}), ("resize", {"size": [6, 5]}), raw], extra=held)
    for w, h in CV_SIZES:
        for f in ("bilinear", "area"):
            pipeline(repo, f"cv_{f}_{w}x{h}", [("decode_image", {}), ("resize", {"size": [w, h], "filter": f,
                                                                                "antialias": False}), raw])
    pipeline(repo, "cv_nearest", [("decode_image", {}), ("resize", {"size": [37, 23], "filter": "nearest",
                                                                     "antialias": False}), raw])
    # ultralytics' LetterBox: auto=True (each side up to a multiple of the stride), and the square.
    for name, pad in (("yolo_auto", {"mode": "multiple", "multiple": 32}), ("yolo_square", {"mode": "size", "size": [64, 64]})):
        pipeline(repo, name, [("decode_image", {}), ("resize", {"mode": "longer_side", "size": [64], "antialias": False}),
                              ("pad", {**pad, "value": 114}), raw])
    s = Server(repo)
    yield s
    s.stop()


def test_decoding_matches_pillow_for_every_format_and_mode(image_server):
    """PNG and lossless WebP within 1 level (alpha composited over white: rounding), grayscale
    spread to RGB; JPEG the same bytes as Pillow's (and OpenCV's) libjpeg-turbo gives, whatever
    its chroma subsampling, baseline or progressive, color or gray; EXIF orientation applied as a
    viewer shows the image."""
    img = photo(40, 30)
    cases = {
        "png": (encode(img, "PNG"), img),
        "webp": (encode(img, "WEBP", lossless=True), img),
        "gray": (encode(img.convert("L"), "PNG"), img.convert("L").convert("RGB")),
    }
    rgba = img.convert("RGBA")
    rgba.putalpha(Image.fromarray(np.tile(np.arange(40, dtype=np.uint8) * 6, (30, 1))))
    white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    cases["alpha"] = (encode(rgba, "PNG"), Image.alpha_composite(white, rgba).convert("RGB"))
    for name, (data, expected) in cases.items():
        got = pixels(image_server.url, "decoded", [data])[0]
        diff = np.abs(got.astype(int) - np.asarray(expected, np.uint8).astype(int))
        assert diff.max() <= 1, (name, diff.max())
    import cv2

    odd = photo(97, 61, 7)
    jpegs = [encode(odd, "JPEG", quality=q, subsampling=sub, progressive=prog)
             for q, sub, prog in [(90, 2, False), (75, 1, False), (95, 0, True), (50, 2, True)]]
    jpegs.append(encode(odd.convert("L"), "JPEG", quality=85))
    for jpeg, got in zip(jpegs, pixels(image_server.url, "decoded", jpegs)):
        ref = np.asarray(Image.open(io.BytesIO(jpeg)).convert("RGB"))
        assert (got == ref).all(), int(np.abs(got.astype(int) - ref).max())
        bgr = cv2.imdecode(np.frombuffer(jpeg, np.uint8), cv2.IMREAD_COLOR)
        assert (got == bgr[..., ::-1]).all()
    # EXIF orientation 6 (rotate 90 clockwise to show): the pixels come out as a viewer shows them.
    exif = Image.Exif()
    exif[0x0112] = 6
    rotated = encode(img, "JPEG", quality=95, exif=exif.tobytes())
    got = pixels(image_server.url, "decoded", [rotated])[0]
    ref = np.asarray(ImageOps.exif_transpose(Image.open(io.BytesIO(rotated))).convert("RGB"))
    assert got.shape == ref.shape == (40, 30, 3)
    assert (got == ref).all()


def test_a_corrupt_jpeg_fails_its_request_alone(image_server):
    """libjpeg's fatal errors (a scan naming Huffman tables that were never defined, which only
    the decoding finds) are the request's 400; the server carries on."""
    good = encode(photo(40, 30), "JPEG", quality=90)
    at = good.index(b"\xff\xda")  # SOS: length, components, then (component, tables) pairs
    bad = good[:at + 6] + b"\x77" + good[at + 7:]
    with pytest.raises(Exception, match="cannot decode the image: libjpeg fatal error: Huffman table"):
        pixels(image_server.url, "decoded", [bad])
    assert pixels(image_server.url, "decoded", [good]).shape == (1, 30, 40, 3)


def test_resizing_matches_pillow(image_server):
    """Every filter the bytes of Pillow's `resize` (its fixed-point convolution, widened when
    shrinking; nearest as its affine scaling picks), on odd sizes, extreme ratios, up and down;
    keep-ratio sizes exact."""
    filters = {"nearest": Image.NEAREST, "bilinear": Image.BILINEAR, "bicubic": Image.BICUBIC, "area": Image.BOX}
    images = [photo(70, 50), photo(200, 9, 1), photo(20, 15, 2), photo(3, 2, 3), photo(37, 100, 4), photo(500, 400, 5)]
    data = [encode(img) for img in images]
    for name, f in filters.items():
        for img, got in zip(images, pixels(image_server.url, f"exact_{name}", data)):
            ref = np.asarray(img.resize((37, 23), f))
            assert (got == ref).all(), (name, img.size, int(np.abs(got.astype(int) - ref).max()))
    img = images[0]
    got = pixels(image_server.url, "shorter", [data[0]])[0]
    assert got.shape == (36, 50, 3)  # 50 -> 36, 70 * 36/50 = 50.4 -> 50
    assert (got == np.asarray(img.resize((50, 36), Image.BILINEAR))).all()
    assert pixels(image_server.url, "longer", [data[0]])[0].shape == (46, 64, 3)  # 50 * 64/70 = 45.7


# Down (by whole blocks, by fractions), up, up one way and down the other, to a pixel.
CV_SIZES = [(37, 23), (35, 25), (150, 97), (71, 13), (1, 1), (10, 25), (66, 47)]
# Odd sizes, extreme ratios, exact halves and doubles of each other, grayscale.
CV_IMAGES = [photo(70, 50), photo(33, 61, 1), photo(200, 9, 2), photo(3, 2, 3), photo(140, 100, 4).convert("L")]


def test_resize_without_antialias_is_opencvs_to_the_byte(image_server):
    """`antialias = false`: the bytes `cv2.resize` gives with INTER_LINEAR (up, down, the 2x case
    OpenCV serves with its area code), INTER_AREA (by whole blocks, 2x2 and others, by fractions,
    and enlarging) and INTER_NEAREST, on every image of a mixed batch."""
    import cv2

    data = [encode(img) for img in CV_IMAGES]
    for (w, h), (f, flag) in itertools.product(CV_SIZES, [("bilinear", cv2.INTER_LINEAR), ("area", cv2.INTER_AREA)]):
        got = infer(image_server.url, f"cv_{f}_{w}x{h}", {"image": data}).as_numpy("pixels")
        for img, g in zip(CV_IMAGES, got):
            ref = cv2.resize(np.asarray(img.convert("RGB")), (w, h), interpolation=flag)
            assert (g == ref).all(), (f, img.size, (w, h), int(np.abs(g.astype(int) - ref).max()), int((g != ref).sum()))
    got = infer(image_server.url, "cv_nearest", {"image": data}).as_numpy("pixels")
    for img, g in zip(CV_IMAGES, got):
        assert (g == cv2.resize(np.asarray(img.convert("RGB")), (37, 23), interpolation=cv2.INTER_NEAREST)).all()


def ultralytics_letterbox(img, size=64, auto=False, stride=32):
    """ultralytics.data.augment.LetterBox as it computes (scaleup, center, 114), in NumPy and OpenCV."""
    import cv2

    shape = img.shape[:2]
    r = min(size / shape[0], size / shape[1])
    new_unpad = int(round(shape[1] * r)), int(round(shape[0] * r))
    dw, dh = size - new_unpad[0], size - new_unpad[1]
    if auto:
        dw, dh = np.mod(dw, stride), np.mod(dh, stride)
    dw, dh = dw / 2, dh / 2
    if shape[::-1] != new_unpad:
        img = cv2.resize(img, new_unpad, interpolation=cv2.INTER_LINEAR)
    top, bottom = int(round(dh - 0.1)), int(round(dh + 0.1))
    left, right = int(round(dw - 0.1)), int(round(dw + 0.1))
    return cv2.copyMakeBorder(img, top, bottom, left, right, cv2.BORDER_CONSTANT, value=(114, 114, 114))


def test_the_letterbox_is_ultralytics_to_the_byte(image_server):
    """resize longer_side (antialias = false) then pad: ultralytics' LetterBox, square and auto,
    including its rounding of the scaled side half to even (128x45 at 64: 22.5 -> 22)."""
    images = CV_IMAGES[:3] + [photo(128, 45, 5), photo(45, 128, 6)]
    data = [encode(img) for img in images]
    for name, auto in (("yolo_square", False), ("yolo_auto", True)):
        for img, d in zip(images, data):
            got = pixels(image_server.url, name, [d])[0]
            ref = ultralytics_letterbox(np.asarray(img.convert("RGB")), auto=auto)
            assert got.shape == ref.shape and (got == ref).all(), (name, img.size, got.shape, ref.shape)


def test_padding_and_cropping_are_exact(image_server):
    img = photo(70, 50)
    arr = np.asarray(img)
    got = pixels(image_server.url, "letterbox", [encode(img)])[0]
    inner = np.asarray(img.resize((64, 46), Image.BILINEAR)).astype(int)
    assert got.shape == (64, 64, 3)
    assert (got[:9] == 114).all() and (got[55:] == 114).all()  # (64 - 46) / 2 = 9 above, 9 below
    assert np.abs(got[9:55].astype(int) - inner).max() <= 2
    got = pixels(image_server.url, "multiple", [encode(img)])[0]
    assert got.shape == (64, 96, 3)
    assert (got[:50, :70] == arr).all() and (got[50:] == 0).all() and (got[:, 70:] == 0).all()
    got = pixels(image_server.url, "square", [encode(img)])[0]
    assert got.shape == (70, 70, 3) and (got[10:60] == arr).all() and (got[:10] == 0).all()
    got = pixels(image_server.url, "crop", [encode(img)])[0]
    assert (got == arr[20:30, 25:45]).all()


def test_normalize_matches_numpy(image_server):
    """Within 1e-6: (v / 255 - mean) / std in NCHW RGB; and BGR NHWC with scale 1 and one mean."""
    img = photo(16, 12)
    arr = np.asarray(img).astype(np.float32)
    got = infer(image_server.url, "imagenet", {"image": [encode(img)]}).as_numpy("pixels")[0]
    ref = ((arr / 255 - np.array([0.485, 0.456, 0.406], np.float32)) / np.array([0.229, 0.224, 0.225], np.float32))
    assert got.shape == (3, 12, 16)
    np.testing.assert_allclose(got, ref.transpose(2, 0, 1), atol=1e-5)
    got = infer(image_server.url, "bgr_nhwc", {"image": [encode(img)]}).as_numpy("pixels")[0]
    np.testing.assert_allclose(got, arr[..., ::-1] - 10.0, atol=1e-5)


def test_images_of_different_sizes_share_a_batch_and_bad_ones_fail_alone(image_server):
    """Rows of one pipeline batch may differ in size; a corrupt, empty, oversized or unknown-format
    image fails its own request with a 400 naming the step, while requests batched with it succeed."""
    good = [encode(photo(10 + i, 8 + i, seed=i)) for i in range(12)]
    bad = {
        b"\xff\xd8\xff\xe0 truncated jpeg": "cannot decode",
        b"": "empty",
        encode(Image.new("RGB", (200, 100))): "more than 10000 pixels",
        b"GIF89a....": "not a JPEG, PNG or WebP",
    }

    def call(data, model):
        try:
            return pixels(image_server.url, model, [data])
        except Exception as e:  # noqa: BLE001 - the error is the answer
            return e

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        goods = [pool.submit(call, g, "small") for g in good]
        bads = {pool.submit(call, b, "small"): why for b, why in bad.items()}
        for i, f in enumerate(goods):
            got = f.result()
            assert not isinstance(got, Exception), got
            assert got.shape == (1, 8 + i, 10 + i, 3)
        for f, why in bads.items():
            e = f.result()
            assert isinstance(e, Exception) and "[400]" in str(e) and "step 'decode_image'" in str(e), e
            assert why in str(e), (why, e)
    # A decompression bomb is refused from its header: 20000 x 20000 pixels in a few KB (a side over
    # max_side), and 8000 x 8000 (within the sides, over max_pixels).
    bomb = encode(Image.new("L", (20000, 20000)), "PNG", optimize=True)
    assert len(bomb) < 500_000
    e = call(bomb, "decoded")
    assert "[400]" in str(e) and "max_side" in str(e), e
    e = call(encode(Image.new("L", (8000, 8000)), "PNG", optimize=True), "decoded")
    assert "[400]" in str(e) and "more than 40000000 pixels" in str(e), e
    # Two rows of one request, the second corrupt: the error names its row.
    e = call_rows(image_server.url, [good[0], b"junk"])
    assert "[400]" in str(e) and "row 1" in str(e), e


@pytest.mark.parametrize("model", ["held", "held_fixed"])
def test_a_batch_of_images_of_many_sizes_and_a_bad_one_runs_once(image_server, model):
    """A corrupt image and three good ones of three sizes in one pipeline batch: the corrupt one
    fails its own request, and the batch goes on without it, each good image decoded once. It used
    to run again without the failed request (a client sending bad images doubled what everyone
    batched with it cost), and, where the answers keep each image's size, again in halves until
    the answers of each run had one size."""
    def decodes():
        text = urllib.request.urlopen(image_server.metrics_url, timeout=10).read().decode()
        return sum(float(line.split()[-1]) for line in text.splitlines()
                   if line.startswith("ferrite_pipeline_step_duration_seconds_count{")
                   and f'"{model}"' in line and '"decode_image"' in line)

    good = [encode(photo(10 + i, 8 + i, seed=i)) for i in range(3)]
    before = decodes()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        goods = [pool.submit(pixels, image_server.url, model, [g]) for g in good]
        bad = pool.submit(pixels, image_server.url, model, [b"\xff\xd8\xff\xe0 truncated jpeg"])
        for i, f in enumerate(goods):
            assert f.result().shape == ((1, 8 + i, 10 + i, 3) if model == "held" else (1, 5, 6, 3))
        with pytest.raises(Exception, match=r"\[400\].*step 'decode_image'.*cannot decode"):
            bad.result()
    assert decodes() - before == 1, "the batch ran its image steps again"
    # Two requests of two rows each, one row corrupt: the error names its row; the other request
    # is answered, its two images at their own sizes.
    def two(images):
        t = httpclient.InferInput("image", [2], "BYTES")
        t.set_data_from_numpy(np.array(images, dtype=object))
        try:
            return http_call(image_server.url, lambda c: c.infer(model, [t]).as_numpy("pixels"))
        except Exception as e:  # noqa: BLE001 - the error is the answer
            return e

    if model == "held":
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            fine, broken = pool.map(two, [[good[0], good[0]], [good[1], b"junk"]])
        assert fine.shape == (2, 8, 10, 3)
        assert "[400]" in str(broken) and "row 1" in str(broken), broken


def test_a_batch_of_large_images_holds_one_at_its_sent_size_at_a_time(image_server):
    """Eight 36-megapixel PNGs in one request (a few hundred KB each): decoding and resizing go row
    by row, so the server's peak memory grows by about one decoded image (108 MB), not eight."""
    big = encode(Image.new("RGB", (6000, 6000), (30, 60, 90)), "PNG", optimize=True)
    status = lambda: dict(line.split(":", 1) for line in open(f"/proc/{image_server.proc.pid}/status"))  # noqa: E731
    kb = lambda key: int(status()[key].split()[0])  # noqa: E731
    before = kb("VmHWM")
    got = pixels(image_server.url, "exact_nearest", [big] * 8)  # (a convolution's CPU is not the point)
    assert got.shape == (8, 23, 37, 3) and (got == [30, 60, 90]).all()
    grown_mb = (kb("VmHWM") - before) / 1024
    assert grown_mb < 400, f"peak memory grew by {grown_mb:.0f} MB"


def call_rows(url, rows):
    try:
        return pixels(url, "decoded", rows)
    except Exception as e:  # noqa: BLE001
        return e


@pytest.fixture(scope="module")
def bundled(tmp_path_factory):
    """The bundled example repository, with test pipelines of the text and detector kinds."""
    repo = tmp_path_factory.mktemp("bundled") / "models"
    shutil.copytree(MODELS, repo)
    make_repository(repo, ("yolo_v8", "yolo_v5"))
    tok = [("tokenize", {"max_length": 256})]
    pipeline(repo, "tokens", tok, outputs=("input_ids", "attention_mask", "token_type_ids", "token_count"))
    shutil.copy(repo / "text_embedder" / "tokenizer.json", repo / "tokens")
    pipeline(repo, "pairs", [("tokenize", {"pair": "second", "max_length": 16})], outputs=("input_ids", "token_type_ids"))
    shutil.copy(repo / "text_embedder" / "tokenizer.json", repo / "pairs")
    pipeline(repo, "strict", [("tokenize", {"max_length": 8, "truncation": False})], outputs=("input_ids",))
    shutil.copy(repo / "text_embedder" / "tokenizer.json", repo / "strict")
    # The ids as the encoder got them: its runs make concurrent requests share pipeline batches.
    pipeline(repo, "tokens_encoded", [*tok, ("model", {"model": "text_encoder"})], outputs=("input_ids",))
    shutil.copy(repo / "text_embedder" / "tokenizer.json", repo / "tokens_encoded")
    # One worker whose batches wait 300 ms for more requests: texts sent at once share one.
    held = "instance_count = 1\n\n[dynamic_batching]\nmax_queue_delay_microseconds = 300000\n"
    pipeline(repo, "tokens_held", [("tokenize", {"max_length": 8, "truncation": False})], outputs=("input_ids",),
             extra=held)
    shutil.copy(repo / "text_embedder" / "tokenizer.json", repo / "tokens_held")
    for name, layout, formats in [("detect_v8", "v8", {}), ("detect_v5", "v5", {}),
                                  ("detect_v8_cxcywhn", "v8", {"box_format": "CXCYWH", "normalized": True}),
                                  ("detect_v8_xywh", "v8", {"box_format": "xywh"}),
                                  ("detect_v8_xywh_int", "v8", {"box_format": "xywh", "integer": True})]:
        d = pipeline(repo, name, [
            ("decode_image", {}), ("resize", {"mode": "longer_side", "size": [64], "antialias": False}),
            ("pad", {"mode": "size", "size": [64, 64], "value": 114}),
            ("normalize", {"output": "images"}), ("model", {"model": f"yolo_{layout}"}),
            ("nms", {"layout": f"yolo{layout}", "labels": "labels.txt", "max_detections": 5, **formats}),
        ])
        (d / "labels.txt").write_text("person\nbicycle\ncar\n")
    s = Server(repo)
    yield s
    s.stop()


def reference_tokenizer(max_length):
    tok = Tokenizer.from_file(str(MODELS / "text_embedder" / "tokenizer.json"))
    tok.no_padding()
    tok.enable_truncation(max_length)
    return tok


def padded(encodings, field):
    longest = max(len(e.ids) for e in encodings)
    return np.array([getattr(e, field) + [0] * (longest - len(e.ids)) for e in encodings], np.int64)


TEXTS = ["Hello world!", "the cat eats fast food", "A question, and an answer: 42.",
         " ".join(["sentence"] * 150), "unknownwordzz"]


def test_tokenize_matches_the_tokenizers_package_and_overrides_the_files_length(bundled):
    """Exact ids, masks and type ids for one batch of texts, padded to the longest; the file says
    128 tokens, the step's max_length 256 wins (the 150-word text keeps 152 tokens)."""
    got = infer(bundled.url, "tokens", {"text": [t.encode() for t in TEXTS]})
    ref = reference_tokenizer(256).encode_batch(TEXTS)
    for field, name in (("ids", "input_ids"), ("attention_mask", "attention_mask"), ("type_ids", "token_type_ids")):
        np.testing.assert_array_equal(got.as_numpy(name), padded(ref, field))
    assert got.as_numpy("token_count").tolist() == [len(e.ids) for e in ref]
    assert got.as_numpy("input_ids").shape[1] == 152
    pairs = infer(bundled.url, "pairs", {"text": [b"what is it", b"a cat"], "second": [b"it is a dog", b"ten dogs run"]})
    ref = reference_tokenizer(16).encode_batch([("what is it", "it is a dog"), ("a cat", "ten dogs run")])
    np.testing.assert_array_equal(pairs.as_numpy("input_ids"), padded(ref, "ids"))
    np.testing.assert_array_equal(pairs.as_numpy("token_type_ids"), padded(ref, "type_ids"))


def test_texts_sent_at_once_are_padded_only_with_texts_of_near_length(bundled):
    """Short and long texts from many clients at once share pipeline batches, but a short text is
    never padded to a long one's length (it would cost the long one's compute), and every
    embedding is the text's own, as sent alone."""
    short, long = "a cat", " ".join(["sentence"] * 100)
    own = {t: len(reference_tokenizer(256).encode(t).ids) for t in (short, long)}

    def tokens(text):
        return infer(bundled.url, "tokens_encoded", {"text": [text.encode()]}).as_numpy("input_ids").shape[1]

    def embedding(text):
        return infer(bundled.url, "text_embedder", {"text": [text.encode()]}).as_numpy("embedding")[0]

    alone = {t: embedding(t) for t in (short, long)}
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        lengths = list(pool.map(tokens, [short, long] * 64))
        embeddings = list(pool.map(embedding, [short, long] * 12))
    assert lengths[1::2] == [own[long]] * 64
    assert lengths[0::2] == [own[short]] * 64, "a short text was padded to a long one's length"
    for text, got in zip([short, long] * 12, embeddings):
        np.testing.assert_allclose(got, alone[text], atol=1e-5)


def test_a_requests_texts_of_far_lengths_run_apart_unless_its_answer_has_their_length(bundled):
    """One request, a short and a long text: the embedder (answers of fixed shape) runs the encoder
    once per length; a pipeline answering the ids themselves pads the short one to the long one's
    length, since a request's rows stack into one tensor."""
    short, long = "a cat", " ".join(["sentence"] * 100)

    def encoder_runs():
        s = http_call(bundled.url, lambda c: c.get_inference_statistics("text_encoder"))
        return s["model_stats"][0]["execution_count"]

    before = encoder_runs()
    got = infer(bundled.url, "text_embedder", {"text": [short.encode(), long.encode()]}).as_numpy("embedding")
    assert encoder_runs() - before == 2
    for text, row in zip((short, long), got):
        alone = infer(bundled.url, "text_embedder", {"text": [text.encode()]}).as_numpy("embedding")[0]
        np.testing.assert_allclose(row, alone, atol=1e-5)
    before = encoder_runs()
    ids = infer(bundled.url, "tokens_encoded", {"text": [short.encode(), long.encode()]}).as_numpy("input_ids")
    assert encoder_runs() - before == 1
    assert ids.shape == (2, len(reference_tokenizer(256).encode(long).ids))


def test_an_empty_or_too_long_text_fails_its_request_alone(bundled):
    with pytest.raises(Exception, match=r"\[400\].*step 'tokenize'.*empty"):
        infer(bundled.url, "tokens", {"text": [b"  "]})
    with pytest.raises(Exception, match=r"\[400\].*more than max_length 8"):
        infer(bundled.url, "strict", {"text": [b"one two three four five six seven eight"]})
    assert infer(bundled.url, "strict", {"text": [b"one two"]}).as_numpy("input_ids").shape == (1, 4)


def test_a_bad_text_in_a_batch_fails_alone_and_the_others_are_tokenized_once(bundled):
    """An empty text and one over max_length (truncation off) batched with good ones: each fails
    its own request, and the batch's tokenize step runs once (it used to run again for the others)."""
    def tokenize_runs():
        text = urllib.request.urlopen(bundled.metrics_url, timeout=10).read().decode()
        return sum(float(line.split()[-1]) for line in text.splitlines()
                   if line.startswith("ferrite_pipeline_step_duration_seconds_count{")
                   and '"tokens_held"' in line and '"tokenize"' in line)

    good = ["a cat", "one two", "the dog"]
    before = tokenize_runs()
    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        goods = [pool.submit(infer, bundled.url, "tokens_held", {"text": [g.encode()]}) for g in good]
        empty = pool.submit(infer, bundled.url, "tokens_held", {"text": [b"  "]})
        long = pool.submit(infer, bundled.url, "tokens_held", {"text": [b"one two three four five six seven eight"]})
        for g, f in zip(good, goods):
            assert f.result().as_numpy("input_ids").shape == (1, len(reference_tokenizer(8).encode(g).ids))
        with pytest.raises(Exception, match=r"\[400\].*step 'tokenize'.*empty"):
            empty.result()
        with pytest.raises(Exception, match=r"\[400\].*more than max_length 8"):
            long.result()
    assert tokenize_runs() - before == 1, "the batch tokenized its texts again"


def test_the_text_embedder_matches_tokenizers_onnxruntime_and_numpy(bundled):
    """Within 1e-5: tokenize (256), the encoder through ONNX Runtime, mean over the mask, L2."""
    texts = TEXTS[:3]
    got = infer(bundled.url, "text_embedder", {"text": [t.encode() for t in texts]}).as_numpy("embedding")
    enc = reference_tokenizer(256).encode_batch(texts)
    feeds = {"input_ids": padded(enc, "ids"), "attention_mask": padded(enc, "attention_mask"),
             "token_type_ids": padded(enc, "type_ids")}
    sess = ort.InferenceSession(str(MODELS / "text_encoder" / "1" / "model.onnx"))
    hidden = sess.run(None, feeds)[0]
    mask = feeds["attention_mask"][..., None].astype(np.float32)
    ref = (hidden * mask).sum(1) / mask.sum(1)
    ref /= np.linalg.norm(ref, axis=1, keepdims=True)
    np.testing.assert_allclose(got, ref, atol=1e-5)
    # One text alone gives the same vector as in a batch (padding never leaks into the mean).
    alone = infer(bundled.url, "text_embedder", {"text": [texts[0].encode()]}).as_numpy("embedding")
    np.testing.assert_allclose(alone[0], ref[0], atol=1e-5)


def test_the_image_classifier_matches_pillow_onnxruntime_and_numpy(bundled):
    """Top 3 as "score:index:label": the same classes as Pillow (shorter side 36, centre crop 32,
    ImageNet normalization) + ONNX Runtime + softmax, scores within 0.01 (resizing differs by up
    to 2 levels)."""
    labels = (MODELS / "image_classifier" / "labels.txt").read_text().split()
    sess = ort.InferenceSession(str(MODELS / "tiny_cnn" / "1" / "model.onnx"))
    images = [photo(48 + 8 * i, 40, seed=i) for i in range(3)]
    got = infer(bundled.url, "image_classifier", {"image": [encode(i, "JPEG", quality=95) for i in images]})
    for row, img in zip(got.as_numpy("classes"), images):
        img = Image.open(io.BytesIO(encode(img, "JPEG", quality=95))).convert("RGB")
        w, h = img.size
        r = 36 / min(w, h)
        small = img.resize((round(w * r), round(h * r)), Image.BILINEAR)
        left, top = (small.width - 32) // 2, (small.height - 32) // 2
        x = np.asarray(small.crop((left, top, left + 32, top + 32)), np.float32) / 255
        x = ((x - [0.485, 0.456, 0.406]) / [0.229, 0.224, 0.225]).astype(np.float32).transpose(2, 0, 1)[None]
        logits = sess.run(None, {"pixels": x})[0][0]
        p = np.exp(logits - logits.max())
        p /= p.sum()
        top3 = np.argsort(-p)[:3]
        parts = [e.decode().split(":") for e in row]
        assert [int(i) for _, i, _ in parts] == top3.tolist()
        assert [lbl for _, _, lbl in parts] == [labels[i] for i in top3]
        np.testing.assert_allclose([float(s) for s, _, _ in parts], p[top3], atol=0.01)


def reference_nms(out, layout, score_threshold=0.25, iou_threshold=0.45, max_det=5):
    """Greedy class-aware NMS as ultralytics does it (best class per anchor; YOLOv5: times objectness)."""
    if layout == "v8":
        boxes, scores = out[:4].T, out[4:].T
    else:
        boxes, scores = out[:, :4], out[:, 5:] * out[:, 4:5]
    cls, best = scores.argmax(1), scores.max(1)
    keep = np.where(best > score_threshold)[0]
    order = keep[np.argsort(-best[keep], kind="stable")]
    xyxy = np.concatenate([boxes[:, :2] - boxes[:, 2:] / 2, boxes[:, :2] + boxes[:, 2:] / 2], 1)
    kept = []
    for i in order:
        ok = True
        for j in kept:
            if cls[i] != cls[j]:
                continue
            a, b = xyxy[i], xyxy[j]
            inter = max(0, min(a[2], b[2]) - max(a[0], b[0])) * max(0, min(a[3], b[3]) - max(a[1], b[1]))
            union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
            if inter / union > iou_threshold:
                ok = False
        if ok:
            kept.append(i)
    return xyxy[kept[:max_det]], best[kept[:max_det]], cls[kept[:max_det]]


@pytest.mark.parametrize("layout", ["v8", "v5"])
def test_the_detector_pipeline_matches_a_numpy_nms_with_boxes_in_the_images_pixels(bundled, layout):
    """Letterbox (longer side 64 as OpenCV resizes, pad to 64x64 centred, 114), the detector, NMS:
    the detections of ultralytics' LetterBox, ONNX Runtime and NumPy's NMS on the same image, boxes
    mapped back to the pixels of the image as sent."""
    img = photo(160, 100, seed=3)
    data = encode(img)
    c = grpcclient.InferenceServerClient(bundled.grpc_url)
    t = grpcclient.InferInput("image", [1], "BYTES")
    t.set_data_from_numpy(np.array([data], dtype=object))
    got = c.infer(f"detect_{layout}", [t])
    r = 64 / 160
    box = ultralytics_letterbox(np.asarray(img), size=64)
    x = (box.astype(np.float32) / 255).transpose(2, 0, 1)[None]
    sess = ort.InferenceSession(str(ROOT / "tests" / "models" / f"yolo_{layout}" / "1" / "model.onnx"))
    boxes, scores, classes = reference_nms(sess.run(None, {"images": x})[0][0], layout)
    n = int(got.as_numpy("num_detections")[0])
    assert n == len(boxes) and n >= 3, (n, len(boxes))
    expected = (boxes - [0, 12, 0, 12]) / r
    expected = np.clip(expected, 0, [160, 100, 160, 100])
    np.testing.assert_allclose(got.as_numpy("boxes")[0][:n], expected, atol=1e-3)
    np.testing.assert_allclose(got.as_numpy("scores")[0][:n], scores, atol=1e-6)
    assert got.as_numpy("classes")[0][:n].tolist() == classes.tolist()
    assert (got.as_numpy("classes")[0][n:] == -1).all() and (got.as_numpy("boxes")[0][n:] == 0).all()
    names = [b.decode() for b in got.as_numpy("labels")[0][:n]]
    assert names == [["person", "bicycle", "car"][c] for c in classes]


def test_nms_writes_boxes_in_the_format_asked(bundled):
    """xywh (COCO, nudenet), whole pixels (INT64, cut toward zero as int() does) and ultralytics'
    normalized centre format: the same detections as the default corners, converted."""
    c = grpcclient.InferenceServerClient(bundled.grpc_url)
    t = grpcclient.InferInput("image", [1], "BYTES")
    t.set_data_from_numpy(np.array([encode(photo(160, 100, seed=3))], dtype=object))
    xyxy = c.infer("detect_v8", [t]).as_numpy("boxes")[0]
    xywh = c.infer("detect_v8_xywh", [t]).as_numpy("boxes")[0]
    cxcywhn = c.infer("detect_v8_cxcywhn", [t]).as_numpy("boxes")[0]
    whole = c.infer("detect_v8_xywh_int", [t]).as_numpy("boxes")[0]
    x1, y1, x2, y2 = xyxy.T
    np.testing.assert_allclose(xywh, np.stack([x1, y1, x2 - x1, y2 - y1], 1), atol=1e-4)
    assert whole.dtype == np.int64 and (whole == xywh.astype(np.int64)).all() and whole[0].any(), whole
    np.testing.assert_allclose(cxcywhn, np.stack([(x1 + x2) / 2 / 160, (y1 + y2) / 2 / 100,
                                                  (x2 - x1) / 160, (y2 - y1) / 100], 1), atol=1e-6)


def test_pipelines_are_models_everywhere(bundled):
    """Metadata, config, statistics, repository index and per-step metrics, like any model; a
    pipeline calling a missing model is unavailable with the reason, not fatal."""
    meta = json.load(urllib.request.urlopen(f"http://{bundled.url}/v2/models/text_embedder"))
    assert meta["platform"] == "ensemble"
    assert meta["inputs"] == [{"name": "text", "datatype": "BYTES", "shape": [-1]}]
    assert meta["outputs"] == [{"name": "embedding", "datatype": "FP32", "shape": [-1, 32]},
                               {"name": "token_count", "datatype": "INT64", "shape": [-1]}]
    config = json.load(urllib.request.urlopen(f"http://{bundled.url}/v2/models/image_classifier/config"))
    assert config["max_batch_size"] == 32 and config["platform"] == "ensemble"
    infer(bundled.url, "image_classifier", {"image": [encode(photo(40, 40))]})
    stats = json.load(urllib.request.urlopen(f"http://{bundled.url}/v2/models/image_classifier/stats"))
    assert stats["model_stats"][0]["inference_stats"]["success"]["count"] >= 1
    metrics = urllib.request.urlopen(bundled.metrics_url).read().decode()
    for step in ("decode_image", "resize", "crop", "normalize", "model", "softmax", "topk"):
        assert f'ferrite_pipeline_step_duration_seconds_count{{model="image_classifier",step="{step}"}}' in metrics, step


def test_a_pipeline_whose_model_is_missing_is_unavailable_with_the_reason(tmp_path):
    repo = tmp_path / "repo"
    pipeline(repo, "broken", [("tokenize", {}), ("model", {"model": "nowhere"})])
    shutil.copy(MODELS / "text_embedder" / "tokenizer.json", repo / "broken")
    pipeline(repo, "typo", [("decode_image", {}), ("blur", {})])
    make_repository(repo, ("mlp",))
    s = Server(repo)
    try:
        index = json.loads(urllib.request.urlopen(urllib.request.Request(
            f"http://{s.url}/v2/repository/index", data=b"{}", method="POST")).read())
        why = {e["name"]: e.get("reason", "") for e in index}
        assert "step 'model' (model): unknown model 'nowhere'" in why["broken"], why
        assert "blur" in why["typo"], why
    finally:
        s.stop()


def test_a_pipeline_follows_a_reload_of_its_model_and_never_answers_from_the_old_ones_cache(start_server, tmp_path):
    """Poll mode: a new version of the model a pipeline calls is served by the pipeline at once,
    and the pipeline's cached answers of the old one are not given (its cache key follows it)."""
    repo = tmp_path / "repo"
    (repo / "scale" / "1").mkdir(parents=True)
    shutil.copy(ROOT / "tests" / "models" / "scale" / "1" / "model.onnx", repo / "scale" / "1")
    pipeline(repo, "scaled", [("model", {"model": "scale"})], extra="[cache]\nenabled = true")
    s = start_server("--model-control-mode", "poll", "--repository-poll-secs", "0.2", repository=repo)
    x = np.arange(4, dtype=np.float32).reshape(1, 4)
    y = lambda: infer(s.url, "scaled", {"x": x}).as_numpy("y")  # noqa: E731
    np.testing.assert_allclose(y(), x)
    np.testing.assert_allclose(y(), x)  # a hit
    (repo / "scale" / "2").mkdir()
    shutil.copy(ROOT / "tests" / "models" / "scale" / "2" / "model.onnx", repo / "scale" / "2")
    import time
    deadline = time.time() + 30
    while time.time() < deadline and not np.allclose(y(), 2 * x):
        time.sleep(0.2)
    np.testing.assert_allclose(y(), 2 * x)
    stats = json.load(urllib.request.urlopen(f"http://{s.url}/v2/models/scaled/stats"))["model_stats"][0]
    assert stats["inference_stats"]["cache_hit"]["count"] >= 1
