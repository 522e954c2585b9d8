"""The paged KV pool, the scheduler and the continuous batching engine (NumPy backend).

Most tests run on the tiny random model; batch invariance is checked on the real model as well.
"""

import asyncio
import contextlib
import ctypes
import mmap
import os
import sys
import threading
import time

import numpy as np
import pytest

from edgeserve import system
from edgeserve.backends.pages import PAGE, aligned_inside, populate_in_background
from edgeserve.config import EngineConfig
from edgeserve.engine.async_engine import AsyncEngine
from edgeserve.engine.llm_engine import LLMEngine
from edgeserve.engine.output import RequestOutput
from edgeserve.engine.prompts import Prompts
from edgeserve.engine.sampler import token_logprobs
from edgeserve.errors import EdgeserveError, PromptTooLongError
from edgeserve.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
TINY_BYTES_PER_TOKEN = 512  # 2 x 2 layers x 2 KV heads x 16 dims x 4 bytes

Arrivals = dict[int, list[tuple[str, list[int], SamplingParams]]]


def make_engine(model, **kw) -> LLMEngine:
    return LLMEngine(model, EngineConfig(backend="numpy", **{"kv_memory": "64MiB", **kw}))


def run_all(engine: LLMEngine, arrivals: Arrivals) -> dict[str, list[int]]:
    """Run to the end; arrivals[k] are requests added before step k."""
    steps = 0

    def arrive(_: list[RequestOutput] | None = None) -> None:
        nonlocal steps
        for rid, ids, params in arrivals.get(steps, []):
            engine.add_request(ids, params, rid)
        steps += 1

    arrive()
    results = engine.run_to_completion(arrive)
    assert steps > max(arrivals), "the engine ran dry before every request arrived"
    return {rid: c.token_ids for rid, c in results.items()}


def assert_no_leaks(engine: LLMEngine) -> None:
    usage = engine.block_manager.usage()
    assert usage.used == 0
    assert usage.free + usage.cached == usage.total  # every block free or cached, none held
    assert engine.request_ids() == []


def text_prompts(tokenizer, n: int, seed: int) -> list[list[int]]:
    """n prompts of 5 to 90 tokens cut from one text."""
    text = "The history of the printing press begins in the fifteenth century, when movable type changed Europe."
    base = tokenizer.encode(text)
    return [(base * 8)[: int(k)] for k in np.random.default_rng(seed).integers(5, 90, size=n)]


@pytest.fixture(scope="module")
def prompts(tiny_model):
    return text_prompts(tiny_model.tokenizer, 17, seed=1)


@pytest.fixture(scope="module")
def engine(tiny_model):
    """One engine shared by the tests that need no special pool; each test leaves it empty."""
    return make_engine(tiny_model)


def check_batch_invariance(model, prompts: list[list[int]]) -> None:
    """Each request's tokens are the same alone and among others arriving over the first steps."""
    alone_engine = make_engine(model)
    alone = {i: run_all(alone_engine, {0: [("a", p, GREEDY)]})["a"] for i, p in enumerate(prompts[:3])}
    engine = make_engine(model, max_num_batched_tokens=128)  # small budget: chunked prefills
    arrivals: Arrivals = {}
    for i, p in enumerate(prompts):
        arrivals.setdefault(i % 6, []).append((f"r{i}", p, GREEDY))
    got = run_all(engine, arrivals)
    for i in alone:
        assert got[f"r{i}"] == alone[i]
    assert engine.stats().steps > 0
    assert_no_leaks(engine)


def test_batch_invariance(tiny_model, prompts):
    check_batch_invariance(tiny_model, prompts)


def test_batch_invariance_on_the_real_model(loaded_model):
    check_batch_invariance(loaded_model, text_prompts(loaded_model.tokenizer, 17, seed=1))


def test_a_rows_logits_do_not_depend_on_the_batch_on_the_real_model(loaded_model):
    """A prompt's logits alone and with more rows in the batch (as a prefix-cache hit or another request
    changes it): a difference of 0.02 is enough to change a seeded or even a greedy answer."""
    engine = make_engine(loaded_model)
    ids = Prompts.for_engine(engine).chat([{"role": "user", "content": "Tell me a story."}])
    alone = engine.prompt_logits(ids)
    among_more = engine.prompt_logits(ids + ids[:3])[: len(ids)]
    assert np.abs(alone - among_more).max() < 1e-3


