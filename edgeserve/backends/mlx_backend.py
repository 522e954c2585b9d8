"""The MLX backend: quantized weights stay quantized, GEMMs and attention run lazily on MLX's device.

A whole step builds one lazy graph (embedding, every layer's K/V writes into the pool, attention,
logits); `to_numpy` evaluates it once. Activations are float16 on a GPU and float32 on the CPU,
where MLX has no fast half-precision arithmetic; the KV pool holds the activations' dtype unless
--kv-dtype asks for float16 or for `kv_formats`' int8 heads (quantized on the device as they are
written, to the bits of the NumPy backend's).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from edgeserve.backends.base import PartialSum
from edgeserve.backends.kv_formats import int8_kv_group, kv_head_bytes
from edgeserve.backends.mlx_blocks import CompiledBlocks, rope_rows
from edgeserve.batch import Batch, Penalties, SamplingRows
from edgeserve.errors import EdgeserveError
from edgeserve.metal import select_attention
from edgeserve.metal.kernels import upload_ints
from edgeserve.metal.launch_limits import kernel_supports
from edgeserve.quant.affine import QuantizedTensor
from edgeserve.quant.kquants import KQuantTensor


@dataclass
class QuantizedWeight:
    """An [out, in] matrix in MLX's affine layout, used through quantized_matmul without dequantizing."""

    weight: mx.array
    scales: mx.array
    biases: mx.array
    bits: int
    group_size: int

    def matmul(self, x: mx.array) -> mx.array:
        return mx.quantized_matmul(
            x, self.weight, self.scales, self.biases, transpose=True, group_size=self.group_size, bits=self.bits
        )

    def rows(self, ids: mx.array) -> mx.array:
        """Dequantized rows (an embedding lookup)."""
        return mx.dequantize(self.weight[ids], self.scales[ids], self.biases[ids], self.group_size, self.bits)


@dataclass
class DenseWeight:
    weight: mx.array  # [out, in]

    def matmul(self, x: mx.array) -> mx.array:
        return x @ self.weight.T

    def rows(self, ids: mx.array) -> mx.array:
        return self.weight[ids]


@dataclass
class Linear:
    """Weights sharing one input (q/k/v, gate/up), fused into as few matmuls as their storage allows; with a
    group, each rank's output is a partial sum (its share of the input columns), added up over the group."""

    parts: list[QuantizedWeight | DenseWeight]
    group: Any = None  # an mx.distributed.Group

    def __call__(self, x: mx.array) -> mx.array:
        outputs = [p.matmul(x) for p in self.parts]
        out = outputs[0] if len(outputs) == 1 else mx.concatenate(outputs, axis=-1)
        return out if self.group is None else mx.distributed.all_sum(out, group=self.group)


@dataclass
class MLXMeta:
    """Per-step arrays, computed once and shared by every layer."""

    token_ids: mx.array
    positions: mx.array
    slot_blocks: mx.array  # pool block of each row's K/V
    slot_offsets: mx.array  # offset inside that block
    slots: mx.array  # the pool slot of each row's K/V (block * block_size + offset)
    logits_indices: mx.array
    freqs: mx.array  # RoPE wavelengths, as mx.fast.rope takes them
    attention: Any  # the active attention path's own per-step arrays


_POOL_DTYPES = {"float32": mx.float32, "float16": mx.float16, "int8": mx.int8}


