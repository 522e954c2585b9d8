"""Benchmark workloads and their figures: throughput, TTFT, time per output token, KV use.

The same seeded workloads drive the in-process engine and any OpenAI-compatible server.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from tqdm import tqdm

from edgeserve.backends import panel_cache
from edgeserve.engine.llm_engine import LLMEngine
from edgeserve.engine.output import RequestOutput
from edgeserve.sampling_params import SamplingParams
from edgeserve.text.tokenizer import Tokenizer


@dataclass
class BenchRequest:
    prompt_ids: list[int]
    prompt_text: str
    max_tokens: int


@dataclass
class RequestTiming:
    prompt_tokens: int
    output_tokens: int
    ttft: float  # seconds from submission to the first token
    latency: float  # seconds from submission to the last token

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first."""
        return (self.latency - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


@dataclass
class BenchResult:
    name: str
    timings: list[RequestTiming]
    wall: float
    extra: dict = field(default_factory=dict)

    def summary(self) -> dict:
        out = sum(t.output_tokens for t in self.timings)
        ttft = np.array([t.ttft for t in self.timings])
        tpot = np.array([t.tpot for t in self.timings if t.tpot is not None] or [0.0])
        return {
            "name": self.name,
            "requests": len(self.timings),
            "output_tokens": out,
            "prompt_tokens": sum(t.prompt_tokens for t in self.timings),
            "wall_s": round(self.wall, 3),
            "output_tokens_per_s": round(out / self.wall, 2) if self.wall else 0.0,
            "ttft_p50_s": round(float(np.percentile(ttft, 50)), 4),
            "ttft_p99_s": round(float(np.percentile(ttft, 99)), 4),
            "tpot_p50_s": round(float(np.percentile(tpot, 50)), 4),
            "tpot_p99_s": round(float(np.percentile(tpot, 99)), 4),
            **self.extra,
        }


def _text_token_ids(tokenizer: Tokenizer) -> np.ndarray:
    """Ids of ordinary word-like tokens, so random prompts decode and re-encode to similar lengths; every
    ordinary id where the vocabulary has no words (a character-level one)."""
    ordinary = [i for i in range(min(tokenizer.vocab_size, 20000)) if not tokenizer.is_special(i)]
    words = [i for i in ordinary if (piece := tokenizer.decode([i])).startswith(" ") and piece[1:].isalpha()]
    return np.asarray(words or ordinary)


def random_prompts(tokenizer: Tokenizer, lengths: list[int], rng: np.random.Generator) -> list[list[int]]:
    pool = _text_token_ids(tokenizer)
    return [rng.choice(pool, size=n).tolist() for n in lengths]


def mixed_workload(tokenizer: Tokenizer, n: int = 64, seed: int = 0, min_prompt: int = 16, max_prompt: int = 512,
                   max_output: int = 512) -> list[BenchRequest]:
    """Workload (a): prompts of 16-512 tokens; heavy-tailed output lengths, most short, a few up to 512."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(min_prompt, max_prompt + 1, size=n).tolist()
    outputs = np.clip(np.round(8 * (1 + rng.pareto(1.2, size=n))), 8, max_output).astype(int).tolist()
    prompts = random_prompts(tokenizer, lengths, rng)
    return [BenchRequest(p, tokenizer.decode(p), o) for p, o in zip(prompts, outputs)]


def uniform_workload(tokenizer: Tokenizer, n: int, prompt_len: int, output_len: int, seed: int = 0) -> list[BenchRequest]:
    rng = np.random.default_rng(seed)
    prompts = random_prompts(tokenizer, [prompt_len] * n, rng)
    return [BenchRequest(p, tokenizer.decode(p), output_len) for p in prompts]


SUFFIX_LEN = 24


def shared_prefix_workload(tokenizer: Tokenizer, n: int = 16, prefix_len: int = 1500, suffix_len: int = SUFFIX_LEN,
                           output_len: int = 16, seed: int = 0) -> list[BenchRequest]:
    """Workload (b): n requests whose prompts share one long system prompt."""
    rng = np.random.default_rng(seed)
    prefix = random_prompts(tokenizer, [prefix_len], rng)[0]
    suffixes = random_prompts(tokenizer, [suffix_len] * n, rng)
    return [BenchRequest(prefix + s, tokenizer.decode(prefix + s), output_len) for s in suffixes]


def pool_mapped(engine: LLMEngine) -> LLMEngine:
    """engine, once its KV pool's pages are mapped in (populate_kv), as llama.cpp clears its cache before it times,
    and its weights are in anonymous memory: no timed step pays for the first touch of a page or reads the weights
    from the file's pages."""
    if engine.populating is not None:
        engine.populating.join()
    for thread in panel_cache.moving():
        thread.join()
    return engine


def run_engine(engine: LLMEngine, requests: list[BenchRequest], name: str, progress: bool = True,
               profile: bool = False) -> BenchResult:
    """Submit every request at once and step the engine until all finish, timing each one; profile: with the
    seconds per step of each phase of the engine's steps (`StepProfile`)."""
    params = [SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True) for r in requests]
    pool_mapped(engine)
    start = time.perf_counter()
    engine.profile.reset()
    ids = [engine.add_request(r.prompt_ids, p) for r, p in zip(requests, params)]
    first: dict[str, float] = {}
    done: dict[str, RequestTiming] = {}
    peak_slots, stored_at_peak, peak_running = 0, 0, 0
    decode_time, decode_tokens = 0.0, 0
    bs = engine.pool_size.block_size
    # counted in output tokens, so a run of one long request moves too; the postfix counts finished requests
    with tqdm(total=sum(r.max_tokens for r in requests), desc=name, unit="tok", disable=not progress,
              leave=False, postfix=f"0/{len(ids)} requests") as bar:
        step_start = time.perf_counter()

        def measure(outputs: list[RequestOutput]) -> None:
            nonlocal step_start, peak_slots, stored_at_peak, peak_running, decode_time, decode_tokens
            now = time.perf_counter()
            stats = engine.stats()
            if outputs and stats.last_batch_tokens == stats.last_batch_seqs:  # one new token each: pure decode
                decode_time += now - step_start
                decode_tokens += sum(len(out.token_ids) for out in outputs)  # a burst's steps, several each
            slots = stats.kv_blocks_used * bs
            if slots > peak_slots:
                peak_slots, peak_running, stored_at_peak = slots, stats.running, stats.kv_tokens_stored
            for out in outputs:
                first.setdefault(out.request_id, now)
                bar.update(len(out.token_ids))
                if out.finished:
                    done[out.request_id] = RequestTiming(out.num_prompt_tokens, out.num_output_tokens,
                                                         first[out.request_id] - start, now - start)
                    bar.set_postfix_str(f"{len(done)}/{len(ids)} requests", refresh=False)
            step_start = time.perf_counter()

        engine.run_to_completion(measure)
    wall = time.perf_counter() - start
    stats = engine.stats()
    contiguous = peak_running * engine.max_model_len
    extra = {
        "decode_tokens_per_s": round(decode_tokens / decode_time, 2) if decode_time else 0.0,
        "peak_kv_slots_allocated": peak_slots,
        "peak_kv_tokens_stored": stored_at_peak,
        "peak_kv_utilization": round(stored_at_peak / peak_slots, 4) if peak_slots else 0.0,
        "contiguous_cache_slots": contiguous,
        "contiguous_cache_utilization": round(stored_at_peak / contiguous, 4) if contiguous else 0.0,
        "preemptions": stats.preemptions,
        "prefix_cache_hit_tokens": stats.prefix_hit_tokens,
    }
    if profile:
        extra.update({f"step_{k}": v for k, v in engine.profile.summary().items() if k != "steps"})
        extra["steps_launched_ahead"] = stats.steps_launched_ahead
    return BenchResult(name, [done[i] for i in ids], wall, extra)


