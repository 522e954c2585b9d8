"""The NumPy backend: float32 weights and BLAS GEMMs on the CPU, paged attention over the pool.

Weights are held as float32 (`weights="float32"`, fastest), or, where memory is short, kept in
their quantized storage and dequantized a block of rows at a time inside each matmul
(`weights="quantized"`), so no float32 copy of a whole matrix ever stays resident. Float32
matrices are stored transposed, [in, out]: OpenBLAS runs `x @ W` with few rows (decode) faster
than `x @ W.T`.

Decode rows attend through the compiled kernel of `cpu_kernels`; prefill chunks through BLAS
GEMMs, a tile of query rows at a time so the causal upper triangle is mostly skipped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from edgeserve.backends.cpu_kernels import compile_now, decode_attention
from edgeserve.batch import Batch
from edgeserve.errors import EdgeserveError
from edgeserve.quant.affine import QuantizedTensor

NEG_INF = np.float32(-1e30)
WEIGHT_MODES = ("float32", "quantized")

# Elements of weight dequantized at once in "quantized" mode: 16 MiB of float32 scratch.
_DEQUANT_BLOCK_ELEMENTS = 1 << 22
# Query rows of a prefill chunk attended at once: each tile only reads keys up to its last row.
_PREFILL_TILE = 128


def as_float32(w: Any) -> np.ndarray:
    """A weight as a float32 array, dequantizing where it is stored quantized."""
    if isinstance(w, QuantizedTensor):
        return w.dequantize(np.float32)
    return np.ascontiguousarray(w, dtype=np.float32)


def resident_weight_bytes(model: Any, mode: str) -> int:
    """Bytes of weights a NumpyBackend in `mode` holds for a LoadedModel.

    "quantized" mode shares the model's own quantized arrays; "float32" mode holds float32
    copies (a tied embedding twice: rows to look up, and transposed for the output head), on top
    of the model's arrays for as long as the LoadedModel is kept.
    """
    _check_mode(mode)
    total = 0
    for w in model.weights.values():
        if mode == "quantized" and isinstance(w, QuantizedTensor):
            total += w.weight.nbytes + w.scales.nbytes + w.biases.nbytes
        else:
            total += 4 * int(np.prod(w.shape))
    if mode == "float32" and "lm_head.weight" not in model.weights:
        total += 4 * int(np.prod(model.weights["model.embed_tokens.weight"].shape))
    return total


def choose_weights_mode(model: Any, available_bytes: int) -> str:
    """'float32' when its weights take at most half of `available_bytes`, else 'quantized'."""
    return "float32" if 2 * resident_weight_bytes(model, "float32") <= available_bytes else "quantized"


def _check_mode(mode: str) -> None:
    if mode not in WEIGHT_MODES:
        raise EdgeserveError(f"unknown weights mode {mode!r} (choose from {', '.join(WEIGHT_MODES)})")


@dataclass
class PrefillChunk:
    rows: slice
    blocks: np.ndarray
    context_len: int
    mask: np.ndarray  # additive causal mask [rows, context_len]


@dataclass
class NumpyMeta:
    """Per-step arrays, computed once and shared by every layer."""

    token_ids: np.ndarray
    slot_mapping: np.ndarray
    logits_indices: np.ndarray
    cos: np.ndarray  # [T, 1, head_dim / 2]
    sin: np.ndarray
    decode_rows: np.ndarray  # rows that are a sequence's single decode token
    decode_blocks: np.ndarray  # [D, max_blocks]
    decode_lens: np.ndarray  # [D] context length of each decode row's sequence
    prefills: list[PrefillChunk]


class NumpyBackend:
    name = "numpy"
    kv_dtype = np.float32
    kv_dtype_bytes = np.dtype(kv_dtype).itemsize

    def __init__(self, weights: str = "float32"):
        _check_mode(weights)
        self.weights = weights
        compile_now()  # at start-up, not inside the first request's timings

    def describe(self) -> str:
        return f"numpy ({self.weights} weights)"

    def vector(self, w: Any) -> np.ndarray:
        return as_float32(w)

    def embedding(self, w: Any) -> np.ndarray | QuantizedTensor:
        if self.weights == "quantized" and isinstance(w, QuantizedTensor):
            return w
        return as_float32(w)

    def head(self, table: np.ndarray | QuantizedTensor) -> np.ndarray | QuantizedTensor:
        """The output head from an embedding table: transposed to [hidden, vocab] where float32."""
        return table if isinstance(table, QuantizedTensor) else np.ascontiguousarray(table.T)

    def linear(self, parts: list[Any]) -> np.ndarray | DequantizingLinear:
        """Fuse weights sharing an input (q/k/v, gate/up) into one [in, out] matrix: one GEMM each."""
        if self.weights == "quantized" and any(isinstance(p, QuantizedTensor) for p in parts):
            return DequantizingLinear([p if isinstance(p, QuantizedTensor) else as_float32(p) for p in parts])
        return np.ascontiguousarray(np.concatenate([as_float32(p) for p in parts], axis=0).T)

    def rope_tables(self, inv_freq: np.ndarray, max_positions: int) -> tuple[np.ndarray, np.ndarray]:
        angles = np.outer(np.arange(max_positions, dtype=np.float64), inv_freq)
        return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)

    def batch_meta(self, batch: Batch, rope: tuple[np.ndarray, np.ndarray]) -> NumpyMeta:
        cos, sin = rope
        rows, blocks, lens = batch.decode_layout()
        prefills = [
            PrefillChunk(slice(c.start, c.start + c.length), c.blocks, c.context_len,
                         np.where(c.masked, NEG_INF, 0.0).astype(np.float32))
            for c in batch.prefill_chunks()
        ]
        return NumpyMeta(
            token_ids=batch.token_ids,
            slot_mapping=batch.slot_mapping,
            logits_indices=batch.logits_indices,
            cos=cos[batch.positions][:, None, :],
            sin=sin[batch.positions][:, None, :],
            decode_rows=rows,
            decode_blocks=blocks,
            decode_lens=lens,
            prefills=prefills,
        )

    def embed(self, table: np.ndarray | QuantizedTensor, ids: np.ndarray) -> np.ndarray:
        if isinstance(table, QuantizedTensor):
            return table.take_rows(ids).dequantize(np.float32)
        return table[ids]

    def matmul(self, x: np.ndarray, w: np.ndarray | DequantizingLinear) -> np.ndarray:
        if isinstance(w, DequantizingLinear):
            return w(x)
        return x @ w

    def lm_head(self, x: np.ndarray, head: np.ndarray | QuantizedTensor) -> np.ndarray:
        if isinstance(head, QuantizedTensor):
            return DequantizingLinear([head])(x)
        return x @ head

    def take_rows(self, x: np.ndarray, rows: np.ndarray) -> np.ndarray:
        return x[rows]

    def rms_norm(self, x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
        ss = np.einsum("ij,ij->i", x, x)  # one pass, no x * x temporary
        ss *= np.float32(1.0 / x.shape[-1])
        ss += np.float32(eps)
        out = x * (1.0 / np.sqrt(ss))[:, None]
        out *= w
        return out

    def apply_rope(self, x: np.ndarray, meta: NumpyMeta) -> np.ndarray:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return np.concatenate([x1 * meta.cos - x2 * meta.sin, x2 * meta.cos + x1 * meta.sin], axis=-1)

    def silu_mul(self, gate_up: np.ndarray) -> np.ndarray:
        half = gate_up.shape[-1] // 2
        g, u = gate_up[:, :half], gate_up[:, half:]
        # one scratch array worked in place: the MLP's largest activation is not copied at each op
        s = np.negative(g)
        np.exp(s, out=s)
        s += 1.0
        np.divide(g, s, out=s)
        s *= u
        return s

    def allocate_kv(self, num_blocks: int, block_size: int, n_kv_heads: int, head_dim: int) -> np.ndarray:
        return np.zeros((num_blocks, block_size, n_kv_heads, head_dim), dtype=self.kv_dtype)

    def write_kv(self, cache: np.ndarray, values: np.ndarray, meta: NumpyMeta) -> np.ndarray:
        cache.reshape(-1, *cache.shape[2:])[meta.slot_mapping] = values
        return cache

    def copy_blocks(self, cache: np.ndarray, pairs: list[tuple[int, int]]) -> np.ndarray:
        for src, dst in pairs:
            cache[dst] = cache[src]
        return cache

    def to_numpy(self, x: np.ndarray) -> np.ndarray:
        return x

    def paged_attention(self, q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, meta: NumpyMeta) -> np.ndarray:
        """Attention of each row over its sequence's K/V, read through the block tables."""
        t, n_heads, hd = q.shape
        if len(meta.decode_rows) == t:  # decode rows only: no rows to pick out and put back
            return decode_attention(q, k_cache, v_cache, meta.decode_blocks, meta.decode_lens)
        n_kv = k_cache.shape[2]
        group = n_heads // n_kv
        scale = np.float32(1.0 / np.sqrt(hd))
        out = np.empty_like(q)
        if len(meta.decode_rows):
            out[meta.decode_rows] = decode_attention(q[meta.decode_rows], k_cache, v_cache, meta.decode_blocks,
                                                     meta.decode_lens)
        for chunk in meta.prefills:
            c = chunk.context_len
            n = chunk.rows.stop - chunk.rows.start
            k = k_cache[chunk.blocks].reshape(-1, n_kv, hd)[:c].transpose(1, 2, 0)  # [kv, hd, c]
            v = v_cache[chunk.blocks].reshape(-1, n_kv, hd)[:c].transpose(1, 0, 2)  # [kv, c, hd]
            qc = (q[chunk.rows] * scale).reshape(n, n_kv, group, hd).transpose(1, 2, 0, 3)  # [kv, g, n, hd]
            for r0 in range(0, n, _PREFILL_TILE):
                r1 = min(r0 + _PREFILL_TILE, n)
                keys = c - n + r1  # the tile's last row sees keys [0, keys)
                # one [group * rows, hd] matrix per KV head, so each product is a plain BLAS GEMM
                qt = qc[:, :, r0:r1].reshape(n_kv, group * (r1 - r0), hd)
                scores = (qt @ k[:, :, :keys]).reshape(n_kv, group, r1 - r0, keys)
                scores += chunk.mask[r0:r1, :keys]
                o = _softmax_av(scores.reshape(n_kv, group * (r1 - r0), keys), v[:, :keys])
                first = chunk.rows.start
                out[first + r0 : first + r1] = o.reshape(n_kv, group, r1 - r0, hd).transpose(2, 0, 1, 3).reshape(
                    r1 - r0, n_heads, hd)
        return out


