"""JSON under a grammar: properties in the schema's written order, and numbers that end.

The scanner and the bound are checked on strings; the real default model shows both through the engine,
the server (`response_format`) and `run --json-schema`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import numpy as np
import openai
import pytest
from click.testing import CliRunner

from edgeserve.cli.main import cli
from edgeserve.config import EngineConfig
from edgeserve.engine.json_numbers import MAX_EXPONENT_DIGITS, MAX_MANTISSA_DIGITS, NumberBound, NumberScanner
from edgeserve.engine.llm_engine import LLMEngine
from edgeserve.sampling_params import SamplingParams
from loopback import ServerThread, serving

# "Reason first, then answer": the order is the point, and neither key comes first alphabetically.
REASONING_FIRST = {"type": "object", "properties": {"reasoning": {"type": "string", "maxLength": 80},
                                                    "answer": {"type": "integer"}},
                   "required": ["reasoning", "answer"], "additionalProperties": False}
NUMBERS = {"type": "object", "properties": {"population_millions": {"type": "number"},
                                            "ratio": {"type": "number"}, "count": {"type": "integer"}},
           "required": ["population_millions", "ratio", "count"], "additionalProperties": False}
_NUMBER = re.compile(r"-?(\d+)(?:\.(\d+))?(?:[eE][+-]?(\d+))?")


def scan(text: str) -> NumberScanner:
    scanner = NumberScanner()
    scanner.feed(text.encode())
    return scanner


def test_the_scanner_follows_numbers_outside_strings() -> None:
    assert not scan('{"a": "123456789012345678901234"').in_number  # digits in a string are no number
    assert not scan('{"a": "x\\"1').in_number  # an escaped quote keeps the string open
    inside = scan('{"a": "x\\"", "b": -12.5')
    assert inside.in_number and inside.mantissa == 3 and inside.part == 1
    assert scan('{"b": 0.25').mantissa == 2  # the lone leading zero does not count
    assert scan('{"b": 1.5e+12').exponent == 2
    assert not scan('{"b": 12, ').in_number


def test_the_bound_forbids_only_the_digits_that_pass_it() -> None:
    vocab = [b"0", b"1", b"12", b"5,", b".", b".3", b"e", b"e5", b"}", b", ", b'"', b"e123"]
    bound = NumberBound(lambda t: vocab[t], len(vocab))

    def forbidden(text: str) -> set[bytes]:
        mask = bound.forbidden(scan(text))
        return set() if mask is None else {vocab[t] for t in np.nonzero(mask)[0]}

    assert forbidden('{"a": "1') == set()  # in a string
    assert forbidden('{"a": 1') == set()
    below = "1" * (MAX_MANTISSA_DIGITS - 1)
    assert forbidden(f'{{"a": {below}') == {b"12"}  # one digit left: two would pass it
    full = "1" * MAX_MANTISSA_DIGITS
    assert forbidden(f'{{"a": {full}') == {b"0", b"1", b"12", b"5,", b".3"}  # ending or an exponent remain
    assert forbidden(f'{{"a": 1e{"1" * (MAX_EXPONENT_DIGITS - 1)}') == {b"12", b"e123"}
    assert forbidden(f'{{"a": 1e{"1" * MAX_EXPONENT_DIGITS}') == {b"0", b"1", b"12", b"5,", b"e5", b"e123"}


def test_a_schema_keeps_its_written_key_order_in_the_grammar_text() -> None:
    kind, source = SamplingParams(json_schema=REASONING_FIRST).constraint
    assert kind == "json_schema" and list(json.loads(source)["properties"]) == ["reasoning", "answer"]
    assert source == json.dumps(REASONING_FIRST, ensure_ascii=False, separators=(",", ":"))


@pytest.fixture(scope="module")
def server(loaded_model) -> Iterator[ServerThread]:
    with serving(loaded_model, "model") as thread:
        yield thread


def keys_in_order(text: str) -> list[str]:
    return list(json.loads(text))


def test_reasoning_first_comes_out_first_from_response_format(server: ServerThread) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    fmt = {"type": "json_schema", "json_schema": {"name": "solve", "schema": REASONING_FIRST}}
    reply = client.chat.completions.create(model="model", max_tokens=120, temperature=0, response_format=fmt,
                                           messages=[{"role": "user", "content": "What is 2 + 3? Think first."}])
    assert reply.choices[0].finish_reason == "stop"
    assert keys_in_order(reply.choices[0].message.content) == ["reasoning", "answer"]


def test_reasoning_first_comes_out_first_from_run(model_path, tmp_path) -> None:
    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(REASONING_FIRST))
    result = CliRunner().invoke(cli, ["run", "-m", str(model_path), "--backend", "numpy", "--kv-memory", "32MiB",
                                      "--json", "--temperature", "0", "-n", "120", "--json-schema", str(schema_file),
                                      "What is 2 + 3? Think first."])
    assert result.exit_code == 0, result.output
    answer = json.loads(result.stdout.strip().splitlines()[-1])
    assert keys_in_order(answer["text"]) == ["reasoning", "answer"]


def test_numbers_end_at_temperature_one(loaded_model) -> None:
    engine = LLMEngine(loaded_model, EngineConfig(backend="numpy", kv_memory="64MiB"))
    prompt = loaded_model.tokenizer.encode("The population of France in millions, as JSON:")
    for seed in range(4):
        engine.add_request(prompt, SamplingParams(max_tokens=200, temperature=1.0, seed=seed, json_schema=NUMBERS),
                           request_id=str(seed))
    texts: dict[str, str] = {}
    reasons: dict[str, str] = {}
    while engine.has_unfinished():
        for out in engine.step():
            texts[out.request_id] = texts.get(out.request_id, "") + out.text
            if out.finished:
                reasons[out.request_id] = out.finish_reason
    for rid, text in texts.items():
        assert reasons[rid] == "stop", text
        values = json.loads(text)
        assert list(values) == ["population_millions", "ratio", "count"]
        for number in _NUMBER.finditer(text.split(":", 1)[1]):
            integer, fraction, exponent = (g or "" for g in number.groups())
            mantissa = len(integer.lstrip("0") if integer != "0" else "") + len(fraction)
            assert mantissa <= MAX_MANTISSA_DIGITS and len(exponent) <= MAX_EXPONENT_DIGITS, text
