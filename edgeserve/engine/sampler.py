"""Turning each sampling row's logits into a token: greedy rows at once, the rest row by row."""

from __future__ import annotations

import numpy as np

from edgeserve.engine.sequence import Sequence

# Far beyond any real logit, and still finite once divided by the smallest sampled temperature.
LOGIT_LIMIT = 1e30


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def apply_penalties(logits: np.ndarray, seq: Sequence) -> np.ndarray:
    """Logit bias, then repetition (over prompt and output, multiplicative), frequency and presence
    (over output) penalties."""
    p = seq.params
    if p.logit_bias:
        ids = np.fromiter(p.logit_bias, dtype=np.int64)
        logits[ids] += np.fromiter(p.logit_bias.values(), dtype=np.float64)
    if p.repetition_penalty != 1.0:
        seen = np.unique(np.asarray(seq.token_ids))
        vals = logits[seen]
        logits[seen] = np.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.frequency_penalty or p.presence_penalty) and seq.num_output_tokens:
        ids, counts = np.unique(np.asarray(seq.output_ids), return_counts=True)
        logits[ids] -= p.frequency_penalty * counts + p.presence_penalty
    return logits


def sample_row(logits: np.ndarray, seq: Sequence) -> int:
    """One token from processed logits: temperature, top-k, top-p, min-p, then a seeded draw."""
    p = seq.params
    # Forbidden by a grammar (masked to about -LOGIT_LIMIT): no penalty may lift them (a repetition
    # penalty of 1e-300 would, multiplying them), nor may clipping tie them with penalized allowed ones.
    masked = logits <= -LOGIT_LIMIT
    with np.errstate(over="ignore"):  # extreme penalties overflow to inf, clipped below: inf - inf is NaN
        logits = apply_penalties(logits.astype(np.float64), seq)
    logits = np.clip(np.nan_to_num(logits, nan=-LOGIT_LIMIT), -LOGIT_LIMIT, LOGIT_LIMIT)
    logits[masked] = -np.inf
    if p.greedy:
        return int(np.argmax(logits))
    logits = logits / p.temperature
    if 0 < p.top_k < logits.size:
        kth = np.partition(logits, -p.top_k)[-p.top_k]
        logits = np.where(logits < kth, -np.inf, logits)
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    if p.min_p > 0.0:
        probs = np.where(probs < p.min_p * probs.max(), 0.0, probs)
    if p.top_p < 1.0:
        order = np.argsort(-probs)
        cum = np.cumsum(probs[order])
        cut = order[np.searchsorted(cum, p.top_p * cum[-1]) + 1 :]  # keep the smallest set reaching top_p
        probs[cut] = 0.0
    probs /= probs.sum()
    return int(seq.rng.choice(probs.size, p=probs))


def needs_processing(seq: Sequence) -> bool:
    p = seq.params
    return (not p.greedy or p.repetition_penalty != 1.0 or bool(p.frequency_penalty) or bool(p.presence_penalty)
            or bool(p.logit_bias))


def sample(logits: np.ndarray, seqs: list[Sequence]) -> tuple[list[int], dict[int, str]]:
    """Tokens for each row of logits [S, vocab] (row i belongs to seqs[i]), and the rows that failed, with why."""
    tokens = np.argmax(logits, axis=-1).tolist()
    failed: dict[int, str] = {}
    for i, seq in enumerate(seqs):
        if needs_processing(seq):
            try:
                tokens[i] = sample_row(logits[i], seq)
            except Exception as exc:  # one request's sampling must not fail the batch
                failed[i] = f"sampling failed: {exc}"
    return tokens, failed


def token_logprobs(logits_row: np.ndarray, token: int, top: int) -> dict:
    """The chosen token's log-probability and the `top` most likely alternatives."""
    lp = log_softmax(logits_row.astype(np.float64))
    top_ids = np.argsort(-lp)[:top] if top else np.array([], dtype=np.int64)
    return {"token": token, "logprob": float(lp[token]), "top": [(int(t), float(lp[t])) for t in top_ids]}
