"""The MLX backend's device steps: tokens taken (greedy) or drawn (sampled) on the device, after a request's bias,
penalties and grammar mask, the next decode launched before the host has the step's tokens (taken when the
scheduler asks for exactly it, dropped otherwise), bursts of decode steps where the device is the host, and the
per-step profile."""

from __future__ import annotations

import pytest

from edgeserve.bench.workloads import BenchRequest, run_engine
from edgeserve.engine import llm_engine
from edgeserve.engine.llm_engine import LLMEngine
from edgeserve.engine.step_profile import PHASES, StepProfile
from edgeserve.sampling_params import GrammarTrigger, SamplingParams

pytest.importorskip("mlx.core", reason="MLX is not installed (pip install 'edgeserve[mlx]'): MLX backend not tested")

# tiny-model blocks are 8 KiB (2 layers, K and V, 16 tokens of 2 heads of 16 float32): 10 of them, so the
# requests below outgrow the pool and some are preempted
SMALL_POOL = 10 * 8192


# a bias and every penalty, the repetition penalty over the whole sequence and over windows of 1 (only the token
# still on the device when a step is launched ahead) and 3 tokens
PENALTIES = [dict(repetition_penalty=1.5, repeat_last_n=n, frequency_penalty=0.6, presence_penalty=0.4,
                  logit_bias={7: 1.5, 11: -2.0}) for n in (-1, 1, 3)]


# up to an "e", then "!?" and the end; triggered: free until the output writes the "e" (as a tool call's grammar
# waits for its opening tag), then bound from it
GRAMMAR = 'start: lead "!?"\nlead[lazy]: /[^e]*e/\n'
TRIGGERED = dict(grammar=GRAMMAR, grammar_trigger=GrammarTrigger(text="e"))


def requests(logprobs: int | None, sampled: bool, penalized: bool = False, triggered: bool = False
             ) -> list[tuple[int, list[int], SamplingParams]]:
    """(step it arrives before, prompt, params): prompts and lengths that end at different steps, a stop string;
    sampled: seeded draws at a temperature, some with top-k, top-p and min-p; penalized: most with a bias and
    penalties; triggered: half with a grammar that binds once their output writes its trigger, and a quarter with
    that grammar bound from the start."""
    out = []
    for i in range(10):
        prompt = [(7 * i + 3 * j) % 90 + 5 for j in range(3 + 4 * i)]
        draws = dict(temperature=0.9, seed=i, top_k=30 * (i % 2), top_p=0.95 if i % 3 else 1.0,
                     min_p=0.01 * (i % 2)) if sampled else dict(temperature=0.0)
        penalties = PENALTIES[i % 3] if penalized and i % 4 else {}
        grammar = {} if not triggered or i % 4 == 0 else TRIGGERED if i % 2 else dict(grammar=GRAMMAR)
        params = SamplingParams(max_tokens=6 + 5 * (i % 5) + 30 * bool(grammar), ignore_eos=i % 3 != 0,
                                stop=["}~"] if i == 4 else [], logprobs=logprobs, **draws, **penalties, **grammar)
        out.append((0 if i < 6 else 7, prompt, params))
    return out


def generate(engine: LLMEngine, logprobs: int | None, sampled: bool, penalized: bool = False,
             triggered: bool = False) -> dict[int, list[int]]:
    """Each request's tokens, by its index; request 8 is aborted before step 10."""
    ids: dict[str, int] = {}
    tokens: dict[int, list[int]] = {}
    step = 0
    pending = requests(logprobs, sampled, penalized, triggered)
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


@pytest.mark.parametrize("penalized", [False, True], ids=["plain", "penalized"])
@pytest.mark.parametrize("early", [False, True], ids=["after-fetch", "early"])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_steps_launched_ahead_give_the_host_sampled_tokens(mlx_on_cpu, tiny_model, sampled, early, penalized,
                                                          monkeypatch) -> None:
    """Tokens drawn on the device, with steps launched ahead (as on a GPU) and dropped where requests arrive,
    end, are aborted or preempted, are the host sampler's: sampled rows take their request's next number in
    order, and a dropped step gives its numbers back; a bias and penalties count the token a step launched
    ahead has only on the device. Float32 on the CPU, where a float tie is rare enough for exact equality.
    early: each step launched before the one it follows is fetched (as on CUDA, where the K/V writes go through
    the pool's pointer), so one is always in flight behind the other."""
    ahead = LLMEngine(tiny_model, backend="mlx", kv_memory=SMALL_POOL)
    ahead.backend.computes_async = True
    monkeypatch.setattr(type(ahead.backend), "launch_early", early)
    host = LLMEngine(tiny_model, backend="mlx", kv_memory=SMALL_POOL)
    got = generate(ahead, logprobs=None, sampled=sampled, penalized=penalized)
    # logprobs take every row through the host's sampler, and no step is launched early
    expected = generate(host, logprobs=0, sampled=sampled, penalized=penalized)
    assert got == expected
    if penalized:  # the penalties changed what was drawn, so the comparison above saw them
        assert expected != generate(LLMEngine(tiny_model, backend="mlx", kv_memory=SMALL_POOL), logprobs=0,
                                    sampled=sampled)
    stats = ahead.stats()
    assert stats.steps_launched_ahead > 10
    assert stats.preemptions > 0  # a preemption drops a step launched ahead, and the outputs stay right
    assert host.stats().steps_launched_ahead == 0
    # whatever was launched and dropped, every block is back once all requests are done
    assert stats.kv_blocks_used == 0


