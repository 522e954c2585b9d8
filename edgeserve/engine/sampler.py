"""Turning each sampling row's logits into a token: greedy rows at once, sampled rows by the compiled op
(`_logits.c`) where it is built, the rest (and the rows it leaves) row by row."""

from __future__ import annotations

from collections import Counter

import numpy as np

from edgeserve.backends import cpu_kernels
from edgeserve.batch import Penalties
from edgeserve.engine.sequence import Sequence
from edgeserve.sampling_params import SamplingParams

# Far beyond any real logit, and still finite once divided by the smallest sampled temperature.
LOGIT_LIMIT = 1e30
# The most top entries the compiled op keeps a row (QM_MAX_TOP).
MAX_COMPILED_TOP = 256


def apply_penalties(logits: np.ndarray, seq: Sequence) -> np.ndarray:
    """Logit bias, then repetition (over the last repeat_last_n tokens of prompt and output, multiplicative),
    frequency and presence (over output) penalties."""
    p = seq.params
    if p.logit_bias:
        ids = np.fromiter(p.logit_bias, dtype=np.int64)
        logits[ids] += np.fromiter(p.logit_bias.values(), dtype=np.float64)
    if _penalizes_repeats(p):
        # sets, not np.unique: faster on a few dozen ids, and its first call imports numpy.ma (~10 ms of a start)
        seen = np.fromiter(_repeat_window(seq), dtype=np.int64)
        vals = logits[seen]
        logits[seen] = np.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.frequency_penalty or p.presence_penalty) and seq.num_output_tokens:
        counted = Counter(seq.output_ids)
        ids = np.fromiter(counted.keys(), dtype=np.int64, count=len(counted))
        counts = np.fromiter(counted.values(), dtype=np.float64, count=len(counted))
        logits[ids] -= p.frequency_penalty * counts + p.presence_penalty
    return logits


def penalty_rows(seqs: list[Sequence], ahead: bool = False) -> Penalties:
    """seqs' biases and penalties as the device applies them (the same as apply_penalties); ahead: each sequence
    has one more token, still on the device (`SamplingRows.recent`), which its window and output then leave out."""
    bias, window, repetition, output = [], [], [], []
    for seq in seqs:
        p = seq.params
        bias.append(p.logit_bias)
        on = _penalizes_repeats(p)
        repetition.append(p.repetition_penalty if on else 1.0)  # 1 also where the device's own token is its window
        window.append(_repeat_window(seq, ahead) if on else set())
        output.append(Counter(seq.output_ids) if p.frequency_penalty or p.presence_penalty else {})
    return Penalties(
        bias_ids=_padded([list(b) for b in bias], np.int32, -1), bias=_padded([list(b.values()) for b in bias]),
        window_ids=_padded([list(w) for w in window], np.int32, -1),
        repetition=np.array(repetition, np.float32),
        output_ids=_padded([list(c) for c in output], np.int32, -1),
        output_counts=_padded([list(c.values()) for c in output]),
        frequency=np.array([seq.params.frequency_penalty for seq in seqs], np.float32),
        presence=np.array([seq.params.presence_penalty for seq in seqs], np.float32))


