"""Every Llama decoder block of a step in one call to the C extension (see _decoder.c).

Block by block, a decode step makes ~10 kernel calls per layer from Python, and for one row each
call's argument parsing and dispatch cost more than its work. `CPUDecoder` hands the whole chain
to C: the same C ops in the same order on the same thread pool, so the results are the same bits
as the block-by-block path, and a step is one call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from edgeserve.backends import qmatmul
from edgeserve.backends.qmatmul import QMatrix

if TYPE_CHECKING:
    from edgeserve.backends.kv_pool import KVPool


class CPUDecoder:
    """A plan of every layer's weights, parsed once by the extension, run once per step."""

    def __init__(self, plan: Any):
        self.plan = plan

    @classmethod
    def build(cls, layers: list[Any], eps: float) -> CPUDecoder | None:
        """A decoder for layers shaped as `models.llama.Layer`, or None where a weight is not packed for the C gemm."""
        if not layers or not qmatmul.compiled():
            return None
        specs = []
        for layer in layers:
            att, mlp = layer.attention, layer.mlp
            mats = [w.packed_args() if isinstance(w, QMatrix) else None for w in (att.qkv, att.o, mlp.gate_up, mlp.down)]
            if None in mats:
                return None
            specs.append((layer.attn_norm, att.qkv_bias, layer.mlp_norm, *mats))
        att, mlp = layers[0].attention, layers[0].mlp
        hidden, inter = att.o.shape[0], mlp.gate_up.shape[0] // 2
        plan = qmatmul._ext.decoder_plan(hidden, att.n_heads, att.n_kv_heads, att.head_dim, inter, eps, specs)
        return cls(plan)

    def __call__(self, h: np.ndarray, kv: KVPool, meta: Any) -> np.ndarray:
        """The residual stream after every block; this step's K/V go into the pool."""
        h = np.ascontiguousarray(h, dtype=np.float32)
        qmatmul._ext.decoder_run(self.plan, h, kv.k, kv.v, meta.cos, meta.sin, meta.slot_mapping, meta.block_tables,
                                 meta.context_lens)
        return h
