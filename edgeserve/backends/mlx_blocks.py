"""The MLX backend's decoder blocks, each layer's math around attention compiled with `mx.compile`.

Building a step's lazy graph op by op costs a few microseconds of Python per op, some forty ops a
layer: on a GPU, where a small model's kernels take less, that host time is most of a decode step.
Each layer here is two compiled calls (everything before the K/V write, everything after attention:
norms, matmuls, RoPE, activation and residual adds, fused into fewer kernels) around the pool write
and the paged attention, which stay as they are (the write updates the pool in place; the attention
is the custom kernel). Where every layer's attention is the CUDA kernel, the K/V write is a kernel
of ours that writes through the pool's pointer (`write_in_place`), so that a step may be launched
while the one before still computes. A compiled function is traced once per input shape: steps of up to
`MAX_COMPILED_ROWS` rows (decode steps) use them, larger ones (long prefill chunks, whose kernels
dwarf their host time) the same math op by op.

The math is `models/llama.py`'s `Llama.block` for the options a family sets (q/k norms, query scale,
QKV bias, sliding window, RoPE table, activation, post norms); `Llama` hands a model here only when
its blocks are that code's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import numpy as np

from edgeserve.metal.kernels import KernelMeta, kernel_paged_attention, padded_width, write_in_place
from edgeserve.metal.reference import MASKED, decode_attention

if TYPE_CHECKING:
    from edgeserve.backends.kv_pool import KVPool
    from edgeserve.backends.mlx_backend import MLXBackend, MLXMeta
    from edgeserve.batch import Batch

MAX_COMPILED_ROWS = 64


def rope_rows(x: mx.array, positions: mx.array, freqs: mx.array) -> mx.array:
    """Rows x [T, heads, head_dim] rotated each to its own position."""
    # mx.fast.rope counts positions along the second-to-last axis from a per-row offset,
    # so each row becomes its own length-1 sequence starting at its position.
    return mx.fast.rope(x[:, :, None, :], x.shape[-1], traditional=False, base=None, scale=1.0, offset=positions,
                        freqs=freqs)[:, :, 0, :]


class CompiledBlocks:
    """Every decoder block of a step: `blocks(h, kv, meta)` returns the residual stream after the last."""

    def __init__(self, backend: MLXBackend, layers: list[Any], eps: float, ropes: list[mx.array], in_place: bool):
        """in_place: write each layer's K/V through the pools' pointers (`_attend_in_place`)."""
        self.backend = backend
        self.in_place = in_place
        self.layers = layers
        self.ropes = ropes
        self.eps = eps
        self.plain = [(self._before_write(layer), self._after_attention(layer)) for layer in layers]
        self.compiled = [(mx.compile(before), mx.compile(after)) for before, after in self.plain]
        # Writing in place, a decode step of up to MAX_COMPILED_ROWS rows is one compiled call for every layer:
        # the Python of ~5 calls a layer (two of them custom kernels, whose every call writes out its source) is
        # then paid once per shape, not per step. Decode steps only: their row counts repeat, where prompts'
        # lengths would each cost a trace of every layer.
        self.stack = mx.compile(self._stack) if in_place else None
        # Likewise where attention is the reference's MLX ops (MLX on the CPU): a decode step is one compiled call that
        # writes K/V with MLX's scatter and gives the pools it wrote back (each updated in place: the caller lets go of
        # the one it passed). A sliding window's masks are made per step, outside: those models go layer by layer.
        self.reference_stack = None
        if backend.attention.name == "mlx-reference" and all(layer.attention.window is None for layer in layers):
            self.reference_stack = mx.compile(self._reference_stack)
        self._greedy_step: Callable[..., tuple[mx.array, ...]] | None = None

    def greedy_decoder(self, embed: Callable[[mx.array], mx.array], head: Callable[[mx.array], mx.array]
                       ) -> Callable[[Batch, KVPool], mx.array | None] | None:
        """A whole greedy decode step (embed: ids -> residual stream; head: last residual stream -> logits) as one
        compiled call with one upload of the step's integers (and of its tokens, unless the step before left them on
        the device), where the blocks' decode step is the reference stack:
        the host then builds a step from a handful of ops rather than some thirty (`greedy_decode`)."""
        if self.reference_stack is None:
            return None

        def step(tokens: mx.array, ints: mx.array, *pools: mx.array) -> tuple[mx.array, ...]:
            h, *written = self._reference_stack(embed(tokens), ints[:, 0], ints[:, 1], ints[:, 2], ints[:, 3:], *pools)
            return (mx.argmax(head(h), axis=-1).astype(mx.int32), *written)

        self._greedy_step = mx.compile(step)
        return self.greedy_decode

    def greedy_decode(self, batch: Batch, kv: KVPool) -> mx.array | None:
        """Each row's likeliest next token, where every row is a sequence's one decode token and samples (None: the
        step takes the model's forward pass)."""
        rows = len(batch.positions)
        if (self._greedy_step is None or not 0 < rows <= MAX_COMPILED_ROWS or batch.num_seqs != rows
                or len(batch.logits_indices) != rows):
            return None
        _, tables, _ = batch.decode_layout()  # cut to the longest context, as the reference's are
        width = tables.shape[1]
        # each row's position, the pool block and offset of its K/V, then its block table padded as
        # _decode_in_one_call pads it, so a trace serves many steps
        ints = np.zeros((rows, 3 + padded_width(width)), np.int32)
        ints[:, 0] = batch.positions
        ints[:, 1], ints[:, 2] = np.divmod(batch.slot_mapping, batch.block_size)
        ints[:, 3 : 3 + width] = tables
        tokens = batch.device_token_ids
        if tokens is None:
            tokens = mx.array(batch.token_ids.astype(np.int32))
        n = len(self.layers)
        sampled, *pools = self._greedy_step(tokens, mx.array(ints), *kv.k, *kv.v)
        # not among the step's written pools (`MLXBackend.written`): the sampled tokens read every layer's, so they
        # are computed with them, and a reference held there would keep the next step's write from updating them in
        # place (a chain of steps, `LLMEngine._burst`)
        kv.k[:], kv.v[:] = pools[:n], pools[n:]
        return sampled

    def __call__(self, h: mx.array, kv: KVPool, meta: MLXMeta) -> mx.array:
        be = self.backend
        rows = h.shape[0]
        if self.stack is not None and rows <= MAX_COMPILED_ROWS and meta.attention.batch.num_seqs == rows:
            a = meta.attention
            return self.stack(h, meta.positions, meta.slots, a.row_seq, a.row_len, a.block_tables, *kv.k, *kv.v)
        if self.reference_stack is not None and rows <= MAX_COMPILED_ROWS and meta.attention.num_decode == rows:
            return self._decode_in_one_call(h, kv, meta)
        parts = self.compiled if rows <= MAX_COMPILED_ROWS else self.plain
        metas = [meta, *(be.with_rope(meta, rope) for rope in self.ropes[1:])]
        for i, layer in enumerate(self.layers):
            before, after = parts[i]
            m = metas[layer.attention.rope]
            q, k, v = before(h, m.positions, m.freqs)
            if self.in_place:
                o = self._attend_in_place(q, k, v, kv.k[i], kv.v[i], m.slots, m.attention)
            else:
                kv.write(i, k, v, m)
                o = be.paged_attention(q, kv.k[i], kv.v[i], m, layer.attention.window)
            h = after(h, o)
        return h

    def _stack(self, h: mx.array, positions: mx.array, slots: mx.array, row_seq: mx.array, row_len: mx.array,
               block_tables: mx.array, *pools: mx.array) -> mx.array:
        """Every layer, K/V written in place (pools: each layer's K, then each layer's V). Traced once per shape, so
        the attention's partitions are sized for the block tables' width (a shape: prepare_kernel pads it to 16 blocks
        or the next power of two, so widths repeat) rather than for the longest context (a value, which a trace
        would keep)."""
        n = len(self.layers)
        block_size = pools[0].shape[1]
        attention = KernelMeta(row_seq, row_len, block_tables, block_size, block_tables.shape[1] * block_size)
        for i, layer in enumerate(self.layers):
            before, after = self.plain[i]
            k_pool, v_pool = pools[i], pools[n + i]
            q, k, v = before(h, positions, self.ropes[layer.attention.rope])
            h = after(h, self._attend_in_place(q, k, v, k_pool, v_pool, slots, attention))
        return h

    def _decode_in_one_call(self, h: mx.array, kv: KVPool, meta: MLXMeta) -> mx.array:
        """A step of decode rows only, in order, through the compiled reference stack; the block tables padded to
        padded_width blocks, so that a trace serves many steps."""
        a = meta.attention
        width = a.decode_blocks.shape[1]
        blocks = mx.pad(a.decode_blocks, [(0, 0), (0, padded_width(width) - width)])
        n = len(self.layers)
        h, *pools = self.reference_stack(h, meta.positions, meta.slot_blocks, meta.slot_offsets, blocks, *kv.k, *kv.v)
        kv.k[:], kv.v[:] = pools[:n], pools[n:]  # computed with any row of h, which reads them all (see greedy_decode)
        return h

    def _reference_stack(self, h: mx.array, positions: mx.array, slot_blocks: mx.array, slot_offsets: mx.array,
                         blocks: mx.array, *pools: mx.array) -> tuple[mx.array, ...]:
        """Every layer of a decode step, attention by the reference's ops (pools: each layer's K, then each layer's V);
        returns the residual stream and the pools written."""
        be, n = self.backend, len(self.layers)
        pools = list(pools)
        # each row sees its sequence's keys up to its own position
        keys = mx.arange(blocks.shape[1] * pools[0].shape[1])
        mask = mx.where(keys[None, :] <= positions[:, None], 0.0, MASKED)[:, None, None, :]
        for i, layer in enumerate(self.layers):
            before, after = self.plain[i]
            q, k, v = before(h, positions, self.ropes[layer.attention.rope])
            for j, values in ((i, k), (n + i, v)):
                pools[j][slot_blocks, slot_offsets] = be.pool_rows(pools[j], values)
            h = after(h, decode_attention(q, pools[i], pools[n + i], blocks, mask))
        return (h, *pools)

    def _attend_in_place(self, q: mx.array, k: mx.array, v: mx.array, k_pool: mx.array, v_pool: mx.array,
                         slots: mx.array, attention: KernelMeta) -> mx.array:
        """A layer's K and V written at slots through the pools' pointers (CUDA), then its attention, the CUDA
        kernel, which takes the write's result as an input and so runs after it."""
        be = self.backend
        written = write_in_place(k_pool, v_pool, be.pool_rows(k_pool, k), be.pool_rows(v_pool, v), slots)
        return kernel_paged_attention(q, k_pool, v_pool, attention, "cuda", written)

    def _before_write(self, layer: Any) -> Callable[[mx.array, mx.array, mx.array], tuple[mx.array, ...]]:
        """(h, positions, RoPE wavelengths) -> this layer's q, k, v [T, heads, head_dim]."""
        eps, attn = self.eps, layer.attention
        n_q, n_kv, hd = attn.n_heads, attn.n_kv_heads, attn.head_dim

        def before_write(h: mx.array, positions: mx.array, freqs: mx.array) -> tuple[mx.array, ...]:
            qkv = attn.qkv(mx.fast.rms_norm(h, layer.attn_norm, eps))
            if attn.qkv_bias is not None:
                qkv = qkv + attn.qkv_bias
            t = qkv.shape[0]
            k_end = (n_q + n_kv) * hd
            qk = qkv[:, :k_end].reshape(t, n_q + n_kv, hd)
            if attn.q_norm is None:
                qk = rope_rows(qk, positions, freqs)
                q, k = qk[:, :n_q], qk[:, n_q:]
            else:
                q = mx.fast.rms_norm(qk[:, :n_q], attn.q_norm, attn.norm_eps)
                k = mx.fast.rms_norm(qk[:, n_q:], attn.k_norm, attn.norm_eps)
                q, k = rope_rows(q, positions, freqs), rope_rows(k, positions, freqs)
            if attn.q_scale != 1.0:
                q = q * attn.q_scale
            return q, k, qkv[:, k_end:].reshape(t, n_kv, hd)

        return before_write

    def _after_attention(self, layer: Any) -> Callable[[mx.array, mx.array], mx.array]:
        """(h, attention output [T, heads, head_dim]) -> h after the block."""
        be, eps, attn, mlp = self.backend, self.eps, layer.attention, layer.mlp
        activation = be.silu_mul if mlp.activation == "silu" else be.gelu_tanh_mul

        def after_attention(h: mx.array, o: mx.array) -> mx.array:
            a = attn.o(o.reshape(o.shape[0], -1))
            if layer.post_attn_norm is not None:
                a = mx.fast.rms_norm(a, layer.post_attn_norm, eps)
            h = h + a
            m = mlp.down(activation(mlp.gate_up(mx.fast.rms_norm(h, layer.mlp_norm, eps))))
            if layer.post_mlp_norm is not None:
                m = mx.fast.rms_norm(m, layer.post_mlp_norm, eps)
            return h + m

        return after_attention