def run_shared_prefix(engine: LLMEngine, requests: list[BenchRequest], progress: bool = True) -> dict:
    """Workload (b): the first request runs cold, the rest arrive one by one and hit the prefix cache."""
    timings = []
    for r in tqdm(requests, desc="shared prefix", unit="req", disable=not progress, leave=False):
        result = run_engine(engine, [r], "one", progress=False)
        timings.append(result.timings[0])
    cold, hits = timings[0].ttft, np.array([t.ttft for t in timings[1:]])
    stats = engine.stats()
    return {
        "name": "shared_prefix",
        "requests": len(requests),
        "prefix_tokens": len(requests[0].prompt_ids) - SUFFIX_LEN,
        "cold_ttft_s": round(cold, 4),
        "hit_ttft_p50_s": round(float(np.percentile(hits, 50)), 4),
        "hit_ttft_p99_s": round(float(np.percentile(hits, 99)), 4),
        "cold_over_hit_ttft": round(cold / float(np.percentile(hits, 50)), 1),
        "prefix_cache_hit_tokens": stats.prefix_hit_tokens,
        "prefix_hit_rate": round(stats.prefix_hit_rate, 4),
    }


_CODE = '''def summarize(orders):
    total = 0
    count = 0
    largest = None
    for order in orders:
        if order.get("status") != "paid":
            continue
        amount = order["amount"]
        total += amount
        count += 1
        if largest is None or amount > largest:
            largest = amount
    average = total / count if count else 0.0
    return {"total": total, "count": count, "average": average, "largest": largest}
'''

