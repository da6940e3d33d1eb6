"""The HTTP API's description and documentation page: /v2/openapi.json describes every route the
server answers (made from the same table as the router), each documented GET answers something
other than "no such endpoint", and /docs renders every operation in headless Chromium (Debian's
package) with nothing fetched but the description."""

import json
import re
import shutil
import subprocess
import urllib.error
import urllib.request

import jsonschema
import numpy as np
import pytest

from conftest import make_repository


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from conftest import Server
    s = Server(make_repository(tmp_path_factory.mktemp("openapi") / "repo", ("mlp", "text_encoder", "text_embedder")))
    yield s
    s.stop()


def get(url):
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.headers.get("Content-Type", ""), r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Content-Type", ""), e.read()


def test_the_description_covers_every_route_and_each_answers(served):
    status, ctype, body = get(f"http://{served.url}/v2/openapi.json")
    assert status == 200 and ctype.startswith("application/json")
    api = json.loads(body)
    assert api["openapi"].startswith("3.")
    paths = api["paths"]
    for path in ("/v2", "/v2/health/live", "/v2/health/ready", "/v2/models/{model}/infer",
                 "/v2/models/{model}/versions/{version}/config", "/v2/repository/index", "/metrics", "/docs"):
        assert path in paths, path
    assert "requestBody" in paths["/v2/models/{model}/infer"]["post"]
    assert {"application/json", "application/octet-stream", "application/msgpack"} <= set(
        paths["/v2/models/{model}/infer"]["post"]["requestBody"]["content"])
    # Every $ref resolves.
    refs = set(re.findall(r'"#/components/schemas/([A-Za-z]+)"', body.decode()))
    assert refs <= set(api["components"]["schemas"]), refs - set(api["components"]["schemas"])
    for path, methods in paths.items():
        # A shared-memory region's status is 404 for a region not registered, as Triton's.
        if "get" not in methods or path == "/metrics" or "{name}" in path:
            continue
        url = f"http://{served.url}" + path.replace("{model}", "mlp").replace("{version}", "1")
        status, _, body = get(url)
        assert status == 200, (path, status, body[:200])
    # A route that is not in the description is not served.
    status, _, body = get(f"http://{served.url}/v2/not/described")
    assert status == 404 and b"no such endpoint" in body


def test_the_docs_page_renders_every_operation_in_chromium(served):
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("chromium is not installed (apt-get install chromium); .ci/run installs it")
    api = json.loads(get(f"http://{served.url}/v2/openapi.json")[2])
    operations = sum(len(m) for m in api["paths"].values())
    status, ctype, page = get(f"http://{served.url}/docs")
    assert status == 200 and ctype.startswith("text/html")
    assert not re.search(rb'(src|href)="(https?:)?//', page), "the page fetches nothing from elsewhere"
    r = subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=10000",
                        "--dump-dom", f"http://{served.url}/docs"], capture_output=True, text=True, timeout=120)
    dom = r.stdout
    assert f'data-operations="{operations}"' in dom, dom[-2000:] + r.stderr[-2000:]
    rendered = set(re.findall(r'data-path="([^"]+)"', dom))
    assert rendered == set(api["paths"]), set(api["paths"]) ^ rendered
    assert '<p id="error"></p>' in dom, "the page reported an error"


def call(url, body=None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"},
                                 method="GET" if body is None else "POST")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_bodies_the_server_takes_and_gives_fit_the_schemas_derived_from_its_types(served):
    """The schemas are derived from the types the handlers read and write: each request the server
    accepts validates against its route's request schema, and each answer (errors included)
    against its answer schema, so the document cannot drift from the bodies."""
    api = json.loads(get(f"http://{served.url}/v2/openapi.json")[2])
    assert api["openapi"] == "3.1.0"

    def check(name, instance):
        root = {"$ref": f"#/components/schemas/{name}", "components": api["components"]}
        jsonschema.Draft202012Validator(root).validate(instance)

    def answer_schema(path, method, status="200"):
        op = api["paths"][path][method]
        return op["responses"][status]["content"]["application/json"]["schema"]["$ref"].split("/")[-1]

    base = f"http://{served.url}"
    for path, url in [("/v2", "/v2"), ("/v2/health/ready", "/v2/health/ready"), ("/v2/health/live", "/v2/health/live"),
                      ("/v2/models/{model}", "/v2/models/mlp"), ("/v2/models/{model}/ready", "/v2/models/mlp/ready"),
                      ("/v2/models/{model}/stats", "/v2/models/mlp/stats"), ("/v2/models/stats", "/v2/models/stats"),
                      ("/v2/models/{model}/config", "/v2/models/mlp/config")]:
        status, body = call(base + url)
        assert status == 200, (url, body)
        check(answer_schema(path, "get"), body)

    # V2 inference: the request as tritonclient writes it, and the answer, plain and binary-less.
    x = np.random.default_rng(0).standard_normal((2, 512)).astype(np.float32)
    request = {"id": "a", "parameters": {"priority": 1},
               "inputs": [{"name": "input", "shape": [2, 512], "datatype": "FP32", "data": x.tolist()}],
               "outputs": [{"name": "output", "parameters": {"binary_data": False}}]}
    infer = api["paths"]["/v2/models/{model}/infer"]["post"]
    check(infer["requestBody"]["content"]["application/json"]["schema"]["$ref"].split("/")[-1], request)
    status, body = call(base + "/v2/models/mlp/infer", request)
    assert status == 200, body
    check(answer_schema("/v2/models/{model}/infer", "post"), body)
    # A refusal's body is the documented error.
    status, body = call(base + "/v2/models/mlp/infer", {**request, "inputs": [{**request["inputs"][0], "shape": [2, 7]}]})
    assert status == 400
    check(answer_schema("/v2/models/{model}/infer", "post", "400"), body)

    for path, body in [("/v2/repository/index", {"ready": True}), ("/v2/repository/index", {})]:
        op = api["paths"][path]["post"]
        check(op["requestBody"]["content"]["application/json"]["schema"]["$ref"].split("/")[-1], body)
        status, answer = call(base + path, body)
        assert status == 200, answer
        check(answer_schema(path, "post"), answer)

    # OpenAI and TEI: requests, answers, and OpenAI's error object.
    openai = api["paths"]["/v1/embeddings"]["post"]
    for request in [{"model": "text_embedder", "input": ["a text", "another"]},
                    {"model": "text_embedder", "input": "one", "encoding_format": "base64"}]:
        check(openai["requestBody"]["content"]["application/json"]["schema"]["$ref"].split("/")[-1], request)
        status, body = call(base + "/v1/embeddings", request)
        assert status == 200, body
        check(answer_schema("/v1/embeddings", "post"), body)
    status, body = call(base + "/v1/embeddings", {"model": "nope", "input": "x"})
    assert status == 404 and isinstance(body["error"], dict)
    check(answer_schema("/v1/embeddings", "post", "404"), body)
    tei = api["paths"]["/embed"]["post"]
    request = {"inputs": ["a text"], "normalize": True, "model": "text_embedder"}
    check(tei["requestBody"]["content"]["application/json"]["schema"]["$ref"].split("/")[-1], request)
    status, body = call(base + "/embed", request)
    assert status == 200, body
    check(answer_schema("/embed", "post"), body)
    # And what the server refuses does not fit the schema either: a body without its required field.
    with pytest.raises(jsonschema.ValidationError):
        check(openai["requestBody"]["content"]["application/json"]["schema"]["$ref"].split("/")[-1], {"input": "x"})
    assert call(base + "/v1/embeddings", {"input": "x"})[0] == 400
