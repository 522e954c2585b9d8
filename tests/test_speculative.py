"""Speculative decoding by prompt lookup: the drafter, its back-off, and drafts checked inside the batched step.

Greedy outputs must be the same with speculation on and off, and sampled ones distributed the same; the tiny
random model repeats itself enough for prompt lookup to guess right, the real model copies a given text.
"""

import json
import statistics
from pathlib import Path

import jsonschema
import numpy as np
import pytest
from scipy.stats import chi2_contingency, chisquare

from edgeserve.config import EngineConfig
from edgeserve.engine.block_manager import blocks_for
from edgeserve.engine.llm_engine import LLMEngine
from edgeserve.engine.prompts import Prompts
from edgeserve.engine.sampler import check_guess
from edgeserve.engine.scheduler import ScheduledSeq
from edgeserve.engine.sequence import Sequence
from edgeserve.engine.speculative import (DECAY, EXPLORE_DRAFT, EXPLORE_EVERY, JUDGE_EVERY, JUDGE_EVERY_KNOWN, JUDGE_MIN,
                                          JUDGE_MARGIN, JUDGE_WINDOW, MIN_SAMPLES, PromptLookup, SharedLookup, Speculator, StepCost,
                                          best_draft)
from edgeserve.errors import EdgeserveError
from edgeserve.sampling_params import InvalidParamsError, SamplingParams

FIXTURES = Path(__file__).parent / "fixtures"
GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


def make_engine(model, speculative: str, **kw) -> LLMEngine:
    return LLMEngine(model, EngineConfig(backend="numpy", speculative=speculative, **{"kv_memory": "64MiB", **kw}))


def assert_no_leaks(engine: LLMEngine) -> None:
    usage = engine.block_manager.usage()
    assert usage.used == 0 and usage.free + usage.cached == usage.total
    assert engine.request_ids() == []


def check_invariants(engine: LLMEngine) -> None:
    """After a step: each running decode holds K/V for all its tokens but the last, blocks for no more than its
    tokens (a rejected guess's blocks went back), and prefix-cache hashes for its full computed blocks only."""
    bs = engine.block_manager.block_size
    for seq in engine.scheduler.running:
        if seq.num_output_tokens and not seq.is_finished:
            assert seq.num_computed_tokens == seq.num_tokens - 1
        assert len(seq.block_table) <= blocks_for(seq.num_tokens, bs)
        if engine.block_manager.enable_prefix_caching:
            assert len(seq.block_hashes) == seq.num_computed_tokens // bs


def run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]], abort: str | None = None
        ) -> dict[str, tuple[list[int], str, str | None]]:
    """Each request's (tokens, text, finish reason), checking the invariants after every step; abort: a request
    to abort after its third step."""
    for rid, (ids, params) in requests.items():
        engine.add_request(ids, params, rid)
    got: dict[str, tuple[list[int], str, str | None]] = {rid: ([], "", None) for rid in requests}
    steps = 0
    while engine.has_unfinished():
        for out in engine.step():
            tokens, text, _ = got[out.request_id]
            got[out.request_id] = (tokens + out.token_ids, text + out.text, out.finish_reason)
        check_invariants(engine)
        steps += 1
        if steps == 3 and abort is not None:
            got[abort] = (*got[abort][:2], engine.abort(abort).finish_reason)
    assert_no_leaks(engine)
    return got


def repetitive_prompts(tokenizer, n: int) -> list[list[int]]:
    text = "The history of the printing press begins in the fifteenth century, when movable type changed Europe."
    base = tokenizer.encode(text)
    return [(base[: 15 + 6 * i]) * 2 for i in range(n)]


# the drafter --------------------------------------------------------------------------------------------------

def lookup_draft(tokens: list[int], k: int) -> list[int]:
    return PromptLookup().draft(tokens, k)


def test_lookup_draft_follows_the_most_recent_longest_match():
    assert lookup_draft([1, 2, 3, 9, 1, 2, 3, 8, 7, 1, 2, 3], k=2) == [8, 7]  # the later of two 3-token matches
    assert lookup_draft([5, 2, 3, 4, 6, 1, 3, 7, 2, 3], k=3) == [4, 6, 1]  # (2, 3) beats the later (3,)
    assert lookup_draft([4, 1, 9, 9, 1], k=5) == [9, 9, 1]
    assert lookup_draft([1, 2, 3, 4], k=4) == []
    assert lookup_draft([7, 7, 7], k=4) == [7]  # the match may overlap the suffix
    assert lookup_draft([1, 2, 1, 2], k=0) == [] and lookup_draft([1], k=3) == []