def test_prefix_cache_hit_skips_prefill(engine, prompts):
    system = np.random.default_rng(5).integers(3, 99, size=80).tolist() + [17]  # unlike any other prompt
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


def test_the_answers_of_one_prompt_share_its_prefill_and_are_those_of_lone_requests(tiny_model, prompts):
    params = [SamplingParams(max_tokens=8, temperature=1.0, seed=i, ignore_eos=True) for i in range(4)]
    alone = [run_all(make_engine(tiny_model), {0: [("a", prompts[3], p)]})["a"] for p in params]
    engine = make_engine(tiny_model)
    together = run_all(engine, {0: [(f"t{i}", prompts[3], p) for i, p in enumerate(params)]})
    assert [together[f"t{i}"] for i in range(4)] == alone
    # the prompt computed once, and its last token once more for each other answer's own first token
    assert engine.stats().prompt_tokens_computed == len(prompts[3]) + 3


def test_preemption_keeps_outputs(tiny_model, prompts):
    # 12 blocks of 16 tokens: room for the longest request alone, far too little for all four at once
    engine = make_engine(tiny_model, kv_memory=12 * 16 * TINY_BYTES_PER_TOKEN, enable_prefix_caching=False)
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
    assert engine.block_manager.usage().used > 0
    final = engine.abort("gone")
    assert final.finished and final.finish_reason == "abort"
    assert engine.abort("gone") is None  # no longer in flight
    finished = [rid for rid, c in engine.run_to_completion().items() if c.finish_reason]
    assert finished == ["stays"]
    assert_no_leaks(engine)


def test_duplicate_request_id_is_refused(engine, prompts):
    engine.add_request(prompts[0], GREEDY, "twice")
    with pytest.raises(EdgeserveError, match="duplicate request id"):
        engine.add_request(prompts[1], GREEDY, "twice")
    engine.run_to_completion()
    assert_no_leaks(engine)


def test_prompt_too_big_for_pool_is_rejected(tiny_model, prompts):
    engine = make_engine(tiny_model, kv_memory=4 * 16 * TINY_BYTES_PER_TOKEN)
    with pytest.raises(PromptTooLongError, match="KV pool holds only 64 tokens"):
        engine.add_request(list(range(3, 99)), GREEDY)
    got = run_all(engine, {0: [("ok", prompts[0][:10], GREEDY)]})
    assert len(got["ok"]) == GREEDY.max_tokens
    with pytest.raises(PromptTooLongError, match="context is 4096 tokens"):
        engine.add_request([5] * 5000, GREEDY)


def test_max_tokens_is_capped_by_the_context(tiny_model):
    engine = make_engine(tiny_model, max_model_len=40)
    rid = engine.add_request([5] * 30, SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True))
    done = engine.run_to_completion()[rid]
    assert len(done.token_ids) == 10 and done.finish_reason == "length"


def test_static_batching_holds_finished(tiny_model, prompts):
    engine = make_engine(tiny_model, static_batching=True, max_num_seqs=4)
    short = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    long = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    requests = [("s0", prompts[0], short), ("l0", prompts[1], long), ("s1", prompts[2], short),
                ("l1", prompts[3], long), ("late", prompts[4], short)]
    order, batch_sizes = [], []
    for rid, ids, p in requests:
        engine.add_request(ids, p, rid)

    def record(outputs: list[RequestOutput]) -> None:
        batch_sizes.append(engine.stats().last_batch_seqs)
        order.extend(o.request_id for o in outputs if o.finished)

    tokens = engine.run_to_completion(record)
    assert order.index("late") > order.index("l0") and order.index("late") > order.index("l1")
    # the short ones finish after 2 tokens but stay in the batch as padding rows until the long ones end
    first_batch = batch_sizes[: batch_sizes.index(1)]
    assert len(first_batch) >= long.max_tokens and set(first_batch) == {4}
    # padding rows change nobody's output
    assert tokens["l1"].token_ids == run_all(make_engine(tiny_model), {0: [("l1", prompts[3], long)]})["l1"]
    assert_no_leaks(engine)


