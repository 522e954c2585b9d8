"""The web chat's files over plain HTTP, on the tiny model: the page at /, every file it loads, the Host check and
the API key as on any route, and `serve --no-web`. tests/test_web_browser.py runs the page in a real browser."""

from __future__ import annotations

import re
from collections.abc import Iterator

import httpx
import pytest
from click.testing import CliRunner

from edgeserve.cli.main import cli
from edgeserve.config import EngineConfig
from edgeserve.engine.llm_engine import LLMEngine
from loopback import ServerThread, serving

KEY = "web-key-7"
http = httpx.Client(timeout=60)


@pytest.fixture(scope="module")
def server(tiny_model) -> Iterator[ServerThread]:
    with serving(tiny_model, "tiny", kv_memory="16MiB") as served:
        yield served


def assets(url: str) -> list[str]:
    """The paths of the files the page loads: those it names, and the modules its scripts import."""
    page = http.get(url + "/").text
    paths = re.findall(r'(?:src|href)="(/[^"]*)"', page)
    for script in [p for p in paths if p.endswith(".js")]:
        source = http.get(url + script).text
        paths += [script.rpartition("/")[0] + "/" + name[2:] for name in re.findall(r'from "(\./[^"]+)"', source)]
    return paths


def test_the_page_and_every_file_it_loads_are_served(server):
    page = http.get(server.url + "/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in page.headers["content-security-policy"]  # nothing from elsewhere loads

    paths = assets(server.url)
    kinds = {"css": "text/css", "js": "javascript", "svg": "image/svg+xml"}
    assert {"/web/app.js", "/web/markdown.js", "/web/style.css", "/web/icon.svg"} <= set(paths)
    for path in paths:
        answer = http.get(server.url + path)
        assert answer.status_code == 200, path
        assert kinds[path.rpartition(".")[2]] in answer.headers["content-type"], path
    assert http.get(server.url + "/web/nothing.js").status_code == 404


def test_a_foreign_host_is_refused_the_page_as_any_route(server):
    for path in ("/", "/web/app.js"):
        refused = http.get(server.url + path, headers={"Host": "attacker.example"})
        assert refused.status_code == 403 and refused.json()["error"]["code"] == "host_not_allowed", path


def test_cors_origins_apply_to_the_page_as_to_the_api(tiny_model):
    page = "http://localhost:3000"
    with serving(tiny_model, "tiny", kv_memory="16MiB", cors_origins=[page]) as served:
        for path in ("/", "/web/app.js", "/v1/models"):
            allowed = http.get(served.url + path, headers={"Origin": page})
            assert allowed.headers["access-control-allow-origin"] == page, path
            other = http.get(served.url + path, headers={"Origin": "http://evil.example"})
            assert "access-control-allow-origin" not in other.headers, path


def test_with_a_key_the_page_loads_and_the_api_asks_for_it(tiny_model):
    with serving(tiny_model, "tiny", kv_memory="16MiB", api_key=KEY) as keyed:
        for path in ("/", "/web/app.js", "/web/style.css"):
            assert http.get(keyed.url + path).status_code == 200, path
        assert http.get(keyed.url + "/v1/models").status_code == 401
        assert http.get(keyed.url + "/metrics").status_code == 401
        assert http.get(keyed.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


def test_create_app_without_the_web_chat_answers_404(tiny_model):
    with serving(tiny_model, "tiny", kv_memory="16MiB", web=False) as bare:
        assert http.get(bare.url + "/").status_code == 404
        assert http.get(bare.url + "/web/app.js").status_code == 404
        assert http.get(bare.url + "/v1/models").status_code == 200


@pytest.mark.parametrize("flag", ["--web", "--no-web"])
def test_serve_turns_the_web_chat_on_and_off(tiny_model, monkeypatch, flag):
    """`edgeserve serve` builds its app with the flag; the app it would run is served here instead."""
    import edgeserve.server.shutdown as shutdown

    served: list = []

    class Capture:
        def __init__(self, config, server, timeout):
            served.append(config.app)

        def run(self, sockets):
            for sock in sockets:
                sock.close()

    monkeypatch.setattr("edgeserve.cli.serve_cmd.build_engine", lambda source, config, quiet=False: LLMEngine(
        tiny_model, EngineConfig(backend="numpy", kv_memory="16MiB")))
    monkeypatch.setattr(shutdown, "DrainingServer", Capture)
    result = CliRunner().invoke(cli, ["serve", "-m", "tiny", "--port", "0", "--prefix-cache-disk", "0", flag])

    assert result.exit_code == 0, result.output
    assert ("the web chat at http://127.0.0.1:" in result.output) == (flag == "--web")
    (app,) = served
    running = ServerThread(app)
    try:
        assert http.get(running.url + "/").status_code == (200 if flag == "--web" else 404)
    finally:
        running.stop()