def scanned_draft(tokens: list[int], k: int) -> list[int]:
    """Prompt lookup by a scan of the whole list, longest suffix first, latest occurrence first."""
    for n in range(min(3, len(tokens) - 1), 0, -1):
        for end in range(len(tokens) - 2, n - 2, -1):
            if tokens[end - n + 1 : end + 1] == tokens[len(tokens) - n :]:
                return tokens[end + 1 : end + 1 + k]
    return []


def test_prompt_lookup_indexes_the_tokens_as_they_grow_and_finds_what_a_scan_finds():
    rng = np.random.default_rng(0)
    for trial in range(20):
        tokens = rng.integers(0, 4 + trial, 30).tolist()
        lookup = PromptLookup()
        for _ in range(60):
            assert lookup.draft(tokens, 5) == scanned_draft(tokens, 5)
            tokens.append(int(rng.integers(0, 4 + trial)))
        del tokens[40:]  # a list that shrank (or another list) is indexed anew
        assert lookup.draft(tokens, 5) == scanned_draft(tokens, 5)
        other = tokens[::-1]
        assert lookup.draft(other, 5) == scanned_draft(other, 5)


def test_the_shared_table_guesses_what_followed_in_an_earlier_answer_and_keeps_the_latest():
    shared = SharedLookup(n=2, capacity=4, k=3)
    shared.add([9, 1, 2, 3, 4, 5, 6], start=3)  # the answer is 3, 4, 5, 6: its first n-gram ends in the prompt
    assert shared.draft([7, 7, 1, 2], 5) == [3, 4, 5]  # k tokens at most were kept
    assert shared.draft([4, 5], 2) == [6] and shared.draft([8, 9], 3) == [] and shared.draft([2], 3) == []
    assert shared.draft([1, 2], 0) == []
    assert len(shared) == 4
    shared.add([0, 0, 2, 3, 8], start=3)  # (2, 3) again, now followed by 8; then (3, 8) pushes out the oldest
    assert shared.draft([2, 3], 3) == [8] and len(shared) == 4
    assert shared.draft([1, 2], 3) == []  # (1, 2) was written longest ago


def test_an_answer_repeated_later_is_guessed_from_the_shared_table(tiny_model):
    # the tiny model's random text rarely repeats itself, so what is accepted comes from the first answer
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    prompt = tiny_model.tokenizer.encode("A short prompt the model answers twice.")
    off = run(make_engine(tiny_model, "off"), {"a": (prompt, params)})["a"]
    engine = make_engine(tiny_model, "ngram")
    assert run(engine, {"a": (prompt, params)})["a"] == off
    first = engine.stats().accepted_draft_tokens
    assert len(engine.speculator.shared) > 50
    assert run(engine, {"b": (prompt, params)})["b"] == off
    assert engine.stats().accepted_draft_tokens - first >= 50  # nearly every token of the answer was guessed
    quiet = make_engine(tiny_model, "off")
    run(quiet, {"a": (prompt, params)})
    assert len(quiet.speculator.shared) == 0  # nothing kept where nothing speculates


def trained_cost(step_time, row_counts=range(1, 40)) -> StepCost:
    """A cost model that saw MIN_SAMPLES steps at each row count, taking step_time(rows) seconds."""
    cost = StepCost()
    for _ in range(MIN_SAMPLES):
        for rows in row_counts:
            cost.observe(rows, step_time(rows))
    return cost


def history(seq: Sequence, spec: Speculator, drafted: int, accepted: int, checks: int = 10) -> None:
    for _ in range(checks):
        spec.record(seq, drafted, accepted)


REPEATS = list(range(20)) * 2 + [0, 1, 2]  # prompt lookup finds the 8 tokens after (0, 1, 2): 3..10


