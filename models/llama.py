"""The Llama architecture (Llama 2/3.x, SmolLM, TinyLlama, Mistral, Qwen2), written once against a backend.

The forward pass takes one ragged batch (decode tokens and prefill chunks of many sequences) and
reads/writes K/V through the paged pool, so the same code serves one stream or many.

A family that differs in a part subclasses that part (`Attention`, `MLP`) and names it on a
subclass of `Llama`; one whose blocks are wired otherwise also overrides `load_layer` and `block`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from edgeserve.backends.base import Array, Backend, Prepared, StepMeta
from edgeserve.batch import Batch
from edgeserve.models.base import ModelArgs, Weights, rope_inv_freq

if TYPE_CHECKING:
    from edgeserve.backends.kv_pool import KVPool


@dataclass
class Qwen2Args(ModelArgs):
    attention_bias: bool = True  # Qwen2 has q/k/v biases; its config.json does not say so


@dataclass
class Attention:
    """Grouped-query self-attention over the paged pool, q/k/v fused into one matmul."""

    n_heads: int
    n_kv_heads: int
    head_dim: int
    qkv: Prepared
    qkv_bias: Array | None
    o: Prepared
    window: int | None = None  # keys each query sees, itself included (sliding-window attention); None: all

    @classmethod
    def load(cls, args: ModelArgs, weights: Weights, prefix: str, be: Backend) -> Attention:
        """The weights under `prefix` (e.g. 'model.layers.0.self_attn.'), prepared by the backend."""
        bias = None
        if args.attention_bias:
            bias = be.vector(np.concatenate([np.asarray(weights[f"{prefix}{n}_proj.bias"]) for n in "qkv"]))
        return cls(
            args.num_attention_heads,
            args.num_key_value_heads,
            args.head_dim,
            qkv=be.linear([weights[f"{prefix}{n}_proj.weight"] for n in "qkv"]),
            qkv_bias=bias,
            o=be.linear([weights[prefix + "o_proj.weight"]]),
        )

    def __call__(self, be: Backend, x: Array, layer: int, kv: KVPool, meta: StepMeta) -> Array:
        """Attention output [T, hidden] of normed x; this step's K/V go into the pool's `layer`."""
        n_q, n_kv, hd = self.n_heads, self.n_kv_heads, self.head_dim
        qkv = be.matmul(x, self.qkv)
        if self.qkv_bias is not None:
            qkv = qkv + self.qkv_bias
        t = qkv.shape[0]
        k_end = (n_q + n_kv) * hd
        q, k = self.position(be, qkv[:, :k_end].reshape(t, n_q + n_kv, hd), meta)
        v = qkv[:, k_end:].reshape(t, n_kv, hd)
        kv.write(layer, k, v, meta)
        o = be.paged_attention(q, kv.k[layer], kv.v[layer], meta, self.window)
        return be.matmul(o.reshape(t, n_q * hd), self.o)

    def position(self, be: Backend, qk: Array, meta: StepMeta) -> tuple[Array, Array]:
        """q and k of the q then k heads qk [T, n_q + n_kv, head_dim], rotated to their positions."""
        qk = be.apply_rope(qk, meta)  # q and k heads in one call
        return qk[:, : self.n_heads], qk[:, self.n_heads :]


@dataclass
class MLP:
    """SiLU-gated MLP, gate and up fused into one matmul."""

    gate_up: Prepared
    down: Prepared

    @classmethod
    def load(cls, args: ModelArgs, weights: Weights, prefix: str, be: Backend) -> MLP:
        """The weights under `prefix` (e.g. 'model.layers.0.mlp.'), prepared by the backend."""
        return cls(
            gate_up=be.linear([weights[prefix + "gate_proj.weight"], weights[prefix + "up_proj.weight"]]),
            down=be.linear([weights[prefix + "down_proj.weight"]]),
        )

    def __call__(self, be: Backend, x: Array) -> Array:
        return be.matmul(be.silu_mul(be.matmul(x, self.gate_up)), self.down)


@dataclass
class Layer:
    """One decoder block: RMSNorm before attention and before the MLP, each added to the residual."""

    attn_norm: Array
    attention: Attention
    mlp_norm: Array
    mlp: MLP


class Llama:
    """Weights prepared by a backend, and the forward pass over a ragged batch."""

    attention_class: type[Attention] = Attention
    mlp_class: type[MLP] = MLP
    # what each layer's checkpoint holds, under Hugging Face names (the loader checks it is all there)
    layer_weights: tuple[str, ...] = (
        "input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
        "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
    )

    def __init__(self, args: ModelArgs, weights: Weights, backend: Backend):
        self.args = args
        self.backend = backend
        be = backend
        self.embed = be.embedding(weights["model.embed_tokens.weight"])
        head = weights.get("lm_head.weight")
        self.lm_head = be.head(self.embed if head is None or args.tie_word_embeddings else be.embedding(head))
        self.norm = be.vector(weights["model.norm.weight"])
        self.layers = [self.load_layer(weights, f"model.layers.{i}.") for i in range(args.num_hidden_layers)]
        self.rope = be.rope_tables(rope_inv_freq(args), args.max_position_embeddings)
        # The backend may run plain blocks as one call; a family that changes a part runs its own code.
        self.fused_blocks = be.fuse_blocks(self.layers, args.rms_norm_eps) if self.has_plain_blocks() else None

    def has_plain_blocks(self) -> bool:
        """Whether every block is this file's Llama block, as a backend's fused blocks compute it."""
        cls = type(self)
        return (cls.block is Llama.block and cls.load_layer is Llama.load_layer and cls.attention_class is Attention
                and cls.mlp_class is MLP)

    def load_layer(self, weights: Weights, prefix: str) -> Layer:
        be = self.backend
        return Layer(
            attn_norm=be.vector(weights[prefix + "input_layernorm.weight"]),
            attention=self.attention_class.load(self.args, weights, prefix + "self_attn.", be),
            mlp_norm=be.vector(weights[prefix + "post_attention_layernorm.weight"]),
            mlp=self.mlp_class.load(self.args, weights, prefix + "mlp.", be),
        )

    def block(self, layer: Layer, i: int, h: Array, kv: KVPool, meta: StepMeta) -> Array:
        """The residual stream h after decoder block i."""
        be, eps = self.backend, self.args.rms_norm_eps
        h = h + layer.attention(be, be.rms_norm(h, layer.attn_norm, eps), i, kv, meta)
        return h + layer.mlp(be, be.rms_norm(h, layer.mlp_norm, eps))

    def forward(self, batch: Batch, kv: KVPool) -> Array:
        """Run one step; return logits of the rows in batch.logits_indices."""
        be = self.backend
        meta = be.batch_meta(batch, self.rope)
        h = be.embed(self.embed, meta.token_ids)
        if self.fused_blocks is not None:
            h = self.fused_blocks(h, kv, meta)
        else:
            for i, layer in enumerate(self.layers):
                h = self.block(layer, i, h, kv, meta)
        h = be.rms_norm(be.take_rows(h, meta.logits_indices), self.norm, self.args.rms_norm_eps)
        return be.lm_head(h, self.lm_head)
