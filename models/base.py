"""What every model family shares: its arguments (from config.json or GGUF metadata), RoPE
frequencies, and the interface the engine runs a model through."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from edgeserve.backends.base import Array, HostWeight
from edgeserve.batch import Batch
from edgeserve.errors import ModelLoadError

if TYPE_CHECKING:
    from edgeserve.backends.kv_pool import KVPool

Weights = dict[str, HostWeight]  # under Hugging Face names, whatever the file format
LONGROPE = ("longrope", "su")  # rope_type of Phi-3's LongRoPE ("su" in older configs)
# what rope_inv_freq computes; "dynamic" (NTK) changes nothing until a sequence outgrows the
# context, which none does here
ROPE_KINDS = {"default", "dynamic", "linear", "llama3", "factors", *LONGROPE}
# Far past any real model, and small enough that what is allocated from them cannot exhaust memory first.
MAX_WIDTH = 1 << 16  # hidden size, head size
MAX_LAYERS = 1024
MAX_VOCAB = 1 << 22
MAX_CONTEXT = 1 << 24


@dataclass
class ModelArgs:
    """The arguments of the Llama-shaped families; a family with more subclasses it."""

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
        self._check_sizes()
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        kind = rope_kind(self)
        if kind not in ROPE_KINDS:
            raise ModelLoadError(f"unsupported RoPE scaling {kind!r} (supported: {', '.join(sorted(ROPE_KINDS))})")

    def _check_sizes(self) -> None:
        """A ModelLoadError naming the field where a size is impossible, before anything is allocated from it (a
        corrupt or hostile file's zero heads or 2^32 layers)."""
        checks = [
            ("hidden_size", 1 <= self.hidden_size <= MAX_WIDTH),
            ("num_hidden_layers", 1 <= self.num_hidden_layers <= MAX_LAYERS),
            ("intermediate_size", 1 <= self.intermediate_size <= 8 * MAX_WIDTH),
            ("num_attention_heads", 1 <= self.num_attention_heads <= self.hidden_size),
            ("num_key_value_heads", 1 <= self.num_key_value_heads <= self.num_attention_heads
             and self.num_attention_heads % self.num_key_value_heads == 0),
            ("vocab_size", 1 <= self.vocab_size <= MAX_VOCAB),
            ("max_position_embeddings", 1 <= self.max_position_embeddings <= MAX_CONTEXT),
            ("head_dim", self.head_dim is None or (2 <= self.head_dim <= MAX_WIDTH and self.head_dim % 2 == 0)),
            ("rms_norm_eps", math.isfinite(self.rms_norm_eps) and 0 <= self.rms_norm_eps < 1),
            ("rope_theta", math.isfinite(self.rope_theta) and self.rope_theta > 0),
        ]
        for name, ok in checks:
            if not ok:
                raise ModelLoadError(f"the model's {name} is {getattr(self, name)!r}, which no model of this kind has "
                                     f"(num_attention_heads {self.num_attention_heads}, hidden_size "
                                     f"{self.hidden_size}): the file is damaged")

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "ModelArgs":
        """Build from a Hugging Face / MLX config.json dictionary."""
        names = set(cls.__dataclass_fields__) - {"extra"}
        args = {k: v for k, v in config.items() if k in names}
        args.setdefault("num_key_value_heads", config["num_attention_heads"])
        # transformers 5 writes RoPE as one "rope_parameters" entry, theta included
        rope = config.get("rope_parameters")
        if rope:
            args["rope_theta"] = args.get("rope_theta") or rope.get("rope_theta", cls.rope_theta)
            if not args.get("rope_scaling") and rope.get("rope_type", rope.get("type", "default")) != "default":
                args["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
        return cls(**args)

    def to_config(self) -> dict[str, Any]:
        """The arguments as a Hugging Face / mlx-lm config.json dictionary, less the class name the
        registry knows (raises ValueError where no config.json can say them)."""
        config = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "extra"}
        config["hidden_act"] = "silu"
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


@dataclass
class WindowedArgs(ModelArgs):
    """The arguments of a family whose attention may look back only `sliding_window` tokens, itself
    included (Mistral 7B v0.1: 4096 of a 32k context; None: every earlier token is seen)."""

    sliding_window: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sliding_window is not None and self.sliding_window >= self.max_position_embeddings:
            self.sliding_window = None  # no sequence outgrows it: plain causal attention, on the fast paths


def rope_kind(args: ModelArgs) -> str:
    """The config's RoPE scaling type ("default" where there is none)."""
    scaling = args.rope_scaling or {}
    return scaling.get("rope_type", scaling.get("type")) or "default"


def rope_inv_freq(args: ModelArgs) -> np.ndarray:
    """Inverse frequencies, with Llama 3 style scaling where the config asks for it."""
    dim = args.head_dim
    inv = 1.0 / (args.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    scaling = args.rope_scaling or {}
    kind = rope_kind(args)
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
    elif kind in LONGROPE:
        # transformers takes the long factors for a whole sequence once it outgrows the original
        # context (and recomputes its cache then); K/V cached in the pool cannot change, so one
        # set serves every sequence: the long one wherever the context outgrows the original
        long = args.max_position_embeddings > scaling["original_max_position_embeddings"]
        inv = inv / np.asarray(scaling["long_factor" if long else "short_factor"], dtype=np.float64)
    return inv


def rope_attention_factor(args: ModelArgs) -> float:
    """How much LongRoPE scales cos and sin (so q·k by its square); 1 for every other RoPE."""
    scaling = args.rope_scaling or {}
    if rope_kind(args) not in LONGROPE:
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or args.max_position_embeddings / original
    return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))



class Model(Protocol):
    """A model built for one backend: one forward pass per engine step."""

    args: ModelArgs
    layer_weights: tuple[str, ...]  # each layer's weights under Hugging Face names, which the loader checks

    def forward(self, batch: Batch, kv: KVPool, hidden: bool = False, h: Array | None = None) -> Array:
        """Run one step over the ragged batch; return logits of the rows in batch.logits_indices (hidden: their
        final hidden states, normed, as embeddings pool them). A pipeline stage (built with `layers`) takes the
        previous stage's residual stream as h, and returns its own where it is not the last."""
        ...

    def greedy_decode(self, batch: Batch, kv: KVPool) -> Array | None:
        """Each row's likeliest next token where every row is a sequence's one decode token and the backend runs
        such a step as one call; None: take forward, and sample its logits."""
        ...