def test_step_cost_reads_each_row_count_and_a_line_through_those_above_one():
    cost = StepCost()
    assert cost.times(1, 8) is None
    for _ in range(MIN_SAMPLES):
        cost.observe(1, 0.002)
    assert cost.times(1, 8) is None  # one row count tells nothing of what a row more costs
    rng = np.random.default_rng(0)
    for rows in rng.integers(2, 20, 200):
        cost.observe(int(rows), 0.01 + 0.005 * rows + rng.normal(0, 1e-4))
    cost.observe(500, 100.0)  # a long prefill chunk, far from the rows asked about
    cost.observe(1, 0.5)  # an outlier: the median keeps it out
    times = cost.times(1, 8)
    # one row runs other kernels (a matrix-vector product: here five times cheaper than the line says): its own
    # median, and it does not bend the line of the others
    assert times[0] == pytest.approx(0.002)
    assert times[1:] == pytest.approx([0.01 + 0.005 * rows for rows in range(2, 10)], rel=0.02)
    assert cost.times(3, 2) == pytest.approx([0.025, 0.03, 0.035], rel=0.02)
    # with a single row count above one, the line from one row to it
    cost = StepCost()
    for rows in [1, 3] * MIN_SAMPLES:
        cost.observe(rows, 0.01 * rows)
    assert cost.times(1, 4) == pytest.approx([0.01, 0.02, 0.03, 0.04, 0.05])


def test_step_cost_medians_are_those_of_the_window_as_it_slides():
    cost, rng = StepCost(window=40), np.random.default_rng(1)
    for _ in range(300):
        cost.observe(int(rng.integers(1, 4)), float(rng.choice([0.5, 1.0, rng.random()])))  # ties, as timers give
        window = cost.samples()
        want = {n: statistics.median(t for r, t in window if r == n) for n in {r for r, _ in window}}
        assert cost.medians() == {n: m for n, m in want.items()
                                  if sum(r == n for r, _ in window) >= MIN_SAMPLES}


def test_auto_drafts_long_where_rows_are_cheap_and_guesses_right():
    spec = Speculator("auto", cost=trained_cost(lambda rows: 10 + 0.01 * rows))
    seq = Sequence("s", list(REPEATS), SamplingParams())
    history(seq, spec, 8, 8)
    assert spec.propose(seq, 8, rows=1, decodes=1) == list(range(3, 11))
    assert spec.propose(seq, 8, rows=16, decodes=16) == list(range(3, 11))  # cheap rows: batched too
    assert spec.propose(seq, 5, rows=1, decodes=1) == list(range(3, 8))  # never past the room it is given
    assert Speculator("ngram").propose(seq, 2, rows=64, decodes=64) == [3, 4]  # ngram drafts regardless


def test_auto_stops_drafting_where_rows_are_expensive():
    def propose(accepted: int, rows: int) -> list[int]:
        spec = Speculator("auto", cost=trained_cost(lambda r: 10 + 5 * r))
        seq = Sequence("s", list(REPEATS), SamplingParams())
        history(seq, spec, 5, accepted)
        return spec.propose(seq, 8, rows=rows, decodes=rows)

    assert propose(0, rows=1) == []  # guesses wrong: no draft, even alone
    assert 1 <= len(propose(4, rows=1)) < 8  # acceptance 0.8 pays alone, a short draft best
    assert propose(4, rows=16) == []  # but not where the batch already makes each row cost
    assert len(propose(5, rows=1)) == 8  # all guesses right: all of them


def test_auto_drafts_as_far_as_its_guesses_usually_run():
    # checks of eight guesses whose first five were right and the sixth wrong: pooled, 83% of guesses are right,
    # which prices a long draft as a gamble at every place; by place, the first five are near certain
    spec = Speculator("auto", cost=trained_cost(lambda rows: 10 + 4 * rows))
    seq = Sequence("s", list(REPEATS), SamplingParams())
    history(seq, spec, 8, 5, checks=6)
    alphas = seq.draft_state.acceptances(8)
    assert min(alphas[:5]) > 0.9 and alphas[5] < 0.25
    assert seq.draft_state.acceptance == pytest.approx(31 / 38)
    assert spec.propose(seq, 8, rows=1, decodes=1) == list(range(3, 8))
    times = spec.cost.times(1, 8)
    assert best_draft([seq.draft_state.acceptance] * 8, 1, times)[0] < 5  # what the pooled figure advised


