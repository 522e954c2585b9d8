"""The paged KV pool and continuous batching engine on the real model (NumPy backend)."""

import asyncio
import contextlib
import threading
import time

import numpy as np
import pytest

from edgeserve.engine.async_engine import AsyncEngine
from edgeserve.errors import PromptTooLongError
from edgeserve.engine.llm_engine import LLMEngine
from edgeserve.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def make_engine(loaded_model, **kw) -> LLMEngine:
    kw.setdefault("kv_memory", "64MiB")
    return LLMEngine(loaded_model, backend="numpy", **kw)


def run_all(engine: LLMEngine, arrivals: dict[int, list[tuple[str, list[int], SamplingParams]]]) -> dict[str, list[int]]:
    """Step the engine to the end; arrivals[k] are requests added before step k."""
    tokens: dict[str, list[int]] = {}
    step = 0
    while engine.has_unfinished() or any(k >= step for k in arrivals):
        for rid, ids, params in arrivals.get(step, []):
            engine.add_request(ids, params, rid)
            tokens[rid] = []
        for out in engine.step():
            tokens[out.request_id] += out.token_ids
        step += 1
    return tokens


def assert_no_leaks(engine: LLMEngine) -> None:
    bm = engine.block_manager
    assert bm.num_used == 0
    assert bm.num_free == bm.num_blocks  # every block free or cached, none held
    assert all(r == 0 for r in bm.ref_count)


@pytest.fixture(scope="module")
def prompts(loaded_model):
    rng = np.random.default_rng(1)
    tok = loaded_model.tokenizer
    text = "The history of the printing press begins in the fifteenth century, when movable type changed Europe."
    base = tok.encode(text)
    return [(base * 8)[: int(n)] for n in rng.integers(5, 90, size=17)]


@pytest.fixture(scope="module")
def engine(loaded_model):
    """One engine shared by the tests that need no special pool; each test leaves it empty."""
    return make_engine(loaded_model)


@pytest.fixture(scope="module")
def alone(engine, prompts):
    return {i: run_all(engine, {0: [("a", p, GREEDY)]})["a"] for i, p in enumerate(prompts[:3])}


def test_batch_invariance(loaded_model, prompts, alone):
    engine = make_engine(loaded_model, max_num_batched_tokens=128)  # small budget: chunked prefills
    arrivals: dict[int, list] = {}
    for i, p in enumerate(prompts):
        arrivals.setdefault(i % 6, []).append((f"r{i}", p, GREEDY))
    got = run_all(engine, arrivals)
    for i in alone:
        assert got[f"r{i}"] == alone[i]
    assert engine.stats().steps > 0
    assert_no_leaks(engine)


def test_prefix_cache_hit_skips_prefill(engine, prompts):
    system = np.random.default_rng(5).integers(1000, 20000, size=80).tolist() + [17]  # unlike any other prompt
    start = engine.stats()
    first = run_all(engine, {0: [("first", system + [30], GREEDY)]})["first"]
    cold = engine.stats()
    second = run_all(engine, {0: [("second", system + [30], GREEDY)]})["second"]
    warm = engine.stats()
    assert second == first
    assert cold.prompt_tokens_computed - start.prompt_tokens_computed == len(system) + 1
    assert warm.prompt_tokens_computed - cold.prompt_tokens_computed == len(system) + 1 - 80  # 5 blocks reused
    assert warm.prefix_hit_tokens - cold.prefix_hit_tokens == 80
    assert_no_leaks(engine)
    engine.block_manager.enable_prefix_caching = False
    try:
        assert run_all(engine, {0: [("x", system + [30], GREEDY)]})["x"] == first
        assert engine.stats().prefix_hit_tokens == warm.prefix_hit_tokens
        assert engine.stats().prompt_tokens_computed - warm.prompt_tokens_computed == len(system) + 1
    finally:
        engine.block_manager.enable_prefix_caching = True
    assert_no_leaks(engine)


def test_preemption_keeps_outputs(loaded_model, prompts):
    # 12 blocks of 16 tokens: room for the longest request alone, far too little for all four at once
    engine = make_engine(loaded_model, kv_memory=12 * 16 * 46080, enable_prefix_caching=False)
    assert engine.pool_size.num_blocks == 12
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    alone = {i: run_all(engine, {0: [(f"alone{i}", p, params)]})[f"alone{i}"] for i, p in enumerate(prompts[:4])}
    assert engine.stats().preemptions == 0
    got = run_all(engine, {0: [(f"r{i}", p, params) for i, p in enumerate(prompts[:4])]})
    assert engine.stats().preemptions > 0
    assert all(got[f"r{i}"] == alone[i] for i in alone)
    assert_no_leaks(engine)


