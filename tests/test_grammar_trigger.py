"""A grammar that binds once the output writes its trigger (tool calls under tool_choice auto): free before it,
held from the token where it begins."""

from __future__ import annotations

import pytest

from edgeserve.config import EngineConfig
from edgeserve.engine.llm_engine import LLMEngine
from edgeserve.sampling_params import InvalidParamsError, SamplingParams

TRIGGER = "e"
# Anything up to the trigger, then "!?" and the end: the random model must write that once it has written an "e".
GRAMMAR = 'start: lead "!?"\nlead[lazy]: /[^e]*e/\n'


def run(engine: LLMEngine, params: SamplingParams) -> tuple[str, str]:
    engine.add_request([1, 2, 3], params)
    text, reason = "", ""
    while engine.has_unfinished():
        for out in engine.step():
            text += out.text
            reason = out.finish_reason or reason
    return text, reason


def test_the_output_is_free_until_the_trigger_then_follows_the_grammar(tiny_model) -> None:
    engine = LLMEngine(tiny_model, EngineConfig(backend="numpy", kv_memory="16MiB"))
    for seed in range(3):
        free, _ = run(engine, SamplingParams(max_tokens=400, temperature=1.0, seed=seed, ignore_eos=True))
        bound, reason = run(engine, SamplingParams(max_tokens=400, temperature=1.0, seed=seed, ignore_eos=True,
                                                   grammar=GRAMMAR, grammar_trigger=TRIGGER))
        at = free.index(TRIGGER)  # the seeds' free answers write the trigger
        # the same free text up to the trigger, then the grammar's end, and the request ends with it
        assert bound == free[: at + 1] + "!?" and reason == "stop"


def test_a_trigger_needs_a_grammar() -> None:
    with pytest.raises(InvalidParamsError):
        SamplingParams(grammar_trigger="<tool_call>")
    with pytest.raises(InvalidParamsError):
        SamplingParams(grammar='start: "a"', grammar_trigger="")
