"""Speculative decoding with a draft model: its guesses checked in the batched step, its own KV pool following
each sequence, speculative sampling's acceptance rule, and `--draft-model` on the command line.

Drafts here come from models that share the target's tokenizer: the target itself (every guess right), the
real model cut to its first layers (an honest, weaker draft), and the tiny model with its head moved (its
distribution near the target's but not it, so guesses are both accepted and rejected).
"""

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from scipy.stats import chi2_contingency, chisquare
from test_speculative import GREEDY, make_engine, repetitive_prompts, run, trained_cost

from edgeserve.cli.main import cli
from edgeserve.config import EngineConfig
from edgeserve.engine import cost_memory
from edgeserve.engine.block_manager import blocks_for
from edgeserve.engine.llm_engine import LLMEngine
from edgeserve.engine.prompts import Prompts
from edgeserve.engine.sampler import check_guess
from edgeserve.engine.sequence import Sequence
from edgeserve.engine.speculative import EXPLORE_EVERY, MAX_DRAFT, PENDING, Speculator
from edgeserve.errors import EdgeserveError
from edgeserve.models.loader import LoadedModel
from edgeserve.sampling_params import InvalidParamsError, SamplingParams
from edgeserve.text.tokenizer import Tokenizer

FIXTURES = Path(__file__).parent / "fixtures"


def first_layers(model: LoadedModel, n: int) -> LoadedModel:
    """model cut to its first n layers: the same tokenizer and head, a cheaper and worse guesser."""
    weights = {k: w for k, w in model.weights.items()
               if ".layers." not in k or int(k.split(".layers.")[1].split(".")[0]) < n}
    return dataclasses.replace(model, args=dataclasses.replace(model.args, num_hidden_layers=n), weights=weights)


def nearby(model: LoadedModel, sharpen: float = 1.0, noise: float = 0.0) -> LoadedModel:
    """model with its head's logits scaled by sharpen (its distribution sharpened, its likeliest token kept) and
    its head's weights moved by seeded noise (its likeliest token sometimes another)."""
    head = model.weights["lm_head.weight"]
    moved = head + noise * np.random.default_rng(0).standard_normal(head.shape).astype(head.dtype) * head.std()
    return dataclasses.replace(model, weights={**model.weights, "lm_head.weight": sharpen * moved})


def draft_engine(model: LoadedModel, draft: LoadedModel, mode: str = "draft", **kw) -> LLMEngine:
    return LLMEngine(model, EngineConfig(backend="numpy", speculative=mode, **{"kv_memory": "64MiB", **kw}), draft)


def check_draft_pool(engine: LLMEngine) -> None:
    """The draft's pool: a shadow only for a running sequence, holding blocks for its tokens and one draft at most."""
    running = {seq.request_id: seq for seq in engine.scheduler.running}
    bs = engine.drafter.block_manager.block_size
    for rid, shadow in engine.drafter.shadows.items():
        assert rid in running
        assert len(shadow.block_table) <= blocks_for(running[rid].num_tokens + MAX_DRAFT, bs)
        assert shadow.num_computed_tokens <= running[rid].num_tokens


def run_drafting(engine: LLMEngine, requests: dict, abort: str | None = None) -> dict:
    """run(), the draft's pool checked after every step too, and empty at the end."""
    original = engine.step

    def step():
        outputs = original()
        check_draft_pool(engine)
        return outputs

    engine.step = step
    got = run(engine, requests, abort)
    usage = engine.drafter.block_manager.usage()
    assert usage.used == 0 and engine.drafter.shadows == {}
    return got


# the acceptance rule ------------------------------------------------------------------------------------------

def test_speculative_sampling_keeps_the_target_distribution():
    """Guesses drawn from a draft distribution q, checked by accepting with min(1, p/q) and else drawing from
    max(0, p - q): the tokens follow p (chi-square), though q alone is far from p (the same test rejects it)."""
    p = np.array([0.35, 0.25, 0.15, 0.1, 0.08, 0.05, 0.02])
    q = np.array([0.05, 0.4, 0.05, 0.3, 0.02, 0.08, 0.1])
    logits = np.log(p).astype(np.float32)
    seq = Sequence("s", [1], SamplingParams(temperature=1.0, seed=7))
    rng = np.random.default_rng(11)
    n = 30000
    guesses = rng.choice(len(q), size=n, p=q)
    tokens = [check_guess(logits, seq, int(g), q) for g in guesses]
    counts = np.bincount(tokens, minlength=len(p))
    assert chisquare(counts, n * p).pvalue > 0.001
    assert chisquare(np.bincount(guesses, minlength=len(p)), n * p).pvalue < 1e-9  # the test has the power
    assert 0.3 < np.mean(np.array(tokens) == guesses) < 0.9  # both accepted and replaced guesses were seen
    greedy = Sequence("g", [1], SamplingParams(temperature=0.0))
    assert check_guess(logits, greedy, 0, q) == 0 and check_guess(logits, greedy, 1, q) == 0