class MLXBackend:
    name = "mlx"
    chains_steps = True

    def __init__(self, kv_dtype: str = "auto", group: Any = None) -> None:
        """group: the tensor-parallel group whose ranks' partial sums (`PartialSum` weights) this one adds up."""
        on_gpu = mx.default_device().type == mx.DeviceType.gpu
        self.computes_async = on_gpu  # MLX on the CPU computes as a step is launched
        self.dtype = mx.float16 if on_gpu else mx.float32
        self.kv_dtype = ("float16" if on_gpu else "float32") if kv_dtype == "auto" else kv_dtype
        if self.kv_dtype not in _POOL_DTYPES:
            raise EdgeserveError(f"unknown KV dtype {kv_dtype!r} (choose from auto, {', '.join(_POOL_DTYPES)})")
        if on_gpu and self.kv_dtype == "float32":
            raise EdgeserveError("--kv-dtype float32: on a GPU the mlx backend computes K/V in float16, so a float32 "
                                 "pool would hold the same values in twice the memory; use float16 or int8")
        self.attention = select_attention()
        self.group = group
        # how the models on this backend (a draft model's too) write their K/V: "in place"
        # (`metal.kernels.write_in_place`) or "scatter" (MLX's, which copies a pool that a step in flight still reads)
        self._kv_writes: set[str] = set()
        self._written: list[mx.array] = []  # this step's pool arrays, evaluated with its logits

    def describe(self) -> str:
        return f"mlx on {mx.default_device().type.name} ({self.dtype} activations)"

    # weights ------------------------------------------------------------------

    def _float(self, w: Any) -> mx.array:
        a = mx.array(np.asarray(w, dtype=np.float32)).astype(self.dtype)
        mx.eval(a)
        return a

    def _scales(self, a: np.ndarray) -> mx.array:
        if a.dtype == np.uint16:  # bfloat16 kept as its bit patterns
            return mx.array(a).view(mx.bfloat16).astype(self.dtype)
        return mx.array(a).astype(self.dtype)

    def _weight(self, w: Any) -> QuantizedWeight | DenseWeight:
        w = mlx_form(w)
        if isinstance(w, QuantizedTensor):
            q = QuantizedWeight(mx.array(w.weight), self._scales(w.scales), self._scales(w.biases), w.bits, w.group_size)
            mx.eval(q.weight, q.scales, q.biases)
            return q
        return DenseWeight(self._float(w))

    def vector(self, w: Any) -> mx.array:
        return self._float(w)

    def embedding(self, w: Any) -> Linear:
        return Linear([self._weight(w)])

    def head(self, table: Linear) -> Linear:
        """The output head: the embedding's own matrix, which serves both lookups and matmuls."""
        return table

    def linear(self, parts: list[Any]) -> Linear:
        """Concatenate the rows of neighbouring parts stored alike, so q/k/v or gate/up is one matmul."""
        partial = isinstance(parts[0], PartialSum)
        if partial and self.group is None:
            raise EdgeserveError("a weight split across ranks needs the backend of a tensor-parallel group")
        groups: list[list[Any]] = []
        for p in (mlx_form(p.weight if partial else p) for p in parts):
            if groups and _storage(groups[-1][0]) == _storage(p):
                groups[-1].append(p)
            else:
                groups.append([p])
        fused = []
        for group in groups:
            if isinstance(group[0], QuantizedTensor):
                fused.append(
                    QuantizedTensor(
                        np.concatenate([p.weight for p in group]),
                        np.concatenate([p.scales for p in group]),
                        np.concatenate([p.biases for p in group]),
                        group[0].bits,
                        group[0].group_size,
                    )
                )
            else:
                fused.append(np.concatenate([np.asarray(p, dtype=np.float32) for p in group]))
        return Linear([self._weight(w) for w in fused], self.group if partial else None)

    def fuse_blocks(self, layers: list[Any], eps: float, ropes: list[mx.array]) -> CompiledBlocks:
        # in place only where every layer's attention is the CUDA kernel, which waits for the write: the reference
        # (a sliding window, a head the kernel cannot take) reads the pool through MLX, which would not wait
        in_place = self.attention.name == "cuda-kernel" and all(
            layer.attention.window is None
            and kernel_supports(layer.attention.head_dim, layer.attention.n_heads, layer.attention.n_kv_heads)
            for layer in layers)
        self._kv_writes.add("in place" if in_place else "scatter")
        return CompiledBlocks(self, layers, eps, ropes, in_place)

    def greedy_decoder(self, blocks: CompiledBlocks, embed: Callable[[mx.array], mx.array],
                       head: Callable[[mx.array], mx.array]) -> Callable[[Batch, Any], mx.array | None] | None:
        return blocks.greedy_decoder(embed, head)

    @property
    def launch_early(self) -> bool:
        """Whether a step may be launched while the one before still computes: where every model here writes its
        K/V in place (a step's writes would otherwise copy the whole pool)."""
        return self._kv_writes == {"in place"}

    def rope_tables(self, inv_freq: np.ndarray, max_positions: int) -> mx.array:
        return mx.array((1.0 / inv_freq).astype(np.float32))

    # one step -----------------------------------------------------------------

    def batch_meta(self, batch: Batch, rope: mx.array) -> MLXMeta:
        bs = batch.block_size
        device_tokens = batch.device_token_ids
        tokens, positions, slot_blocks, slot_offsets, slots, logits_indices = upload_ints(
            batch.token_ids, batch.positions, batch.slot_mapping // bs, batch.slot_mapping % bs, batch.slot_mapping,
            batch.logits_indices)
        return MLXMeta(
            token_ids=tokens if device_tokens is None else device_tokens,
            positions=positions,
            slot_blocks=slot_blocks,
            slot_offsets=slot_offsets,
            slots=slots,
            logits_indices=logits_indices,
            freqs=rope,
            attention=self.attention.prepare(batch),
        )

    def embed(self, table: Linear, ids: mx.array) -> mx.array:
        return table.parts[0].rows(ids)

    def matmul(self, x: mx.array, w: Linear) -> mx.array:
        return w(x)

    def lm_head(self, x: mx.array, head: Linear) -> mx.array:
        if x.size == 0:  # MLX kernels reject empty launches
            return mx.zeros((0, head.parts[0].weight.shape[0]), dtype=self.dtype)
        return head(x)

    def take_rows(self, x: mx.array, rows: mx.array) -> mx.array:
        if rows.size == 0:  # a step of prefill chunks that sample nothing
            return mx.zeros((0, x.shape[1]), dtype=x.dtype)
        return x[rows]

    def rms_norm(self, x: mx.array, w: mx.array, eps: float) -> mx.array:
        return x if x.size == 0 else mx.fast.rms_norm(x, w, eps)

    def apply_rope(self, x: mx.array, meta: MLXMeta) -> mx.array:
        return rope_rows(x, meta.positions, meta.freqs)

    def silu_mul(self, gate_up: mx.array) -> mx.array:
        g, u = mx.split(gate_up, 2, axis=-1)
        return g * mx.sigmoid(g) * u

    def gelu_tanh_mul(self, gate_up: mx.array) -> mx.array:
        g, u = mx.split(gate_up, 2, axis=-1)
        return nn.gelu_approx(g) * u

    def soft_cap(self, x: mx.array, cap: float) -> mx.array:
        return mx.tanh(x / cap) * cap

    def with_rope(self, meta: MLXMeta, rope: mx.array) -> MLXMeta:
        return dataclasses.replace(meta, freqs=rope)

    # the KV pool --------------------------------------------------------------

    def allocate_kv(self, num_blocks: int, block_size: int, n_kv_heads: int, head_dim: int) -> mx.array:
        dtype = _POOL_DTYPES[self.kv_dtype]
        pool = mx.zeros((num_blocks, block_size, n_kv_heads, kv_head_bytes(self.kv_dtype, head_dim) // dtype.size),
                        dtype=dtype)
        # made now, on the thread building the engine: pending work runs only on a stream of the thread that made
        # it, and the engine steps on a thread of its own (the server's)
        mx.eval(pool)
        return pool

    def write_kv(self, cache: mx.array, values: mx.array, meta: MLXMeta) -> mx.array:
        # Indexing the 4-D pool directly (no reshape) leaves the scatter's input unshared, so MLX
        # updates the pool's buffer in place instead of copying it.
        self._kv_writes.add("scatter")
        cache[meta.slot_blocks, meta.slot_offsets] = self.pool_rows(cache, values)
        self._written.append(cache)
        return cache

    def written(self, pools: list[mx.array]) -> None:
        """Pool arrays a step wrote, to be evaluated with it."""
        self._written.extend(pools)

    @staticmethod
    def pool_rows(cache: mx.array, values: mx.array) -> mx.array:
        """Heads as the pool holds them."""
        return store_int8(values) if cache.dtype == mx.int8 else values.astype(cache.dtype)

    def copy_blocks(self, cache: mx.array, pairs: list[tuple[int, int]]) -> mx.array:
        src, dst = (mx.array(list(ids), dtype=mx.int32) for ids in zip(*pairs))
        cache[dst] = cache[src]
        self._written.append(cache)
        return cache

    def read_blocks(self, cache: mx.array, blocks: list[int]) -> np.ndarray:
        return np.array(cache[mx.array(blocks, dtype=mx.int32)])

    def write_blocks(self, cache: mx.array, blocks: list[int], values: np.ndarray) -> mx.array:
        cache[mx.array(blocks, dtype=mx.int32)] = mx.array(values).astype(cache.dtype)
        self._written.append(cache)
        return cache

    def to_numpy(self, x: mx.array) -> np.ndarray:
        """Evaluate the step's graph, pool writes included (logits may not need them all), as float32 NumPy."""
        x = x.astype(mx.float32)
        self.evaluate(x)
        return np.array(x)

    def evaluate(self, *arrays: mx.array) -> None:
        """Evaluate arrays and the step's pool writes."""
        mx.eval(*arrays, *self._written)
        self._written = []

    def sample(self, logits: mx.array, rows: SamplingRows | None) -> mx.array:
        if logits.size == 0:  # a step of prefill chunks that sample nothing; MLX's argmax rejects empty rows
            return mx.zeros((logits.shape[0],), dtype=mx.int32)
        if rows is not None and rows.penalties is not None:
            logits = _penalized(logits, rows.penalties, rows.recent)
        if rows is not None and rows.allowed is not None:  # after the penalties, which must not lift a mask
            bits = mx.array(rows.allowed)[:, :, None] >> mx.arange(8, dtype=mx.uint8)
            allowed = (bits & 1).reshape(len(rows.allowed), -1)[:, : logits.shape[1]].astype(mx.bool_)
            logits = mx.where(allowed, logits, -mx.inf)
        greedy = mx.argmax(logits, axis=-1).astype(mx.int32)
        if rows is None or not rows.temperature.any():
            return greedy
        return mx.where(mx.array(rows.temperature == 0), greedy, _draw(logits, rows))

    def launch(self, tokens: mx.array) -> None:
        mx.async_eval(tokens, *self._written)
        self._written = []

    def fetch_tokens(self, tokens: mx.array) -> list:
        return tokens.tolist()

    def stack_tokens(self, steps: list[mx.array]) -> mx.array:
        return mx.stack(steps)

    def paged_attention(self, q: mx.array, k_cache: mx.array, v_cache: mx.array, meta: MLXMeta,
                        window: int | None = None) -> mx.array:
        return self.attention.run(q, k_cache, v_cache, meta.attention, window)


def store_int8(values: mx.array) -> mx.array:
    """Heads [..., head_dim] as int8 pool heads, to the bits of kv_formats.store: each group's values times
    the reciprocal of its float16 scale max|x| / 127, rounded half to even, then the scales' bytes."""
    x = values.astype(mx.float32)
    head_dim = x.shape[-1]
    group = int8_kv_group(head_dim)
    groups = x.reshape(*x.shape[:-1], head_dim // group, group)
    scale = (mx.abs(groups).max(axis=-1, keepdims=True) / 127).astype(mx.float16)
    wide = scale.astype(mx.float32)
    inv = mx.where(wide > 0, 1 / wide, 0)  # a group of zeros has scale 0 and values 0
    q = mx.clip(mx.round(groups * inv), -127, 127).astype(mx.int8).reshape(x.shape)
    return mx.concatenate([q, scale[..., 0].view(mx.int8)], axis=-1)


def _penalized(logits: mx.array, pen: Penalties, recent: mx.array | None) -> mx.array:
    """Logits in float32 after each row's bias and penalties (engine/sampler.py's apply_penalties); recent: each
    row's latest token, which pen's windows and outputs leave out."""
    rows, vocab = logits.shape

    def per_token(ids: Any, values: Any) -> mx.array:
        """[rows, vocab]: values added up at each row's ids; the padding id -1 lands in a column cut off after."""
        ids = mx.array(ids)
        return mx.zeros((rows, vocab + 1), mx.float32).at[mx.arange(rows)[:, None], ids].add(
            mx.broadcast_to(mx.array(values, mx.float32), ids.shape))[:, :vocab]

    window, output, counts = pen.window_ids, pen.output_ids, pen.output_counts
    if recent is not None:
        latest = recent.astype(mx.int32)[:, None]
        window, output = mx.concatenate([mx.array(window), latest], 1), mx.concatenate([mx.array(output), latest], 1)
        counts = mx.concatenate([mx.array(counts), mx.ones((rows, 1), mx.float32)], 1)
    x = logits.astype(mx.float32) + per_token(pen.bias_ids, pen.bias)
    repetition = mx.array(pen.repetition)[:, None]
    x = mx.where(per_token(window, 1.0) > 0, mx.where(x > 0, x / repetition, x * repetition), x)
    seen = per_token(output, counts)
    return x - (mx.array(pen.frequency)[:, None] * seen + mx.array(pen.presence)[:, None] * (seen > 0))


def _draw(logits: mx.array, rows: SamplingRows) -> mx.array:
    """Each row's token drawn as the host's sampler draws it (engine/sampler.py: temperature, top-k, min-p, top-p,
    then the first token whose cumulative probability passes the row's uniform number), in float32."""
    vocab = logits.shape[1]
    x = logits.astype(mx.float32) / mx.array(np.where(rows.temperature > 0, rows.temperature, 1.0), mx.float32)[:, None]
    if ((rows.top_k > 0) & (rows.top_k < vocab)).any():
        k = np.where((rows.top_k > 0) & (rows.top_k < vocab), rows.top_k, vocab)
        kth = mx.take_along_axis(mx.sort(x, axis=-1), mx.array(vocab - k, mx.int32)[:, None], axis=-1)
        x = mx.where(x < kth, -mx.inf, x)
    probs = mx.exp(x - x.max(axis=-1, keepdims=True))
    if (rows.min_p > 0).any():
        probs = mx.where(probs < mx.array(rows.min_p, mx.float32)[:, None] * probs.max(axis=-1, keepdims=True), 0.0,
                         probs)
    if (rows.top_p < 1).any():
        # the smallest set of likeliest tokens reaching top_p of the total: all as likely as the one that reaches it
        ranked = -mx.sort(-probs, axis=-1)
        reached = mx.cumsum(ranked, axis=-1)
        target = mx.array(rows.top_p, mx.float32)[:, None] * reached[:, -1:]
        reaching = mx.minimum(mx.sum(reached < target, axis=-1, keepdims=True), vocab - 1).astype(mx.int32)
        last = mx.take_along_axis(ranked, reaching, axis=-1)
        probs = mx.where(mx.array(rows.top_p < 1)[:, None] & (probs < last), 0.0, probs)
    cdf = mx.cumsum(probs, axis=-1)
    drawn = mx.sum(cdf <= mx.array(rows.uniform, mx.float32)[:, None] * cdf[:, -1:], axis=-1)
    return mx.minimum(drawn, vocab - 1).astype(mx.int32)


def mlx_form(w: Any) -> Any:
    """A GGUF K-quant as MLX affine groups where MLX has them (Q4_K, Q5_K), else as float32."""
    if isinstance(w, KQuantTensor):
        return w.to_affine() or w.dequantize(np.float32)
    return w


def _storage(w: Any) -> tuple:
    """What must agree for two weights to share one matmul."""
    if isinstance(w, QuantizedTensor):
        return ("quantized", w.bits, w.group_size, w.scales.dtype)
    return ("dense",)
