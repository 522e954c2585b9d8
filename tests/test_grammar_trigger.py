"""A grammar that binds once the output writes its trigger (tool calls under tool_choice auto): free before it,
held from the token where it begins; a special token as the trigger; and a trigger that counts only as the output's
opening, whose grammar holds from the first token and is let go once the output opens otherwise."""

from __future__ import annotations

import pytest

from edgeserve.config import EngineConfig
from edgeserve.engine.llm_engine import LLMEngine
from edgeserve.sampling_params import GrammarTrigger, InvalidParamsError, SamplingParams

TRIGGER = "e"
# Anything up to the trigger, then "!?" and the end: the random model must write that once it has written an "e".
GRAMMAR = 'start: lead "!?"\nlead[lazy]: /[^e]*e/\n'
SPECIAL = 1  # <|im_start|> in the tiny vocabulary: a special token, not an end, which no text spells


def opening_grammar(first: str, other: str) -> str:
    """Blanks, then `first` and "!?", or another opening (other: its regex)."""
    return f'start: GAP ("{first}" "!?" | OTHER)?\nGAP: /[ \\t\\n]*/\nOTHER: /{other}/\n'


@pytest.fixture(scope="module")
def engine(tiny_model) -> LLMEngine:
    return LLMEngine(tiny_model, EngineConfig(backend="numpy", kv_memory="16MiB"))


def run(engine: LLMEngine, params: SamplingParams) -> tuple[str, str, list[int]]:
    """The output's text, its finish reason and its tokens."""
    engine.add_request([1, 2, 3], params)
    text, reason, tokens = "", "", []
    while engine.has_unfinished():
        for out in engine.step():
            text += out.text
            reason = out.finish_reason or reason
            tokens += out.token_ids
    return text, reason, tokens


def test_the_output_is_free_until_the_trigger_then_follows_the_grammar(engine) -> None:
    for seed in range(3):
        free, _, _ = run(engine, SamplingParams(max_tokens=400, temperature=1.0, seed=seed, ignore_eos=True))
        bound, reason, _ = run(engine, SamplingParams(max_tokens=400, temperature=1.0, seed=seed, ignore_eos=True,
                                                      grammar=GRAMMAR, grammar_trigger=GrammarTrigger(text=TRIGGER)))
        at = free.index(TRIGGER)  # the seeds' free answers write the trigger
        # the same free text up to the trigger, then the grammar's end, and the request ends with it
        assert bound == free[: at + 1] + "!?" and reason == "stop"


def test_a_special_token_triggers_the_grammar_from_itself(engine, tiny_model) -> None:
    # Biased up, the special token comes now and then in the seeds' free answers.
    sampling = dict(max_tokens=100, temperature=1.0, ignore_eos=True, logit_bias={SPECIAL: 3.0})
    for seed in range(3):
        _, _, free = run(engine, SamplingParams(**sampling, seed=seed))
        _, reason, bound = run(engine, SamplingParams(**sampling, seed=seed, grammar=f'start: <[{SPECIAL}]> "!?"',
                                                      grammar_trigger=GrammarTrigger(token_id=SPECIAL)))
        at = free.index(SPECIAL)
        assert bound == free[: at + 1] + tiny_model.tokenizer.encode("!?") and reason == "stop"


def test_an_opening_trigger_holds_the_grammar_from_the_first_token(engine) -> None:
    greedy = dict(max_tokens=40, temperature=0.0, ignore_eos=True)
    free, _, _ = run(engine, SamplingParams(**greedy))
    opening = free.lstrip(" \n")[0]
    # opened with the trigger: held from the first token, blanks included, to the grammar's end
    bound, reason, _ = run(engine, SamplingParams(**greedy, grammar=opening_grammar(opening, f"[^{opening} \\t\\n]"),
                                                  grammar_trigger=GrammarTrigger(text=opening, opening=True)))
    assert bound == free[: free.index(opening) + 1] + "!?" and reason == "stop"
    # opened otherwise: let go after the first token, though this grammar takes no second one
    other = "!" if opening != "!" else "?"
    unbound, reason, _ = run(engine, SamplingParams(**greedy, grammar=opening_grammar(other, f"[^{other} \\t\\n]"),
                                                    grammar_trigger=GrammarTrigger(text=other, opening=True)))
    assert unbound == free and reason == "length"


def test_a_trigger_needs_a_grammar_and_something_to_watch_for() -> None:
    with pytest.raises(InvalidParamsError):
        SamplingParams(grammar_trigger=GrammarTrigger(text="<tool_call>"))
    for trigger in (GrammarTrigger(text=""), GrammarTrigger(), GrammarTrigger(text="{}", opening=True),
                    GrammarTrigger(text=" ", opening=True)):
        with pytest.raises(InvalidParamsError):
            SamplingParams(grammar='start: "a"', grammar_trigger=trigger)
