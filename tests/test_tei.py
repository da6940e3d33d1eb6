"""TEI drop-in: Hugging Face directories (written by scripts/make_models.py --hugging-face as
optimum and sentence-transformers lay them out) served with no configuration, and TEI's API over
them: /embed, /embed_sparse, /embed_all, /rerank, /predict, /similarity, /tokenize, /decode, /info, /health
and the default route POST /, plus Cohere's /v1/rerank.
Answers are compared with a reference made here from the same files: the tokenizer through the
`tokenizers` package, the ONNX file through onnxruntime, pooling and scores in NumPy."""

import json
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request

import jsonschema
import numpy as np
import onnxruntime as ort
import pytest
from tokenizers import Tokenizer

from conftest import BIN, ROOT, Server, free_port

TOKEN = "tei-token-0123456789abcdef"
TEXTS = ["the cat eats fast food", "hello world", "A question, and an answer."]


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf")
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_models.py"), "--hugging-face", str(out)],
                   check=True, capture_output=True)
    return out


@pytest.fixture(scope="module")
def server(hf, tmp_path_factory):
    """The three directories as they are, beside an image pipeline (BYTES in, like a text model)
    and the bundled hand-written text pipeline renamed out of the embedders' way."""
    repo = tmp_path_factory.mktemp("tei") / "models"
    repo.mkdir()
    for m in ("hf_embedder", "hf_reranker", "hf_classifier"):
        shutil.copytree(hf / m, repo / m)
    for m in ("tiny_cnn", "image_classifier", "mlp"):
        shutil.copytree(ROOT / "models" / m, repo / m)
    tokens = repo.parent / "tokens"
    tokens.write_text(f"{TOKEN} infer\n")
    s = Server(repo, "--auth-token-file", str(tokens))
    yield s
    s.stop()


def call(server, path, body=None, token=TOKEN):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://{server.url}{path}", data=data, method="GET" if body is None else "POST")
    req.add_header("Authorization", f"Bearer {token}")
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


class Reference:
    """The model of a Hugging Face directory run by hand."""

    def __init__(self, directory, max_length):
        self.tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
        self.tok.no_padding()
        self.tok.enable_truncation(max_length)
        onnx = directory / "onnx" / "model.onnx"
        self.session = ort.InferenceSession(str(onnx if onnx.exists() else directory / "model.onnx"))

    def run(self, first, second=None):
        e = self.tok.encode(first, second) if second is not None else self.tok.encode(first)
        feed = {"input_ids": np.array([e.ids], np.int64), "attention_mask": np.array([e.attention_mask], np.int64),
                "token_type_ids": np.array([e.type_ids], np.int64)}
        return self.session.run(None, feed)[0][0]

    def embed(self, text, normalize=True):
        v = self.run(text).mean(axis=0)
        return v / np.linalg.norm(v) if normalize else v


def sigmoid(x):
    return 1 / (1 + np.exp(-x))


def softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def test_info_says_what_each_directory_was_found_to_be(server):
    status, info = call(server, "/info?model=hf_embedder")
    assert status == 200, info
    assert info["model_type"] == {"embedding": {"pooling": "mean"}}
    # sentence_bert_config.json's max_seq_length, not the model's 512 positions.
    assert info["max_input_length"] == 24 and info["max_client_batch_size"] == 32 and info["model_id"] == "hf_embedder"
    assert call(server, "/info?model=hf_reranker")[1]["model_type"] == {
        "reranker": {"id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0}}}
    classifier = call(server, "/info?model=hf_classifier")[1]
    assert classifier["model_type"]["classifier"]["id2label"] == {"0": "negative", "1": "neutral", "2": "positive"}
    assert classifier["max_input_length"] == 512
    # Three text models: /info must be told which (TEI serves one, Ferrite many).
    status, body = call(server, "/info")
    assert status == 413 and body["error_type"] == "Validation" and "hf_classifier" in body["error"], body
    status, body = call(server, "/info?model=nowhere")
    assert status == 404 and body["error_type"] == "NotFound", body


def test_a_directory_served_as_it_is_embeds_as_its_files_say(server, hf):
    ref = Reference(hf / "hf_embedder", 24)
    # No "model": the one embedder answers, though an image pipeline also takes BYTES.
    status, got = call(server, "/embed", {"inputs": TEXTS})
    assert status == 200, got
    np.testing.assert_allclose(np.array(got), [ref.embed(t) for t in TEXTS], atol=1e-5)
    # normalize: false answers the pooled vector as it is (the directory's pipeline does not normalize).
    status, raw = call(server, "/embed", {"inputs": "hello world", "normalize": False})
    assert status == 200
    np.testing.assert_allclose(raw[0], ref.embed("hello world", normalize=False), atol=1e-5)
    assert abs(np.linalg.norm(raw[0]) - 1) > 0.1
    # dimensions: cut, then normalized.
    status, cut = call(server, "/embed", {"inputs": "hello world", "dimensions": 8})
    v = ref.embed("hello world", normalize=False)[:8]
    np.testing.assert_allclose(cut[0], v / np.linalg.norm(v), atol=1e-5)
    for bad in (0, 33):
        status, body = call(server, "/embed", {"inputs": "hi", "dimensions": bad})
        assert status == 413 and body["error_type"] == "Validation", body
    # A prompt of config_sentence_transformers.json goes before the text.
    status, prompted = call(server, "/embed", {"inputs": "hello world", "prompt_name": "query"})
    np.testing.assert_allclose(prompted[0], ref.embed("query: hello world"), atol=1e-5)
    status, body = call(server, "/embed", {"inputs": "hi", "prompt_name": "nope"})
    assert status == 413 and '"query"' in body["error"] and '"passage"' in body["error"], body
    # Its vectors are dense: /embed_sparse is TEI's 424.
    status, body = call(server, "/embed_sparse", {"inputs": "hi"})
    assert status == 424 and body["error_type"] == "Backend" and "SPLADE" in body["error"], body


def test_embed_all_answers_the_hidden_state_of_each_token_each_text_took(server, hf):
    """TEI's /embed_all: per text, the encoder's output at each of its tokens, special tokens
    included and padding not, however the texts of a call differ in length."""
    ref = Reference(hf / "hf_embedder", 24)
    texts = TEXTS + ["a text long enough to be cut at the directory's twenty four tokens " * 3]
    status, got = call(server, "/embed_all", {"inputs": texts})
    assert status == 200, got
    fits(call(server, "/v2/openapi.json")[1], "/embed_all", "post", got)
    for text, tokens in zip(texts, got):
        want = ref.run(text)
        assert np.array(tokens).shape == want.shape, (text, np.array(tokens).shape, want.shape)
        np.testing.assert_allclose(tokens, want, atol=1e-5)
    assert [len(t) for t in got] == [len(ref.tok.encode(t).ids) for t in texts] and len(got[-1]) == 24
    # Their mean is what /embed answers unnormalized; one text alone answers as in company.
    status, pooled = call(server, "/embed", {"inputs": texts, "normalize": False})
    np.testing.assert_allclose([np.mean(t, axis=0) for t in got], pooled, atol=1e-5)
    assert call(server, "/embed_all", {"inputs": "hello world"})[1][0] == got[1]
    status, prompted = call(server, "/embed_all", {"inputs": "hello world", "prompt_name": "query"})
    np.testing.assert_allclose(prompted[0], ref.run("query: hello world"), atol=1e-5)
    # TEI's refusals: too long with truncate false, an empty batch, no text model of embeddings.
    status, body = call(server, "/embed_all", {"inputs": texts[-1], "truncate": False})
    assert status == 413 and body["error_type"] == "Validation" and "less than 24 tokens" in body["error"], body
    status, body = call(server, "/embed_all", {"inputs": []})
    assert status == 400 and body["error_type"] == "Empty", body
    status, body = call(server, "/embed_all", {"inputs": "hi", "model": "hf_reranker"})
    assert status == 424 and body["error_type"] == "Backend" and "not an embedding model" in body["error"], body
    status, body = call(server, "/embed_all", {"inputs": ["hi"] * 33})
    assert status == 413 and body == {"error": "batch size 33 > maximum allowed batch size 32", "error_type": "Validation"}
    assert call(server, "/embed_all", {"inputs": "hi"}, token="wrong")[0] == 401


def test_long_texts_are_cut_unless_truncate_is_false_and_bad_inputs_fail_as_in_tei(server, hf):
    ref = Reference(hf / "hf_embedder", 24)
    long = "the cat eats fast food " * 10  # 52 tokens
    status, got = call(server, "/embed", {"inputs": long})
    assert status == 200
    np.testing.assert_allclose(got[0], ref.embed(long), atol=1e-5)
    status, body = call(server, "/embed", {"inputs": long, "truncate": False})
    assert status == 413 and body == {"error": "`inputs` must have less than 24 tokens. Given: 52",
                                      "error_type": "Validation"}, body
    status, body = call(server, "/embed", {"inputs": ["fine", ""]})
    assert status == 400 and body["error_type"] == "Empty", body
    status, body = call(server, "/embed", {"inputs": ["x"] * 33})
    assert status == 413 and body["error"] == "batch size 33 > maximum allowed batch size 32", body
    status, body = call(server, "/embed", {"inputs": "x", "truncation_direction": "Left"})
    assert status == 413 and "Right" in body["error"], body
    assert call(server, "/embed", {"inputs": "x"}, token="wrong")[0] == 401
    status, body = call(server, "/embed", {"inputs": "x", "model": "nowhere"})
    assert status == 404 and body["error_type"] == "NotFound", body


def test_rerank_scores_each_passage_for_the_query_highest_first(server, hf):
    ref = Reference(hf / "hf_reranker", 512)
    query, passages = "what do cats eat", ["cats eat fish", "the road is long", "a dog runs fast", "hello world"]
    raw = np.array([ref.run(query, p)[0] for p in passages])
    status, got = call(server, "/rerank", {"query": query, "texts": passages, "return_text": True})
    assert status == 200, got
    order = np.argsort(-raw, kind="stable")
    assert [r["index"] for r in got] == list(order)
    np.testing.assert_allclose([r["score"] for r in got], sigmoid(raw[order]), atol=1e-5)
    assert [r["text"] for r in got] == [passages[i] for i in order]
    status, scores = call(server, "/rerank", {"query": query, "texts": passages, "raw_scores": True})
    np.testing.assert_allclose([r["score"] for r in scores], raw[order], atol=1e-4)
    assert all("text" not in r for r in scores)
    # The wrong task is TEI's 424; an empty query its 400.
    status, body = call(server, "/rerank", {"query": query, "texts": passages, "model": "hf_embedder"})
    assert status == 424 and body["error_type"] == "Backend" and "not a re-ranker" in body["error"], body
    assert call(server, "/rerank", {"query": "", "texts": passages})[0] == 400
    # Cohere's and Jina's shape of the same call.
    documents = [passages[0], {"text": passages[1]}, passages[2], passages[3]]
    status, body = call(server, "/v1/rerank", {"query": query, "documents": documents, "top_n": 2,
                                               "return_documents": True})
    assert status == 200, body
    assert [r["index"] for r in body["results"]] == list(order[:2])
    np.testing.assert_allclose([r["relevance_score"] for r in body["results"]], sigmoid(raw[order[:2]]), atol=1e-5)
    assert body["results"][0]["document"] == {"text": passages[order[0]]} and body["model"] == "hf_reranker"
    assert body["usage"]["total_tokens"] > 0


def test_a_call_of_the_most_inputs_counts_passages_and_pairs_not_their_texts(server):
    """TEI's client batch size counts a re-ranker's passages, not its query (a classifier's pairs
    are counted as one each: the hand-written pair classifier's test)."""
    status, ranks = call(server, "/rerank", {"query": "cats", "texts": [f"passage {i}" for i in range(32)]})
    assert status == 200 and len(ranks) == 32, ranks
    status, body = call(server, "/rerank", {"query": "cats", "texts": ["passage"] * 33})
    assert status == 413 and body["error"] == "batch size 33 > maximum allowed batch size 32", body


def test_predict_classifies_a_text_or_a_list_with_the_labels_of_config_json(server, hf):
    ref = Reference(hf / "hf_classifier", 512)
    labels = ["negative", "neutral", "positive"]
    status, one = call(server, "/predict", {"inputs": "i love the sun"})
    assert status == 200, one
    p = softmax(ref.run("i love the sun"))
    order = np.argsort(-p)
    assert [c["label"] for c in one] == [labels[i] for i in order]
    np.testing.assert_allclose([c["score"] for c in one], p[order], atol=1e-5)
    status, many = call(server, "/predict", {"inputs": ["i love the sun", "a bad day", "the road"], "raw_scores": True})
    assert status == 200 and len(many) == 3
    for text, answer in zip(["i love the sun", "a bad day", "the road"], many):
        logits = ref.run(text)
        np.testing.assert_allclose(sorted(c["score"] for c in answer), sorted(logits), atol=1e-4)
        assert answer[0]["label"] == labels[int(np.argmax(logits))]
    # Two strings are one pair (TEI's reading): this classifier reads single texts.
    status, body = call(server, "/predict", {"inputs": ["a", "b"]})
    assert status == 413 and "single texts" in body["error"], body


def test_similarity_tokenize_and_decode(server, hf):
    ref = Reference(hf / "hf_embedder", 24)
    status, sims = call(server, "/similarity", {"inputs": {"source_sentence": "hello world",
                                                           "sentences": ["hello world", "the cat eats"]},
                                                "model": "hf_embedder"})
    assert status == 200, sims
    source = ref.embed("hello world")
    np.testing.assert_allclose(sims, [1.0, float(source @ ref.embed("the cat eats"))], atol=1e-5)
    text = "Hello, café world"
    status, tokens = call(server, "/tokenize", {"inputs": [text, "the cat"], "model": "hf_embedder"})
    assert status == 200 and len(tokens) == 2
    want = Tokenizer.from_file(str(hf / "hf_embedder" / "tokenizer.json"))
    want.no_padding()
    want.no_truncation()
    e = want.encode(text)
    assert [t["id"] for t in tokens[0]] == e.ids
    first, last = tokens[0][0], tokens[0][-1]
    assert first == {"id": e.ids[0], "text": "[CLS]", "special": True, "start": None, "stop": None}
    assert last["special"] and last["text"] == "[SEP]"
    for t in tokens[0][1:-1]:
        # Byte offsets into the text as sent, and the text they cover.
        assert text.encode()[t["start"]:t["stop"]].decode() == t["text"] and not t["special"], t
    # /tokenize never cuts: 52 tokens from a model that keeps 24.
    status, long = call(server, "/tokenize", {"inputs": "the cat eats fast food " * 10, "model": "hf_embedder"})
    assert len(long[0]) == 52
    status, plain = call(server, "/tokenize", {"inputs": "the cat", "add_special_tokens": False, "model": "hf_embedder"})
    assert [t["text"] for t in plain[0]] == ["the", "cat"]
    status, decoded = call(server, "/decode", {"ids": e.ids, "model": "hf_embedder"})
    assert status == 200 and decoded == [want.decode(e.ids, skip_special_tokens=True)]
    status, both = call(server, "/decode", {"ids": [e.ids, e.ids[:3]], "skip_special_tokens": False,
                                            "model": "hf_embedder"})
    assert both == [want.decode(e.ids, skip_special_tokens=False), want.decode(e.ids[:3], skip_special_tokens=False)]
    status, body = call(server, "/tokenize", {"inputs": "x" * (1 << 20) + "y", "model": "hf_embedder"})
    assert status == 413 and "at most" in body["error"], body


def raw(url, path, method="GET", body=None, token=None):
    req = urllib.request.Request(f"http://{url}{path}", method=method,
                                 data=None if body is None else json.dumps(body).encode())
    req.add_header("Content-Type", "application/json")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_a_lone_directory_answers_teis_health_and_default_routes(hf, tmp_path):
    """TEI serves one model, its directory named by --model-id, and its users' probes and clients
    call routes named for that: GET /health (/ and /ping on its Inference Endpoints and SageMaker
    images), POST / and /invocations (the model's own call, by its type), POST /embeddings
    (OpenAI's, unversioned). The embedder's directory is the repository itself, as TEI's
    --model-id names it; the reranker's sits in a repository beside a model that is not a text
    model (it does not count)."""
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{TOKEN} infer\n")
    for directory, body, route in (("hf_embedder", {"inputs": TEXTS}, "/embed"),
                                   ("hf_reranker", {"query": "cats", "texts": ["a cat", "a road"]}, "/rerank")):
        if directory == "hf_embedder":
            name = "bge-small-en-v1.5"
            repo = tmp_path / name
            shutil.copytree(hf / directory, repo)
            r = subprocess.run([BIN, "check", "--model-id", str(repo)], capture_output=True, text=True)
            assert r.returncode == 0, r.stdout + r.stderr
            assert [line.split()[0] for line in r.stdout.splitlines()[1:]] == [name], r.stdout
        else:
            name = directory
            repo = tmp_path / directory / "models"
            shutil.copytree(hf / directory, repo / directory)
            shutil.copytree(ROOT / "models" / "mlp", repo / "mlp")
        s = Server(repo, "--auth-token-file", str(tokens), "--auth-allow-health")
        try:
            assert json.loads(raw(s.url, "/info", token=TOKEN)[1])["model_id"] == name
            for path in ("/health", "/", "/ping"):
                assert raw(s.url, path) == (200, b""), path
            want = raw(s.url, route, "POST", body, TOKEN)
            assert want[0] == 200, want
            for path in ("/", "/invocations"):
                assert raw(s.url, path, "POST", body, TOKEN) == want, path
                assert raw(s.url, path, "POST", body)[0] == 401, path
            # A bad call is answered as its route answers it.
            bad = {"inputs": ""} if route == "/embed" else {"query": "", "texts": ["x"]}
            assert raw(s.url, "/", "POST", bad, TOKEN) == raw(s.url, route, "POST", bad, TOKEN)
            if directory == "hf_embedder":
                # Only the directory is served: its own folders (onnx, 1_Pooling) are not models.
                assert raw(s.url, "/v2/models/onnx", token=TOKEN)[0] == 404
                assert "load failed" not in s.logs()
                np.testing.assert_allclose(json.loads(want[1]), [Reference(hf / directory, 24).embed(t) for t in TEXTS],
                                           atol=1e-5)
                openai = {"input": TEXTS, "model": name}
                want = json.loads(raw(s.url, "/v1/embeddings", "POST", openai, TOKEN)[1])
                got = json.loads(raw(s.url, "/embeddings", "POST", openai, TOKEN)[1])
                assert [d["embedding"] for d in got["data"]] == [d["embedding"] for d in want["data"]]
        finally:
            s.stop()


def test_teis_command_line_starts_the_server_and_its_flags_take_effect(hf, tmp_path):
    """A TEI deployment's arguments, as its users write them: the model directory, the address,
    the client batch size, an API key, auto-truncation, the payload limit, JSON logs and the
    Prometheus port. Each takes effect: the batch bound (and /info's), the key on inference and
    metrics with health open (TEI's public routes), the body bound, the log lines. Beside them,
    Ferrite's element bound holds /embed_all's answers too."""
    model = tmp_path / "bge-small-en-v1.5"
    shutil.copytree(hf / "hf_embedder", model)
    key = "tei-api-key-0123456789"
    port, prometheus = free_port(), free_port()
    log = open(tmp_path / "log", "w")
    proc = subprocess.Popen([BIN, "serve", "--model-id", str(model), "--hostname", "127.0.0.1", "--port", str(port),
                             "--max-client-batch-size", "4", "--api-key", key, "--auto-truncate",
                             "--payload-limit", "20000", "--json-output", "--prometheus-port", str(prometheus),
                             "--grpc-port", str(free_port()), "--max-request-elements", "3000"],
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if proc.poll() is not None or raw(url, "/health")[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(0.1)
        assert raw(url, "/health") == (200, b""), (tmp_path / "log").read_text()
        status, body = raw(url, "/info", token=key)
        info = json.loads(body)
        assert status == 200 and info["max_client_batch_size"] == 4 and info["model_id"] == model.name, info
        assert raw(url, "/embed", "POST", {"inputs": TEXTS}, key)[0] == 200
        status, body = raw(url, "/embed", "POST", {"inputs": TEXTS * 2}, key)
        assert (status, json.loads(body)) == (413, {"error": "batch size 6 > maximum allowed batch size 4",
                                                    "error_type": "Validation"})
        assert raw(url, "/embed", "POST", {"inputs": TEXTS})[0] == 401
        assert raw(url, "/embed", "POST", {"inputs": TEXTS}, "tei-api-key-wrong-0123")[0] == 401
        # Its long texts are cut (it was started with --auto-truncate), and its bodies bounded.
        assert raw(url, "/embed", "POST", {"inputs": "the cat eats fast food " * 20}, key)[0] == 200
        assert raw(url, "/embed", "POST", {"inputs": ["x" * 8000] * 3}, key)[0] == 413
        # Token embeddings are bounded as a request's tensors are: 4 x 24 tokens x 32 > 3000 values.
        status, body = raw(url, "/embed_all", "POST", {"inputs": TEXTS}, key)
        assert status == 200 and sum(len(t) for t in json.loads(body)) * 32 < 3000
        status, body = raw(url, "/embed_all", "POST", {"inputs": ["the cat eats fast food " * 20] * 4}, key)
        assert status == 413 and "3000 values" in json.loads(body)["error"], body
        # Metrics on the Prometheus port need the key too; the admin routes are not the key's.
        metrics = urllib.request.Request(f"http://127.0.0.1:{prometheus}/metrics")
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(metrics)
        assert e.value.code == 401
        metrics.add_header("Authorization", f"Bearer {key}")
        with urllib.request.urlopen(metrics) as r:
            assert b"ferrite_" in r.read()
        assert raw(url, "/v2/repository/index", "POST", {}, key)[0] == 403
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()
    lines = [line for line in (tmp_path / "log").read_text().splitlines() if line.strip()]
    assert lines and all(json.loads(line) for line in lines), lines[:3]
    assert key not in (tmp_path / "log").read_text()
    # A short key, and a key beside a token file, are refused at start.
    short = subprocess.run([BIN, "serve", "--model-id", str(model), "--api-key", "short"], capture_output=True, text=True)
    assert short.returncode != 0 and "at least 16 characters" in short.stderr, short.stderr
    both = subprocess.run([BIN, "serve", "--model-id", str(model), "--api-key", key, "--auth-token-file", "x"],
                          capture_output=True, text=True)
    assert both.returncode != 0 and "cannot be used with" in both.stderr, both.stderr


def test_a_splade_directory_answers_the_sparse_vectors_its_logits_make(hf, tei_pb):
    """A *ForMaskedLM directory is served as TEI serves it with --pooling splade: /embed_sparse
    answers, per text, the entries that are not zero of the largest log(1 + relu(logits)) over its
    tokens, in index order; gRPC's EmbedSparse and TEI's default route the same."""
    import grpc
    pb, stubs = tei_pb
    ref = Reference(hf / "hf_splade", 512)
    vocab = json.loads((hf / "hf_splade" / "config.json").read_text())["vocab_size"]
    s = Server(hf / "hf_splade")
    try:
        status, got = call(s, "/embed_sparse", {"inputs": TEXTS})
        assert status == 200, got
        fits(call(s, "/v2/openapi.json")[1], "/embed_sparse", "post", got)
        for text, sparse in zip(TEXTS, got):
            want = np.log1p(np.maximum(ref.run(text).max(axis=0), 0))
            index = [v["index"] for v in sparse]
            assert index == sorted(index) and 0 < len(index) < vocab / 2, index
            dense = np.zeros(vocab, np.float32)
            dense[index] = [v["value"] for v in sparse]
            np.testing.assert_allclose(dense, want, atol=1e-5)
        assert call(s, "/info")[1]["model_type"] == {"embedding": {"pooling": "splade"}}
        assert call(s, "/", {"inputs": TEXTS}) == (200, got)
        channel = grpc.insecure_channel(s.grpc_url)
        one = stubs.EmbedStub(channel).EmbedSparse(pb.EmbedSparseRequest(inputs=TEXTS[0]))
        assert [(v.index, round(v.value, 5)) for v in one.sparse_embeddings] == [
            (v["index"], round(v["value"], 5)) for v in got[0]]
        streamed = list(stubs.EmbedStub(channel).EmbedSparseStream(iter(pb.EmbedSparseRequest(inputs=t) for t in TEXTS)))
        assert [[v.index for v in r.sparse_embeddings] for r in streamed] == [[v["index"] for v in g] for g in got]
        # /embed answers the same vectors dense, but not normalized (TEI refuses `normalize` there,
        # and so OpenAI's call, which asks for unit vectors).
        status, body = call(s, "/embed", {"inputs": "hi"})
        assert status == 424 and body["error_type"] == "Backend" and "`normalize`" in body["error"], body
        assert call(s, "/v1/embeddings", {"input": "hi"})[0] == 400
        status, dense = call(s, "/embed", {"inputs": TEXTS, "normalize": False})
        assert status == 200, dense
        for sparse, row in zip(got, dense):
            assert [i for i, x in enumerate(row) if x != 0] == [v["index"] for v in sparse]
            np.testing.assert_allclose([row[v["index"]] for v in sparse], [v["value"] for v in sparse], atol=1e-6)
        # Its token embeddings would be the vocabulary's logits: TEI refuses them.
        status, body = call(s, "/embed_all", {"inputs": "hi"})
        assert status == 424 and body["error_type"] == "Backend" and "SPLADE" in body["error"], body
        with pytest.raises(grpc.RpcError) as e:
            stubs.EmbedStub(channel).EmbedAll(pb.EmbedAllRequest(inputs="hi"))
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED and "SPLADE" in e.value.details()
        channel.close()
    finally:
        s.stop()


def test_the_default_route_asks_which_call_when_models_of_several_tasks_are_served(server):
    status, body = raw(server.url, "/", "POST", {"inputs": "hello"}, TOKEN)
    assert status == 413, body
    error = json.loads(body)
    assert error["error_type"] == "Validation" and "embed, rerank, classify" in error["error"], error
    # Health needs the token here (no --auth-allow-health).
    assert raw(server.url, "/health")[0] == 401
    assert raw(server.url, "/health", token=TOKEN) == (200, b"")


def test_the_hand_written_pipeline_and_the_directory_agree_and_check_shows_what_was_found(hf, tmp_path):
    repo = tmp_path / "models"
    repo.mkdir()
    shutil.copytree(hf / "hf_embedder", repo / "hf_embedder")
    for m in ("text_encoder", "text_embedder"):
        shutil.copytree(ROOT / "models" / m, repo / m)
    # A hand-written classifier over the classifier's ONNX file, run as its own model (`file`),
    # its task declared and its labels from a file.
    mine = repo / "sentiment"
    mine.mkdir()
    shutil.copy(hf / "hf_classifier" / "model.onnx", mine / "classifier.onnx")
    shutil.copy(hf / "hf_classifier" / "tokenizer.json", mine / "tokenizer.json")
    (mine / "labels.txt").write_text("sad\nmeh\nglad\n")
    (mine / "config.toml").write_text('task = "classify"\n[[steps]]\nop = "tokenize"\n[[steps]]\nop = "model"\n'
                                      'file = "classifier.onnx"\n[[output]]\nname = "logits"\nlabel_filename = "labels.txt"\n')
    # The same file as a classifier of pairs (an NLI model's call).
    shutil.copytree(mine, repo / "pairs")
    (repo / "pairs" / "config.toml").write_text((mine / "config.toml").read_text().replace(
        'op = "tokenize"\n', 'op = "tokenize"\npair = "pair"\n'))
    s = Server(repo)
    try:
        status, classes = call(s, "/predict", {"inputs": "i love the sun", "model": "sentiment"})
        assert status == 200, classes
        p = softmax(Reference(hf / "hf_classifier", 512).run("i love the sun"))
        assert [c["label"] for c in classes] == [["sad", "meh", "glad"][i] for i in np.argsort(-p)]
        # 17 pairs are 17 inputs of TEI's 32, not 34.
        pairs = [["i love the sun", f"it is day {i}"] for i in range(17)]
        status, classes = call(s, "/predict", {"inputs": pairs, "model": "pairs"})
        assert status == 200 and len(classes) == 17, classes
        p = softmax(Reference(hf / "hf_classifier", 512).run(*pairs[3]))
        assert [c["label"] for c in classes[3]] == [["sad", "meh", "glad"][i] for i in np.argsort(-p)]
        status, body = call(s, "/predict", {"inputs": pairs * 2, "model": "pairs"})
        assert status == 413 and body["error"] == "batch size 34 > maximum allowed batch size 32", body
        texts = ["hello world", "the cat eats fast food"]
        status, hand = call(s, "/embed", {"inputs": texts, "model": "text_embedder"})
        assert status == 200
        status, found = call(s, "/embed", {"inputs": texts, "model": "hf_embedder"})
        np.testing.assert_allclose(found, hand, atol=1e-6)
        # The hand-written pipeline answers its token embeddings too: its steps before the pool.
        status, tokens = call(s, "/embed_all", {"inputs": texts, "model": "text_embedder"})
        assert status == 200, tokens
        assert tokens == call(s, "/embed_all", {"inputs": texts, "model": "hf_embedder"})[1]
        unit = [np.mean(t, axis=0) / np.linalg.norm(np.mean(t, axis=0)) for t in tokens]
        np.testing.assert_allclose(unit, hand, atol=1e-6)
        # Two embedders: the call must name one.
        status, body = call(s, "/embed", {"inputs": texts})
        assert status == 413 and "hf_embedder, text_embedder" in body["error"], body
    finally:
        s.stop()
    r = subprocess.run([BIN, "check", "--model-repository", str(repo)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    row = next(line for line in r.stdout.splitlines() if line.startswith("hf_embedder"))
    assert "embed (mean, 24 tokens)" in row, row
    # A directory of a head not served is refused by name.
    shutil.copytree(hf / "hf_embedder", repo / "ner")
    config = json.loads((repo / "ner" / "config.json").read_text())
    (repo / "ner" / "config.json").write_text(json.dumps({**config, "architectures": ["BertForTokenClassification"]}))
    r = subprocess.run([BIN, "check", "--model-repository", str(repo)], capture_output=True, text=True)
    assert r.returncode == 1 and "BertForTokenClassification: only" in r.stdout, r.stdout


def fits(api, path, method, instance, status="200", request=False):
    """`instance` validates against the OpenAPI document's schema of that body."""
    op = api["paths"][path][method]
    content = op["requestBody"] if request else op["responses"][status]
    name = content["content"]["application/json"]["schema"]["$ref"].split("/")[-1]
    jsonschema.Draft202012Validator({"$ref": f"#/components/schemas/{name}", "components": api["components"]}
                                    ).validate(instance)


def test_tei_bodies_fit_the_openapi_document(server):
    api = call(server, "/v2/openapi.json")[1]

    def check(*args, **kwargs):
        fits(api, *args, **kwargs)

    calls = [("/rerank", {"query": "cats", "texts": ["a cat", "a road"], "return_text": True}),
             ("/predict", {"inputs": ["i love the sun", "a day", "the road"]}),
             ("/predict", {"inputs": "i love the sun"}),
             ("/similarity", {"inputs": {"source_sentence": "a", "sentences": ["b"]}}),
             ("/tokenize", {"inputs": "hello", "model": "hf_embedder"}),
             ("/decode", {"ids": [2, 3], "model": "hf_embedder"}),
             ("/v1/rerank", {"query": "cats", "documents": ["a cat"], "return_documents": True})]
    for path, body in calls:
        check(path, "post", body, request=True)
        status, answer = call(server, path, body)
        assert status == 200, (path, answer)
        check(path, "post", answer)
    # A list of pairs is a request the schema takes too.
    check("/predict", "post", {"inputs": [["a pair", "of texts"], ["another", "pair"]]}, request=True)
    status, info = call(server, "/info?model=hf_reranker")
    check("/info", "get", info)
    status, error = call(server, "/rerank", {"query": "", "texts": ["x"]})
    check("/rerank", "post", error, status="400")


@pytest.fixture(scope="module")
def tei_pb(tmp_path_factory):
    """TEI's gRPC stubs, generated from the project's proto/tei.proto (TEI's field numbers)."""
    from grpc_tools import protoc
    out = tmp_path_factory.mktemp("tei_pb")
    assert protoc.main(["protoc", f"-I{ROOT / 'proto'}", f"--python_out={out}", f"--grpc_python_out={out}",
                        str(ROOT / "proto" / "tei.proto")]) == 0
    sys.path.insert(0, str(out))
    import tei_pb2
    import tei_pb2_grpc
    return tei_pb2, tei_pb2_grpc


def test_tei_grpc_clients_get_the_http_answers(server, hf, tei_pb):
    import grpc
    pb, stubs = tei_pb
    channel = grpc.insecure_channel(server.grpc_url)
    auth = [("authorization", f"Bearer {TOKEN}")]
    info = stubs.InfoStub(channel).Info(pb.InfoRequest(), metadata=auth + [("model", "hf_reranker")])
    assert info.model_type == pb.MODEL_TYPE_RERANKER and info.max_input_length == 512 and info.model_id == "hf_reranker"
    embed = stubs.EmbedStub(channel)
    got = embed.Embed(pb.EmbedRequest(inputs="hello world", normalize=True), metadata=auth)
    status, want = call(server, "/embed", {"inputs": "hello world"})
    np.testing.assert_allclose(got.embeddings, want[0], atol=1e-6)
    assert got.metadata.compute_tokens == 4
    streamed = list(embed.EmbedStream(iter([pb.EmbedRequest(inputs=t, normalize=True) for t in TEXTS]), metadata=auth))
    np.testing.assert_allclose([list(r.embeddings) for r in streamed], call(server, "/embed", {"inputs": TEXTS})[1],
                               atol=1e-6)
    passages = ["cats eat fish", "the road is long", "hello world"]
    ranks = stubs.RerankStub(channel).Rerank(pb.RerankRequest(query="what do cats eat", texts=passages, return_text=True),
                                            metadata=auth)
    http = call(server, "/rerank", {"query": "what do cats eat", "texts": passages, "return_text": True})[1]
    assert [(r.index, r.text) for r in ranks.ranks] == [(r["index"], r["text"]) for r in http]
    np.testing.assert_allclose([r.score for r in ranks.ranks], [r["score"] for r in http], atol=1e-6)
    stream = iter([pb.RerankStreamRequest(query="what do cats eat", text=p) for p in passages])
    assert [r.index for r in stubs.RerankStub(channel).RerankStream(stream, metadata=auth).ranks] == [r["index"] for r in http]
    predicted = stubs.PredictStub(channel).Predict(pb.PredictRequest(inputs="i love the sun"), metadata=auth)
    http = call(server, "/predict", {"inputs": "i love the sun"})[1]
    assert [(p.label, round(p.score, 5)) for p in predicted.predictions] == [(p["label"], round(p["score"], 5)) for p in http]
    tokens = stubs.TokenizeStub(channel).Tokenize(pb.EncodeRequest(inputs="hello world", add_special_tokens=True),
                                                 metadata=auth + [("model", "hf_embedder")])
    assert [(t.text, t.special, t.HasField("start")) for t in tokens.tokens] == [
        ("[CLS]", True, False), ("hello", False, True), ("world", False, True), ("[SEP]", True, False)]
    decoded = stubs.TokenizeStub(channel).Decode(pb.DecodeRequest(ids=[t.id for t in tokens.tokens], skip_special_tokens=True),
                                                metadata=auth + [("model", "hf_embedder")])
    assert decoded.text == "hello world"
    # TEI's errors as gRPC codes: the wrong task, an empty text, no token, what is not served.
    with pytest.raises(grpc.RpcError) as e:
        stubs.RerankStub(channel).Rerank(pb.RerankRequest(query="q", texts=["t"]), metadata=auth + [("model", "hf_embedder")])
    assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED and "not a re-ranker" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        embed.Embed(pb.EmbedRequest(inputs=""), metadata=auth)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as e:
        embed.Embed(pb.EmbedRequest(inputs="hi"))
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as e:
        embed.EmbedSparse(pb.EmbedSparseRequest(inputs="hi"), metadata=auth)
    assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED and "SPLADE" in e.value.details()
    # Token embeddings: one message a text, unary and streamed, as over HTTP.
    status, want = call(server, "/embed_all", {"inputs": TEXTS})
    one = embed.EmbedAll(pb.EmbedAllRequest(inputs=TEXTS[1]), metadata=auth)
    np.testing.assert_allclose([list(t.embeddings) for t in one.token_embeddings], want[1], atol=1e-6)
    assert one.metadata.compute_tokens == len(want[1]) == 4
    streamed = list(embed.EmbedAllStream(iter(pb.EmbedAllRequest(inputs=t) for t in TEXTS), metadata=auth))
    assert [len(r.token_embeddings) for r in streamed] == [len(w) for w in want]
    with pytest.raises(grpc.RpcError) as e:
        embed.EmbedAll(pb.EmbedAllRequest(inputs="hi"), metadata=auth + [("model", "hf_reranker")])
    assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED and "not an embedding model" in e.value.details()


def test_tei_streams_end_with_unavailable_when_the_server_stops(hf, tei_pb, tmp_path):
    """TEI's streams open when the server stops: EmbedStream answers what it was sent, then ends
    with UNAVAILABLE; RerankStream, its passages still coming, ends with UNAVAILABLE rather than
    ranking part of them; neither holds the process up."""
    import queue
    import signal
    import threading
    import time

    import grpc
    pb, stubs = tei_pb
    repo = tmp_path / "models"
    repo.mkdir()
    for m in ("hf_embedder", "hf_reranker"):
        shutil.copytree(hf / m, repo / m)
    s = Server(repo, "--shutdown-grace-secs", "0.2")
    embeds, passages = queue.Queue(), queue.Queue()

    def held(q):  # a client still sending: the stream stays open until None
        while (item := q.get()) is not None:
            yield item

    embed_got, rerank_got = [], []

    def embed_stream():
        try:
            for answer in stubs.EmbedStub(channel).EmbedStream(held(embeds)):
                embed_got.append(answer)
        except grpc.RpcError as e:
            embed_got.append(e)

    def rerank_stream():
        try:
            rerank_got.append(stubs.RerankStub(channel).RerankStream(held(passages)))
        except grpc.RpcError as e:
            rerank_got.append(e)

    try:
        channel = grpc.insecure_channel(s.grpc_url)
        threads = [threading.Thread(target=f) for f in (embed_stream, rerank_stream)]
        for t in threads:
            t.start()
        embeds.put(pb.EmbedRequest(inputs="hello world"))
        passages.put(pb.RerankStreamRequest(query="what do cats eat", text="cats eat fish"))
        deadline = time.time() + 30
        while not embed_got and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)  # the passage read
        started = time.time()
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(30) == 0
        took = time.time() - started
        for t in threads:
            t.join(10)
        answer, ended = embed_got
        assert len(answer.embeddings) > 0
        assert ended.code() == grpc.StatusCode.UNAVAILABLE and "stopping" in ended.details(), ended
        (cut,) = rerank_got
        assert isinstance(cut, grpc.RpcError), cut
        assert cut.code() == grpc.StatusCode.UNAVAILABLE and "stopping" in cut.details(), cut
        assert took < 6, took
    finally:
        embeds.put(None)
        passages.put(None)
        s.stop()
