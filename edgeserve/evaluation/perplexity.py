"""Perplexity of a model on a text, over sliding windows.

Windows of `ctx` tokens advance by `stride` (half a window by default); each scores only the
tokens the previous windows did not, so every token past the first window is predicted from
at least ctx - stride tokens of context (the Hugging Face recipe).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from tqdm import tqdm

from edgeserve.engine.llm_engine import LLMEngine
from edgeserve.errors import EdgeserveError


@dataclass(frozen=True)
class PerplexityResult:
    perplexity: float
    mean_nll: float  # nats per scored token
    tokens: int  # tokens scored
    windows: int
    ctx: int
    stride: int

    def describe(self) -> str:
        return (f"perplexity {self.perplexity:.4f} over {self.tokens} tokens "
                f"({self.windows} windows, ctx {self.ctx}, stride {self.stride})")


def windows(n_tokens: int, ctx: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, first scored position) of each window over n_tokens tokens."""
    spans = []
    scored_to = 1  # the first token has nothing to be predicted from
    for begin in range(0, n_tokens - 1, stride):
        end = min(begin + ctx, n_tokens)
        first = max(scored_to, begin + 1)
        if first < end:
            spans.append((begin, end, first))
        scored_to = end
        if end == n_tokens:
            break
    return spans


def scored_windows(ids: list[int], ctx: int, stride: int | None = None,
                   bos: int | None = None) -> list[tuple[list[int], slice, np.ndarray]]:
    """Each window's tokens, the rows of its logits that score (row p predicts token p + 1), and their targets.

    With `bos`, every window starts with that token in place of its first one, as the first window
    does (a model whose text always follows BOS, such as Gemma, reads a window without it badly);
    llama-perplexity does the same.
    """
    stride = stride or max(1, ctx // 2)
    if ctx < 2:
        raise EdgeserveError(f"perplexity needs a window of at least 2 tokens, got --ctx {ctx}")
    if not 0 < stride <= ctx:
        raise EdgeserveError(f"the stride must be between 1 and the window ({ctx}), got {stride}")
    if len(ids) < 2:
        raise EdgeserveError("the text must be at least 2 tokens long to measure perplexity")
    out = []
    for begin, end, first in windows(len(ids), ctx, stride):
        window = ids[begin:end]
        if bos is not None and begin > 0:
            window = [bos, *window[1:]]
        out.append((window, slice(first - 1 - begin, end - 1 - begin), np.asarray(ids[first:end])))
    return out


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Log-probabilities of rows of logits, in float64."""
    rows = logits.astype(np.float64)
    top = rows.max(axis=-1, keepdims=True)
    return rows - top - np.log(np.exp(rows - top).sum(axis=-1, keepdims=True))


def perplexity(
    engine: LLMEngine, ids: list[int], ctx: int = 512, stride: int | None = None, progress: bool = True,
    label: str = "perplexity", bos: int | None = None,
) -> PerplexityResult:
    """Perplexity of the token ids under the engine's model, over `scored_windows`; `label` names its
    progress bar. Uses `engine.prompt_logits`, so no requests may be running on the engine meanwhile.
    """
    stride = stride or max(1, ctx // 2)
    spans = scored_windows(ids, ctx, stride, bos)
    nll_sum, count = 0.0, 0
    with tqdm(spans, unit="window", desc=label, disable=not progress) as bar:
        for window, rows, targets in bar:
            logp = log_softmax(engine.prompt_logits(window)[rows])
            nll_sum -= float(logp[np.arange(len(targets)), targets].sum())
            count += len(targets)
            bar.set_postfix(ppl=f"{math.exp(nll_sum / count):.3f}")
    mean = nll_sum / count
    return PerplexityResult(math.exp(mean), mean, count, len(spans), ctx, stride)


def text_perplexity(
    engine: LLMEngine, text: str, ctx: int = 512, stride: int | None = None, progress: bool = True,
    label: str = "perplexity",
) -> PerplexityResult:
    """Perplexity of a text, tokenized the way the model tokenizes a raw prompt (BOS first in every
    window where the tokenizer adds one)."""
    tokenizer = engine.tokenizer
    bos = tokenizer.bos_token_id if tokenizer.add_bos else None
    return perplexity(engine, tokenizer.encode(text), ctx, stride, progress, label, bos)