def test_auto_tries_a_short_draft_now_and_then():
    """Where the estimates advise against drafting, "auto" still tries a short draft, one a step at most: every
    other step while the cost of a row or a sequence's acceptance is unknown, else every EXPLORE_EVERY steps."""
    spec = Speculator("auto")
    seqs = [Sequence(f"s{i}", list(REPEATS), SamplingParams()) for i in range(3)]

    def step(rows: int) -> list[int]:
        drafts = [len(spec.propose(seq, 8, rows=3, decodes=3)) for seq in seqs]
        spec.observe(rows + sum(drafts), 10 + 5 * (rows + sum(drafts)))
        return drafts

    drafts = []
    while spec.cost.times(3, 8) is None:
        drafts.append(step(3))
        assert len(drafts) < 4 * MIN_SAMPLES
    assert all(d == [EXPLORE_DRAFT, 0, 0] for d in drafts[2::2]) and not any(map(any, drafts[1::2]))
    assert not any(drafts[0])  # not before a step was timed
    for seq in seqs:
        history(seq, spec, 5, 0)
    drafts = [step(3) for _ in range(3 * EXPLORE_EVERY)]
    tries = [i for i, d in enumerate(drafts) if any(d)]
    assert len(tries) == 3 and all(sorted(drafts[i]) == [0, 0, EXPLORE_DRAFT] for i in tries)
    assert np.diff(tries).tolist() == [EXPLORE_EVERY, EXPLORE_EVERY]
    # acceptance is learned from the checks, the first rejected guess a miss and those after it not judged
    seq = Sequence("t", [1], SamplingParams())
    spec.record(seq, 4, 2)
    assert seq.draft_state.acceptance == pytest.approx(3 / 5)
    spec.propose(seq, 8, rows=3, decodes=3)  # nothing to look up: the record stays
    assert seq.draft_state.acceptance == pytest.approx(3 / 5)
    seq.token_ids = list(REPEATS)
    spec.propose(seq, 8, rows=3, decodes=3)  # the record fades
    assert seq.draft_state.acceptance == pytest.approx((2 * DECAY + 1) / (3 * DECAY + 2))
    assert (seq.draft_state.drafted, seq.draft_state.accepted, seq.draft_state.checks) == (4, 2, 1)


def test_auto_stops_drafting_in_batches_where_steps_with_drafts_gave_fewer_tokens_a_second():
    """The judge compares whole steps at each batch size: where steps with drafts gave fewer tokens a second than
    steps without, "auto" drafts in one step of JUDGE_EVERY_KNOWN only, however much its estimates promise; where
    they gave more, it drafts in all but one of JUDGE_EVERY_KNOWN; before both are measured, one step in JUDGE_EVERY
    goes without drafts so that they are."""
    spec = Speculator("auto", cost=trained_cost(lambda rows: 10 + 0.01 * rows))  # rows look free
    seq = Sequence("s", list(REPEATS), SamplingParams())
    history(seq, spec, 8, 8)

    def steps(decodes: int, n: int, seconds_with: float) -> list[bool]:
        """n steps of `decodes` sequences, seq's draft (if any) checked in each; whether each drafted."""
        drafted = []
        for _ in range(n):
            draft = spec.propose(seq, 8, rows=decodes, decodes=decodes)
            items = [ScheduledSeq(seq, 1 + len(draft), draft=draft)] + [
                ScheduledSeq(Sequence(f"o{i}", [1, 2], SamplingParams()), 1) for i in range(decodes - 1)]
            for item in items:  # each decodes its last token (and the draft after it)
                item.seq.num_computed_tokens = item.seq.num_tokens - 1
            spec.step_done(items, decodes + len(draft), seconds_with if draft else 1.0)
            drafted.append(bool(draft))
        return drafted

    unknown = steps(16, 2 * JUDGE_EVERY, seconds_with=2.0)  # 16 + 8 tokens in 2 s: fewer a second than 16 in 1 s
    assert unknown == [i % JUDGE_EVERY != JUDGE_EVERY - 1 for i in range(2 * JUDGE_EVERY)]
    assert spec.judge.pays(16) is None  # two steps without drafts: not yet enough to judge
    steps(16, JUDGE_EVERY * JUDGE_MIN, seconds_with=2.0)
    assert spec.judge.pays(16) is False
    losing = steps(16, 4 * JUDGE_EVERY_KNOWN, seconds_with=2.0)
    assert sum(losing) == 4 and all(losing[i] for i in range(len(losing)) if (len(unknown) + JUDGE_EVERY * JUDGE_MIN + i)
                                    % JUDGE_EVERY_KNOWN == JUDGE_EVERY_KNOWN - 1)
    assert spec.judge.pays(2) is None and spec.propose(seq, 8, rows=2, decodes=2)  # another batch size: its own verdict
    steps(2, 4 * JUDGE_EVERY * JUDGE_MIN, seconds_with=1.05)  # 2 + 8 tokens in 1.05 s against 2 in 1 s
    assert spec.judge.pays(2) is True
    paying = steps(2, 2 * JUDGE_EVERY_KNOWN, seconds_with=1.05)
    assert sum(paying) == 2 * JUDGE_EVERY_KNOWN - 2
    ngram = Speculator("ngram")
    ngram.judge = spec.judge  # prompt lookup as asked drafts whatever the judge says
    assert ngram.propose(seq, 8, rows=16, decodes=16) == list(range(3, 11))