_DOCUMENT = ("The lighthouse at Point Arden was built in 1871 from granite quarried on the island itself. "
             "Its lamp burned whale oil until 1893, then kerosene, and was finally electrified in 1937. "
             "The last keeper, Margaret Hollis, left the station in 1968, when the light was automated. "
             "Today the tower is maintained by a volunteer society and is open to visitors every summer.")

_RECORD = ('{"name": "Point Arden Light", "built": 1871, "keepers": ["Thomas Hollis", "Margaret Hollis"], '
           '"automated": 1968, "open": "every summer"}')
_RECORD_SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "built": {"type": "integer"},
    "keepers": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 4},
    "automated": {"type": "integer"}, "open": {"type": "string", "maxLength": 30}},
    "required": ["name", "built", "keepers", "automated", "open"], "additionalProperties": False}

# Single-stream chat tasks, each (message, extra sampling parameters): three whose answers copy their input
# (where prompt lookup's guesses are right; one through a JSON schema, whose grammar checks each guess), and an
# open-ended one (where they mostly are not, and speculation must not cost much).
SPECULATIVE_TASKS: dict[str, tuple[str, dict]] = {
    # asked this way the default model writes the function out again (with "rewrite ... reply with the whole
    # function only" it wrote six lines of its own)
    "code_edit": (f"Here is a Python function:\n\n```python\n{_CODE}```\n\nRename the variable `largest` to "
                  f"`biggest` everywhere in it and show the complete new function.", {}),
    "quote": (f"Here is a document:\n\n{_DOCUMENT}\n\nRepeat the document exactly, word for word.", {}),
    "json_copy": (f"Here is a record:\n\n{_RECORD}\n\nRepeat it as JSON.", {"json_schema": _RECORD_SCHEMA}),
    "open_chat": ("Write a short story about a fox who learns to paint.", {}),
}


# what request i of a batch changes in a task's text (names and identifiers taken in turn, years moved on by i), so
# that no two requests copy the same input and an engine's table of earlier answers cannot guess a later one whole
_VARIANT_WORDS = {
    "Point Arden": ("Cape Sorrel", "Gull Rock", "Haven Point", "North Skerry", "Black Head", "Mill Cove", "Owl Island"),
    "Hollis": ("Pryce", "Abbott", "Lindqvist", "Okafor", "Marsh"),
    "Margaret": ("Edith", "Ruth", "Agnes"),
    "orders": ("sales", "invoices", "payments", "tickets", "bookings", "receipts"),
    "order": ("sale", "invoice", "payment", "ticket", "booking", "receipt"),
    "amount": ("value", "price", "cost", "fee", "sum"),
    "summarize": ("report", "tally", "digest", "overview", "collect", "review", "measure"),
    "fox": ("owl", "otter", "badger", "heron", "hare", "wren", "mole"),
    "paint": ("sing", "swim", "knit", "sail", "juggle"),
    "short": ("brief", "funny", "sad", "strange", "quiet", "happy", "gentle", "tiny", "curious"),
}
_VARIANT_PATTERN = re.compile(r"\b(" + "|".join(_VARIANT_WORDS) + r"|1[89]\d\d)\b")


def task_variant(text: str, i: int) -> str:
    """Request i's version of a speculative task's text; i = 0: the text as written."""
    if i == 0:
        return text

    def swap(match: re.Match) -> str:
        word = match.group()
        if word.isdigit():
            return str(int(word) + i)
        choices = _VARIANT_WORDS[word]
        return choices[(i - 1) % len(choices)]

    return _VARIANT_PATTERN.sub(swap, text)


def speculative_request(engine: LLMEngine, task: str, max_tokens: int, variant: int = 0
                        ) -> tuple[list[int], SamplingParams]:
    """A speculative task's chat prompt for engine (its text's `variant`: see task_variant), and its greedy
    sampling parameters."""
    from edgeserve.engine.prompts import Prompts

    content, extra = SPECULATIVE_TASKS[task]
    ids = Prompts.for_engine(engine).chat([{"role": "user", "content": task_variant(content, variant)}])
    return ids, SamplingParams(max_tokens=max_tokens, temperature=0.0, **extra)