def test_abort_frees_blocks(engine, prompts):
    engine.add_request(prompts[3], SamplingParams(max_tokens=50, temperature=0), "gone")
    engine.add_request(prompts[4], GREEDY, "stays")
    engine.step()
    assert engine.block_manager.num_used > 0
    final = engine.abort("gone")
    assert final.finished and final.finish_reason == "abort"
    finished = []
    while engine.has_unfinished():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished == ["stays"]
    assert_no_leaks(engine)


def test_prompt_too_big_for_pool_is_rejected(loaded_model, prompts):
    engine = make_engine(loaded_model, kv_memory=4 * 16 * 46080)
    with pytest.raises(PromptTooLongError, match="KV pool holds only 64 tokens"):
        engine.add_request(list(range(100, 200)), GREEDY)
    got = run_all(engine, {0: [("ok", prompts[0][:10], GREEDY)]})
    assert len(got["ok"]) == GREEDY.max_tokens
    with pytest.raises(PromptTooLongError, match="context is 8192 tokens"):
        engine.add_request([200] * 9000, GREEDY)


def test_static_batching_holds_finished(loaded_model, prompts):
    engine = make_engine(loaded_model, static_batching=True, max_num_seqs=4)
    short = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    long = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    requests = [("s0", prompts[0], short), ("l0", prompts[1], long), ("s1", prompts[2], short),
                ("l1", prompts[3], long), ("late", prompts[4], short)]
    order, batch_sizes, tokens = [], [], {rid: [] for rid, _, _ in requests}
    for rid, ids, p in requests:
        engine.add_request(ids, p, rid)
    while engine.has_unfinished():
        outputs = engine.step()
        batch_sizes.append(engine.stats().last_batch_seqs)
        order += [o.request_id for o in outputs if o.finished]
        for o in outputs:
            tokens[o.request_id] += o.token_ids
    assert order.index("late") > order.index("l0") and order.index("late") > order.index("l1")
    # the short ones finish after 2 tokens but stay in the batch as padding rows until the long ones end
    first_batch = batch_sizes[: batch_sizes.index(1)]
    assert len(first_batch) >= long.max_tokens and set(first_batch) == {4}
    # padding rows change nobody's output
    assert tokens["l1"] == run_all(make_engine(loaded_model), {0: [("l1", prompts[3], long)]})["l1"]
    assert_no_leaks(engine)


def test_sampling_seed_and_stop(engine, prompts):
    p = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, top_k=40, seed=7, ignore_eos=True)
    a = run_all(engine, {0: [("a", prompts[5], p)]})["a"]
    b = run_all(engine, {0: [("b", prompts[5], SamplingParams(**{**p.__dict__}))]})["b"]
    assert a == b
    greedy_ids = run_all(engine, {0: [("g", prompts[6], GREEDY)]})["g"]
    text = engine.tokenizer.decode(greedy_ids)
    stop = text.split()[2]
    rid = engine.add_request(prompts[6], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=[stop]))
    pieces, reason = [], None
    while engine.has_unfinished():
        for out in engine.step():
            pieces.append(out.text)
            reason = out.finish_reason or reason
    assert reason == "stop"
    assert stop not in "".join(pieces)
    assert text.startswith("".join(pieces))


def test_async_engine_outlives_a_caller_whose_event_loop_closed(loaded_model, prompts):
    aengine = AsyncEngine(make_engine(loaded_model))
    try:
        started = threading.Event()

        def slow(engine: LLMEngine) -> int:
            started.set()
            time.sleep(0.5)
            return engine.block_manager.num_blocks

        async def impatient() -> None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(aengine.call(slow), 0.1)

        asyncio.run(impatient())  # its loop is closed before slow() returns on the engine thread
        assert started.wait(5)

        async def answer() -> list[int]:
            return [t async for out in aengine.generate(prompts[0], GREEDY) for t in out.token_ids]

        assert len(asyncio.run(asyncio.wait_for(answer(), 60))) == GREEDY.max_tokens  # still serving
    finally:
        aengine.shutdown()
