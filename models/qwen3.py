"""Qwen 3: Llama blocks whose q and k heads each pass an RMSNorm of their own before RoPE, without
q/k/v biases (Qwen2's), and with a head width of its own (128 where hidden / heads is 64)."""

from __future__ import annotations

from dataclasses import dataclass

from edgeserve.backends.base import Backend
from edgeserve.models.base import ModelArgs, Weights
from edgeserve.models.llama import Attention, Llama


@dataclass
class Qwen3Attention(Attention):
    @classmethod
    def load(cls, args: ModelArgs, weights: Weights, prefix: str, be: Backend) -> Qwen3Attention:
        """Llama's attention with its q and k head norms (over head_dim; q heads and k heads have their own)."""
        attention = super().load(args, weights, prefix, be)
        attention.q_norm = be.vector(weights[prefix + "q_norm.weight"])
        attention.k_norm = be.vector(weights[prefix + "k_norm.weight"])
        attention.norm_eps = args.rms_norm_eps
        return attention


class Qwen3(Llama):
    attention_class = Qwen3Attention
    layer_weights = (*Llama.layer_weights, "self_attn.q_norm", "self_attn.k_norm")