def run_speculative(make_engine: Callable[[str], LLMEngine], modes: tuple[str, ...] = ("off", "auto", "ngram"),
                    max_tokens: int = 256, repeats: int = 2) -> list[dict]:
    """Each task's greedy answer, alone, under each speculative mode (the best of `repeats` runs each, the modes
    taking turns as in run_speculative_batch; "off" first): decode tokens/s, its ratio to "off", and how many
    guessed tokens were accepted."""
    rows = []
    for task in tqdm(SPECULATIVE_TASKS, desc="speculative", unit="task", leave=False):
        row: dict = {"name": task}
        answers = set()
        best = dict.fromkeys(modes, 0.0)
        stats = {}
        for _ in range(repeats):
            for mode in modes:
                engine = make_engine(mode)
                engine.add_request(*speculative_request(engine, task, max_tokens), task)
                first, tokens = None, []
                while engine.has_unfinished():
                    for out in engine.step():
                        first = first or time.perf_counter()
                        tokens += out.token_ids
                decode_time = time.perf_counter() - first
                best[mode] = max(best[mode], (len(tokens) - 1) / decode_time if len(tokens) > 1 else 0.0)
                answers.add(tuple(tokens))
                stats[mode] = engine.stats()
                row["output_tokens"] = len(tokens)
        for mode in modes:
            row[f"{mode}_decode_tokens_per_s"] = round(best[mode], 1)
            if mode != "off":
                st = stats[mode]
                row[f"{mode}_over_off"] = round(best[mode] / best["off"], 2)
                row[f"{mode}_draft_acceptance_rate"] = round(st.draft_acceptance_rate, 3)
                checks = st.draft_checks
                row[f"{mode}_tokens_per_check"] = round(1 + st.accepted_draft_tokens / checks, 2) if checks else 0.0
        row["same_answer"] = len(answers) == 1
        rows.append(row)
    return rows


# The 16-stream mixes: every task in turn, and the tasks that copy their input only.
SPECULATIVE_MIXES = {"mixed": list(SPECULATIVE_TASKS),
                     "input-grounded": [t for t in SPECULATIVE_TASKS if t != "open_chat"]}


def run_speculative_batch(make_engine: Callable[[str], LLMEngine], streams: int = 16, rounds: int = 4,
                          modes: tuple[str, ...] = ("off", "auto", "ngram"), max_tokens: int = 256,
                          repeats: int = 2) -> list[dict]:
    """Each mix's greedy requests (its tasks in turn, each request its own variant of its task's text, as a server's
    requests differ), rounds * streams of them queued at once on an engine running
    `streams` at a time (make_engine's), so that a request that finishes early makes room for the next as on a busy
    server, under each speculative mode ("off" first): output tokens per second over the whole run (the best of
    `repeats` runs, the modes taking turns: a machine whose speed drifts over a minute favours none), and its ratio
    to "off". (Were all of a mix's requests to start together and none to follow, the run would last as long as its
    longest answer takes alone, however fast the others finish.)"""
    rows = []
    for mix, tasks in tqdm(SPECULATIVE_MIXES.items(), desc=f"speculative, {streams} streams", unit="mix",
                           leave=False):
        row: dict = {"name": f"{mix}, {streams} streams"}
        answers = set()
        best = dict.fromkeys(modes, 0.0)
        for _ in range(repeats):
            for mode in modes:
                engine = make_engine(mode)
                start = time.perf_counter()
                for i in range(rounds * streams):
                    engine.add_request(*speculative_request(engine, tasks[i % len(tasks)], max_tokens, variant=i),
                                       str(i))
                done = engine.run_to_completion()
                wall = time.perf_counter() - start
                tokens = sum(len(c.token_ids) for c in done.values())
                answers.add(tuple(tuple(done[str(i)].token_ids) for i in range(rounds * streams)))
                row["output_tokens"] = tokens
                best[mode] = max(best[mode], tokens / wall)
        for mode in modes:
            row[f"{mode}_output_tokens_per_s"] = round(best[mode], 1)
            if mode != "off":
                row[f"{mode}_over_off"] = round(best[mode] / best["off"], 2)
        row["same_answers"] = len(answers) == 1
        rows.append(row)
    return rows
