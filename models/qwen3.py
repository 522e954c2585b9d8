"""Qwen 3: Llama blocks whose q and k heads each pass an RMSNorm of their own before RoPE, without
q/k/v biases (Qwen2's), and with a head width of its own (128 where hidden / heads is 64)."""

from __future__ import annotations

from dataclasses import dataclass

from edgeserve.backends.base import Array, Backend, StepMeta
from edgeserve.models.base import ModelArgs, Weights
from edgeserve.models.llama import Attention, Llama


@dataclass
class Qwen3Attention(Attention):
    q_norm: Array = None
    k_norm: Array = None
    eps: float = 1e-6

    @classmethod
    def load(cls, args: ModelArgs, weights: Weights, prefix: str, be: Backend) -> Qwen3Attention:
        attention = super().load(args, weights, prefix, be)
        attention.q_norm = be.vector(weights[prefix + "q_norm.weight"])
        attention.k_norm = be.vector(weights[prefix + "k_norm.weight"])
        attention.eps = args.rms_norm_eps
        return attention

    def position(self, be: Backend, qk: Array, meta: StepMeta) -> tuple[Array, Array]:
        """Each head's RMSNorm over head_dim (q heads and k heads have their own weights), then RoPE."""
        t, n_q, hd = qk.shape[0], self.n_heads, self.head_dim
        q = be.rms_norm(qk[:, :n_q].reshape(t * n_q, hd), self.q_norm, self.eps).reshape(t, n_q, hd)
        k = be.rms_norm(qk[:, n_q:].reshape(t * self.n_kv_heads, hd), self.k_norm, self.eps)
        return be.apply_rope(q, meta), be.apply_rope(k.reshape(t, self.n_kv_heads, hd), meta)


class Qwen3(Llama):
    attention_class = Qwen3Attention
    layer_weights = (*Llama.layer_weights, "self_attn.q_norm", "self_attn.k_norm")
