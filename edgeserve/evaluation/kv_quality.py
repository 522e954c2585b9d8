"""What holding K/V in a smaller dtype costs a model: perplexity, and the KL divergence and top-1 agreement of its
next-token distributions against the float32 pool's, over the same windows of a text."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from tqdm import tqdm

from edgeserve.engine.llm_engine import LLMEngine
from edgeserve.evaluation.perplexity import log_softmax, scored_windows

REFERENCE = "float32"


@dataclass(frozen=True)
class KVQuality:
    kv_dtype: str
    tokens_per_gib: int
    perplexity: float
    kl_divergence: float  # mean over scored tokens, in nats, of KL(float32 pool || this pool)
    top1_agreement: float  # share of scored tokens whose likeliest next token is the float32 pool's
    tokens: int


def kv_quality(engines: dict[str, LLMEngine], text: str, ctx: int = 512, progress: bool = True) -> list[KVQuality]:
    """Each engine's figures on a text; the engines hold one model, with kv_dtype (the keys, float32 among them)."""
    reference = engines[REFERENCE]
    tokenizer = reference.tokenizer
    bos = tokenizer.bos_token_id if tokenizer.add_bos else None
    spans = scored_windows(tokenizer.encode(text), ctx, bos=bos)
    nll = dict.fromkeys(engines, 0.0)
    kl = dict.fromkeys(engines, 0.0)
    same = dict.fromkeys(engines, 0)
    count = 0
    for window, rows, targets in tqdm(spans, unit="window", desc="KV dtypes", disable=not progress):
        logp = {dtype: log_softmax(engine.prompt_logits(window)[rows]) for dtype, engine in engines.items()}
        base = logp[REFERENCE]
        for dtype, lp in logp.items():
            nll[dtype] -= float(lp[np.arange(len(targets)), targets].sum())
            kl[dtype] += float((np.exp(base) * (base - lp)).sum())
            same[dtype] += int((lp.argmax(-1) == base.argmax(-1)).sum())
        count += len(targets)
    return [KVQuality(dtype, 2**30 // engine.pool_size.bytes_per_token, math.exp(nll[dtype] / count),
                      kl[dtype] / count, same[dtype] / count, count) for dtype, engine in engines.items()]
