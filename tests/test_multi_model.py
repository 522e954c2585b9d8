"""Several models behind one server, over real HTTP: requests pick a model by name, models load on first use within
the budget and unload after their keep-alive, never under a request in flight; a model that fails to load fails
only its own requests. Two tiny random models (different weights, so different answers) for the rules, the default
model for the swap under a live stream and the memory an unload gives back."""

from __future__ import annotations

import gc
import os
import shutil
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import ollama
import openai
import pytest
from click.testing import CliRunner

from conftest import tiny_model_from
from edgeserve.cli.ps_cmd import ps as ps_command
from edgeserve.config import EngineConfig
from edgeserve.engine.async_engine import AsyncEngine
from edgeserve.engine.llm_engine import LLMEngine
from edgeserve.models.catalog import DEFAULT_MODEL
from edgeserve.server.app import create_app
from edgeserve.server.models import FOREVER, ModelEntry, ModelPool, parse_keep_alive
from loopback import ServerThread

ASK = [{"role": "user", "content": "hello there"}]
IGNORE_EOS = {"ignore_eos": True}
http = httpx.Client(timeout=120)


def engine_of(model: object, kv_memory: str = "16MiB") -> Callable[[], AsyncEngine]:
    return lambda: AsyncEngine(LLMEngine(model, EngineConfig(backend="numpy", kv_memory=kv_memory)))


@contextmanager
def pool_server(entries: list[ModelEntry], max_loaded: int, keep_alive: float = FOREVER) -> Iterator[ServerThread]:
    pool = ModelPool(entries, max_loaded, keep_alive)
    server = ServerThread(create_app(pool))
    try:
        yield server
    finally:
        server.stop()
        pool.shutdown()


def greedy(url: str, model: str, tokens: int = 6) -> str:
    answer = http.post(url + "/v1/chat/completions", json={"model": model, "messages": ASK, "temperature": 0,
                                                           "max_tokens": tokens, **IGNORE_EOS})
    assert answer.status_code == 200, answer.text
    assert answer.json()["model"] == model
    return answer.json()["choices"][0]["message"]["content"]


def until_unloaded(client: ollama.Client, seconds: float = 10) -> None:
    """Wait for /api/ps to list no model: a lease ends once its answer has gone out, a moment after it arrives."""
    deadline = time.monotonic() + seconds
    while client.ps().models:
        assert time.monotonic() < deadline, "a model stayed loaded"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory) -> tuple[object, object]:
    return (tiny_model_from(tmp_path_factory.mktemp("tiny-a"), seed=0),
            tiny_model_from(tmp_path_factory.mktemp("tiny-b"), seed=1))


def test_keep_alive_reads_seconds_and_durations() -> None:
    assert parse_keep_alive("5m") == 300 and parse_keep_alive("1h30m") == 5400 and parse_keep_alive("250ms") == 0.25
    assert parse_keep_alive(0) == 0 and parse_keep_alive("0") == 0 and parse_keep_alive(12.5) == 12.5
    assert parse_keep_alive(-1) == FOREVER and parse_keep_alive("-1m") == FOREVER and parse_keep_alive("-1") == FOREVER
    for bad in ("soon", "5x", "m5", "", True):
        with pytest.raises(ValueError):
            parse_keep_alive(bad)


def test_two_models_answer_interleaved_requests(tiny_pair) -> None:
    a, b = tiny_pair
    entries = [ModelEntry("tiny-a", ("a",), load=engine_of(a)), ModelEntry("tiny-b", load=engine_of(b))]
    with pool_server(entries, max_loaded=2) as server:
        listed = http.get(server.url + "/v1/models").json()["data"]
        assert [(m["id"], m["loaded"]) for m in listed] == [("tiny-a", False), ("a", False), ("tiny-b", False)]
        alone = {name: greedy(server.url, name) for name in ("tiny-a", "tiny-b")}
        assert alone["tiny-a"] != alone["tiny-b"]  # two models, two answers
        asked = ["tiny-a", "tiny-b", "a"] * 4
        answers: dict[int, str] = {}

        def ask(i: int) -> None:
            answers[i] = greedy(server.url, asked[i])

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(asked))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [answers[i] for i in range(len(asked))] == [alone["tiny-b" if n == "tiny-b" else "tiny-a"] for n in asked]
        client = ollama.Client(host=server.url)
        assert {m.model for m in client.ps().models} == {"tiny-a", "tiny-b"}
        assert [m.model for m in client.list().models] == ["tiny-a", "a", "tiny-b"]
        assert {m["id"] for m in http.get(server.url + "/v1/models").json()["data"] if m["loaded"]} == {
            "tiny-a", "a", "tiny-b"}
        missing = http.post(server.url + "/v1/chat/completions", json={"model": "tiny-c", "messages": ASK})
        assert missing.status_code == 404 and "'tiny-a', 'a', 'tiny-b'" in missing.json()["error"]["message"]


