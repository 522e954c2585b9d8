"""What a request asks of generation: length, sampling, penalties, stops, logprobs, and a grammar its output must follow."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


from edgeserve.config import SPECULATIVE_MODES
from edgeserve.errors import EdgeserveError


# How a json_schema grammar writes JSON: as models mostly saw it (`{"a": 1, "b": 2}`), with no free
# whitespace, which a small model can fill forever. Tool-call grammars write their arguments the same way.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
GREEDY_BELOW = 1e-5  # temperatures under this sample as greedy: dividing by them would overflow the logits
# Every stop string is searched for after every token on the engine thread, where all streams wait: a request
# gets a few (OpenAI allows 4), of a sensible length.
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1000
# A schema of more values than this takes a millisecond or more to write as text: it waits for a gap between the
# engine's steps (engine/step_gate.py).
LARGE_SCHEMA_VALUES = 2000


def generator_seed(seed: int | None) -> int | None:
    """Any int64 seed (OpenAI allows negatives) as a seed NumPy accepts; non-negative seeds unchanged."""
    return None if seed is None else int(seed) % 2**64


def schema_text(schema: dict[str, Any]) -> str:
    """A JSON Schema as compact JSON text, its keys in their order.

    pydantic-core's serializer, not json.dumps: a request's schema is made text on the event loop, holding the GIL,
    and json.dumps took ~10x as long (a schema of 15,000 properties, tens of ms: every stream stalled that long).
    """
    import pydantic_core  # here: importing it adds ~20 ms to every start of a command

    return pydantic_core.to_json(schema).decode()


class InvalidParamsError(EdgeserveError):
    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


# What an opening trigger skips before the output's first character counts; an opening grammar's gap is these too.
OPENING_BLANKS = " \t\n"


@dataclass(frozen=True)
class GrammarTrigger:
    """When a request's grammar binds (tool calls under tool_choice auto), so that free text costs no mask.

    The output is free, unmasked, until it writes `text` (the grammar then binds from the token in which the text
    begins) or samples `token_id` (a special token, which no text spells: bound from it).
    With `opening`, only the output's first token past OPENING_BLANKS counts, and `text` is one character: the
    grammar is bound from the first token, so it must also take any other opening, and is let go once the output
    opens with neither (a call that is the whole answer, such as Llama 3's, is then held from its first character,
    and an answer that is no call is masked at its first token only).
    """

    text: str | None = None
    token_id: int | None = None
    opening: bool = False

    def problem(self) -> str | None:
        """What makes this trigger unusable, or None."""
        if not self.text and self.token_id is None:
            return "must name a text or a token"
        if self.opening and self.text is not None and (len(self.text) != 1 or self.text in OPENING_BLANKS):
            return "must open with one character that is not blank"
        return None


# What the front ends (run, chat, tui, serve) sample with where neither the request nor the model says:
# Ollama's choices, which keep small models from looping (greedy decoding and no penalty repeat one
# sentence), with chat's long-standing temperature of 0.7.
FALLBACK_SAMPLING = {"temperature": 0.7, "top_p": 0.9, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.1,
                     "repeat_last_n": 64}

# generation_config.json's keys, and GGUF's general.sampling.* keys, for the SamplingParams fields they set.
_HF_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
            "repetition_penalty": "repetition_penalty"}
_GGUF_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
              "general.sampling.top_k": "top_k", "general.sampling.min_p": "min_p",
              "general.sampling.penalty_repeat": "repetition_penalty",
              "general.sampling.penalty_last_n": "repeat_last_n"}


@dataclass(frozen=True)
class SamplingDefaults:
    """The sampling settings a model asks for (its generation_config.json or GGUF metadata), over the fallback."""

    settings: dict[str, float | int] = field(default_factory=lambda: dict(FALLBACK_SAMPLING))
    source: str = "edgeserve's defaults"

    @classmethod
    def from_generation_config(cls, config: dict[str, Any]) -> SamplingDefaults:
        """From a Hugging Face generation_config.json; do_sample false means greedy, as in transformers."""
        given = {field_: config[key] for key, field_ in _HF_KEYS.items() if isinstance(config.get(key), (int, float))}
        if config.get("do_sample") is False:
            given["temperature"] = 0.0
        return cls._over_fallback(given, "generation_config.json")

    @classmethod
    def from_gguf(cls, metadata: dict[str, Any]) -> SamplingDefaults:
        """From a GGUF file's general.sampling.* metadata."""
        given = {field_: metadata[key] for key, field_ in _GGUF_KEYS.items()
                 if isinstance(metadata.get(key), (int, float))}
        return cls._over_fallback(given, "the GGUF metadata")

    @classmethod
    def _over_fallback(cls, given: dict[str, float | int], source: str) -> SamplingDefaults:
        if not given:
            return cls()
        merged = {**FALLBACK_SAMPLING, **given}
        try:
            SamplingParams(**merged)
        except InvalidParamsError:
            return cls()  # a model's out-of-range setting is not worth refusing to load it
        return cls(merged, source)

    def apply(self, settings: dict[str, Any]) -> dict[str, Any]:
        """These defaults under the settings a user or request gave (None: not given).

        A temperature of 0 given without a repetition penalty is plain greedy decoding, the likeliest token
        each step, as tests and scripts expect of it: the default penalty is left out then.
        """
        given = {k: v for k, v in settings.items() if v is not None}
        merged = {**self.settings, **given}
        if given.get("temperature", 1.0) < GREEDY_BELOW and "repetition_penalty" not in given:
            merged["repetition_penalty"] = 1.0
        return merged