def test_a_check_against_a_no_that_gains_is_followed_by_another():
    """An answer's opening, before it copies its input, teaches the judge that drafts lose; once the text repeats, the
    one check in JUDGE_EVERY_KNOWN that goes against that verdict gains, and so the next step drafts too, and the next,
    until one loses."""
    judge = Speculator("auto").judge
    for _ in range(JUDGE_MIN):
        judge.record(1, False, 1, 1.0)
        judge.record(1, True, 1, 1.2)  # a guess missed: a slower step, no more tokens
    assert judge.pays(1) is False
    vetoed = 0
    while not judge.allows(1):
        judge.record(1, False, 1, 1.0)
        vetoed += 1
    assert 0 < vetoed < JUDGE_EVERY_KNOWN
    judge.record(1, True, 5, 1.1)  # the check gains: four guesses right
    assert judge.pays(1) is False and judge.allows(1)
    judge.record(1, True, 9, 1.1)
    assert judge.allows(1)  # and so on while the checks gain
    judge.record(1, True, 1, 1.1)  # this one lost
    assert not judge.allows(1)



def test_the_judge_weighs_its_window_of_recent_steps_only():
    """The judge's verdict at a batch size comes from its last JUDGE_WINDOW steps: the medians of those with drafts
    and without, as sorting the window's rates would give, whatever older steps said."""
    judge = Speculator("auto").judge
    rng = np.random.default_rng(0)
    steps = [(bool(rng.random() < 0.4), float(rng.uniform(1, 3))) for _ in range(3 * JUDGE_WINDOW)]
    for i, (drafted, rate) in enumerate(steps):
        judge.record(4, drafted, round(100 * rate), 100.0)
        window = [(d, round(100 * r) / 100.0) for d, r in steps[max(0, i + 1 - JUDGE_WINDOW) : i + 1]]
        without = [r for d, r in window if not d]
        with_drafts = [r for d, r in window if d]
        if min(len(without), len(with_drafts)) >= JUDGE_MIN:
            want = statistics.median(with_drafts) > (1 + JUDGE_MARGIN) * statistics.median(without)
            assert judge.pays(4) is want, i
    for _ in range(JUDGE_WINDOW):  # a window of steps where drafts gained pushes every older step out
        judge.record(4, True, 300, 100.0)
        judge.record(4, False, 100, 100.0)
    assert judge.pays(4) is True

def test_a_step_of_tries_alone_is_not_judged():
    """A try (a short draft "auto" makes to learn what rows cost, before it can estimate) says nothing of whether the
    drafts it chooses pay: a step whose only drafts are tries is left out of the judge's comparison, where the misses
    of an answer's opening used to turn it against drafting for the copied rest."""
    spec = Speculator("auto")  # no step timed yet: no estimate, so a draft is a try every other step
    seq = Sequence("s", list(REPEATS), SamplingParams())

    def step() -> list[int]:
        draft = spec.propose(seq, 8, rows=1, decodes=1)
        seconds = 0.02 if draft else 0.01  # each try misses: a slower step, no more tokens
        spec.observe(1 + len(draft), seconds)
        item = ScheduledSeq(seq, 1 + len(draft), draft=draft)
        seq.num_computed_tokens = seq.num_tokens - 1
        spec.step_done([item], 1, seconds)
        return draft

    drafts = [step() for _ in range(2 * JUDGE_MIN + 4)]
    assert [len(d) for d in drafts[:4]] == [0, 0, EXPLORE_DRAFT, 0]  # a try once two steps went by, and so on
    assert sum(map(bool, drafts)) > JUDGE_MIN
    assert spec.judge.pays(1) is None  # as many steps with drafts as it takes to judge, but all of them tries


def test_which_requests_speculate():
    spec = Speculator("off")
    assert spec.mode_for(Sequence("a", [1], SamplingParams())) == "off"
    assert spec.mode_for(Sequence("b", [1], SamplingParams(speculative="ngram"))) == "ngram"
    on = Speculator("auto")
    assert on.mode_for(Sequence("c", [1], SamplingParams(speculative="off"))) == "off"
    assert on.mode_for(Sequence("d", [1], SamplingParams(logprobs=2))) == "auto"
    assert on.mode_for(Sequence("e", [1], SamplingParams(regex="[ab]+"))) == "auto"
    with pytest.raises(InvalidParamsError):
        SamplingParams(speculative="always")
    with pytest.raises(EdgeserveError):
        Speculator("draft")


