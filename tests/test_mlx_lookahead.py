"""The MLX backend's greedy steps: tokens taken on the device, the next decode launched before the host has the
step's tokens (taken when the scheduler asks for exactly it, dropped otherwise), and the per-step profile."""

from __future__ import annotations

import pytest

from edgeserve.engine.llm_engine import LLMEngine
from edgeserve.engine.step_profile import PHASES, StepProfile
from edgeserve.sampling_params import SamplingParams

pytest.importorskip("mlx.core", reason="MLX is not installed (pip install 'edgeserve[mlx]'): MLX backend not tested")

# tiny-model blocks are 8 KiB (2 layers, K and V, 16 tokens of 2 heads of 16 float32): 10 of them, so the
# requests below outgrow the pool and some are preempted
SMALL_POOL = 10 * 8192


def requests(logprobs: int | None) -> list[tuple[int, list[int], SamplingParams]]:
    """(step it arrives before, prompt, params): prompts and lengths that end at different steps, a stop string."""
    out = []
    for i in range(10):
        prompt = [(7 * i + 3 * j) % 90 + 5 for j in range(3 + 4 * i)]
        params = SamplingParams(max_tokens=6 + 5 * (i % 5), temperature=0.0, ignore_eos=i % 3 != 0,
                                stop=["}~"] if i == 4 else [], logprobs=logprobs)
        out.append((0 if i < 6 else 7, prompt, params))
    return out


def generate(engine: LLMEngine, logprobs: int | None) -> dict[int, list[int]]:
    """Each request's tokens, by its index; request 8 is aborted before step 10."""
    ids: dict[str, int] = {}
    tokens: dict[int, list[int]] = {}
    step = 0
    pending = requests(logprobs)
    while pending or engine.has_unfinished():
        for i, (arrive, prompt, params) in enumerate(pending):
            if arrive <= step:
                ids[engine.add_request(prompt, params)] = len(ids)
        pending = [r for r in pending if r[0] > step]
        if step == 10:
            engine.abort(next(rid for rid, i in ids.items() if i == 8))
        for out in engine.step():
            tokens.setdefault(ids[out.request_id], []).extend(out.token_ids)
        step += 1
    return tokens


def test_steps_launched_ahead_give_the_host_sampled_tokens(mlx_on_cpu, tiny_model) -> None:
    # float32 on the CPU, where greedy ties are rare enough for exact equality, with steps launched ahead as on a GPU
    ahead = LLMEngine(tiny_model, backend="mlx", kv_memory=SMALL_POOL)
    ahead.backend.computes_async = True
    host = LLMEngine(tiny_model, backend="mlx", kv_memory=SMALL_POOL)
    got = generate(ahead, logprobs=None)
    # logprobs take every row through the host's sampler, and no step is launched early
    expected = generate(host, logprobs=0)
    assert got == expected
    stats = ahead.stats()
    assert stats.steps_launched_ahead > 10
    assert stats.preemptions > 0  # a preemption drops a step launched ahead, and the outputs stay right
    assert host.stats().steps_launched_ahead == 0
    # whatever was launched and dropped, every block is back once all requests are done
    assert stats.kv_blocks_used == 0


def test_no_step_is_launched_ahead_where_the_device_is_the_host(mlx_on_cpu, tiny_model) -> None:
    engine = LLMEngine(tiny_model, backend="mlx")
    assert not engine.backend.computes_async  # MLX on the CPU computes as a step is launched: nothing would overlap
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    engine.run_to_completion()
    assert engine.stats().steps_launched_ahead == 0


def test_profile_accounts_for_each_step(tiny_model) -> None:
    engine = LLMEngine(tiny_model, backend="mlx")
    engine.add_request([5, 6, 7, 8], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    engine.run_to_completion()
    summary = engine.profile.summary()
    assert summary["steps"] == engine.stats().steps == 12
    phases = [summary[f"{p}_s"] for p in PHASES]
    assert all(s >= 0 for s in phases) and summary["eval_s"] > 0 and summary["graph_s"] > 0
    assert summary["step_s"] == pytest.approx(sum(phases), rel=1e-3)
    assert summary["host_s"] == pytest.approx(summary["step_s"] - summary["eval_s"], rel=1e-3)
    engine.profile.reset()
    assert engine.profile.summary()["steps"] == 0


def test_profile_counts_idle_time_between_steps() -> None:
    profile = StepProfile()
    for _ in range(2):
        profile.begin()
        profile.lap("schedule")
        profile.end("output")
        # nothing runs between the end of one step and the next begin but this loop
    summary = profile.summary()
    assert summary["steps"] == 2 and summary["idle_s"] > 0
