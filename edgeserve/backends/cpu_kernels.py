"""Decode attention straight from the paged KV pool, compiled for the CPU with numba.

A decode row has one query token per sequence, so as a BLAS product it is a GEMM with as many
rows as the GQA group (3 for SmolLM2): BLAS runs those far below its speed, and gathering each
sequence's K/V out of the pool first costs a full copy. These kernels walk the block tables and
read every K and V row once, in place. The softmax between them stays in NumPy, whose exp is
vectorized where numba's is not.

numba compiles on first use and keeps the machine code in its on-disk cache, so only the first
run on a machine pays for it.
"""

from __future__ import annotations

import threading

import numpy as np
from numba import njit, prange

# numba's default thread pool must not be entered from two threads at once (two engines in one process).
_LOCK = threading.Lock()


def decode_attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, block_tables: np.ndarray,
                     context_lens: np.ndarray) -> np.ndarray:
    """Attention of decode queries q [D, n_heads, head_dim] over K/V pools [blocks, block_size, n_kv, head_dim].

    block_tables [D, max_blocks] and context_lens [D] say where each sequence's keys are.
    """
    d, n_heads, hd = q.shape
    scale = np.float32(1.0 / np.sqrt(hd))
    scores = np.full((d, n_heads, int(context_lens.max())), -np.inf, dtype=np.float32)
    out = np.empty_like(q)
    with _LOCK:
        _scores(np.ascontiguousarray(q), k_cache, block_tables, context_lens, scale, scores)
        scores -= scores.max(axis=-1, keepdims=True)
        np.exp(scores, out=scores)
        scores /= scores.sum(axis=-1, keepdims=True)
        _weighted_values(scores, v_cache, block_tables, context_lens, out)
    return out


@njit(parallel=False, fastmath=True, cache=True)
def _scores(q, k_cache, block_tables, context_lens, scale, scores):
    """scores[s, h, t] = scale * q[s, h] . K[s, t] for t below each context length; the rest untouched."""
    num_seqs, n_heads, hd = q.shape
    block_size, n_kv = k_cache.shape[1], k_cache.shape[2]
    group = n_heads // n_kv
    for s in prange(num_seqs):
        length = context_lens[s]
        qs = q[s] * scale
        for b in range((length + block_size - 1) // block_size):
            block = k_cache[block_tables[s, b]]
            for off in range(min(block_size, length - b * block_size)):
                t = b * block_size + off
                for h in range(n_heads):
                    acc = np.float32(0.0)
                    for i in range(hd):
                        acc += qs[h, i] * block[off, h // group, i]
                    scores[s, h, t] = acc


@njit(parallel=False, fastmath=True, cache=True)
def _weighted_values(probs, v_cache, block_tables, context_lens, out):
    """out[s, h] = sum over t of probs[s, h, t] * V[s, t]."""
    num_seqs, n_heads, hd = out.shape
    block_size, n_kv = v_cache.shape[1], v_cache.shape[2]
    group = n_heads // n_kv
    for s in prange(num_seqs):
        length = context_lens[s]
        acc = np.zeros((n_heads, hd), np.float32)
        for b in range((length + block_size - 1) // block_size):
            block = v_cache[block_tables[s, b]]
            for off in range(min(block_size, length - b * block_size)):
                t = b * block_size + off
                for h in range(n_heads):
                    w = probs[s, h, t]
                    for i in range(hd):
                        acc[h, i] += w * block[off, h // group, i]
        out[s] = acc