def test_the_budget_unloads_the_least_recently_used_and_keep_alive_expires(tiny_pair) -> None:
    a, b = tiny_pair
    entries = [ModelEntry("tiny-a", load=engine_of(a)), ModelEntry("tiny-b", load=engine_of(b))]
    with pool_server(entries, max_loaded=1) as server:
        client = ollama.Client(host=server.url)
        first = greedy(server.url, "tiny-a")
        assert [m.model for m in client.ps().models] == ["tiny-a"]
        shown = CliRunner().invoke(ps_command, ["--url", server.url])
        assert shown.exit_code == 0 and "tiny-a, tiny-b (not loaded)\n" in shown.output
        greedy(server.url, "tiny-b")
        assert [m.model for m in client.ps().models] == ["tiny-b"]  # a made room for b
        assert greedy(server.url, "tiny-a") == first  # and loads again, the same model
        loaded = client.chat(model="tiny-b", messages=ASK, options={"num_predict": 2}, keep_alive="300ms")
        assert loaded.load_duration > 0  # it had to load
        again = client.chat(model="tiny-b", messages=ASK, options={"num_predict": 2}, keep_alive="300ms")
        assert again.load_duration < loaded.load_duration
        ps = client.ps().models
        assert [m.model for m in ps] == ["tiny-b"] and ps[0].expires_at is not None
        until_unloaded(client)  # idle past its keep-alive: unloaded by the pool's reaper
        unload = client.generate(model="tiny-a", keep_alive=0)  # Ollama's way to load (here: and unload) a model
        assert unload.done_reason == "unload"
        until_unloaded(client, 2)
        bad = http.post(server.url + "/api/chat", json={"model": "tiny-a", "messages": ASK, "keep_alive": "soon"})
        assert bad.status_code == 400 and "keep_alive" in bad.json()["error"]


def test_a_loaded_model_is_out_of_the_collectors_sight_and_an_unloaded_one_is_freed(tiny_pair) -> None:
    pool = ModelPool([ModelEntry("tiny-a", load=engine_of(tiny_pair[0]))], 1, FOREVER)
    server = ServerThread(create_app(pool))
    try:
        gc.unfreeze()
        greedy(server.url, "tiny-a")
        # a full collection no longer walks the engine's objects, nor any alive when it loaded
        assert gc.get_freeze_count() > 10_000
        engine = weakref.ref(pool.loaded[0].model.aengine)
        assert ollama.Client(host=server.url).generate(model="tiny-a", keep_alive=0).done_reason == "unload"
        until_unloaded(ollama.Client(host=server.url), 2)
        assert engine() is None  # thawed to be collected with its cycles, the rest frozen again
        assert gc.get_freeze_count() > 10_000
    finally:
        server.stop()
        pool.shutdown()
        gc.unfreeze()


def test_a_swap_waits_for_the_stream_in_flight(loaded_model) -> None:
    """With room for one model, a request for the other waits until the first model's stream has finished whole."""
    entries = [ModelEntry("first", load=engine_of(loaded_model, "64MiB")),
               ModelEntry("second", load=engine_of(loaded_model, "64MiB"))]
    with pool_server(entries, max_loaded=1) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
        stream = client.chat.completions.create(model="first", messages=ASK, max_tokens=40, temperature=0,
                                                stream=True, stream_options={"include_usage": True},
                                                extra_body=IGNORE_EOS)
        chunks = iter(stream)
        text = [next(chunks).choices[0].delta.content or ""]  # the first model is answering now
        other: dict[str, object] = {}

        def ask_second() -> None:
            other["answer"] = greedy(server.url, "second", tokens=4)
            other["at"] = time.monotonic()

        asker = threading.Thread(target=ask_second)
        asker.start()
        usage = None
        for chunk in chunks:
            if chunk.choices:
                text.append(chunk.choices[0].delta.content or "")
            usage = chunk.usage or usage
        stream_ended = time.monotonic()
        asker.join(timeout=120)
        assert usage is not None and usage.completion_tokens == 40  # the stream ran to its end, intact
        assert "".join(text) == greedy(server.url, "first", 40)
        assert other["at"] > stream_ended and other["answer"]  # the second waited, then answered


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads resident memory from /proc")
def test_keep_alive_zero_unloads_and_gives_the_memory_back(model_path) -> None:
    from edgeserve.models.loader import load_model

    def load() -> AsyncEngine:  # parsed afresh: nothing of it stays referenced once unloaded
        return AsyncEngine(LLMEngine(load_model(str(model_path)), EngineConfig(backend="numpy", kv_memory="32MiB")))

    with pool_server([ModelEntry("guest", load=load)], max_loaded=1) as server:
        client = ollama.Client(host=server.url)
        client.generate(model="guest", prompt="Hello", options={"num_predict": 4}, keep_alive=0)  # a first load
        until_unloaded(client, 5)
        gc.collect()  # pays once for what stays: modules imported, caches filled
        before = rss_mib()
        answer = client.generate(model="guest", prompt="Hello", options={"num_predict": 4}, keep_alive=-1)
        assert answer.done and answer.load_duration > 0
        loaded = rss_mib()
        assert loaded - before > 40  # the weights are resident
        client.generate(model="guest", keep_alive=0)
        until_unloaded(client, 5)
        after = rss_mib()
        assert after - before < 0.25 * (loaded - before), (before, loaded, after)