@pytest.mark.parametrize("early", [False, True], ids=["after-fetch", "early"])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_grammars_mask_on_the_device(mlx_on_cpu, tiny_model, sampled, early, monkeypatch) -> None:
    """Rows masked by their grammar take the mask to the device, and no step is launched ahead of them; requests
    whose grammar waits for a trigger (tool calls) draw their free tokens on the device, steps launched ahead
    included, and the step launched ahead of a grammar binding is dropped: the host's sampler's tokens throughout,
    and no step of the host's."""
    ahead = LLMEngine(tiny_model, backend="mlx", kv_memory=SMALL_POOL)
    ahead.backend.computes_async = True
    monkeypatch.setattr(type(ahead.backend), "launch_early", early)
    host_steps = []
    monkeypatch.setattr(ahead, "_host_step", lambda scheduled: host_steps.append(scheduled))
    host = LLMEngine(tiny_model, backend="mlx", kv_memory=SMALL_POOL)
    got = generate(ahead, logprobs=None, sampled=sampled, triggered=True)
    assert got == generate(host, logprobs=0, sampled=sampled, triggered=True)
    assert not host_steps
    # the grammars changed what the requests bound from the start wrote
    free = generate(LLMEngine(tiny_model, backend="mlx", kv_memory=SMALL_POOL), logprobs=0, sampled=sampled)
    assert got[2] != free[2] and got[6] != free[6]
    if sampled:  # and, bound from the start or at an "e", ended requests with "!?"
        assert sum(tiny_model.tokenizer.decode(got[i]).endswith("e!?") for i in got if i % 4) >= 3
    assert ahead.stats().steps_launched_ahead > 5


def test_a_mask_that_allows_nothing_fails_its_request_alone(mlx_on_cpu, tiny_model, monkeypatch) -> None:
    """A grammar's mask with no token left fails that request with a message; the batch's other requests run on."""
    import numpy as np

    engine = LLMEngine(tiny_model, backend="mlx", kv_memory=SMALL_POOL)
    engine.backend.computes_async = True
    forbidden = engine.constraints.forbidden

    def nothing_allowed(pending, seqs):
        masks, failed = forbidden(pending, seqs)
        return {row: np.ones_like(mask) for row, mask in masks.items()}, failed

    monkeypatch.setattr(engine.constraints, "forbidden", nothing_allowed)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    free = engine.add_request([5, 6, 7], params)
    masked = engine.add_request([5, 6, 8], SamplingParams(max_tokens=8, temperature=0.0, grammar=GRAMMAR))
    outputs = []
    results = engine.run_to_completion(outputs.extend)
    assert [(out.token_ids, out.error) for out in outputs if out.request_id == masked] == [
        ([], "no token is allowed")]
    assert not any(out.error for out in outputs if out.request_id == free) and len(results[free].token_ids) == 8


def test_no_step_is_launched_ahead_where_the_device_is_the_host(mlx_on_cpu, tiny_model) -> None:
    engine = LLMEngine(tiny_model, backend="mlx")
    assert not engine.backend.computes_async  # MLX on the CPU computes as a step is launched: nothing would overlap
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    engine.run_to_completion()
    assert engine.stats().steps_launched_ahead == 0