def test_auto_leaves_seeded_sampled_requests_alone():
    """A seeded sampled request draws once per guess checked (sampler.check_guess), and "auto" guesses by the machine's
    timing: it leaves such requests alone, so a seed gives the same answer on every run. Greedy seeded requests, and
    sampled ones without a seed, still speculate; "ngram" asked for guesses for every request."""
    spec = Speculator("auto", cost=trained_cost(lambda rows: 10 + 0.01 * rows))  # rows look free
    for params, drafts in ((SamplingParams(temperature=0.8), True), (SamplingParams(temperature=0.8, seed=3), False),
                           (SamplingParams(temperature=0.0, seed=3), True)):
        seq = Sequence("s", list(REPEATS), params)
        history(seq, spec, 8, 8)
        assert bool(spec.propose(seq, 8, rows=1, decodes=1)) is drafts, params
    seeded = Sequence("n", list(REPEATS), SamplingParams(temperature=0.8, seed=3))
    assert Speculator("ngram").propose(seeded, 8, rows=1, decodes=1) == list(range(3, 11))


# inside the engine, on the tiny model -------------------------------------------------------------------------

def test_auto_is_the_default_on_the_cpu_and_off_on_mlx(tiny_model):
    """Without a mode asked for, the NumPy backend's engine speculates as "auto" (measured never slower there); MLX's
    does not (a step with guesses is neither launched ahead nor chained into a burst), unless a draft model is given;
    a mode asked for is kept."""
    def mode(**config) -> str:
        return LLMEngine(tiny_model, EngineConfig(kv_memory="16MiB", **config)).speculator.mode

    assert mode(backend="numpy") == "auto"
    assert mode(backend="numpy", speculative="off") == "off"
    pytest.importorskip("mlx.core", reason="MLX is not installed (pip install 'edgeserve[mlx]')")
    assert mode(backend="mlx") == "off"
    assert mode(backend="mlx", speculative="ngram") == "ngram"
    assert LLMEngine(tiny_model, EngineConfig(backend="mlx", kv_memory="16MiB"), draft=tiny_model).speculator.mode == "auto"


def test_greedy_is_unchanged_in_a_batch_and_guesses_are_accepted(tiny_model):
    prompts = repetitive_prompts(tiny_model.tokenizer, 6)
    requests = {f"r{i}": (p, GREEDY) for i, p in enumerate(prompts)}
    off = run(make_engine(tiny_model, "off"), requests)
    for mode in ("ngram", "auto"):
        engine = make_engine(tiny_model, mode, max_num_batched_tokens=64)  # drafts compete for the budget
        assert run(engine, requests) == off
        st = engine.stats()
        assert st.accepted_draft_tokens > 0 and st.draft_tokens > st.accepted_draft_tokens  # some right, some not
    alone = run(make_engine(tiny_model, "ngram"), {"r0": requests["r0"]})
    assert alone["r0"] == off["r0"]


def test_stop_strings_max_tokens_and_penalties_land_as_without_speculation(tiny_model):
    prompts = repetitive_prompts(tiny_model.tokenizer, 3)
    plain = run(make_engine(tiny_model, "off"), {"g": (prompts[0], GREEDY)})["g"][1]
    stop = plain[20:23]
    requests = {
        "stop": (prompts[0], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop=[stop])),
        "short": (prompts[1], SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True)),
        "penalty": (prompts[2], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True,
                                               repetition_penalty=1.3)),
    }
    off = run(make_engine(tiny_model, "off"), requests)
    engine = make_engine(tiny_model, "ngram")
    assert run(engine, requests) == off
    assert engine.stats().accepted_draft_tokens > 0
    assert off["stop"][2] == "stop" and off["stop"][1] == plain[: plain.index(stop)]
    assert len(off["short"][0]) == 7 and off["short"][2] == "length"