def test_a_model_that_fails_to_load_fails_only_its_own_requests(tiny_pair, tmp_path) -> None:
    from edgeserve.models.loader import load_model

    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\x00" * 64)
    entries = [ModelEntry("tiny-a", load=engine_of(tiny_pair[0])),
               ModelEntry("broken", load=lambda: AsyncEngine(LLMEngine(load_model(str(broken)), EngineConfig())))]
    with pool_server(entries, max_loaded=2) as server:
        failed = http.post(server.url + "/v1/chat/completions", json={"model": "broken", "messages": ASK})
        assert failed.status_code == 500
        error = failed.json()["error"]
        assert error["code"] == "model_load_failed" and "'broken' failed to load" in error["message"]
        ollama_failed = http.post(server.url + "/api/generate", json={"model": "broken", "prompt": "hi"})
        assert ollama_failed.status_code == 500 and "failed to load" in ollama_failed.json()["error"]
        assert greedy(server.url, "tiny-a")  # the other model answers
        assert http.get(server.url + "/health").json()["status"] == "ok"


def test_ollama_bodies_read_as_json_whatever_their_content_type(tiny_pair) -> None:
    """`curl -d '{...}'`, as Ollama's docs write requests, labels the body a form."""
    with pool_server([ModelEntry("tiny-a", load=engine_of(tiny_pair[0]))], max_loaded=1) as server:
        answer = http.post(server.url + "/api/generate", content=b'{"model": "tiny-a", "prompt": "hi", "stream": false,'
                                                                 b' "options": {"num_predict": 3, "temperature": 0}}',
                           headers={"content-type": "application/x-www-form-urlencoded"})
        assert answer.status_code == 200 and answer.json()["eval_count"] == 3


def test_pull_fetches_a_catalog_model_and_serves_it(tiny_pair, model_path) -> None:
    pulled: list[str] = []

    def loader(name: str) -> Callable[[], AsyncEngine]:
        pulled.append(name)
        return engine_of(tiny_pair[1])

    pool = ModelPool([ModelEntry("tiny-a", load=engine_of(tiny_pair[0]))], 2, FOREVER, loader)
    server = ServerThread(create_app(pool))
    try:
        client = ollama.Client(host=server.url)
        steps = list(client.pull(DEFAULT_MODEL, stream=True))
        assert steps[0].status == "pulling manifest" and steps[-1].status == "success"
        assert any(s.total == model_path.stat().st_size for s in steps)  # the cached file, checked by its digest
        assert pulled == [DEFAULT_MODEL] and DEFAULT_MODEL in [m.model for m in client.list().models]
        assert client.pull(DEFAULT_MODEL).status == "success" and pulled == [DEFAULT_MODEL]  # served once
        with pytest.raises(ollama.ResponseError) as unknown:
            client.pull("no-such-model")
        assert unknown.value.status_code == 404 and "catalog" in unknown.value.error
    finally:
        server.stop()
        pool.shutdown()


