"""Paged attention over a ragged batch in plain MLX ops: the reference the custom kernels must match.

K and V are gathered from the pool through the block tables into contiguous copies (an int8
pool's heads dequantized there, as `kv_formats.load` does), then attended with ordinary matmuls
and a softmax. Decode rows (one query token per sequence) are
done together as one batch; each prefill chunk is done on its own with a causal mask. A
sliding-window layer adds the keys before each row's window to its mask (those masks are made
on the step's first windowed call and kept for its other layers).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from edgeserve.backends.kv_formats import int8_kv_group
from edgeserve.batch import Batch

# Large enough to zero a probability, small enough to stay finite in float32.
MASKED = -1e30


@dataclass
class PrefillChunk:
    start: int  # first row of the chunk in the batch
    length: int  # rows (query tokens) in the chunk
    blocks: mx.array  # [blocks] the sequence's pool blocks covering its context
    context_len: int
    mask: mx.array  # additive float32 [length, context_len], causal within the chunk


@dataclass
class ReferenceMeta:
    """Per-step arrays of the reference path, computed once and shared by every layer."""

    decode_rows: mx.array | None  # [D] rows that are a sequence's single decode token; None: every row, in order
    decode_blocks: mx.array  # [D, max_blocks]
    decode_lens: np.ndarray  # [D] keys each decode row sees
    block_size: int
    num_decode: int
    prefills: list[PrefillChunk]
    row_order: mx.array | None  # [T] where each batch row sits in the concatenated outputs; None: where it is
    # window (None: none) -> the decode rows' additive float32 mask [D, 1, 1, max_blocks * block_size] and one mask per
    # prefill chunk, made when a layer first asks (a compiled decode step makes its own)
    window_masks: dict[int | None, tuple[mx.array, list[mx.array]]] = field(default_factory=dict)


def prepare_reference(batch: Batch) -> ReferenceMeta:
    """The block lists, masks and row order the reference needs for this batch."""
    rows, blocks, lens = batch.decode_layout()
    if len(rows) == len(batch.token_ids):  # a decode step: every row a sequence's one token, nothing to reorder
        return ReferenceMeta(decode_rows=None, decode_blocks=mx.array(blocks.astype(np.int32)), decode_lens=lens,
                             block_size=batch.block_size, num_decode=len(rows), prefills=[], row_order=None)
    prefills = [
        PrefillChunk(
            start=c.start,
            length=c.length,
            blocks=mx.array(c.blocks.astype(np.int32)),
            context_len=c.context_len,
            mask=mx.array(np.where(c.masked, MASKED, 0.0).astype(np.float32)),
        )
        for c in batch.prefill_chunks()
    ]
    concatenated_rows = np.concatenate([rows] + [np.arange(c.start, c.start + c.length) for c in prefills])
    return ReferenceMeta(
        decode_rows=mx.array(rows.astype(np.int32)),
        decode_blocks=mx.array(blocks.astype(np.int32)),
        decode_lens=lens,
        block_size=batch.block_size,
        num_decode=len(rows),
        prefills=prefills,
        row_order=mx.array(np.argsort(concatenated_rows).astype(np.int32)),
    )


def window_masks(meta: ReferenceMeta, window: int | None) -> tuple[mx.array, list[mx.array]]:
    """The decode mask and each prefill chunk's mask, hiding also the keys before each row's last `window`."""
    if window not in meta.window_masks:
        keys = np.arange(meta.decode_blocks.shape[1] * meta.block_size)[None, :]
        lens = meta.decode_lens[:, None]
        decode = keys < lens
        chunks = [c.mask for c in meta.prefills]
        if window is not None:
            decode &= keys >= lens - window
            chunks = []
            for c in meta.prefills:
                position = (c.context_len - c.length + np.arange(c.length))[:, None]
                keys = np.arange(c.context_len)[None, :]
                chunks.append(mx.array(np.where((keys <= position) & (keys > position - window), 0.0, MASKED)
                                       .astype(np.float32)))
        meta.window_masks[window] = (
            mx.array(np.where(decode, 0.0, MASKED).astype(np.float32)[:, None, None, :]), chunks)
    return meta.window_masks[window]


def reference_paged_attention(q: mx.array, k_cache: mx.array, v_cache: mx.array, meta: ReferenceMeta,
                              window: int | None = None) -> mx.array:
    """Attention of each row [T, n_heads, head_dim] over its sequence's K/V (its last `window` keys
    where given), read through the block tables."""
    t, n_heads, hd = q.shape
    n_kv = k_cache.shape[2]
    group = n_heads // n_kv
    scale = 1.0 / math.sqrt(hd)
    decode_mask, chunk_masks = window_masks(meta, window)
    outputs = []
    if meta.num_decode:
        rows = q if meta.decode_rows is None else q[meta.decode_rows]
        outputs.append(decode_attention(rows, k_cache, v_cache, meta.decode_blocks, decode_mask))
    for chunk, mask in zip(meta.prefills, chunk_masks):
        c, n = chunk.context_len, chunk.length
        k = kv_heads(k_cache[chunk.blocks], hd, q.dtype).reshape(-1, n_kv, hd)[:c].transpose(1, 2, 0)  # [kv, hd, c]
        v = kv_heads(v_cache[chunk.blocks], hd, q.dtype).reshape(-1, n_kv, hd)[:c].transpose(1, 0, 2)  # [kv, c, hd]
        qc = (q[chunk.start : chunk.start + n] * scale).reshape(n, n_kv, group, hd).transpose(1, 2, 0, 3)
        o = _softmax_av(qc @ k[:, None] + mask, v[:, None])  # [kv, g, n, hd]
        outputs.append(o.transpose(2, 0, 1, 3).reshape(n, n_heads, hd))
    if meta.row_order is None:
        return outputs[0]
    return mx.concatenate(outputs, axis=0)[meta.row_order]


def decode_attention(q: mx.array, k_cache: mx.array, v_cache: mx.array, blocks: mx.array, mask: mx.array
                     ) -> mx.array:
    """Attention of D single-token rows q [D, n_heads, head_dim], each over the keys of its row of blocks [D, W]
    that its additive mask [D, 1, 1, W * block_size] leaves open."""
    d, n_heads, hd = q.shape
    n_kv = k_cache.shape[2]
    k, v = (kv_heads(cache[blocks], hd, q.dtype).reshape(d, -1, n_kv, hd) for cache in (k_cache, v_cache))
    k, v = k.transpose(0, 2, 3, 1), v.transpose(0, 2, 1, 3)  # [D, kv, hd, L], [D, kv, L, hd]
    qd = q.reshape(d, n_kv, n_heads // n_kv, hd) * (1.0 / math.sqrt(hd))
    return _softmax_av(qd @ k + mask, v).reshape(d, n_heads, hd)


def kv_heads(heads: mx.array, head_dim: int, dtype: mx.Dtype) -> mx.array:
    """Pool heads [..., head] as dtype [..., head_dim]: an int8 head's values times its groups' float16
    scales, in float32 as kv_formats.load does."""
    if heads.dtype != mx.int8:
        return heads if heads.dtype == dtype else heads.astype(dtype)
    group = int8_kv_group(head_dim)
    lead = heads.shape[:-1]
    scales = heads[..., head_dim:].view(mx.float16).astype(mx.float32)
    values = heads[..., :head_dim].astype(mx.float32).reshape(*lead, head_dim // group, group)
    return (values * scales[..., None]).reshape(*lead, head_dim).astype(dtype)


def _softmax_av(scores: mx.array, v: mx.array) -> mx.array:
    """softmax(scores) @ v, the softmax in float32 and the product in V's dtype."""
    probs = mx.softmax(scores.astype(mx.float32), axis=-1, precise=True)
    return probs.astype(v.dtype) @ v
