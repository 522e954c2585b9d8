"""What a request asks of generation: length, sampling, penalties, stops, logprobs, and a grammar its output must follow."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from edgeserve.errors import EdgeserveError


# How a json_schema grammar writes JSON: as models mostly saw it (`{"a": 1, "b": 2}`), with no free
# whitespace, which a small model can fill forever. Tool-call grammars write their arguments the same way.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
GREEDY_BELOW = 1e-5  # temperatures under this sample as greedy: dividing by them would overflow the logits


def generator_seed(seed: int | None) -> int | None:
    """Any int64 seed (OpenAI allows negatives) as a seed NumPy accepts; non-negative seeds unchanged."""
    return None if seed is None else int(seed) % 2**64


class InvalidParamsError(EdgeserveError):
    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0 means off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; k >= 0: the chosen token's logprob and the top k
    logit_bias: dict[int, float] = field(default_factory=dict)  # added to those tokens' logits, as OpenAI's
    # At most one grammar the output must follow; the request ends when it is complete.
    json_schema: dict[str, Any] | str | None = None  # a JSON Schema (as a dict or JSON text)
    regex: str | None = None
    grammar: str | None = None  # a Lark grammar (llguidance's dialect, which may embed %json {...})

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    def validate(self) -> None:
        checks = [
            (self.max_tokens >= 1, "max_tokens", "must be at least 1"),
            (0.0 <= self.temperature <= 2.0, "temperature", "must be between 0 and 2"),
            (self.top_k >= 0, "top_k", "must be 0 (off) or positive"),
            (0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]"),
            (0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]"),
            (self.repetition_penalty > 0.0, "repetition_penalty", "must be positive"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be between -2 and 2"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be between -2 and 2"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs", "must be between 0 and 20"),
            (all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings"),
            (all(-100 <= b <= 100 for b in self.logit_bias.values()), "logit_bias",
             "values must be between -100 and 100"),
            (sum(x is not None for x in (self.json_schema, self.regex, self.grammar)) <= 1, "json_schema",
             "cannot be combined with regex or grammar: give one of them"),
        ]
        for ok, param, message in checks:
            if not ok:
                raise InvalidParamsError(f"{param} {message} (got {getattr(self, param)!r})", param)

    @property
    def constraint(self) -> tuple[str, str] | None:
        """The grammar as (kind, source): kind "json_schema" (source is JSON text), "regex" or "lark"; or None."""
        if self.json_schema is not None:
            schema = self.json_schema
            return "json_schema", schema if isinstance(schema, str) else json.dumps(schema, sort_keys=True)
        if self.regex is not None:
            return "regex", self.regex
        if self.grammar is not None:
            return "lark", self.grammar
        return None

    def check_vocab(self, vocab_size: int) -> None:
        """Raise InvalidParamsError when logit_bias names a token the model does not have."""
        outside = sorted(t for t in self.logit_bias if not 0 <= t < vocab_size)
        if outside:
            raise InvalidParamsError(f"logit_bias names token ids outside the vocabulary (0..{vocab_size - 1}): "
                                     f"{outside[:5]}", "logit_bias")
