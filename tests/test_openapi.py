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

import pytest

from conftest import make_repository


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from conftest import Server
    s = Server(make_repository(tmp_path_factory.mktemp("openapi") / "repo", ("mlp",)))
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
        if "get" not in methods or path == "/metrics":
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