def _penalizes_repeats(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 and p.repeat_last_n != 0


def _repeat_window(seq: Sequence, ahead: bool = False) -> set[int]:
    """The distinct tokens the repetition penalty looks at: seq's last repeat_last_n (all of them where it is -1);
    ahead: less the latest, which only the device has."""
    n = seq.params.repeat_last_n
    if n < 0:
        return set(seq.token_ids)
    return set(seq.token_ids[-(n - ahead):]) if n - ahead > 0 else set()


def _padded(rows: list[list], dtype: type = np.float32, fill: float = 0) -> np.ndarray:
    """Lists as the rows of one array, each padded with fill to the longest (at least one column)."""
    out = np.full((len(rows), max([1, *map(len, rows)])), fill, dtype)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return out


def _processed(logits: np.ndarray, seq: Sequence) -> np.ndarray:
    """A row's logits as float64 after bias and penalties, a grammar's forbidden tokens at -inf."""
    # Forbidden by a grammar (masked to about -LOGIT_LIMIT): no penalty may lift them (a repetition
    # penalty of 1e-300 would, multiplying them), nor may clipping tie them with penalized allowed ones.
    masked = logits <= -LOGIT_LIMIT
    with np.errstate(over="ignore"):  # extreme penalties overflow to inf, clipped below: inf - inf is NaN
        logits = apply_penalties(logits.astype(np.float64), seq)
    np.clip(logits, -LOGIT_LIMIT, LOGIT_LIMIT, out=logits)
    logits[np.isnan(logits)] = -LOGIT_LIMIT
    logits[masked] = -np.inf
    return logits


def _weights(logits: np.ndarray, seq: Sequence) -> np.ndarray:
    """Unnormalized probabilities of processed logits: temperature, top-k, top-p, min-p."""
    p = seq.params
    x = logits / p.temperature
    if 0 < p.top_k < x.size:
        x[x < np.partition(x, -p.top_k)[-p.top_k]] = -np.inf
    best = x.max()
    if not np.isfinite(best):
        raise ValueError("no token is allowed")
    x -= best
    # A whole vocabulary per row: float32's exp is vectorized (float64's is not), then the sums run in float64.
    probs = np.exp(x.astype(np.float32)).astype(np.float64)
    if p.min_p > 0.0:
        probs[probs < p.min_p * probs.max()] = 0.0
    if p.top_p < 1.0:
        keep_top_p(probs, p.top_p)
    return probs


def _draw(probs: np.ndarray, rng: np.random.Generator) -> int:
    cdf = np.cumsum(probs)
    cdf /= cdf[-1]
    return int(np.searchsorted(cdf, rng.random(), side="right"))  # Generator.choice's draw, less its checks


def sample_row(logits: np.ndarray, seq: Sequence) -> int:
    """One token from processed logits: temperature, top-k, top-p, min-p, then a seeded draw."""
    x = _processed(logits, seq)
    if seq.params.greedy:
        return int(np.argmax(x))
    return _draw(_weights(x, seq), seq.rng)


def draw_guess(logits: np.ndarray, seq: Sequence) -> tuple[int, np.ndarray | None]:
    """A draft model's guess from its row of logits, as seq would sample it, and the distribution it was drawn
    from (its probabilities over the vocabulary, summing to 1), which checking it needs; greedy rows take the
    likeliest token and give no distribution (they are checked against the target's likeliest)."""
    x = _processed(logits, seq)
    if seq.params.greedy:
        return int(np.argmax(x)), None
    probs = _weights(x, seq)
    probs /= probs.sum()
    return _draw(probs, seq.rng), probs


def check_guess(logits: np.ndarray, seq: Sequence, guess: int | None, q: np.ndarray | None = None) -> int:
    """The token a row of a draft's check gives: guess where it is accepted, else what replaces it (guess None:
    the row after a wholly accepted draft, sampled as usual).

    Speculative sampling's rule, for a guess drawn from q (a draft model's distribution): accept it with
    probability min(1, p(guess) / q(guess)), else draw from p - q where it is positive, normalized; the token is
    then distributed as p exactly. q None is a point mass on guess (a prompt-lookup draft): accept guess with its
    probability p(guess), else draw from p without guess. Greedy rows accept guess only where it is the likeliest.
    """
    if guess is None or seq.params.greedy:
        return sample_row(logits, seq) if needs_processing(seq) else int(np.argmax(logits))
    p = _weights(_processed(logits, seq), seq)
    p /= p.sum()
    if seq.rng.random() * (1.0 if q is None else q[guess]) < p[guess]:
        return guess
    if q is None:
        p[guess] = 0.0
        return _draw(p, seq.rng)
    residual = np.maximum(p - q, 0.0)
    # all zero only where p is q (up to rounding), where a rejection had no chance: p is then the residual's limit
    return _draw(residual if residual.any() else p, seq.rng)


def keep_top_p(probs: np.ndarray, top_p: float) -> None:
    """Zero, in place, all but the smallest set of most likely tokens that reaches top_p of the total.

    The set is nearly always within the few hundred most likely tokens: those are sorted first, and
    more only where they fall short (a full sort of the vocabulary costs more than a decode step)."""
    target = top_p * probs.sum()
    m = 256
    while True:
        if m >= probs.size:
            order = np.argsort(-probs)
        else:
            order = np.argpartition(-probs, m)[:m]
            order = order[np.argsort(-probs[order])]
        cum = np.cumsum(probs[order])
        if cum[-1] >= target or m >= probs.size:
            break
        m *= 8
    keep = np.zeros(probs.size, dtype=bool)
    keep[order[: np.searchsorted(cum, target) + 1]] = True
    probs[~keep] = 0.0


def penalizes(seq: Sequence) -> bool:
    """Whether seq's logits take a bias or a penalty before sampling."""
    p = seq.params
    return _penalizes_repeats(p) or bool(p.frequency_penalty) or bool(p.presence_penalty) or bool(p.logit_bias)


def needs_processing(seq: Sequence) -> bool:
    return not seq.params.greedy or penalizes(seq)


def _compiled(logits: np.ndarray) -> bool:
    """Whether the compiled ops take these logits (float32 rows of unit stride)."""
    return cpu_kernels.ops is not None and logits.dtype == np.float32 and logits.ndim == 2 and logits.strides[1] == 4


def _compiled_draws(logits: np.ndarray, seqs: list[Sequence]) -> dict[int, int]:
    """The tokens of the sampled (not greedy) rows, by row, drawn at once by the compiled op with each row's own
    generator's next uniform (as `_draw` takes it); a row it leaves (masked, not finite, a cut past its reach) is
    absent. Rows with a bias or penalty are drawn from a float32 copy that has them."""
    rows = [i for i, seq in enumerate(seqs) if not seq.params.greedy] if _compiled(logits) else []
    if not rows:
        return {}
    x, x_rows = logits, np.array(rows, np.int64)
    if any(penalizes(seqs[i]) for i in rows):
        x, x_rows = logits[rows], np.arange(len(rows), dtype=np.int64)
        for row, i in zip(x, rows):
            if penalizes(seqs[i]):
                masked = row <= -LOGIT_LIMIT
                with np.errstate(all="ignore"):  # an inf or NaN made here leaves the row to the NumPy path
                    apply_penalties(row, seqs[i])
                row[masked] = -LOGIT_LIMIT  # no penalty lifts a grammar's mask
    params = [seqs[i].params for i in rows]
    inv_t = np.array([1.0 / p.temperature for p in params], np.float32)
    top_k = np.array([p.top_k for p in params], np.int32)
    top_p = np.array([p.top_p for p in params], np.float32)
    min_p = np.array([p.min_p for p in params], np.float32)
    u = np.array([seqs[i].rng.random() for i in rows])
    tokens = np.empty(len(rows), np.int64)
    cpu_kernels.ops.sample_logits(x, x_rows, inv_t, top_k, top_p, min_p, u, tokens)
    return {i: token for i, token in zip(rows, tokens.tolist()) if token >= 0}


def sample(logits: np.ndarray, seqs: list[Sequence]) -> tuple[list[int], dict[int, str]]:
    """Tokens for each row of logits [S, vocab] (row i belongs to seqs[i]), and the rows that failed, with why."""
    tokens = np.argmax(logits, axis=-1).tolist()
    failed: dict[int, str] = {}
    try:
        drawn = _compiled_draws(logits, seqs)
    except Exception:  # drawn one by one instead, where a row that fails fails alone
        drawn = {}
    for i, seq in enumerate(seqs):
        if i in drawn:
            tokens[i] = drawn[i]
        elif needs_processing(seq):
            try:
                tokens[i] = sample_row(logits[i], seq)
            except Exception as exc:  # one request's sampling must not fail the batch
                failed[i] = f"sampling failed: {exc}"
    return tokens, failed


def token_logprobs(logits: np.ndarray, tokens: list[int], tops: list[int]) -> list[dict]:
    """Each row's chosen token's log-probability and its `tops[i]` most likely alternatives, rows [R, vocab] at once.

    Row by row, each row's normalizer and top few cost a step of many such rows more than the model's head: here
    the compiled op's one pass a row, or NumPy's one pass over the batch each (exponentials in float32,
    vectorized, summed in float64); only the chosen and top tokens' logprobs are formed.
    """
    x = logits.astype(np.float32, copy=False)
    k = min(max(tops), x.shape[1])
    normalizer, ids = _row_stats(x, k)
    chosen = (x[np.arange(len(tokens)), tokens] - normalizer).tolist()
    top_lps = (np.take_along_axis(x, ids, axis=1) - normalizer[:, None]).tolist()
    return [{"token": token, "logprob": lp, "top": list(zip(row_ids[:top], lps[:top]))}
            for token, lp, top, row_ids, lps in zip(tokens, chosen, tops, ids.tolist(), top_lps)]


def _row_stats(x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Each row's log-sum-exp (float64) and its k largest entries' ids [R, k], largest first."""
    if _compiled(x) and k <= MAX_COMPILED_TOP:
        normalizer, ids = np.empty(len(x)), np.empty((len(x), k), np.int64)
        rows = np.arange(len(x), dtype=np.int64)
        if cpu_kernels.ops.logit_stats(x, rows, normalizer, ids) and np.isfinite(normalizer).all():
            return normalizer, ids
    peak = x.max(axis=1, keepdims=True)
    normalizer = peak[:, 0].astype(np.float64) + np.log(np.exp(x - peak).sum(axis=1, dtype=np.float64))
    if not k:
        return normalizer, np.empty((len(x), 0), np.int64)
    ids = np.argpartition(x, -k, axis=1)[:, -k:]  # the top k of each row by partition, then only those sorted
    order = np.argsort(-np.take_along_axis(x, ids, axis=1), axis=1, kind="stable")
    return normalizer, np.take_along_axis(ids, order, axis=1)
