"""Mistral: Llama blocks whose attention may look back only `sliding_window` tokens (Mistral 7B
v0.1: 4096 of a 32k context; later versions have none). llama.cpp writes its GGUF files as the
`llama` architecture, which loads as Llama, without a window (as llama.cpp runs them)."""

from __future__ import annotations

from dataclasses import dataclass

from edgeserve.backends.base import Backend
from edgeserve.models.base import Weights, WindowedArgs
from edgeserve.models.llama import Attention, Llama


@dataclass
class WindowedAttention(Attention):
    @classmethod
    def load(cls, args: WindowedArgs, weights: Weights, prefix: str, be: Backend) -> WindowedAttention:
        attention = super().load(args, weights, prefix, be)
        attention.window = args.sliding_window
        return attention


class Mistral(Llama):
    attention_class = WindowedAttention