def test_sampled_requests_are_distributed_as_without_speculation(tiny_model):
    """The 2nd to 6th tokens of many seeded requests with the draft model on against off: a chi-square test finds
    no difference, with guesses both accepted and rejected."""
    prompt = repetitive_prompts(tiny_model.tokenizer, 3)[2]
    n = 600

    def tokens(engine: LLMEngine) -> np.ndarray:
        requests = {f"s{i}": (prompt, SamplingParams(max_tokens=6, temperature=0.8, ignore_eos=True, seed=i))
                    for i in range(n)}
        got = run(engine, requests)
        return np.array([got[f"s{i}"][0][1:] for i in range(n)])

    big = {"max_num_seqs": n, "max_num_batched_tokens": 8192}
    off = tokens(make_engine(tiny_model, "off", **big))
    engine = draft_engine(tiny_model, nearby(tiny_model, sharpen=1.6), **big)
    on = tokens(engine)
    st = engine.stats()
    assert 0.2 * st.draft_tokens < st.accepted_draft_tokens < 0.95 * st.draft_tokens
    for pos in range(off.shape[1]):
        ids = np.union1d(off[:, pos], on[:, pos])
        table = np.array([[np.sum(col == t) for t in ids] for col in (off[:, pos], on[:, pos])])
        table = table[:, table.sum(axis=0) >= 5]  # chi-square needs expected counts that are not tiny
        assert chi2_contingency(table).pvalue > 0.001, f"position {pos + 1}"


class TimedDraft:
    """A stand-in draft model: its room always there, its guesses taking the given seconds each."""

    def __init__(self, seconds_per_guess: float | None):
        self.seconds_per_guess = seconds_per_guess

    def reserve(self, seq: Sequence, k: int) -> bool:
        return True


def test_auto_drafts_with_the_model_only_where_its_guesses_pay_for_their_time():
    def propose(per_guess: float | None, accepted: int, tokens: list[int], lookup_accepted: int = 0) -> list[int]:
        spec = Speculator("auto", cost=trained_cost(lambda rows: 0.010 + 0.0001 * rows), drafter=TimedDraft(per_guess))
        seq = Sequence("s", tokens, SamplingParams())
        for _ in range(10):
            spec.record(seq, 4, accepted, by_model=True)
            spec.record(seq, 4, lookup_accepted)
        return spec.propose(seq, 8, rows=1, decodes=1)

    text = list(range(40))  # nothing repeats: prompt lookup finds no draft
    assert propose(0.001, 4, text) == [PENDING] * 8  # cheap guesses, all right: a full draft
    assert propose(0.020, 4, text) == []  # each guess costs two steps: none pays
    assert propose(0.002, 0, text) == []  # cheap but wrong
    # the draft model's record fades at its checks, not at the steps between them
    spec = Speculator("auto", cost=trained_cost(lambda rows: 0.010 + 0.0001 * rows), drafter=TimedDraft(0.020))
    seq = Sequence("s", text, SamplingParams())
    spec.record(seq, 4, 3, by_model=True)
    before = seq.model_draft_state.acceptance
    assert [spec.propose(seq, 8, rows=1, decodes=1) for _ in range(20)] == [[]] * 20
    assert seq.model_draft_state.acceptance == before
    assert propose(None, 4, text) == []  # not yet timed: only an exploring try drafts
    # a try now and then, as for prompt lookup; far more rarely where even all guesses right would not pay
    for per_guess, tries in ((0.003, 1), (0.020, 0)):
        spec = Speculator("auto", cost=trained_cost(lambda rows: 0.010 + 0.0001 * rows), drafter=TimedDraft(per_guess))
        seq = Sequence("s", text, SamplingParams())
        for _ in range(10):
            spec.record(seq, 4, 0, by_model=True)
        drafts = []
        for _ in range(EXPLORE_EVERY):
            spec.record(seq, 4, 0, by_model=True)  # every guess wrong, on and on
            spec.observe(1, 0.0101)
            drafts.append(spec.propose(seq, 8, rows=1, decodes=1))
        assert sum(map(bool, drafts)) == tries
    # where the text repeats, the drafter whose draft promises more tokens a second: prompt lookup's guesses, as
    # right as the model's, cost nothing to make; where they are mostly wrong, the model's
    repeats = list(range(20)) * 2 + [0, 1, 2]
    assert propose(0.001, 4, repeats, lookup_accepted=4)[0] == 3
    assert propose(0.001, 4, repeats, lookup_accepted=0) == [PENDING] * 8


