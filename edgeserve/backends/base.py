"""The contract between the model code and an array backend: every operation a model's forward pass
and the KV pool ask of a backend, so a model is written once and runs on each.

Arrays stay opaque here: a NumPy backend computes on `np.ndarray`, the MLX backend on `mx.array`
(which cannot be named without importing MLX), and what a backend makes of a weight (a float32
matrix, a dequantizing wrapper, MLX's quantized layout) is its own affair. The model only hands
those objects back to the backend that made them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, Union, runtime_checkable

import numpy as np

from edgeserve.batch import Batch, SamplingRows
from edgeserve.quant.affine import QuantizedTensor

Array = Any  # an activation or KV array of the backend (np.ndarray, mx.array)
HostWeight = Union[np.ndarray, QuantizedTensor]  # a weight as a loader gives it


@dataclass
class PartialSum:
    """A weight of which this rank holds some input columns (tensor parallelism, `edgeserve.distributed`): its
    matmul gives a partial sum, which a backend running in a group adds up over the group's ranks."""

    weight: HostWeight

Prepared = Any  # a weight as the backend keeps it, made by vector/embedding/head/linear
RopeTables = Any  # RoPE as the backend applies it, made once by rope_tables


class StepMeta(Protocol):
    """A backend's per-step arrays, made once by batch_meta and shared by every layer."""

    token_ids: Array
    logits_indices: Array