def test_sampling_seed_and_stop(engine, prompts):
    p = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, top_k=40, seed=7, ignore_eos=True)
    a = run_all(engine, {0: [("a", prompts[5], p)]})["a"]
    b = run_all(engine, {0: [("b", prompts[5], SamplingParams(**{**p.__dict__}))]})["b"]
    assert a == b
    greedy_ids = run_all(engine, {0: [("g", prompts[6], GREEDY)]})["g"]
    text = engine.tokenizer.decode(greedy_ids, skip_special_tokens=True)
    stop = text[5:8]  # spans three tokens of the character-level vocabulary
    rid = engine.add_request(prompts[6], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                                        stop=["never", stop]))
    pieces, reason = [], None

    def collect(outputs: list[RequestOutput]) -> None:
        nonlocal reason
        for out in outputs:
            pieces.append(out.text)
            reason = out.finish_reason or reason

    engine.run_to_completion(collect)
    assert reason == "stop"
    assert "".join(pieces) == text[: text.index(stop)]
    # until the end, the last 4 characters (they might start "never") are held back
    for i in range(len(pieces) - 1):
        so_far = engine.tokenizer.decode(greedy_ids[: i + 1], skip_special_tokens=True)
        assert "".join(pieces[: i + 1]) == so_far[: max(0, len(so_far) - 4)]
    assert rid not in engine.request_ids()


def test_stop_token_and_logprobs(engine, prompts):
    greedy_ids = run_all(engine, {0: [("g", prompts[7], GREEDY)]})["g"]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop_token_ids=[greedy_ids[4]],
                            logprobs=2)
    rid = engine.add_request(prompts[7], params)
    done = engine.run_to_completion()[rid]
    cut = greedy_ids.index(greedy_ids[4]) + 1
    assert done.token_ids == greedy_ids[:cut] and done.finish_reason == "stop"
    assert done.text == engine.tokenizer.decode(greedy_ids[: cut - 1], skip_special_tokens=True)  # stop token: no text
    assert [e["token"] for e in done.logprobs] == done.token_ids
    assert all(len(e["top"]) == 2 and e["top"][0][0] == e["token"] and e["logprob"] <= 0 for e in done.logprobs)


def test_a_step_takes_the_logprobs_of_its_rows_in_one_pass(tiny_model, prompts, monkeypatch):
    engine = make_engine(tiny_model)
    passes: list[int] = []

    def counted(logits: np.ndarray, tokens: list[int], tops: list[int]) -> list[dict]:
        passes.append(len(tokens))
        return token_logprobs(logits, tokens, tops)

    monkeypatch.setattr("edgeserve.engine.llm_engine.token_logprobs", counted)
    asking = [engine.add_request(prompts[i], SamplingParams(max_tokens=5, temperature=1.0, seed=i, ignore_eos=True,
                                                            logprobs=i % 3)) for i in range(6)]
    engine.add_request(prompts[6], GREEDY)  # no logprobs: left out of the pass
    done = engine.run_to_completion()
    # every step ran one pass over the six rows asking, each request got an entry a token with its own top count
    assert passes == [6] * 5
    assert all(len(done[rid].logprobs) == 5 and all(len(e["top"]) == i % 3 for e in done[rid].logprobs)
               for i, rid in enumerate(asking))


def test_kv_map_and_stats_report_the_block_manager(engine, prompts):
    engine.add_request(prompts[8], GREEDY, "holder")
    engine.step()
    kv = engine.kv_map()
    held = [owners for _, owners in kv if owners]
    assert held and all(owners == ["holder"] for owners in held)
    assert {state for state, _ in kv} <= {"free", "cached", "used"}
    st = engine.stats()
    assert st.kv_blocks_used == len(held) and st.running == 1
    assert st.kv_blocks_used + st.kv_blocks_cached + st.kv_blocks_free == st.kv_blocks_total
    assert st.kv_tokens_stored == len(prompts[8])
    engine.run_to_completion()
    assert_no_leaks(engine)


