"""Gemma 3 (its text decoder), written once against a backend.

Where it differs from Llama: the embedding is scaled by sqrt(hidden); every RMSNorm scales by
(1 + weight); attention and MLP each have a norm before and after them; q and k heads each pass
an RMSNorm of their own before RoPE; queries are scaled by query_pre_attn_scalar ** -0.5; the MLP
gate is GELU (tanh approximation); local layers see only the last `sliding_window` tokens and
interleave with global ones (one global layer in every `sliding_window_pattern`), each kind with
its own RoPE base; the logits may be soft-capped.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from edgeserve.backends.base import Array, Backend, HostWeight, RopeTables
from edgeserve.models.base import ModelArgs, Weights, rope_inv_freq
from edgeserve.models.llama import MLP, Attention, Layer, Llama

SLIDING, FULL = "sliding_attention", "full_attention"

# Gemma's turn format, as its tokenizer_config.json writes it (string contents only), for files
# that ship no template of their own: the system prompt opens the first user turn.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'system' %}"
    "{% set first_user_prefix = messages[0]['content'] + '\n\n' %}{% set loop_messages = messages[1:] %}"
    "{% else %}{% set first_user_prefix = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)


@dataclass
class Gemma3Args(ModelArgs):
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0  # global layers
    rope_local_base_freq: float = 10_000.0  # sliding-window layers
    tie_word_embeddings: bool = True
    sliding_window: int = 4096
    sliding_window_pattern: int = 6  # every 6th layer is global (GGUF files do not say; llama.cpp assumes 6)
    layer_types: list[str] | None = None
    query_pre_attn_scalar: float = 256.0
    final_logit_softcapping: float | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.layer_types is None:
            every = self.sliding_window_pattern
            self.layer_types = [FULL if (i + 1) % every == 0 else SLIDING for i in range(self.num_hidden_layers)]

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Gemma3Args:
        """Also reads transformers 5's per-layer-type rope_parameters and its `_sliding_window_pattern`."""
        config = dict(config)
        rope = config.pop("rope_parameters", None) or {}
        if FULL in rope:
            config.setdefault("rope_theta", rope[FULL].get("rope_theta", cls.rope_theta))
            if rope[FULL].get("rope_type", "default") != "default":
                config.setdefault("rope_scaling", rope[FULL])
            config.setdefault("rope_local_base_freq", rope.get(SLIDING, {}).get("rope_theta", cls.rope_local_base_freq))
        if "_sliding_window_pattern" in config:
            config.setdefault("sliding_window_pattern", config["_sliding_window_pattern"])
        return super().from_config(config)


class Gemma3(Llama):
    """Llama's forward pass with Gemma's parts: (1 + weight) norms, four per block, q/k head norms,
    the query scale, GELU, a second RoPE base and a window on local layers, the scaled embedding
    and the soft-capped logits."""

    layer_weights: tuple[str, ...] = (
        "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm",
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm",
        "self_attn.k_norm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
    )
    args: Gemma3Args

    def __init__(self, args: Gemma3Args, weights: Weights, backend: Backend, layers: range | None = None):
        # float32, as transformers multiplies a float32 embedding by it
        self.embed_scale = float(np.float32(math.sqrt(args.hidden_size)))
        super().__init__(args, weights, backend, layers)

    def norm_vector(self, w: HostWeight) -> Array:
        """A Gemma RMSNorm weight as the plain scale the backend's rms_norm multiplies by: 1 + weight."""
        return self.backend.vector(np.asarray(w, dtype=np.float32) + np.float32(1.0))

    def rope_tables(self) -> list[RopeTables]:
        """The global layers' tables, then the local (sliding-window) layers' at their own base."""
        args = self.args
        local = dataclasses.replace(args, rope_theta=args.rope_local_base_freq, rope_scaling=None)
        return [*super().rope_tables(), self.backend.rope_tables(rope_inv_freq(local), args.max_position_embeddings)]

    def load_layer(self, weights: Weights, i: int) -> Layer:
        be, args, prefix = self.backend, self.args, f"model.layers.{i}."
        attention = Attention.load(args, weights, prefix + "self_attn.", be)
        attention.q_norm = self.norm_vector(weights[prefix + "self_attn.q_norm.weight"])
        attention.k_norm = self.norm_vector(weights[prefix + "self_attn.k_norm.weight"])
        attention.norm_eps = args.rms_norm_eps
        attention.q_scale = math.sqrt(args.head_dim / args.query_pre_attn_scalar)
        if args.layer_types[i] == SLIDING:
            attention.window, attention.rope = args.sliding_window, 1
        return Layer(
            attn_norm=self.norm_vector(weights[prefix + "input_layernorm.weight"]),
            attention=attention,
            mlp_norm=self.norm_vector(weights[prefix + "pre_feedforward_layernorm.weight"]),
            mlp=dataclasses.replace(MLP.load(args, weights, prefix + "mlp.", be), activation="gelu_tanh"),
            post_attn_norm=self.norm_vector(weights[prefix + "post_attention_layernorm.weight"]),
            post_mlp_norm=self.norm_vector(weights[prefix + "post_feedforward_layernorm.weight"]),
        )

    def embed_tokens(self, ids: Array) -> Array:
        return super().embed_tokens(ids) * self.embed_scale

    def logits(self, h: Array) -> Array:
        logits = super().logits(h)
        cap = self.args.final_logit_softcapping
        return self.backend.soft_cap(logits, cap) if cap else logits