@runtime_checkable
class Backend(Protocol):
    """The operations a backend provides; each returns new arrays unless it says otherwise."""

    name: str  # "numpy", "mlx"
    # whether launched work runs while the host goes on (a GPU), so that launching a step early pays
    computes_async: bool
    # whether a step may be launched while the one before still computes without its K/V writes copying the pool
    launch_early: bool
    # whether a step's input tokens may be the step before's samples still on the device (Batch.device_token_ids)
    chains_steps: bool
    kv_dtype: str  # the KV pool's element type, one of KV_DTYPES: "float32", "float16" or "int8"

    def describe(self) -> str:
        """One line for the start-up message, e.g. 'numpy (float32 weights)'."""
        ...

    # weights, prepared once when the model is built -----------------------------------------

    def vector(self, w: HostWeight) -> Array:
        """A 1-D weight (norm scale, bias) as an activation-dtype array."""
        ...

    def embedding(self, w: HostWeight) -> Prepared:
        """A [vocab, hidden] table that `embed` looks rows up in."""
        ...

    def head(self, table: Prepared) -> Prepared:
        """The output head made from an embedding (the model's own, where tied), for `lm_head`."""
        ...

    def linear(self, parts: list[HostWeight]) -> Prepared:
        """[out, in] matrices sharing one input (q/k/v, gate/up), fused so `matmul` gives their outputs side by side."""
        ...

    def rope_tables(self, inv_freq: np.ndarray, max_positions: int) -> RopeTables:
        """RoPE for positions below max_positions at the given inverse frequencies."""
        ...

    def fuse_blocks(self, layers: list[Any], eps: float,
                    ropes: list[RopeTables]) -> Callable[[Array, Any, StepMeta], Array] | None:
        """All of a model's blocks, as `models.llama.Layer` describes each (its attention rotated by
        ropes[layer.attention.rope]), as one call (h, kv_pool, meta) -> h, where the backend has one;
        None: the model runs its blocks one op at a time."""
        ...

    def greedy_decoder(self, blocks: Any, embed: Callable[[Array], Array], head: Callable[[Array], Array]
                       ) -> Callable[[Batch, Any], Array | None] | None:
        """A whole decode step of fused blocks (`fuse_blocks`) between a model's embedding (ids -> residual stream)
        and its head (last residual stream -> logits), giving each row's likeliest token as one call where the
        backend has one: (batch, kv_pool) -> tokens, or None for a step it does not take. None: none."""
        ...

    # one step: a ragged batch of decode tokens and prefill chunks -----------------------------

    def batch_meta(self, batch: Batch, rope: RopeTables) -> StepMeta:
        ...

    def embed(self, table: Prepared, ids: Array) -> Array:
        """Rows of an embedding: [T] ids -> [T, hidden]."""
        ...

    def matmul(self, x: Array, w: Prepared) -> Array:
        """x [T, in] times a `linear` weight: [T, out]."""
        ...

    def lm_head(self, x: Array, head: Prepared) -> Array:
        """Logits [T, vocab] of hidden states [T, hidden]."""
        ...

    def take_rows(self, x: Array, rows: Array) -> Array:
        ...

    def rms_norm(self, x: Array, w: Array, eps: float) -> Array:
        ...

    def apply_rope(self, x: Array, meta: StepMeta) -> Array:
        """Rotate-half (NeoX) RoPE of heads [T, heads, head_dim] at each row's position."""
        ...

    def silu_mul(self, gate_up: Array) -> Array:
        """silu(gate) * up of [T, 2 * n] laid out as gate then up: [T, n]."""
        ...

    def gelu_tanh_mul(self, gate_up: Array) -> Array:
        """gelu(gate) * up, GELU in its tanh approximation, of [T, 2 * n] laid out as gate then up: [T, n]."""
        ...

    def soft_cap(self, x: Array, cap: float) -> Array:
        """cap * tanh(x / cap), elementwise."""
        ...

    def with_rope(self, meta: StepMeta, rope: RopeTables) -> StepMeta:
        """The step's meta with `apply_rope` at other tables (a model whose layers differ in RoPE base)."""
        ...

    def paged_attention(self, q: Array, k_cache: Array, v_cache: Array, meta: StepMeta,
                        window: int | None = None) -> Array:
        """Causal attention of q [T, heads, head_dim] over each row's sequence in the pool; with a
        window, each row sees only its last `window` keys (itself included), as sliding-window layers do."""
        ...

    def to_numpy(self, x: Array) -> np.ndarray:
        """Evaluate the step (pool writes included) and return x as float32 NumPy."""
        ...

    def sample(self, logits: Array, rows: SamplingRows | None) -> Array:
        """Each row's token, left on the device: the likeliest where rows is None; backends with computes_async
        draw by `rows` (the others are given None)."""
        ...

    def launch(self, tokens: Array) -> None:
        """Start computing tokens and the step's pool writes, without waiting for them."""
        ...

    def fetch_tokens(self, tokens: Array) -> list:
        """Launched tokens on the host, once computed: a list of ints, or of lists for several steps' tokens."""
        ...

    def stack_tokens(self, steps: list[Array]) -> Array:
        """Several steps' tokens as one [steps, rows] array, left on the device (chains_steps backends)."""
        ...

    # the KV pool: per layer K and V of [num_blocks, block_size, n_kv_heads, head_dim] ---------

    def allocate_kv(self, num_blocks: int, block_size: int, n_kv_heads: int, head_dim: int) -> Array:
        ...

    def write_kv(self, cache: Array, values: Array, meta: StepMeta) -> Array:
        """Store values [T, n_kv_heads, head_dim] at the step's slots; the pool array to keep using."""
        ...

    def copy_blocks(self, cache: Array, pairs: list[tuple[int, int]]) -> Array:
        """Copy whole blocks (source, destination), for copy-on-write; the pool array to keep using."""
        ...

    def read_blocks(self, cache: Array, blocks: list[int]) -> np.ndarray:
        """Whole blocks of one layer's K or V as NumPy [len(blocks), block_size, n_kv_heads, head] in the pool's
        own element type (an int8 block's scales included), for the prefix store."""
        ...

    def write_blocks(self, cache: Array, blocks: list[int], values: np.ndarray) -> Array:
        """Put whole blocks read by read_blocks back into the pool at `blocks`; the pool array to keep using."""
        ...
