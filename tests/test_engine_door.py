"""The one door into the engine: AsyncEngine's prompt side from a running event loop, the offline LLM through
it, and front ends that hold the door and nothing behind it (tiny random model)."""

from __future__ import annotations

import ast
import asyncio
import gc
import threading
import time
from pathlib import Path

import pytest

import edgeserve
from edgeserve.cli.chat_clients import EngineClient
from edgeserve.config import EngineConfig
from edgeserve.engine.async_engine import AsyncEngine
from edgeserve.engine.llm_engine import LLMEngine
from edgeserve.errors import EdgeserveError, PromptTooLongError
from edgeserve.llm import LLM
from edgeserve.sampling_params import InvalidParamsError, SamplingParams
from edgeserve.server.app import create_app
from edgeserve.text.tokenizer import Tokenizer

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi there"}]
SERVER_PACKAGE = Path(edgeserve.__file__).parent / "server"


def make_engine(model, **kw) -> LLMEngine:
    return LLMEngine(model, EngineConfig(backend="numpy", **{"kv_memory": "16MiB", **kw}))


@pytest.fixture
def aengine(tiny_model):
    aengine = AsyncEngine(make_engine(tiny_model))
    yield aengine
    aengine.shutdown()


def engine_threads() -> int:
    return sum(t.name == "edgeserve-engine" and t.is_alive() for t in threading.enumerate())


# the prompt side, from a running event loop -------------------------------------------------------------


async def test_a_chat_renders_through_the_template_on_a_worker_thread(aengine, tiny_model, monkeypatch):
    tokenizer = tiny_model.tokenizer
    # the tiny model's template is ChatML without a BOS
    text = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi there<|im_end|>\n"
            "<|im_start|>assistant\n")
    want, want_plain = tokenizer.encode(text, add_bos=False), tokenizer.encode(text)
    encode, threads = Tokenizer.encode, []

    def recording_encode(self: Tokenizer, *args: object, **kwargs: object) -> list[int]:
        threads.append(threading.get_ident())
        return encode(self, *args, **kwargs)

    monkeypatch.setattr(Tokenizer, "encode", recording_encode)
    assert await aengine.chat_prompt(MESSAGES) == want
    assert await aengine.tokenize(text) == want_plain
    assert len(threads) == 2 and threading.get_ident() not in threads  # neither ran on the loop's thread
    assert aengine.prompts.chat(MESSAGES) == want  # the same work, called directly, for code without a loop
    without_prompt = await aengine.chat_prompt(MESSAGES, add_generation_prompt=False)
    assert want[: len(without_prompt)] == without_prompt and len(without_prompt) < len(want)


async def test_a_slow_chat_render_leaves_the_loop_free(aengine, monkeypatch):
    encode = Tokenizer.encode

    def slow_encode(self: Tokenizer, *args: object, **kwargs: object) -> list[int]:
        time.sleep(1.0)  # as a prompt of megabytes takes
        return encode(self, *args, **kwargs)

    monkeypatch.setattr(Tokenizer, "encode", slow_encode)
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    ticker = asyncio.ensure_future(tick())
    await aengine.chat_prompt(MESSAGES)
    ticker.cancel()
    assert ticks >= 10, f"the loop ran {ticks} times in a second of rendering"


async def test_prompt_checks_through_the_door(aengine):
    info = aengine.info
    aengine.check_prompt([5] * (info.max_model_len - 1))  # room for one token after it
    with pytest.raises(PromptTooLongError, match="context"):
        aengine.check_prompt([5] * info.max_model_len)
    with pytest.raises(EdgeserveError, match="empty"):
        aengine.check_prompt([])
    with pytest.raises(EdgeserveError, match="outside the model's vocabulary"):
        aengine.check_prompt([5, info.vocab_size])
    with pytest.raises(EdgeserveError, match="outside the model's vocabulary"):
        aengine.check_prompt([-1, 5])


async def test_a_prompt_longer_than_the_pool_is_refused_by_the_pool(tiny_model):
    aengine = AsyncEngine(make_engine(tiny_model, kv_memory=4 * 16 * 512))  # 4 blocks of 16 tokens
    try:
        assert aengine.info.max_model_len == 64 < aengine.info.context_len
        with pytest.raises(PromptTooLongError):
            aengine.check_prompt([5] * 64)
        aengine.check_prompt([5] * 63)
    finally:
        aengine.shutdown()


async def test_grammars_compile_through_the_door(aengine):
    await aengine.compile_grammar(SamplingParams(regex="[ab]{3}"))
    await aengine.compile_grammar(SamplingParams(json_schema={"type": "object"}))
    with pytest.raises(InvalidParamsError) as bad:
        await aengine.compile_grammar(SamplingParams(grammar="start: ("))
    assert bad.value.param == "grammar"
    with pytest.raises(InvalidParamsError, match="logit_bias"):
        await aengine.compile_grammar(SamplingParams(logit_bias={aengine.info.vocab_size: 1.0}))
    answer = "".join([out.text async for out in aengine.generate([5, 6, 7], SamplingParams(
        regex="[ab]{3}", max_tokens=10, temperature=1.0, seed=3))])
    assert len(answer) == 3 and set(answer) <= {"a", "b"}


