"""The Llama architecture (Llama 2/3.x, SmolLM, TinyLlama, Mistral, Qwen2), written once against a backend.

The forward pass takes one ragged batch (decode tokens and prefill chunks of many sequences) and
reads/writes K/V through the paged pool, so the same code serves one stream or many.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edgeserve.batch import Batch

SUPPORTED_MODEL_TYPES = {"llama", "mistral", "qwen2", "smollm", "smollm2"}


@dataclass
class ModelArgs:
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 has biases on q/k/v
    head_dim: int | None = None
    model_type: str = "llama"
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "ModelArgs":
        """Build from a Hugging Face / MLX config.json dictionary."""
        names = set(cls.__dataclass_fields__) - {"extra"}
        args = {k: v for k, v in config.items() if k in names}
        args.setdefault("num_key_value_heads", config["num_attention_heads"])
        if config.get("model_type") == "qwen2":
            args.setdefault("attention_bias", True)
        return cls(**args)

    def to_config(self) -> dict[str, Any]:
        """A Hugging Face / mlx-lm config.json dictionary (raises ValueError where none can say it)."""
        config = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "extra"}
        architecture = {"qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}.get(self.model_type)
        config.update(architectures=[architecture or "LlamaForCausalLM"], hidden_act="silu")
        scaling = self.rope_scaling or {}
        if scaling.get("rope_type") == "factors":
            # GGUF keeps Llama 3 rope scaling only as per-frequency divisors. Every Llama 3.x
            # model uses low/high frequency factors 1 and 4, which leaves the factor (the
            # largest divisor) and the original context (from the divisors in between) to recover.
            divisors = np.asarray(scaling["factors"], dtype=np.float64)
            factor = float(divisors.max())
            dim = self.head_dim
            wavelen = 2 * math.pi * self.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
            between = (divisors > 1) & (divisors < factor)
            smooth = (1 / divisors[between] - 1 / factor) / (1 - 1 / factor)
            original = int(np.round(np.median(wavelen[between] * (3 * smooth + 1)))) if between.any() else 8192
            config["rope_scaling"] = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": original}
            fitted = type(self)(**{**self.__dict__, "rope_scaling": config["rope_scaling"]})
            if not np.allclose(rope_inv_freq(fitted), rope_inv_freq(self), rtol=1e-5, atol=0):
                raise ValueError("the model's rope frequency factors (GGUF rope_freqs) match no Llama 3 "
                                 "rope_scaling that config.json can hold")
        config.update(self.extra)
        return config


def rope_inv_freq(args: ModelArgs) -> np.ndarray:
    """Inverse frequencies, with Llama 3 style scaling where the config asks for it."""
    dim = args.head_dim
    inv = 1.0 / (args.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    scaling = args.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "llama3":
        factor = scaling["factor"]
        low = scaling.get("low_freq_factor", 1.0)
        high = scaling.get("high_freq_factor", 4.0)
        old_ctx = scaling.get("original_max_position_embeddings", 8192)
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv
        smooth = (old_ctx / wavelen - low) / (high - low)
        scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
        mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        inv = np.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    elif kind == "linear":
        inv = inv / scaling["factor"]
    elif kind == "factors":  # GGUF's rope_freqs tensor: the same Llama 3 scaling, precomputed
        inv = inv / np.asarray(scaling["factors"], dtype=np.float64)
    return inv


class Llama:
    """Weights prepared by a backend, and the forward pass over a ragged batch."""

    def __init__(self, args: ModelArgs, weights: dict[str, Any], backend: Any):
        self.args = args
        self.backend = backend
        be = backend
        self.embed = be.embedding(weights["model.embed_tokens.weight"])
        head = weights.get("lm_head.weight")
        self.lm_head = be.head(self.embed if head is None or args.tie_word_embeddings else be.embedding(head))
        self.norm = be.vector(weights["model.norm.weight"])
        self.layers = []
        for i in range(args.num_hidden_layers):
            p = f"model.layers.{i}."
            attn = p + "self_attn."
            mlp = p + "mlp."
            qkv = [weights[attn + n + "_proj.weight"] for n in ("q", "k", "v")]
            qkv_bias = None
            if args.attention_bias:
                qkv_bias = be.vector(np.concatenate([np.asarray(weights[attn + n + "_proj.bias"]) for n in "qkv"]))
            self.layers.append(
                dict(
                    attn_norm=be.vector(weights[p + "input_layernorm.weight"]),
                    qkv=be.linear(qkv),
                    qkv_bias=qkv_bias,
                    o=be.linear([weights[attn + "o_proj.weight"]]),
                    mlp_norm=be.vector(weights[p + "post_attention_layernorm.weight"]),
                    gate_up=be.linear([weights[mlp + "gate_proj.weight"], weights[mlp + "up_proj.weight"]]),
                    down=be.linear([weights[mlp + "down_proj.weight"]]),
                )
            )
        self.rope = be.rope_tables(rope_inv_freq(args), args.max_position_embeddings)

    def forward(self, batch: Batch, kv: Any) -> Any:
        """Run one step; return logits of the rows in batch.logits_indices."""
        a, be = self.args, self.backend
        n_q, n_kv, hd = a.num_attention_heads, a.num_key_value_heads, a.head_dim
        meta = be.batch_meta(batch, self.rope)
        h = be.embed(self.embed, meta.token_ids)
        k_end = (n_q + n_kv) * hd
        for i, layer in enumerate(self.layers):
            x = be.rms_norm(h, layer["attn_norm"], a.rms_norm_eps)
            qkv = be.matmul(x, layer["qkv"])
            if layer["qkv_bias"] is not None:
                qkv = qkv + layer["qkv_bias"]
            t = qkv.shape[0]
            qk = be.apply_rope(qkv[:, :k_end].reshape(t, n_q + n_kv, hd), meta)  # q and k heads in one call
            q, k = qk[:, :n_q], qk[:, n_q:]
            v = qkv[:, k_end:].reshape(t, n_kv, hd)
            kv.write(i, k, v, meta)
            o = be.paged_attention(q, kv.k[i], kv.v[i], meta)
            h = h + be.matmul(o.reshape(t, n_q * hd), layer["o"])
            x = be.rms_norm(h, layer["mlp_norm"], a.rms_norm_eps)
            h = h + be.matmul(be.silu_mul(be.matmul(x, layer["gate_up"])), layer["down"])
        h = be.rms_norm(be.take_rows(h, meta.logits_indices), self.norm, a.rms_norm_eps)
        return be.lm_head(h, self.lm_head)
