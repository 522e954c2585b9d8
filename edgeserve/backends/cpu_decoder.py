"""Every decoder block of a step in one call to the C extension (see _decoder.c).

Block by block, a decode step makes ~10 kernel calls per layer from Python, and for one row each
call's argument parsing and dispatch cost more than its work. `CPUDecoder` hands the whole chain
to C: the same C ops in the same order on the same thread pool, so the results are the same bits
as the block-by-block path, and a step is one call.

The plan reads each layer as `models.llama.Layer` describes it: the options the families set
(q/k head norms, a query scale, a window, which RoPE tables, SiLU or GELU, norms after attention
and MLP) become per-layer flags and optional weights, so Llama, Mistral, Phi-3, Qwen 3 and Gemma 3
share the one loop.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from edgeserve.backends import qmatmul
from edgeserve.backends.qmatmul import QMatrix

if TYPE_CHECKING:
    from edgeserve.backends.kv_pool import KVPool

def _segments(w: Any) -> list[tuple[int, tuple]] | None:
    """A matrix as the plan takes it: (first column, gemm's weight arguments) per packed segment, or
    None where it is not a QMatrix or a segment is float32 (which BLAS computes, block by block)."""
    if not isinstance(w, QMatrix) or not all(s.bits for s in w.segments):
        return None
    return [(s.start, (*s.c_args()[0], *s.c_args()[1])) for s in w.segments]


def _layer_spec(layer: Any) -> tuple | None:
    """The plan's tuple of one `models.llama.Layer`, or None where the plan cannot run it."""
    att, mlp = layer.attention, layer.mlp
    mats = [_segments(w) for w in (att.qkv, att.o, mlp.gate_up, mlp.down)]
    if None in mats:
        return None
    return (layer.attn_norm, att.qkv_bias, att.q_norm, att.k_norm, layer.post_attn_norm, layer.mlp_norm,
            layer.post_mlp_norm, *mats, float(att.norm_eps), float(att.q_scale), att.window or 0, att.rope,
            mlp.activation == "gelu_tanh")


class CPUDecoder:
    """A plan of every layer's weights, parsed once by the extension, run once per step."""

    def __init__(self, plan: Any):
        self.plan = plan

    @classmethod
    def build(cls, layers: list[Any], eps: float, ropes: list[tuple[np.ndarray, np.ndarray]],
              kv_dtype: str) -> CPUDecoder | None:
        """A decoder for layers described as `models.llama.Layer`, rotated by `ropes` (the tables
        `attention.rope` indexes), on a KV pool of kv_dtype; None where a weight is not packed for the C
        gemm, the heads are wider than attention's kernels take or the build has no kernels for kv_dtype."""
        if not layers or not qmatmul.compiled() or kv_dtype not in qmatmul._ext.KV_TYPES:
            return None
        specs = [_layer_spec(layer) for layer in layers]
        if None in specs:
            return None
        att, mlp = layers[0].attention, layers[0].mlp
        hidden, inter = att.o.shape[0], mlp.gate_up.shape[0] // 2
        plan = qmatmul._ext.decoder_plan(hidden, att.n_heads, att.n_kv_heads, att.head_dim, inter, eps, specs,
                                         [tuple(rope) for rope in ropes])
        return None if plan is None else cls(plan)

    def __call__(self, h: np.ndarray, kv: KVPool, meta: Any) -> np.ndarray:
        """The residual stream after every block; this step's K/V go into the pool."""
        h = np.ascontiguousarray(h, dtype=np.float32)
        qmatmul._ext.decoder_run(self.plan, h, kv.k, kv.v, np.asarray(meta.positions, np.int64), meta.slot_mapping,
                                 meta.block_tables, meta.context_lens)
        return h
