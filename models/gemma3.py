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
from typing import TYPE_CHECKING, Any

import numpy as np

from edgeserve.backends.base import Array, Backend, RopeTables, StepMeta
from edgeserve.batch import Batch
from edgeserve.models.base import ModelArgs, Weights, rope_inv_freq
from edgeserve.models.llama import MLP, Attention

if TYPE_CHECKING:
    from edgeserve.backends.kv_pool import KVPool

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


@dataclass
class Gemma3Attention(Attention):
    """Attention with q/k norms, its query scale, and a sliding window on local layers."""

    q_norm: Array = None
    k_norm: Array = None
    eps: float = 1e-6
    q_scale: float = 1.0  # on top of the backend's 1 / sqrt(head_dim)

    @classmethod
    def load(cls, args: ModelArgs, weights: Weights, prefix: str, be: Backend) -> Gemma3Attention:
        attention = super().load(args, weights, prefix, be)
        attention.q_norm = norm_vector(be, weights[prefix + "q_norm.weight"])
        attention.k_norm = norm_vector(be, weights[prefix + "k_norm.weight"])
        attention.eps = args.rms_norm_eps
        attention.q_scale = math.sqrt(args.head_dim / args.query_pre_attn_scalar)
        return attention

    def position(self, be: Backend, qk: Array, meta: StepMeta) -> tuple[Array, Array]:
        """Each head's RMSNorm (q and k heads with their own weights), RoPE, then the query scale."""
        t, n_q, n_kv, hd = qk.shape[0], self.n_heads, self.n_kv_heads, self.head_dim
        q = be.rms_norm(qk[:, :n_q].reshape(t * n_q, hd), self.q_norm, self.eps)
        k = be.rms_norm(qk[:, n_q:].reshape(t * n_kv, hd), self.k_norm, self.eps)
        q = be.apply_rope(q.reshape(t, n_q, hd), meta)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        return q, be.apply_rope(k.reshape(t, n_kv, hd), meta)


@dataclass
class GeluMLP(MLP):
    """GELU(tanh)-gated MLP, gate and up fused into one matmul."""

    def __call__(self, be: Backend, x: Array) -> Array:
        return be.matmul(be.gelu_tanh_mul(be.matmul(x, self.gate_up)), self.down)


@dataclass
class Gemma3Layer:
    input_norm: Array
    attention: Gemma3Attention
    post_attention_norm: Array
    pre_mlp_norm: Array
    mlp: GeluMLP
    post_mlp_norm: Array


def norm_vector(be: Backend, w: Any) -> Array:
    """A Gemma RMSNorm weight as the plain scale the backend's rms_norm multiplies by: 1 + weight."""
    return be.vector(np.asarray(w, dtype=np.float32) + np.float32(1.0))


class Gemma3:
    """Weights prepared by a backend, and the forward pass over a ragged batch."""

    layer_weights: tuple[str, ...] = (
        "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm",
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm",
        "self_attn.k_norm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
    )

    def __init__(self, args: Gemma3Args, weights: Weights, backend: Backend):
        self.args = args
        self.backend = be = backend
        self.embed = be.embedding(weights["model.embed_tokens.weight"])
        head = weights.get("lm_head.weight")
        self.lm_head = be.head(self.embed if head is None or args.tie_word_embeddings else be.embedding(head))
        self.norm = norm_vector(be, weights["model.norm.weight"])
        # float32, as transformers multiplies a float32 embedding by it
        self.embed_scale = float(np.float32(math.sqrt(args.hidden_size)))
        self.layers = [self.load_layer(weights, i) for i in range(args.num_hidden_layers)]
        self.rope = be.rope_tables(rope_inv_freq(args), args.max_position_embeddings)
        local = dataclasses.replace(args, rope_theta=args.rope_local_base_freq, rope_scaling=None)
        self.local_rope: RopeTables = be.rope_tables(rope_inv_freq(local), args.max_position_embeddings)

    def load_layer(self, weights: Weights, i: int) -> Gemma3Layer:
        be, args, prefix = self.backend, self.args, f"model.layers.{i}."
        attention = Gemma3Attention.load(args, weights, prefix + "self_attn.", be)
        if args.layer_types[i] == SLIDING:
            attention.window = args.sliding_window
        return Gemma3Layer(
            input_norm=norm_vector(be, weights[prefix + "input_layernorm.weight"]),
            attention=attention,
            post_attention_norm=norm_vector(be, weights[prefix + "post_attention_layernorm.weight"]),
            pre_mlp_norm=norm_vector(be, weights[prefix + "pre_feedforward_layernorm.weight"]),
            mlp=GeluMLP.load(args, weights, prefix + "mlp.", be),
            post_mlp_norm=norm_vector(be, weights[prefix + "post_feedforward_layernorm.weight"]),
        )

    def block(self, layer: Gemma3Layer, i: int, h: Array, kv: KVPool, meta: StepMeta) -> Array:
        """The residual stream h after decoder block i."""
        be, eps = self.backend, self.args.rms_norm_eps
        a = layer.attention(be, be.rms_norm(h, layer.input_norm, eps), i, kv, meta)
        h = h + be.rms_norm(a, layer.post_attention_norm, eps)
        m = layer.mlp(be, be.rms_norm(h, layer.pre_mlp_norm, eps))
        return h + be.rms_norm(m, layer.post_mlp_norm, eps)

    def forward(self, batch: Batch, kv: KVPool) -> Array:
        """Run one step; return logits of the rows in batch.logits_indices."""
        be, args = self.backend, self.args
        meta = be.batch_meta(batch, self.rope)
        local = be.with_rope(meta, self.local_rope)
        h = be.embed(self.embed, meta.token_ids) * self.embed_scale
        for i, layer in enumerate(self.layers):
            h = self.block(layer, i, h, kv, local if layer.attention.window is not None else meta)
        h = be.rms_norm(be.take_rows(h, meta.logits_indices), self.norm, args.rms_norm_eps)
        logits = be.lm_head(h, self.lm_head)
        if args.final_logit_softcapping:
            logits = be.soft_cap(logits, args.final_logit_softcapping)
        return logits