# the engine on the tiny model ---------------------------------------------------------------------------------

def test_greedy_is_unchanged_and_the_draft_pool_follows(tiny_model):
    prompts = repetitive_prompts(tiny_model.tokenizer, 6)
    requests = {f"r{i}": (p, GREEDY) for i, p in enumerate(prompts)}
    off = run(make_engine(tiny_model, "off"), requests)
    draft = nearby(tiny_model, noise=0.5)
    for mode in ("draft", "auto"):
        engine = draft_engine(tiny_model, draft, mode, max_num_batched_tokens=64)
        assert run_drafting(engine, requests) == off
        if mode == "draft":
            st = engine.stats()
            assert 0 < st.accepted_draft_tokens < st.draft_tokens


def test_the_next_engine_starts_from_the_step_times_and_guess_time_this_one_measured(tiny_model):
    """A fresh engine's "auto" must time steps before it can judge a draft; with remember_step_costs the engine
    saves what it measured when it closes, and the next one of the same model, draft model and backend starts
    from it (an engine not asked to remember, or finding a damaged file, starts from nothing)."""
    draft = nearby(tiny_model, noise=0.5)
    first = draft_engine(tiny_model, draft, "draft", remember_step_costs=True)
    saved = cost_memory.cost_dir() / f"{first._cost_key}.json"
    saved.unlink(missing_ok=True)
    assert first.speculator.cost.times(1, 2) is None and first.drafter.seconds_per_guess is None
    requests = {f"r{i}": (p, GREEDY) for i, p in enumerate(repetitive_prompts(tiny_model.tokenizer, 3))}
    run_drafting(first, requests)
    learned = first.speculator.cost.medians()
    guess = first.drafter.seconds_per_guess
    assert learned and guess > 0
    first.close()
    assert saved.exists()
    second = draft_engine(tiny_model, draft, "auto", remember_step_costs=True)
    assert second.speculator.cost.samples() == first.speculator.cost.samples()
    assert second.drafter.seconds_per_guess == guess
    assert all(second.speculator.cost.times(n, 0) == [t] for n, t in learned.items())  # before its first step
    plain = draft_engine(tiny_model, draft, "auto")
    assert plain.speculator.cost.samples() == [] and plain.drafter.seconds_per_guess is None
    saved.write_text("{not json")
    damaged = draft_engine(tiny_model, draft, "auto", remember_step_costs=True)
    assert damaged.speculator.cost.samples() == [] and damaged.drafter.seconds_per_guess is None
    for engine in (second, plain, damaged):
        engine.close()


def test_mlx_greedy_is_unchanged_by_prompt_lookup_and_a_draft_model(tiny_model, mlx_on_cpu):
    """The MLX backend checks drafts in its batched step too: six streams at once, greedy, the same tokens with
    prompt lookup, a draft model and auto as without speculation, guesses both accepted and rejected."""
    prompts = repetitive_prompts(tiny_model.tokenizer, 6)
    requests = {f"r{i}": (p, GREEDY) for i, p in enumerate(prompts)}

    def engine(mode: str, draft: LoadedModel | None = None) -> LLMEngine:
        config = EngineConfig(backend="mlx", speculative=mode, kv_memory="64MiB", max_num_batched_tokens=64)
        return LLMEngine(tiny_model, config, draft)

    off = run(engine("off"), requests)
    lookup = engine("ngram")
    assert run(lookup, requests) == off
    assert 0 < lookup.stats().accepted_draft_tokens < lookup.stats().draft_tokens
    for mode in ("draft", "auto"):
        drafting = engine(mode, nearby(tiny_model, noise=0.5))
        assert run_drafting(drafting, requests) == off
        assert 0 < drafting.stats().accepted_draft_tokens < drafting.stats().draft_tokens


def test_preemption_aborts_and_a_full_draft_pool_leave_no_blocks_behind(tiny_model):
    prompts = repetitive_prompts(tiny_model.tokenizer, 4)
    requests = {f"r{i}": (p, GREEDY) for i, p in enumerate(prompts)}
    pool = 10 * 16 * 512  # 10 blocks of 16 tokens at 512 bytes a token: too few for all four at once
    off = run(make_engine(tiny_model, "off", kv_memory=pool, enable_prefix_caching=False), requests)
    # a one-layer draft: its pool (a quarter of the target's memory) holds 5 blocks, a sequence or two at a time,
    # so the others decode without drafts until they leave
    draft = first_layers(nearby(tiny_model, noise=0.5), 1)
    engine = draft_engine(tiny_model, draft, kv_memory=pool, enable_prefix_caching=False)
    assert run_drafting(engine, requests) == off
    assert engine.stats().preemptions > 0 and engine.stats().accepted_draft_tokens > 0
    assert engine.drafter.block_manager.num_blocks == 5
    aborted = run_drafting(draft_engine(tiny_model, nearby(tiny_model, noise=0.5)), requests, abort="r2")
    assert aborted["r2"][2] == "abort"
    assert {k: v for k, v in aborted.items() if k != "r2"} == {k: v for k, v in off.items() if k != "r2"}