class DequantizingLinear:
    """Weights sharing an input, kept as stored; each call dequantizes a block of rows at a time."""

    def __init__(self, parts: list[np.ndarray | QuantizedTensor]):
        self.parts = parts

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """x @ W.T for the parts stacked by rows, as one [T, out] array."""
        out = np.empty((x.shape[0], sum(p.shape[0] for p in self.parts)), dtype=np.float32)
        col = 0
        for part in self.parts:
            rows, cols = part.shape
            step = max(1, _DEQUANT_BLOCK_ELEMENTS // cols) if isinstance(part, QuantizedTensor) else rows
            for start in range(0, rows, step):
                stop = min(start + step, rows)
                out[:, col + start : col + stop] = x @ _float32_rows(part, start, stop).T
            col += rows
        return out


def _float32_rows(w: np.ndarray | QuantizedTensor, start: int, stop: int) -> np.ndarray:
    """Rows [start, stop) of a weight as float32, dequantizing only those rows."""
    if not isinstance(w, QuantizedTensor):
        return w[start:stop]
    block = QuantizedTensor(w.weight[start:stop], w.scales[start:stop], w.biases[start:stop], w.bits, w.group_size)
    return block.dequantize(np.float32)


def _softmax_av(scores: np.ndarray, v: np.ndarray) -> np.ndarray:
    """softmax(scores) @ v, overwriting scores; normalized after the product, on the smaller array."""
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    out = scores @ v
    out /= scores.sum(axis=-1, keepdims=True)
    return out