def test_preemption_and_aborts_leave_no_blocks_behind(tiny_model):
    prompts = repetitive_prompts(tiny_model.tokenizer, 4)
    requests = {f"r{i}": (p, GREEDY) for i, p in enumerate(prompts)}
    pool = 10 * 16 * 512  # 10 blocks of 16 tokens at 512 bytes a token: too few for all four at once
    off = run(make_engine(tiny_model, "off", kv_memory=pool, enable_prefix_caching=False), requests)
    engine = make_engine(tiny_model, "ngram", kv_memory=pool, enable_prefix_caching=False)
    assert run(engine, requests) == off
    assert engine.stats().preemptions > 0 and engine.stats().accepted_draft_tokens > 0
    aborted = run(make_engine(tiny_model, "ngram"), requests, abort="r2")
    assert aborted["r2"][2] == "abort"
    assert {k: v for k, v in aborted.items() if k != "r2"} == {k: v for k, v in off.items() if k != "r2"}


@pytest.mark.parametrize("guess", [0, 2, 4])
def test_checking_a_guess_keeps_the_sampling_distribution(guess):
    """Accepting a guess with its probability, else drawing from the rest, gives each token its probability
    (a chi-square goodness of fit over many draws), whichever token was guessed."""
    logits = np.log(np.array([0.4, 0.25, 0.15, 0.1, 0.07, 0.03], dtype=np.float32))
    seq = Sequence("s", [1], SamplingParams(temperature=1.0, top_k=5, seed=3))
    p = np.array([0.4, 0.25, 0.15, 0.1, 0.07, 0.0]) / 0.97  # top_k=5 drops the last
    draws = np.bincount([check_guess(logits, seq, guess) for _ in range(20000)], minlength=6)
    assert draws[5] == 0
    assert chisquare(draws[:5], 20000 * p[:5]).pvalue > 0.001
    greedy = Sequence("g", [1], SamplingParams(temperature=0.0))
    assert check_guess(logits, greedy, 0) == 0 and check_guess(logits, greedy, 2) == 0


def test_sampled_tokens_are_distributed_as_without_speculation(tiny_model):
    """The 2nd to 6th tokens of many seeded requests (rows where guesses are checked): a chi-square test of
    speculation on against off finds no difference."""
    prompt = repetitive_prompts(tiny_model.tokenizer, 3)[2]
    n = 600

    def tokens(mode: str) -> tuple[np.ndarray, LLMEngine]:
        engine = make_engine(tiny_model, mode, max_num_seqs=n, max_num_batched_tokens=8192)
        requests = {f"s{i}": (prompt, SamplingParams(max_tokens=6, temperature=0.3, ignore_eos=True, seed=i))
                    for i in range(n)}
        got = run(engine, requests)
        return np.array([got[f"s{i}"][0][1:] for i in range(n)]), engine

    off, _ = tokens("off")
    on, engine = tokens("ngram")
    assert engine.stats().accepted_draft_tokens > 60
    for pos in range(off.shape[1]):
        ids = np.union1d(off[:, pos], on[:, pos])
        table = np.array([[np.sum(col == t) for t in ids] for col in (off[:, pos], on[:, pos])])
        table = table[:, table.sum(axis=0) >= 5]  # chi-square needs expected counts that are not tiny
        assert chi2_contingency(table).pvalue > 0.001, f"position {pos + 1}"


# the real model ------------------------------------------------------------------------------------------------

COPY_TEXT = ("def area(width, height):\n    \"\"\"The area of a rectangle.\"\"\"\n    return width * height\n\n\n"
             "def perimeter(width, height):\n    return 2 * (width + height)\n")


def test_greedy_is_unchanged_on_the_real_model(loaded_model):
    cases = json.loads((FIXTURES / "smollm2_transformers_reference.json").read_text())["cases"]
    off_engine = make_engine(loaded_model, "off")
    copy = Prompts.for_engine(off_engine).chat([{"role": "user", "content": (
        f"Repeat this code exactly, renaming `height` to `depth`:\n\n{COPY_TEXT}")}])
    requests = {f"case{i}": (c["prompt_ids"], GREEDY) for i, c in enumerate(cases)}
    requests["copy"] = (copy, SamplingParams(max_tokens=80, temperature=0.0))
    off = {rid: run(off_engine, {rid: r})[rid] for rid, r in requests.items()}
    alone = make_engine(loaded_model, "auto")
    # as on a GPU, whatever this CPU's steps take (each row count's median would soon be this CPU's)
    alone.speculator.cost = trained_cost(lambda rows: 0.01 + 1e-6 * rows)
    alone.speculator.cost.observe = lambda rows, seconds: None
    alone.speculator.step_done = lambda scheduled, tokens, seconds: None  # nor what its steps gave
    assert run(alone, {"copy": requests["copy"]})["copy"] == off["copy"]
    assert alone.stats().accepted_draft_tokens > 10
    batched = make_engine(loaded_model, "ngram")
    assert run(batched, requests) == off
    assert batched.stats().accepted_draft_tokens > 10


