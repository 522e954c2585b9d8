"""Benchmark workloads and their figures: throughput, TTFT, time per output token, KV use.

The same seeded workloads drive the in-process engine and any OpenAI-compatible server.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from edgeserve.tokenizer import Tokenizer


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
    """Ids of ordinary word-like tokens, so random prompts decode and re-encode to similar lengths."""
    ids = []
    for i in range(min(tokenizer.vocab_size, 20000)):
        if tokenizer.is_special(i):
            continue
        piece = tokenizer.decode([i])
        if piece.startswith(" ") and piece[1:].isalpha():
            ids.append(i)
    return np.asarray(ids)


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


def shared_prefix_workload(tokenizer: Tokenizer, n: int = 16, prefix_len: int = 1500, suffix_len: int = 24,
                           output_len: int = 16, seed: int = 0) -> list[BenchRequest]:
    """Workload (b): n requests whose prompts share one long system prompt."""
    rng = np.random.default_rng(seed)
    prefix = random_prompts(tokenizer, [prefix_len], rng)[0]
    suffixes = random_prompts(tokenizer, [suffix_len] * n, rng)
    return [BenchRequest(prefix + s, tokenizer.decode(prefix + s), output_len) for s in suffixes]