@dataclass
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0 means off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    repeat_last_n: int = 64  # the repetition penalty looks at this many last tokens; -1: all of them
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
    grammar_trigger: GrammarTrigger | None = None  # the grammar binds once it fires; the output is free until then
    speculative: str | None = None  # "auto", "ngram", "draft" or "off" for this request; None: the engine's setting

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    def write_schema(self) -> None:
        """Turn a JSON Schema given as a dict into its text, once (the engine asks for `constraint` every step).

        Done at the first `constraint`, which for a server's request is on the grammar thread: a schema of
        thousands of properties takes milliseconds, holding the GIL, which the event loop need not spend.
        """
        if isinstance(self.json_schema, dict):
            self.json_schema = schema_text(self.json_schema)

    @property
    def large_schema(self) -> bool:
        """Whether the schema, given as a dict, holds more than LARGE_SCHEMA_VALUES values (its text a millisecond
        or more to write)."""
        if not isinstance(self.json_schema, dict):
            return False
        todo: list[Any] = [self.json_schema]
        seen = 0
        while todo and seen <= LARGE_SCHEMA_VALUES:
            value = todo.pop()
            seen += 1
            if isinstance(value, dict):
                todo.extend(value.values())
            elif isinstance(value, list):
                todo.extend(value)
        return seen > LARGE_SCHEMA_VALUES

    @property
    def constrained(self) -> bool:
        """Whether the output follows a grammar (a JSON Schema, a regex or a Lark grammar)."""
        return self.json_schema is not None or self.regex is not None or self.grammar is not None

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    def validate(self) -> None:
        trigger_problem = self.grammar_trigger.problem() if self.grammar_trigger is not None else None
        checks = [
            (self.max_tokens >= 1, "max_tokens", "must be at least 1"),
            (0.0 <= self.temperature <= 2.0, "temperature", "must be between 0 and 2"),
            (self.top_k >= 0, "top_k", "must be 0 (off) or positive"),
            (0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]"),
            (0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]"),
            (self.repetition_penalty > 0.0, "repetition_penalty", "must be positive"),
            (self.repeat_last_n >= -1, "repeat_last_n", "must be -1 (all tokens), 0 (off) or positive"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be between -2 and 2"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be between -2 and 2"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs", "must be between 0 and 20"),
            (all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings"),
            (len(self.stop) <= MAX_STOP_STRINGS and all(len(s) <= MAX_STOP_CHARS for s in self.stop), "stop",
             f"must hold at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} characters"),
            (all(-100 <= b <= 100 for b in self.logit_bias.values()), "logit_bias",
             "values must be between -100 and 100"),
            (sum(x is not None for x in (self.json_schema, self.regex, self.grammar)) <= 1, "json_schema",
             "cannot be combined with regex or grammar: give one of them"),
            (self.grammar_trigger is None or self.grammar is not None, "grammar_trigger", "needs a grammar"),
            (trigger_problem is None, "grammar_trigger", trigger_problem),
            (self.speculative in (None, *SPECULATIVE_MODES), "speculative",
             f"must be one of {', '.join(SPECULATIVE_MODES)}"),
        ]
        for ok, param, message in checks:
            if not ok:
                got = repr(getattr(self, param))
                got = got if len(got) <= 200 else f"{got[:200]}... ({len(got)} characters)"
                raise InvalidParamsError(f"{param} {message} (got {got})", param)

    @property
    def constraint(self) -> tuple[str, str] | None:
        """The grammar as (kind, source): kind "json_schema" (source is JSON text), "regex" or "lark"; or None.

        A schema's keys keep their written order: the grammar writes properties in that order (a schema that
        asks for its reasoning before its answer gets them so), and the grammar cache keys on this text.
        """
        if self.json_schema is not None:
            self.write_schema()
            return "json_schema", self.json_schema
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
