"""The server's smaller routes and options, over real HTTP on the tiny model: names an answer carries (an
alias stays the alias), GET /v1/models/{id}, llama.cpp's /tokenize and /detokenize, and CORS for web pages."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
from click.testing import CliRunner

from edgeserve.cli.main import cli
from loopback import ServerThread, serving

MODEL = "tiny"
ALIAS = "gpt-4o-mini"
KEY = "sesame"
PAGE = "http://localhost:3000"
http = httpx.Client(timeout=60)


@pytest.fixture(scope="module")
def server(tiny_model) -> Iterator[ServerThread]:
    with serving(tiny_model, MODEL, kv_memory="16MiB", aliases=[ALIAS]) as server:
        yield server


@pytest.fixture(scope="module")
def cors_server(tiny_model) -> Iterator[ServerThread]:
    with serving(tiny_model, MODEL, kv_memory="16MiB", api_key=KEY, cors_origins=[PAGE]) as server:
        yield server


def test_an_answer_carries_the_name_it_was_asked_by(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    for name in (ALIAS, MODEL):
        chat = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        text = client.completions.create(model=name, prompt="hi", max_tokens=2)
        assert chat.model == text.model == name
    body = http.post(server.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                                 "max_tokens": 2}).json()
    assert body["model"] == MODEL  # no name given: the served one


def test_a_model_is_retrieved_by_name(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    assert client.models.retrieve(MODEL).id == MODEL
    assert client.models.retrieve(ALIAS).id == ALIAS
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("no-such-model")
    assert missing.value.body["code"] == "model_not_found"


def test_tokenize_and_detokenize_as_llama_cpp_answers(server, tiny_model):
    tokenizer = tiny_model.tokenizer
    text = "Hello world, hello!"
    plain = http.post(server.url + "/tokenize", json={"content": text}).json()
    assert plain == {"tokens": tokenizer.encode(text, add_bos=False)}
    special = http.post(server.url + "/tokenize", json={"content": text, "add_special": True}).json()["tokens"]
    assert special == tokenizer.encode(text, add_bos=True)
    pieces = http.post(server.url + "/tokenize", json={"content": text, "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == plain["tokens"]
    assert "".join(p["piece"] for p in pieces) == tokenizer.decode(plain["tokens"])
    back = http.post(server.url + "/detokenize", json={"tokens": plain["tokens"]}).json()
    assert back == {"content": tokenizer.decode(plain["tokens"])}

    bad = http.post(server.url + "/detokenize", json={"tokens": [0, tokenizer.vocab_size]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert http.post(server.url + "/tokenize", json={"text": "hi"}).status_code == 400  # content is required


def test_a_browser_page_from_an_allowed_origin_may_call_with_the_key(cors_server):
    url = cors_server.url + "/v1/chat/completions"
    preflight = {"Origin": PAGE, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    allowed = http.options(url, headers=preflight)
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == PAGE
    refused = http.options(url, headers={**preflight, "Origin": "http://evil.example"})
    assert refused.status_code == 400 and "access-control-allow-origin" not in refused.headers

    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    no_key = http.post(url, json=body, headers={"Origin": PAGE})
    assert no_key.status_code == 401 and no_key.headers["access-control-allow-origin"] == PAGE
    keyed = http.post(url, json=body, headers={"Origin": PAGE, "Authorization": f"Bearer {KEY}"})
    assert keyed.status_code == 200 and keyed.headers["access-control-allow-origin"] == PAGE
    assert http.post(cors_server.url + "/tokenize", json={"content": "hi"}).status_code == 401  # keyed too
    foreign_host = http.get(cors_server.url + "/health", headers={"Host": "attacker.example", "Origin": PAGE})
    assert foreign_host.status_code == 403  # the Host check is unchanged


def test_without_cors_origins_no_page_gets_through(server):
    preflight = http.options(server.url + "/v1/chat/completions",
                             headers={"Origin": PAGE, "Access-Control-Request-Method": "POST"})
    assert preflight.status_code == 405 and "access-control-allow-origin" not in preflight.headers


def test_any_origin_needs_its_own_flag():
    refused = CliRunner().invoke(cli, ["serve", "--cors-origins", "*"])
    assert refused.exit_code == 2 and "--cors-allow-all" in refused.output


def test_with_a_key_only_health_answers_without_it(cors_server):
    for path in ("/metrics", "/docs", "/openapi.json", "/v1/edgeserve/kv"):
        assert http.get(cors_server.url + path).status_code == 401, path
        assert http.get(cors_server.url + path, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200, path
    assert http.get(cors_server.url + "/health").json()["status"] == "ok"


def test_without_a_key_the_status_pages_stay_open(server):
    assert http.get(server.url + "/metrics").status_code == 200
    assert http.get(server.url + "/openapi.json").status_code == 200
