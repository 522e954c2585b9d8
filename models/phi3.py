"""Phi-3: Llama blocks whose checkpoints hold q/k/v as one `qkv_proj` and gate/up as one
`gate_up_proj`, with LongRoPE (short and long per-frequency factors, and an attention factor) in
the 128k-context models, and an attention window in some configs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from edgeserve.backends.base import Backend
from edgeserve.errors import ModelLoadError
from edgeserve.models.base import LONGROPE, ModelArgs, Weights, WindowedArgs, rope_attention_factor, rope_kind
from edgeserve.models.llama import MLP, Attention, Llama


@dataclass
class Phi3Args(WindowedArgs):
    original_max_position_embeddings: int | None = None

    def __post_init__(self) -> None:
        scaling = self.rope_scaling or {}
        if scaling.get("partial_rotary_factor", 1.0) != 1.0:
            raise ModelLoadError(f"phi3 with RoPE over part of each head (partial_rotary_factor "
                                 f"{scaling['partial_rotary_factor']}, as in Phi-4-mini) is not supported")
        if rope_kind(self) in LONGROPE:
            original = scaling.get("original_max_position_embeddings") or self.original_max_position_embeddings
            if original is None:
                raise ModelLoadError("phi3 LongRoPE without original_max_position_embeddings")
            self.original_max_position_embeddings = original
            self.rope_scaling = {**scaling, "original_max_position_embeddings": original}
        super().__post_init__()

    def to_config(self) -> dict[str, Any]:
        config = super().to_config()
        scaling = config.get("rope_scaling")
        if scaling and "rope_type" in scaling:
            config["rope_scaling"] = {**scaling, "type": scaling["rope_type"]}  # where mlx-lm's Phi-3 reads it
        return config


@dataclass
class Phi3Attention(Attention):
    @classmethod
    def load(cls, args: ModelArgs, weights: Weights, prefix: str, be: Backend) -> Phi3Attention:
        """q/k/v from one matrix; LongRoPE's scale of cos and sin is on q and k both, so their
        product, which attention sees, scales by its square: q carries it."""
        factor = rope_attention_factor(args)
        return cls(args.num_attention_heads, args.num_key_value_heads, args.head_dim,
                   qkv=be.linear([weights[prefix + "qkv_proj.weight"]]), qkv_bias=None,
                   o=be.linear([weights[prefix + "o_proj.weight"]]), window=args.sliding_window,
                   q_scale=factor * factor)


@dataclass
class Phi3MLP(MLP):
    @classmethod
    def load(cls, args: ModelArgs, weights: Weights, prefix: str, be: Backend) -> Phi3MLP:
        return cls(gate_up=be.linear([weights[prefix + "gate_up_proj.weight"]]),
                   down=be.linear([weights[prefix + "down_proj.weight"]]))


class Phi3(Llama):
    attention_class = Phi3Attention
    mlp_class = Phi3MLP
    layer_weights = ("input_layernorm", "post_attention_layernorm", "self_attn.qkv_proj", "self_attn.o_proj",
                     "mlp.gate_up_proj", "mlp.down_proj")