async def test_a_snapshot_reads_stats_and_blocks_together(aengine):
    stream = aengine.generate([5] * 40, SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True), "held")
    await anext(stream)
    stats, blocks = await aengine.snapshot()
    assert stats.running == 1 and stats.kv_blocks_used == sum(state != "free" and state != "cached"
                                                              for state, _ in blocks)
    assert any("held" in owners for _, owners in blocks)
    await stream.aclose()


def test_an_out_of_vocabulary_prompt_fails_alone_in_the_engine(tiny_model):
    engine = make_engine(tiny_model)
    engine.add_request([5, 6, 7], GREEDY, "good")
    with pytest.raises(EdgeserveError, match="outside the model's vocabulary"):
        engine.add_request([5, engine.vocab_size + 3], GREEDY, "bad")
    assert len(engine.run_to_completion()["good"].token_ids) == GREEDY.max_tokens


# the offline LLM through the same door ------------------------------------------------------------------


@pytest.fixture
def llm(tiny_model, monkeypatch):
    monkeypatch.setattr("edgeserve.engine.llm_engine.load_model", lambda _: tiny_model)
    return LLM("tiny", backend="numpy", kv_memory="16MiB")


def test_llm_generate_matches_the_engine_and_keeps_prompt_order(llm, tiny_model):
    prompts = ["abc", [5, 6, 7, 8], "the quick brown fox"]
    results = llm.generate(prompts, GREEDY)
    engine = make_engine(tiny_model)
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    alone = engine.run_to_completion()
    assert [r.token_ids for r in results] == [alone[i].token_ids for i in ids]
    assert [r.finish_reason for r in results] == ["length"] * 3
    assert results[1].num_prompt_tokens == 4


def test_llm_generate_checks_every_prompt_before_any_runs(llm):
    with pytest.raises(PromptTooLongError):
        llm.generate(["ok", [5] * llm.engine.info.max_model_len], GREEDY)
    with pytest.raises(InvalidParamsError):
        llm.generate(["ok", "also ok"], [GREEDY, SamplingParams(regex="(")])
    assert llm.engine.stats().running == 0 and llm.engine.stats().waiting == 0
    assert len(llm.generate(["ok"], GREEDY)[0].token_ids) == GREEDY.max_tokens


async def test_llm_generate_works_inside_a_running_event_loop(llm):
    # as in a notebook: the loop here is busy waiting, so the generation runs on a loop of its own
    assert len(llm.generate([[5, 6, 7]], GREEDY)[0].token_ids) == GREEDY.max_tokens


def test_an_llm_stops_its_engine_thread_when_it_goes(tiny_model, monkeypatch):
    monkeypatch.setattr("edgeserve.engine.llm_engine.load_model", lambda _: tiny_model)
    before = engine_threads()
    llm = LLM("tiny", backend="numpy", kv_memory="16MiB")
    assert engine_threads() == before + 1
    del llm
    gc.collect()
    deadline = time.monotonic() + 10
    while engine_threads() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine_threads() == before


# front ends hold the door and nothing behind it ---------------------------------------------------------


def _engine_parts(engine: LLMEngine) -> list[object]:
    """The engine and the objects its thread changes."""
    return [engine, engine.scheduler, engine.block_manager, engine.output, engine.runner, engine.backend]


def test_the_server_and_the_chat_client_hold_only_the_door(tiny_model):
    engine = make_engine(tiny_model)
    aengine = AsyncEngine(engine)
    try:
        server = create_app(aengine, "tiny").state.server
        client = EngineClient(aengine)
        parts = [id(p) for p in _engine_parts(engine)]
        assert not [v for v in vars(server).values() if id(v) in parts]
        for holder in (server.models.default.model, client):  # the server's model, loaded: the door alone
            held = list(vars(holder).values())
            assert aengine in held
            assert not [v for v in held if id(v) in parts]
        public = [v for name, v in vars(aengine).items() if not name.startswith("_")]
        assert not [v for v in public if id(v) in parts]  # the door shows none of them either
    finally:
        aengine.shutdown()


def test_the_server_imports_no_engine_internals():
    """From the engine, the server's modules import the door and the data it hands out: nothing the thread runs."""
    allowed = {"edgeserve.engine.async_engine": {"AsyncEngine"}, "edgeserve.engine.output": {"RequestOutput"},
               "edgeserve.engine.llm_engine": {"EngineStats", "EngineInfo"}}
    found = {}
    for path in sorted(SERVER_PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("edgeserve.engine"):
                names = {alias.name for alias in node.names}
                found[path.name] = found.get(path.name, set()) | names
                assert names <= allowed.get(node.module, set()), f"{path.name} imports {names} from {node.module}"
            if isinstance(node, ast.Attribute):
                assert node.attr != "_engine", f"{path.name} reaches behind the door"
    assert found  # the walk saw the server's imports