def test_serve_refuses_two_models_under_one_name(tmp_path) -> None:
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        shutil.copy(Path(__file__), tmp_path / name / "same.gguf")
    done = subprocess.run([sys.executable, "-m", "edgeserve.cli", "serve", "-m", str(tmp_path / "a" / "same.gguf"),
                           "-m", str(tmp_path / "b" / "same.gguf"), "--port", "0"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "two models would be served under one name" in done.stderr
    assert "Traceback" not in done.stderr
    (tmp_path / "b" / "same.gguf").rename(tmp_path / "b" / "other.gguf")
    clash = subprocess.run([sys.executable, "-m", "edgeserve.cli", "serve", "-m", str(tmp_path / "a" / "same.gguf"),
                            "-m", str(tmp_path / "b" / "other.gguf"), "--alias", "other", "--port", "0"],
                           capture_output=True, text=True, timeout=60)
    assert clash.returncode == 2 and "--alias other is the name of another model" in clash.stderr


def test_models_dir_lists_gguf_files_and_model_folders(tmp_path) -> None:
    from edgeserve.cli.serve_cmd import models_in

    (tmp_path / "b.gguf").write_bytes(b"")
    (tmp_path / "a-folder").mkdir()
    (tmp_path / "a-folder" / "config.json").write_text("{}")
    (tmp_path / "notes.txt").write_text("")
    (tmp_path / "empty-folder").mkdir()
    assert [Path(p).name for p in models_in(tmp_path)] == ["a-folder", "b.gguf"]


def test_serve_answers_for_two_real_models_and_pulls_a_third_on_request(model_path) -> None:
    """`edgeserve serve -m A -m B` as a user starts it: both answer under their names (greedy on /api/chat as on
    /v1), one at a time with room for one, and --allow-pull serves a catalog model nobody listed."""
    from serve_process import ServeProcess

    served = ServeProcess(str(model_path), "-m", DEFAULT_MODEL, "--max-loaded-models", "1", "--allow-pull",
                          "--kv-memory", "64MiB")
    try:
        client = ollama.Client(host=served.url)
        first = model_path.stem
        names = [m["id"] for m in http.get(served.url + "/v1/models").json()["data"]]
        assert names == [first, DEFAULT_MODEL]  # the file by its name, and the catalog name: two models
        for name in (first, DEFAULT_MODEL):
            answer = client.chat(model=name, messages=ASK, options={"temperature": 0, "num_predict": 6})
            assert answer.model == name and answer.message.content == greedy(served.url, name)
            assert [m.model for m in client.ps().models] == [name]  # room for one: the other made way
        pulled = client.chat(model="gemma3-270m", messages=ASK, options={"temperature": 0, "num_predict": 4})
        assert pulled.model == "gemma3-270m" and pulled.eval_count == 4 and pulled.load_duration > 0
        assert [m.model for m in client.ps().models] == ["gemma3-270m"]
        assert "gemma3-270m" in [m["id"] for m in http.get(served.url + "/v1/models").json()["data"]]
        log = served.output()
        assert f"loaded {DEFAULT_MODEL} in" in log and "loaded gemma3-270m in" in log
        assert f"unloaded {DEFAULT_MODEL} (room for gemma3-270m)" in log
    finally:
        served.close()


def test_a_memory_budget_unloads_as_the_count_does_and_refuses_what_never_fits(tiny_pair) -> None:
    a, b = tiny_pair
    probe = engine_of(a)()
    one = probe.info.memory_bytes  # weights and KV pool, as the pool counts a loaded model
    probe.shutdown()
    entries = [ModelEntry("tiny-a", load=engine_of(a), size=one), ModelEntry("tiny-b", load=engine_of(b), size=one),
               ModelEntry("huge", load=engine_of(b), size=10 * one)]
    pool = ModelPool(entries, max_loaded=3, keep_alive=FOREVER, max_bytes=int(1.5 * one))
    server = ServerThread(create_app(pool))
    try:
        client = ollama.Client(host=server.url)
        greedy(server.url, "tiny-a")
        greedy(server.url, "tiny-b")
        assert [m.model for m in client.ps().models] == ["tiny-b"]  # room for three by count, one by bytes
        too_big = http.post(server.url + "/v1/chat/completions", json={"model": "huge", "messages": ASK})
        assert too_big.status_code == 500 and "memory budget" in too_big.json()["error"]["message"]
        assert [m.model for m in client.ps().models] == ["tiny-b"]  # and nothing was unloaded for it
    finally:
        server.stop()
        pool.shutdown()


def test_a_served_file_answers_to_its_catalog_name_too() -> None:
    from edgeserve.cli.serve_cmd import catalog_names
    from edgeserve.models.catalog import CATALOG

    file = f"/models/{CATALOG[DEFAULT_MODEL].filename}"
    assert catalog_names(file, {"SmolLM2"}) == (DEFAULT_MODEL,)
    assert catalog_names(file, {DEFAULT_MODEL}) == ()  # served as a model of its own already
    assert catalog_names("/models/other.gguf", set()) == ()