@pytest.mark.parametrize("triggered", [False, True], ids=["plain", "grammars"])
def test_bursts_of_decode_steps_give_the_step_by_step_tokens(mlx_on_cpu, tiny_model, triggered, monkeypatch) -> None:
    """Where the device is the host (MLX on the CPU), plain greedy decodes run BURST steps as one, each step's tokens
    the samples of the one before, left on the device: requests that end inside a burst (a stop token, their
    length), arrive (nobody bursts while one waits), are preempted, or carry a grammar, bound or waiting for its
    trigger (they never burst), get the tokens of one step at a time, and every block comes back."""
    engine = LLMEngine(tiny_model, backend="mlx", kv_memory=SMALL_POOL)
    bursts = []
    burst = engine._burst

    def spy(scheduled, steps):
        bursts.append((scheduled, steps, bool(engine.scheduler.waiting)))
        return burst(scheduled, steps)

    monkeypatch.setattr(engine, "_burst", spy)
    got = generate(engine, logprobs=None, sampled=False, triggered=triggered)
    full = llm_engine.BURST
    monkeypatch.setattr(llm_engine, "BURST", 1)
    step_by_step = LLMEngine(tiny_model, backend="mlx", kv_memory=SMALL_POOL)
    expected = generate(step_by_step, logprobs=None, sampled=False, triggered=triggered)
    aborted = 8  # after as many engine steps, which hold more decode steps in bursts
    assert {i: t for i, t in got.items() if i != aborted} == {i: t for i, t in expected.items() if i != aborted}
    shorter, longer = sorted((got.get(aborted, []), expected.get(aborted, [])), key=len)
    assert longer[: len(shorter)] == shorter
    if not triggered:  # with grammars, half the requests hold off every batch they are in
        assert len(bursts) > 5 and max(steps for _, steps, _ in bursts) == full > 1
    assert not any(waiting for _, _, waiting in bursts)
    assert not any(item.seq.params.grammar for scheduled, _, _ in bursts for item in scheduled)
    stats = engine.stats()
    assert stats.preemptions > 0 and stats.kv_blocks_used == 0


@pytest.mark.parametrize("one_call", [True, False], ids=["one-call", "forward"])
def test_a_burst_writes_the_pool_in_place(mlx_on_cpu, tiny_model, one_call) -> None:
    """Each step of a burst writes K/V into the pools the step before wrote, in place: were any step's pools still
    held outside the graph, the next one's write would copy a layer's pool. one_call: the greedy step as one compiled
    call, else the model's forward pass (the blocks' decode stack, then the head and an argmax)."""
    import mlx.core as mx

    engine = LLMEngine(tiny_model, backend="mlx", kv_memory="32MiB")
    if not one_call:
        engine.runner.model.greedy = None
    layer_pool = engine.runner.kv.k[0].nbytes
    for i in range(4):
        engine.add_request([5 + i, 6, 7], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    engine.step()  # the prompts
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    engine.run_to_completion()
    assert engine.stats().steps == 40 and engine.profile.steps == 40
    assert mx.get_peak_memory() - before < layer_pool / 4


def test_a_stop_string_inside_a_burst_ends_its_request_there(mlx_on_cpu, tiny_model, monkeypatch) -> None:
    def run(stop: list[str]) -> tuple[str, list[int], str | None, int]:
        engine = LLMEngine(tiny_model, backend="mlx")
        rid = engine.add_request([5, 9, 14, 3], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                                                               stop=stop))
        outputs = []
        done = engine.run_to_completion(outputs.extend)[rid]
        return done.text, done.token_ids, done.finish_reason, max(len(out.token_ids) for out in outputs)

    free, _, _, most = run([])
    assert most == llm_engine.BURST > 1  # its decode steps ran in bursts
    stop = free[9:12]
    got = run([stop])
    monkeypatch.setattr(llm_engine, "BURST", 1)
    assert got[:3] == run([stop])[:3]  # one step at a time
    assert got[0] == free[: free.index(stop)] and got[2] == "stop" and got[3] > 1


def test_the_bench_counts_every_token_of_a_burst(mlx_on_cpu, tiny_model) -> None:
    """Decode tokens per second count each token a burst brings (they were counted one an output, a quarter of
    them): decoding alone is at least as fast as the whole run, its prompt included."""
    engine = LLMEngine(tiny_model, backend="mlx")
    summary = run_engine(engine, [BenchRequest([5, 6, 7], "", 96)], "one stream", progress=False).summary()
    assert summary["output_tokens"] == 96
    assert summary["decode_tokens_per_s"] > 0.9 * summary["output_tokens_per_s"]


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


# sampling on the device ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("settings", [dict(temperature=0.8), dict(temperature=1.3, top_k=40),
                                      dict(temperature=0.7, top_p=0.9, min_p=0.02)], ids=["plain", "top_k", "top_p"])
