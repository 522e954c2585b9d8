"""Paged attention straight from the KV pool, and the small ops of a decoder block, compiled for the CPU.

Every row is one query with its own block table and key count (a decode row sees its whole
sequence, a prefill row the keys up to its position), so a row's result does not depend on the
rows beside it. As a BLAS product a decode row is a GEMM with as many rows as the GQA group (3
for SmolLM2), far below BLAS's speed, and gathering each sequence's K/V out of the pool first
costs a full copy: the kernels walk the block tables and read every K and V row in place, with
the softmax in between.

The C extension of `qmatmul` runs them (see _cpu_ops.c), with RMSNorm, RoPE and the SiLU and
GELU gates as single-pass ops: one call each, on the extension's thread pool, where NumPy's
per-call cost is most of a decode step's time for these small arrays. Without the extension, or with
EDGESERVE_QMATMUL=numba, `ops` is None: decode attention runs the numba kernel below and the
NumpyBackend its NumPy code for the small ops.

The numba kernel splits many rows by sequence into one share per core, each share run on
its own thread (the kernel releases the GIL): a plain thread pool rather than numba's, since a
third pool beside the matmul kernels' and OpenBLAS's would fight them for the same cores. numba
compiles on first use and keeps the machine code in its on-disk cache, so only the first run on
a machine pays for it.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np

from edgeserve.backends import kv_formats, qmatmul
from edgeserve.backends.lazy_jit import njit
from edgeserve.system import usable_cores

# The extension's fused ops, or None where the numba and NumPy code runs instead. Each op returns
# False, having done nothing, for arrays laid out in a way it does not take.
ops = qmatmul._ext if qmatmul.compiled() else None
# Below this many rows one thread is faster than handing shares to the pool.
_MIN_ROWS_TO_SPLIT = 4
_CORES = usable_cores()
_pool = ThreadPoolExecutor(_CORES - 1, thread_name_prefix="attention") if _CORES > 1 else None


def decode_attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, block_tables: np.ndarray,
                     context_lens: np.ndarray, window: int | None = None) -> np.ndarray:
    """Attention of queries q [D, n_heads, head_dim] over K/V pools [blocks, block_size, n_kv, head] (kv_formats).

    block_tables [D, max_blocks] and context_lens [D] say where each row's keys are and how many it
    sees; with a window, a row sees only the last `window` of them (a sliding-window layer).
    """
    out = np.empty(q.shape, np.float32)
    scale = np.float32(1.0 / np.sqrt(q.shape[-1]))
    span = window or 0  # 0: no window
    if ops is not None and ops.attention(q, k_cache, v_cache, block_tables, context_lens, out, scale, span):
        return out
    q = np.ascontiguousarray(q)
    if k_cache.dtype != np.float32:  # the blocks the rows read, converted, and their tables renumbered
        blocks, renumbered = np.unique(block_tables, return_inverse=True)
        k_cache, v_cache = (kv_formats.load(c[blocks], q.shape[-1]) for c in (k_cache, v_cache))
        block_tables = renumbered.reshape(block_tables.shape).astype(np.int64)
    if _pool is None or len(q) < _MIN_ROWS_TO_SPLIT:
        _decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, span, out)
        return out
    seen = np.minimum(context_lens, span) if span else context_lens
    shares = _shares(seen, _CORES)
    futures = [_pool.submit(_decode_attention, q[a:b], k_cache, v_cache, block_tables[a:b], context_lens[a:b],
                            scale, span, out[a:b]) for a, b in shares[1:]]
    a, b = shares[0]
    _decode_attention(q[a:b], k_cache, v_cache, block_tables[a:b], context_lens[a:b], scale, span, out[a:b])
    for f in futures:
        f.result()
    return out


def _shares(context_lens: np.ndarray, n: int) -> list[tuple[int, int]]:
    """Contiguous row ranges, one per thread, with about equal keys to read in each."""
    ends = np.cumsum(context_lens)
    cuts = np.searchsorted(ends, ends[-1] * np.arange(1, n) / n)
    bounds = [0, *np.clip(cuts + 1, 1, len(context_lens) - 1).tolist(), len(context_lens)]
    return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray | None:
    """x / sqrt(mean(x^2) + eps) * w per row of x [R, K] by the C op, or None where it does not run."""
    if ops is None:
        return None
    out = np.empty(x.shape, np.float32)
    return out if ops.rms_norm(x, w, out, eps) else None


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray | None:
    """Rotate-half RoPE of heads x [T, H, head_dim] at angles cos, sin [T, ..., head_dim / 2] by the C op, or None."""
    if ops is None:
        return None
    out = np.empty(x.shape, np.float32)
    return out if ops.rope(x, cos, sin, out) else None


def silu_mul(gate_up: np.ndarray) -> np.ndarray | None:
    """silu(gate) * up for gate_up [R, 2F] by the C op, or None where it does not run."""
    if ops is None:
        return None
    out = np.empty((gate_up.shape[0], gate_up.shape[1] // 2), np.float32)
    return out if ops.silu_mul(gate_up, out) else None


def gelu_tanh_mul(gate_up: np.ndarray) -> np.ndarray | None:
    """gelu(gate) * up (GELU's tanh approximation) for gate_up [R, 2F] by the C op, or None where it does not run."""
    if ops is None:
        return None
    out = np.empty((gate_up.shape[0], gate_up.shape[1] // 2), np.float32)
    return out if ops.silu_mul(gate_up, out, True) else None


def write_kv(cache: np.ndarray, values: np.ndarray, slots: np.ndarray) -> bool:
    """Rows `slots` of a K or V pool [blocks, block_size, n_kv, head_dim] = values by the C op; whether it ran."""
    return ops is not None and ops.write_kv(cache, values, slots)


def compile_now() -> None:
    """Compile the numba kernel (or load it from its cache) now where it is in use, so that no decode step waits."""
    pool = np.zeros((1, 1, 1, 1), np.float32)
    decode_attention(np.zeros((1, 1, 1), np.float32), pool, pool, np.zeros((1, 1), np.int64), np.ones(1, np.int64))


@njit(fastmath=True, nogil=True, cache=True)
def _decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, window, out):
    num_seqs, n_heads, hd = q.shape
    block_size, n_kv = k_cache.shape[1], k_cache.shape[2]
    group = n_heads // n_kv
    probs = np.empty((n_heads, block_tables.shape[1] * block_size), np.float32)
    acc = np.empty(hd, np.float32)
    for s in range(num_seqs):
        length = context_lens[s]
        start = length - window if 0 < window < length else 0  # keys before it are outside the window
        qs = q[s] * scale
        for b in range(start // block_size, (length + block_size - 1) // block_size):
            block = k_cache[block_tables[s, b]]
            for off in range(max(0, start - b * block_size), min(block_size, length - b * block_size)):
                t = b * block_size + off
                for kv_head in range(n_kv):
                    k_row = block[off, kv_head]
                    for h in range(kv_head * group, (kv_head + 1) * group):
                        dot = np.float32(0.0)
                        for i in range(hd):
                            dot += qs[h, i] * k_row[i]
                        probs[h, t] = dot
        for h in range(n_heads):
            top = probs[h, start]
            for t in range(start + 1, length):
                top = max(top, probs[h, t])
            total = np.float32(0.0)
            for t in range(start, length):
                e = np.exp(probs[h, t] - top)
                probs[h, t] = e
                total += e
            for t in range(start, length):
                probs[h, t] /= total
        # one head at a time, so its accumulator stays in registers
        for h in range(n_heads):
            kv_head = h // group
            acc[:] = 0.0
            for b in range(start // block_size, (length + block_size - 1) // block_size):
                block = v_cache[block_tables[s, b]]
                for off in range(max(0, start - b * block_size), min(block_size, length - b * block_size)):
                    w = probs[h, b * block_size + off]
                    v_row = block[off, kv_head]
                    for i in range(hd):
                        acc[i] += w * v_row[i]
            out[s, h] = acc