def test_engine_config(tiny_model, monkeypatch):
    assert EngineConfig(kv_memory="2MiB").kv_budget_bytes() == 2 * 2**20
    assert EngineConfig(kv_memory=1000).kv_budget_bytes() == 1000
    assert 0 < EngineConfig(kv_memory="25%").kv_budget_bytes() < EngineConfig(kv_memory="0.5").kv_budget_bytes()
    with pytest.raises(EdgeserveError, match="invalid KV memory fraction"):
        EngineConfig(kv_memory="150%").kv_budget_bytes()
    # a fraction is of the memory the process may still fill: MemAvailable, or its container's limit less its usage
    monkeypatch.setattr(system, "memory_headroom", lambda: (3 * 2**30, 8 * 2**30))
    assert EngineConfig(kv_memory="25%").kv_budget_bytes() == 3 * 2**30 // 4
    engine = LLMEngine(tiny_model, EngineConfig(backend="numpy", kv_memory="1MiB"), block_size=8)
    assert engine.config.block_size == engine.pool_size.block_size == 8
    assert engine.config.kv_memory == "1MiB"


def _resident_bytes(array: np.ndarray) -> int:
    """The bytes of array's whole pages that are in RAM now (mincore, page by page)."""
    start, end = aligned_inside(array, PAGE)
    in_core = (ctypes.c_ubyte * ((end - start) // PAGE))()
    mincore = ctypes.CDLL(None, use_errno=True).mincore
    mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert mincore(start, end - start, in_core) == 0, os.strerror(ctypes.get_errno())
    return sum(b & 1 for b in in_core) * PAGE


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_POPULATE_WRITE is Linux's")
def test_populating_maps_every_page_in_and_keeps_the_contents():
    memory = mmap.mmap(-1, 80 << 20)  # fresh anonymous memory, none of it in RAM yet; over one call's chunk
    array = np.frombuffer(memory, np.uint8)
    array[:5000] = 7
    assert _resident_bytes(array) < 1 << 20
    populate_in_background([array]).join()
    assert _resident_bytes(array) == array.nbytes
    assert (array[:5000] == 7).all() and not array[5000:].any()
    del array
    memory.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_POPULATE_WRITE is Linux's")
def test_a_server_s_pool_is_mapped_in_at_start_its_contents_kept(tiny_model, prompts):
    engine = make_engine(tiny_model, kv_memory="256MiB", populate_kv=True)
    arrays = engine.runner.kv.k + engine.runner.kv.v
    deadline = time.monotonic() + 20
    while min(map(_resident_bytes, arrays)) < 0.95 * arrays[0].nbytes and time.monotonic() < deadline:
        time.sleep(0.05)
    assert min(map(_resident_bytes, arrays)) >= 0.95 * arrays[0].nbytes
    arrivals = {0: [(f"p{i}", p, GREEDY) for i, p in enumerate(prompts[:2])]}
    # the pages mapped in, as zeros, change nothing
    assert run_all(engine, arrivals) == run_all(make_engine(tiny_model), arrivals)


def test_async_engine_outlives_a_caller_whose_event_loop_closed(tiny_model, prompts):
    aengine = AsyncEngine(make_engine(tiny_model))
    try:
        started = threading.Event()

        def slow(engine: LLMEngine) -> int:
            started.set()
            time.sleep(0.5)
            return engine.pool_size.num_blocks

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


def test_tokens_per_second_counts_the_steps_of_the_last_five_seconds(tiny_model, monkeypatch):
    """The rate over the window's steps after its first, the window kept as steps come (not filtered at each)."""
    from edgeserve.engine import llm_engine

    engine = make_engine(tiny_model)
    now = [0.0]
    monkeypatch.setattr(llm_engine.time, "perf_counter", lambda: now[0])
    for t, tokens in ((0.0, 4), (1.0, 4), (2.0, 4), (6.5, 8)):
        now[0] = t
        engine._count_outputs(tokens)
    assert [t for t, _ in engine._recent] == [2.0, 6.5]  # the steps at 0 and 1 left the window
    assert engine.stats().tokens_per_second == pytest.approx(8 / 4.5)
    assert engine.stats().output_tokens == 20
