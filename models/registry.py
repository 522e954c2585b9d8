"""Which models edgeserve runs: config.json's `model_type` → the class that runs it, and GGUF's
`general.architecture` → that model_type. The one list of what is supported.

Adding a family: write models/<family>.py (a `Llama` subclass overriding the parts that differ,
or any class built as `cls(args, weights, backend)` with a `forward(batch, kv)` and its
`layer_weights`; a `ModelArgs` subclass where it has more arguments) and add its line to ARCHITECTURES.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from edgeserve.backends.base import Backend
from edgeserve.errors import ModelLoadError
from edgeserve.models.base import Model, ModelArgs, Weights, WindowedArgs
from edgeserve.models.gemma3 import CHAT_TEMPLATE as GEMMA3_CHAT_TEMPLATE, Gemma3, Gemma3Args
from edgeserve.models.llama import Llama, Qwen2Args
from edgeserve.models.mistral import Mistral
from edgeserve.models.phi3 import Phi3, Phi3Args
from edgeserve.models.qwen3 import Qwen3

T = TypeVar("T")


@dataclass(frozen=True)
class Architecture:
    """A supported model_type: the class that runs it, its arguments, and its names in other formats."""

    model: Callable[..., Model]  # (args, weights, backend[, layers])
    hf_name: str  # config.json's "architectures" entry, as convert writes it
    args: type[ModelArgs] = ModelArgs
    gguf_name: str | None = None  # GGUF general.architecture of its files; None: GGUF not supported
    # llama.cpp's converter permutes q/k rows of this family for interleaved (GPT-J) RoPE
    gguf_rope_permuted: bool = False
    # GGUF layer tensor kinds that mean something else in this family (e.g. Phi-3's fused ffn_up)
    gguf_layer_names: dict[str, str] = field(default_factory=dict)
    # llama.cpp's converter stores this family's RMSNorm weights plus this (Gemma's 1 + weight)
    gguf_norm_shift: float = 0.0
    chat_template: str | None = None  # for files of this family that ship none


ARCHITECTURES: dict[str, Architecture] = {
    "gemma3_text": Architecture(Gemma3, "Gemma3ForCausalLM", Gemma3Args, gguf_name="gemma3", gguf_norm_shift=1.0,
                                gguf_layer_names={"ffn_norm": "pre_feedforward_layernorm",
                                                  "post_attention_norm": "post_attention_layernorm",
                                                  "post_ffw_norm": "post_feedforward_layernorm"},
                                chat_template=GEMMA3_CHAT_TEMPLATE),
    "llama": Architecture(Llama, "LlamaForCausalLM", gguf_name="llama", gguf_rope_permuted=True),
    "mistral": Architecture(Mistral, "MistralForCausalLM", WindowedArgs),  # GGUF: written as llama
    "phi3": Architecture(Phi3, "Phi3ForCausalLM", Phi3Args, gguf_name="phi3",
                         gguf_layer_names={"ffn_up": "mlp.gate_up_proj"}),
    "qwen2": Architecture(Llama, "Qwen2ForCausalLM", Qwen2Args, gguf_name="qwen2"),
    "qwen3": Architecture(Qwen3, "Qwen3ForCausalLM", gguf_name="qwen3"),
    "smollm": Architecture(Llama, "LlamaForCausalLM"),
    "smollm2": Architecture(Llama, "LlamaForCausalLM"),
}
GGUF_MODEL_TYPES = {a.gguf_name: t for t, a in ARCHITECTURES.items() if a.gguf_name}


def architecture(model_type: str, source: Path | str) -> Architecture:
    """The entry of a config.json model_type; a ModelLoadError naming `source` where there is none."""
    return _lookup(ARCHITECTURES, model_type, source)


def gguf_model_type(gguf_architecture: str, source: Path | str) -> str:
    """The model_type of a GGUF general.architecture; a ModelLoadError naming `source` where there is none."""
    return _lookup(GGUF_MODEL_TYPES, gguf_architecture, source)


def build_model(args: ModelArgs, weights: Weights, backend: Backend, layers: range | None = None) -> Model:
    """The model of args.model_type with its weights prepared by `backend`: only the decoder blocks in `layers`
    where given (a pipeline stage, see Llama)."""
    model = ARCHITECTURES[args.model_type].model
    return model(args, weights, backend) if layers is None else model(args, weights, backend, layers)


def _lookup(table: dict[str, T], name: str, source: Path | str) -> T:
    if name not in table:
        raise ModelLoadError(f"{source}: unsupported architecture {name!r} (supported: {', '.join(sorted(table))})")
    return table[name]
