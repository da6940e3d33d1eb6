"""Text embeddings as their users call them: OpenAI's POST /v1/embeddings through the `openai`
package (base_url to Ferrite), TEI's POST /embed over plain HTTP; the same vectors as the V2
route, with the server's auth, tenants and cache."""

import base64
import json
import shutil
import urllib.error
import urllib.request

import numpy as np
import openai
import pytest

from conftest import ROOT, Server

TOKEN = "infer-token-0123456789abcdef"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("embed") / "models"
    repo.mkdir()
    for m in ("text_encoder", "text_embedder", "mlp"):
        shutil.copytree(ROOT / "models" / m, repo / m)
    cfg = repo / "text_embedder" / "config.toml"
    cfg.write_text(cfg.read_text() + "\n[cache]\nenabled = true\n")
    tokens = repo.parent / "tokens"
    tokens.write_text(f"{TOKEN} infer,metrics\n")
    s = Server(repo, "--auth-token-file", str(tokens))
    yield s
    s.stop()


def post(server, path, body, token=TOKEN):
    req = urllib.request.Request(f"http://{server.url}{path}", data=json.dumps(body).encode(), method="POST")
    req.add_header("Authorization", f"Bearer {token}")
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def v2_embeddings(server, texts):
    body = {"inputs": [{"name": "text", "shape": [len(texts)], "datatype": "BYTES", "data": texts}],
            "outputs": [{"name": "embedding"}]}
    status, out = post(server, "/v2/models/text_embedder/infer", body)
    assert status == 200, out
    return np.array(out["outputs"][0]["data"], np.float32).reshape(len(texts), -1)


TEXTS = ["the cat eats fast food", "hello world", "A question, and an answer."]


def test_the_openai_client_gets_the_v2_vectors_and_the_token_usage(server):
    client = openai.OpenAI(base_url=f"http://{server.url}/v1", api_key=TOKEN)
    expected = v2_embeddings(server, TEXTS)
    # The client asks for base64 unless told otherwise, and decodes it.
    got = client.embeddings.create(model="text_embedder", input=TEXTS)
    assert [d.index for d in got.data] == [0, 1, 2]
    np.testing.assert_allclose(np.array([d.embedding for d in got.data]), expected, atol=1e-6)
    assert got.model == "text_embedder"
    # [CLS] + words + [SEP], as the tokenizer counts them.
    assert got.usage.prompt_tokens == got.usage.total_tokens == 7 + 4 + 9
    floats = client.embeddings.create(model="text_embedder", input="hello world", encoding_format="float")
    np.testing.assert_allclose(floats.data[0].embedding, expected[1], atol=1e-6)
    raw = post(server, "/v1/embeddings", {"model": "text_embedder", "input": ["hello world"], "encoding_format": "base64"})[1]
    vector = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), "<f4")
    np.testing.assert_allclose(vector, expected[1], atol=1e-6)


def test_openai_errors_come_in_openais_shape(server):
    client = openai.OpenAI(base_url=f"http://{server.url}/v1", api_key=TOKEN)
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="nowhere", input="hi")
    with pytest.raises(openai.BadRequestError, match="is not a text pipeline of task 'embed'"):
        client.embeddings.create(model="mlp", input="hi")
    with pytest.raises(openai.BadRequestError, match="step 'tokenize'.*empty"):
        client.embeddings.create(model="text_embedder", input=["fine", " "])
    with pytest.raises(openai.BadRequestError, match="more than 2048 texts"):
        client.embeddings.create(model="text_embedder", input=["a"] * 2049)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"http://{server.url}/v1", api_key="wrong").embeddings.create(model="text_embedder", input="hi")
    status, body = post(server, "/v1/embeddings", {"model": "text_embedder", "input": "hi", "encoding_format": "int8"})
    assert status == 400 and body["error"]["type"] == "invalid_request_error", body


def test_tei_embed_normalizes_and_picks_the_one_embedding_model(server):
    expected = v2_embeddings(server, TEXTS)
    status, got = post(server, "/embed", {"inputs": TEXTS})
    assert status == 200
    np.testing.assert_allclose(np.array(got), expected, atol=1e-6)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1, atol=1e-5)
    status, one = post(server, "/embed", {"inputs": "hello world", "truncate": True})
    assert status == 200 and np.allclose(one[0], expected[1], atol=1e-6)
    # Its pool step normalizes: raw vectors cannot be had from it, and the refusal says why.
    status, body = post(server, "/embed", {"inputs": "hello world", "normalize": False})
    assert status == 413 and body["error_type"] == "Validation" and "pool step normalizes" in body["error"], body
    assert post(server, "/embed", {"inputs": "hi"}, token="wrong")[0] == 401
    assert post(server, "/embed", {"inputs": 7})[0] == 422


def test_a_long_list_is_split_into_batches_and_answered_in_order_from_the_cache_the_second_time(server):
    texts = [f"{w} number {i}" for i, w in enumerate(["cat", "dog", "bird", "fish"] * 40)]  # 160 > 64 rows
    status, first = post(server, "/v1/embeddings", {"model": "text_embedder", "input": texts})
    assert status == 200 and len(first["data"]) == 160
    vectors = [d["embedding"] for d in first["data"]]
    np.testing.assert_allclose(np.array(vectors[:3]), v2_embeddings(server, texts[:3]), atol=1e-6)
    status, second = post(server, "/v1/embeddings", {"model": "text_embedder", "input": texts})
    assert second == first
    # TEI's routes take at most its client batch size (32), as TEI does.
    status, body = post(server, "/embed", {"inputs": texts})
    assert status == 413 and body["error"] == "batch size 160 > maximum allowed batch size 32", body
    with urllib.request.urlopen(urllib.request.Request(f"http://{server.url}/v2/models/text_embedder/stats",
                                                       headers={"Authorization": f"Bearer {TOKEN}"})) as r:
        stats = json.loads(r.read())["model_stats"][0]["inference_stats"]
    assert stats["cache_hit"]["count"] >= 3, stats