def test_draft_mode_needs_a_draft_model_with_the_same_vocabulary(tiny_model, spm_model):
    with pytest.raises(EdgeserveError, match="needs a draft model"):
        make_engine(tiny_model, "draft")
    with pytest.raises(EdgeserveError, match="needs a draft model"):
        make_engine(tiny_model, "auto").add_request([5, 6], SamplingParams(speculative="draft"))
    # the server's check before a request queues: a 400 naming the parameter, not an error once it runs
    with pytest.raises(InvalidParamsError, match="needs a draft model") as info:
        Prompts.for_engine(make_engine(tiny_model, "auto")).compile_grammar(SamplingParams(speculative="draft"))
    assert info.value.param == "speculative"
    other = dataclasses.replace(tiny_model, tokenizer=Tokenizer.from_dir(spm_model[0]))  # a SentencePiece vocabulary
    with pytest.raises(EdgeserveError, match="another vocabulary"):
        draft_engine(tiny_model, other)


# the real model -----------------------------------------------------------------------------------------------

def fixture_requests(loaded_model) -> dict:
    cases = json.loads((FIXTURES / "smollm2_transformers_reference.json").read_text())["cases"]
    return {f"case{i}": (c["prompt_ids"], GREEDY) for i, c in enumerate(cases)}


@pytest.fixture(scope="module")
def off_answers(loaded_model) -> dict:
    """Each fixture prompt's greedy tokens with speculation off, run alone: what drafting must give."""
    off_engine = make_engine(loaded_model, "off")
    return {rid: run(off_engine, {rid: r})[rid] for rid, r in fixture_requests(loaded_model).items()}


def test_a_draft_equal_to_the_target_accepts_every_guess(loaded_model, off_answers):
    requests = fixture_requests(loaded_model)
    engine = draft_engine(loaded_model, loaded_model)
    assert {rid: run_drafting(engine, {rid: r})[rid] for rid, r in requests.items()} == off_answers
    st = engine.stats()
    assert st.draft_tokens > 100 and st.accepted_draft_tokens == st.draft_tokens


def test_greedy_with_a_weaker_draft_equals_off_alone_and_in_16_streams(loaded_model, off_answers):
    requests = fixture_requests(loaded_model)
    draft = first_layers(loaded_model, 12)
    alone = draft_engine(loaded_model, draft)
    assert {rid: run_drafting(alone, {rid: r})[rid] for rid, r in requests.items()} == off_answers
    st = alone.stats()
    assert 0 < st.accepted_draft_tokens < st.draft_tokens
    # 16 streams: the fixture prompts again and again, as separate requests drafting in one batch
    many = {f"{rid}-{j}": r for j in range(-(-16 // len(requests))) for rid, r in requests.items()}
    many = dict(list(many.items())[:16])
    batched = draft_engine(loaded_model, draft)
    got = run_drafting(batched, many)
    assert got == {rid: off_answers[rid.rsplit("-", 1)[0]] for rid in many}
    assert batched.stats().draft_checks > 16


# the command line ---------------------------------------------------------------------------------------------

def test_run_with_a_draft_model_and_a_mismatched_one(model_path):
    common = ["run", "--model", str(model_path), "--backend", "numpy", "--kv-memory", "64MiB", "--temp", "0",
              "-n", "12", "--json", "Name three colours."]
    plain = CliRunner().invoke(cli, common)
    shutil.rmtree(cost_memory.cost_dir(), ignore_errors=True)
    drafted = CliRunner().invoke(cli, [*common, "--draft-model", str(model_path), "--speculative", "draft"])
    assert drafted.exit_code == 0, drafted.output
    out = json.loads(drafted.stdout)
    assert out["text"] == json.loads(plain.stdout)["text"]
    assert out["draft_tokens"] > 0 and out["draft_acceptance_rate"] == 1.0
    # what the run measured is kept for the next one
    (saved,) = [json.loads(p.read_text()) for p in cost_memory.cost_dir().glob("*.json")]
    assert saved["steps"] and saved["seconds_per_guess"] > 0
    wrong = CliRunner().invoke(cli, [*common, "--draft-model", "gemma3-270m"])  # Gemma 3's tokenizer
    assert wrong.exit_code == 1 and "another vocabulary" in wrong.stderr and "Traceback" not in wrong.output
    usage = CliRunner().invoke(cli, [*common, "--speculative", "draft"])
    assert usage.exit_code == 2 and "--draft-model" in usage.stderr