def test_device_draws_are_the_host_samplers_draws(mlx_on_cpu, settings) -> None:
    import mlx.core as mx
    import numpy as np

    from edgeserve.backends.mlx_backend import MLXBackend
    from edgeserve.batch import SamplingRows
    from edgeserve.engine.sampler import _processed, _weights
    from edgeserve.engine.sequence import Sequence

    rng = np.random.default_rng(1)
    logits = rng.standard_normal(300).astype(np.float32)
    seq = Sequence("r", [1], SamplingParams(**settings))
    probs = _weights(_processed(logits.copy(), seq), seq)
    cdf = np.cumsum(probs) / probs.sum()
    uniform = (np.arange(4000) + 0.5) / 4000
    expected = np.searchsorted(cdf, uniform, side="right")  # the host's draw at each number
    p = seq.params
    n = len(uniform)
    rows = SamplingRows(np.full(n, p.temperature, np.float32), np.full(n, p.top_k), np.full(n, p.top_p, np.float32),
                        np.full(n, p.min_p, np.float32), uniform)
    drawn = np.array(MLXBackend().sample(mx.array(np.tile(logits, (n, 1))), rows))
    assert (drawn == expected).mean() > 0.998  # float32 against float64 sums: a boundary may move by a hair
    assert set(np.unique(drawn)) <= set(np.flatnonzero(probs > 0))  # nothing the filters removed is ever drawn
    assert len(np.unique(drawn)) > 5


@pytest.mark.parametrize("on_device", [0, 1, 2], ids=["none", "one", "two"])
def test_device_penalties_are_the_host_samplers(mlx_on_cpu, on_device) -> None:
    """Bias, repetition, frequency and presence penalties on the device, greedy and drawn, give the host's
    choices; on_device: how many of each sequence's latest tokens are still on the device (a step launched ahead
    has one; two shows that the device's tokens count only where the host's leave them out)."""
    import mlx.core as mx
    import numpy as np

    from edgeserve.backends.mlx_backend import MLXBackend, _penalized
    from edgeserve.batch import SamplingRows
    from edgeserve.engine.sampler import _processed, penalty_rows
    from edgeserve.engine.sequence import Sequence

    rng = np.random.default_rng(2)
    vocab = 64
    settings = [dict(repetition_penalty=1.8, repeat_last_n=n, frequency_penalty=f, presence_penalty=pr,
                     logit_bias=bias) for n in (-1, 1, 2, 5, 0) for f, pr in ((0.0, 0.0), (0.7, 0.3))
                for bias in ({}, {3: 2.5, 40: -1.0})] + [dict(logit_bias={5: 4.0})]
    seqs = []
    for i, kw in enumerate(settings):
        seq = Sequence(str(i), rng.integers(0, vocab, 6).tolist(), SamplingParams(temperature=0.0, **kw))
        seq.token_ids += rng.integers(0, 12, 10).tolist()  # outputs repeating a few tokens
        seqs.append(seq)
    logits = rng.standard_normal((len(seqs), vocab)).astype(np.float32) * 3
    logits[:, :12] += 3  # the tokens the outputs repeat lead, so that the penalties decide
    expected = np.stack([_processed(row.copy(), seq) for row, seq in zip(logits, seqs)])
    if on_device == 1:
        recent = [seq.token_ids.pop() for seq in seqs]
        pen = penalty_rows(seqs, ahead=True)
        for seq, token in zip(seqs, recent):
            seq.token_ids.append(token)
    else:
        recent, pen = None, penalty_rows(seqs)
        if on_device == 2:  # the host's lists already hold the latest token: counting it again must change things
            recent = [seq.token_ids[-1] for seq in seqs]
    device_recent = None if recent is None else mx.array(recent, mx.int32)
    penalized = np.array(_penalized(mx.array(logits), pen, device_recent))
    if on_device == 2:
        assert not np.allclose(penalized, expected, rtol=1e-5, atol=1e-5)
        return
    np.testing.assert_allclose(penalized, expected, rtol=1e-5, atol=1e-5)
    n = len(seqs)
    plain = SamplingRows(np.zeros(n, np.float32), np.zeros(n, np.int64), np.ones(n, np.float32),
                         np.zeros(n, np.float32), np.zeros(n), penalties=pen, recent=device_recent)
    greedy = np.array(MLXBackend().sample(mx.array(logits), plain))
    assert (greedy == expected.argmax(axis=1)).all()
    assert (greedy != logits.argmax(axis=1)).sum() >= len(seqs) // 3  # the penalties changed many choices
    # drawn at a temperature: the same token as the host's draw at the same number
    hot = SamplingRows(np.ones(n, np.float32), np.zeros(n, np.int64), np.ones(n, np.float32), np.zeros(n, np.float32),
                       rng.random(n), penalties=pen, recent=plain.recent)
    drawn = np.array(MLXBackend().sample(mx.array(logits), hot))
    probs = np.exp(expected - expected.max(axis=1, keepdims=True))
    cdf = np.cumsum(probs, axis=1) / probs.sum(axis=1, keepdims=True)
    assert drawn.tolist() == [int(np.searchsorted(c, u, side="right")) for c, u in zip(cdf, hot.uniform)]
