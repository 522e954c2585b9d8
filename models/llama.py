"""The Llama architecture (Llama 2/3.x, SmolLM, TinyLlama, Mistral, Qwen2), written once against a backend.

The forward pass takes one ragged batch (decode tokens and prefill chunks of many sequences) and
reads/writes K/V through the paged pool, so the same code serves one stream or many.

Each part is a description as much as code: its weights and the options the families set
(per-head q/k norms, a query scale, a sliding window, which RoPE tables, the MLP's activation, norms
after attention and MLP). The block-by-block code below reads them, and so does a backend that runs
every block of a step as one call (`Backend.fuse_blocks`). A family sets the options in its loaders
(`Attention.load`, `MLP.load`, `load_layer`); one whose blocks compute something else overrides
`block` or a part's `__call__`, and runs block by block.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from edgeserve.backends.base import Array, Backend, HostWeight, Prepared, RopeTables, StepMeta
from edgeserve.batch import Batch
from edgeserve.models.base import ModelArgs, Weights, rope_inv_freq

if TYPE_CHECKING:
    from edgeserve.backends.kv_pool import KVPool

ACTIVATIONS = ("silu", "gelu_tanh")  # an MLP's gate: SiLU, or GELU in its tanh approximation


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
    # an RMSNorm over each q head and each k head before RoPE (Qwen 3, Gemma 3): both or neither
    q_norm: Array | None = None
    k_norm: Array | None = None
    norm_eps: float = 1e-6
    q_scale: float = 1.0  # q times this after RoPE, on top of attention's 1 / sqrt(head_dim)
    rope: int = 0  # which of the model's RoPE tables (`Llama.ropes`) rotates q and k

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
        """q and k of the q then k heads qk [T, n_q + n_kv, head_dim]: normed per head where the family
        does, rotated to their positions, q scaled."""
        n_q = self.n_heads
        if self.q_norm is None:
            qk = be.apply_rope(qk, meta)  # q and k heads in one call
            q, k = qk[:, :n_q], qk[:, n_q:]
        else:
            t, n_kv, hd = qk.shape[0], self.n_kv_heads, self.head_dim
            q = be.rms_norm(qk[:, :n_q].reshape(t * n_q, hd), self.q_norm, self.norm_eps)
            k = be.rms_norm(qk[:, n_q:].reshape(t * n_kv, hd), self.k_norm, self.norm_eps)
            q, k = be.apply_rope(q.reshape(t, n_q, hd), meta), be.apply_rope(k.reshape(t, n_kv, hd), meta)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        return q, k


@dataclass
class MLP:
    """Gated MLP, gate and up fused into one matmul: SiLU-gated, or GELU-gated (tanh approximation; Gemma)."""

    gate_up: Prepared
    down: Prepared
    activation: str = "silu"  # or "gelu_tanh"

    def __post_init__(self) -> None:
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"unknown MLP activation {self.activation!r} (choose from {', '.join(ACTIVATIONS)})")

    @classmethod
    def load(cls, args: ModelArgs, weights: Weights, prefix: str, be: Backend) -> MLP:
        """The weights under `prefix` (e.g. 'model.layers.0.mlp.'), prepared by the backend."""
        return cls(
            gate_up=be.linear([weights[prefix + "gate_proj.weight"], weights[prefix + "up_proj.weight"]]),
            down=be.linear([weights[prefix + "down_proj.weight"]]),
        )

    def __call__(self, be: Backend, x: Array) -> Array:
        gate_up = be.matmul(x, self.gate_up)
        act = be.silu_mul(gate_up) if self.activation == "silu" else be.gelu_tanh_mul(gate_up)
        return be.matmul(act, self.down)


@dataclass
class Layer:
    """One decoder block: RMSNorm before attention and before the MLP, each added to the residual
    (Gemma 3: each output normed again before it is added)."""

    attn_norm: Array
    attention: Attention
    mlp_norm: Array
    mlp: MLP
    post_attn_norm: Array | None = None
    post_mlp_norm: Array | None = None


class Llama:
    """Weights prepared by a backend, and the forward pass over a ragged batch."""

    attention_class: type[Attention] = Attention
    mlp_class: type[MLP] = MLP
    # what each layer's checkpoint holds, under Hugging Face names (the loader checks it is all there)
    layer_weights: tuple[str, ...] = (
        "input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
        "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
    )

    def __init__(self, args: ModelArgs, weights: Weights, backend: Backend, layers: range | None = None):
        """layers: the decoder blocks this process holds (a pipeline stage; None: all of them); the embedding
        comes with the first block, the final norm and head with the last, so a stage prepares only its weights."""
        self.args = args
        self.backend = be = backend
        self.stage = layers = range(args.num_hidden_layers) if layers is None else layers
        first, last = layers.start == 0, layers.stop == args.num_hidden_layers
        head = weights.get("lm_head.weight")
        tied = head is None or args.tie_word_embeddings
        # a last stage with a tied head holds the embedding for it
        self.embed = be.embedding(weights["model.embed_tokens.weight"]) if first or (last and tied) else None
        self.lm_head = be.head(self.embed if tied else be.embedding(head)) if last else None
        self.norm = self.norm_vector(weights["model.norm.weight"]) if last else None
        self.layers = [self.load_layer(weights, i) for i in layers]
        self.ropes = self.rope_tables()
        # The backend may run every block as one call, from the parts' descriptions; a family whose
        # blocks compute something else runs its own code, block by block.
        fusable = self.has_plain_blocks()
        self.fused_blocks = be.fuse_blocks(self.layers, args.rms_norm_eps, self.ropes) if fusable else None
        # and where it holds the whole model, a greedy decode step as one call
        self.greedy = (be.greedy_decoder(self.fused_blocks, self.embed_tokens, self.final_logits)
                       if self.fused_blocks is not None and first and last else None)

    def has_plain_blocks(self) -> bool:
        """Whether every block is computed by this file's code from its parts' descriptions, which is
        what a backend's fused blocks compute."""
        def shared(part: object, base: type, *methods: str) -> bool:
            return all(getattr(type(part), m) is getattr(base, m) for m in methods)

        return type(self).block is Llama.block and all(
            shared(layer.attention, Attention, "__call__", "position") and shared(layer.mlp, MLP, "__call__")
            for layer in self.layers)

    def norm_vector(self, w: HostWeight) -> Array:
        """An RMSNorm weight as the scale the backend's rms_norm multiplies by."""
        return self.backend.vector(w)

    def rope_tables(self) -> list[RopeTables]:
        """The RoPE tables layers pick from by `Attention.rope`; the first is the step's own."""
        return [self.backend.rope_tables(rope_inv_freq(self.args), self.args.max_position_embeddings)]

    def load_layer(self, weights: Weights, i: int) -> Layer:
        be, prefix = self.backend, f"model.layers.{i}."
        return Layer(
            attn_norm=self.norm_vector(weights[prefix + "input_layernorm.weight"]),
            attention=self.attention_class.load(self.args, weights, prefix + "self_attn.", be),
            mlp_norm=self.norm_vector(weights[prefix + "post_attention_layernorm.weight"]),
            mlp=self.mlp_class.load(self.args, weights, prefix + "mlp.", be),
        )

    def block(self, layer: Layer, i: int, h: Array, kv: KVPool, meta: StepMeta) -> Array:
        """The residual stream h after decoder block i."""
        be, eps = self.backend, self.args.rms_norm_eps
        a = layer.attention(be, be.rms_norm(h, layer.attn_norm, eps), i, kv, meta)
        if layer.post_attn_norm is not None:
            a = be.rms_norm(a, layer.post_attn_norm, eps)
        h = h + a
        m = layer.mlp(be, be.rms_norm(h, layer.mlp_norm, eps))
        if layer.post_mlp_norm is not None:
            m = be.rms_norm(m, layer.post_mlp_norm, eps)
        return h + m

    def embed_tokens(self, ids: Array) -> Array:
        """The residual stream's first value: the tokens' embeddings [T, hidden]."""
        return self.backend.embed(self.embed, ids)

    def logits(self, h: Array) -> Array:
        """Logits of final hidden states (normed) [T, hidden]."""
        return self.backend.lm_head(h, self.lm_head)

    def final_logits(self, h: Array) -> Array:
        """Logits of the last block's residual stream [T, hidden], after the final norm."""
        return self.logits(self.backend.rms_norm(h, self.norm, self.args.rms_norm_eps))

    def greedy_decode(self, batch: Batch, kv: KVPool) -> Array | None:
        """Each row's likeliest next token, where the backend runs this step (decode rows only) as one call; None:
        take forward and sample."""
        return None if self.greedy is None else self.greedy(batch, kv)

    def forward(self, batch: Batch, kv: KVPool, hidden: bool = False, h: Array | None = None) -> Array:
        """Run one step; return logits of the rows in batch.logits_indices (hidden: their normed final states).
        A pipeline stage after the first takes the residual stream [T, hidden] from the one before as h; one
        before the last returns the residual stream after its blocks (every row), for the next."""
        be = self.backend
        meta = be.batch_meta(batch, self.ropes[0])
        if h is None:
            h = self.embed_tokens(meta.token_ids)
        if self.fused_blocks is not None:
            h = self.fused_blocks(h, kv, meta)
        else:
            metas = [meta, *(be.with_rope(meta, rope) for rope in self.ropes[1:])]
            for i, layer in enumerate(self.layers):
                h = self.block(layer, i, h, kv, metas[layer.attention.rope])
        if self.norm is None:
            return h
        h = be.take_rows(h, meta.logits_indices)
        return be.rms_norm(h, self.norm, self.args.rms_norm_eps) if hidden else self.final_logits(h)