BOOK = {"title": "The History of the Printing Press in Europe", "authors": ["Elizabeth Eisenstein", "Lucien Febvre"],
        "year": 1979, "pages": 794}
BOOK_SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 24}, "authors": {"type": "array", "items": {"type": "string", "maxLength": 40},
                                                              "maxItems": 4},
    "year": {"type": "integer"}, "pages": {"type": "integer"}},
    "required": ["title", "authors", "year", "pages"], "additionalProperties": False}


def test_constrained_and_logprobs_requests_speculate_and_answer_as_without(loaded_model):
    """A grammar masks each row of a draft's check as it stands after the guesses accepted before it, and each
    accepted token gets its logprobs: greedy tokens, text and logprobs are those of one token a step."""
    off_engine = make_engine(loaded_model, "off")
    chat = Prompts.for_engine(off_engine).chat
    requests = {
        "json": (chat([{"role": "user", "content": f"Repeat this JSON exactly:\n\n{json.dumps(BOOK)}"}]),
                 SamplingParams(max_tokens=120, temperature=0.0, json_schema=BOOK_SCHEMA)),
        "logprobs": (chat([{"role": "user", "content": f"Repeat this code exactly:\n\n{COPY_TEXT}"}]),
                     SamplingParams(max_tokens=60, temperature=0.0, logprobs=3)),
    }

    def answers(engine: LLMEngine) -> dict:
        for rid, (ids, params) in requests.items():
            engine.add_request(ids, params, rid)
        done = engine.run_to_completion()
        assert_no_leaks(engine)
        return {rid: (c.token_ids, c.text, c.finish_reason, c.logprobs) for rid, c in done.items()}

    off = answers(off_engine)
    on_engine = make_engine(loaded_model, "ngram")
    on = answers(on_engine)
    assert on == off
    # the grammar holds the title to 24 characters where the guesses copy all of it
    jsonschema.validate(json.loads(on["json"][1]), BOOK_SCHEMA)
    assert len(on["logprobs"][3]) == len(on["logprobs"][0]) and len(on["logprobs"][3][0]["top"]) == 3
    assert on_engine.stats().accepted_draft_tokens > 40


def test_the_speculative_benchmark_gives_each_task_the_same_answer_in_every_mode(tiny_model):
    from edgeserve.bench.workloads import SPECULATIVE_TASKS, run_speculative

    rows = run_speculative(lambda mode: make_engine(tiny_model, mode), max_tokens=24, repeats=1)
    assert [r["name"] for r in rows] == list(SPECULATIVE_TASKS) and "json_copy" in SPECULATIVE_TASKS
    for row in rows:
        assert row["same_answer"] and row["output_tokens"] > 1
        assert row["off_decode_tokens_per_s"] > 0 and row["ngram_over_off"] > 0


def test_each_request_of_a_speculative_batch_copies_its_own_input():
    """A batch's requests each get their own version of their task's text (or a table of earlier answers would
    guess the repeats whole), and the first is the text as written (the one-stream figures' prompt)."""
    from edgeserve.bench.workloads import SPECULATIVE_TASKS, task_variant

    for text, _ in SPECULATIVE_TASKS.values():
        assert task_variant(text, 0) == text
        assert len({task_variant(text, i) for i in range(64)}) == 64


def test_the_speculative_benchmark_queues_each_mix_and_answers_alike_in_every_mode(tiny_model):
    from edgeserve.bench.workloads import SPECULATIVE_MIXES, run_speculative_batch

    made = []

    def engine(mode: str) -> LLMEngine:
        made.append(mode)
        return make_engine(tiny_model, mode, max_num_seqs=2)

    rows = run_speculative_batch(engine, streams=2, rounds=2, max_tokens=16, repeats=2)
    assert made == ["off", "auto", "ngram"] * 2 * len(SPECULATIVE_MIXES)  # the modes take turns
    assert [r["name"] for r in rows] == [f"{mix}, 2 streams" for mix in SPECULATIVE_MIXES]
    assert "open_chat" not in SPECULATIVE_MIXES["input-grounded"] and "open_chat" in SPECULATIVE_MIXES["mixed"]
    for row in rows:
        assert row["same_answers"] and row["output_tokens"] > 4
        assert row["off_output_tokens_per_s"] > 0 and row["auto_over_off"] > 0 and row["ngram_over_off"] > 0
