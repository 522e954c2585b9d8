"""Constrained decoding inside the batched engine: grammars per row, free rows untouched, both backends."""

from __future__ import annotations

import json
import re

import jsonschema
import llguidance
import pytest
from click.testing import CliRunner

from edgeserve.cli.main import cli
from edgeserve.engine.constraints import ll_tokenizer
from edgeserve.engine.llm_engine import LLMEngine
from edgeserve.engine.prompts import Prompts
from edgeserve.llm import LLM
from edgeserve.sampling_params import InvalidParamsError, SamplingParams
from edgeserve.text.tokenizer import Tokenizer

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 16},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
    "score": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "null"}]}},
    "required": ["name", "tags", "score"], "additionalProperties": False}
REGEX = r"[a-z]{2,8}( [a-z]{2,8}){1,3}\."


def run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict:
    for rid, (ids, params) in requests.items():
        engine.add_request(ids, params, rid)
    return engine.run_to_completion()


def test_free_rows_are_the_same_with_constrained_rows_in_their_batch(loaded_model) -> None:
    engine = LLMEngine(loaded_model, backend="numpy", kv_memory="128MiB")
    ids = [Prompts.for_engine(engine).chat([{"role": "user", "content": text}])
           for text in ("Tell me about cats.", "Name three rivers.", "Describe a person in JSON.")]
    free = {"greedy": (ids[0], SamplingParams(max_tokens=24, temperature=0)),
            "seeded": (ids[1], SamplingParams(max_tokens=24, temperature=1.0, seed=11))}
    alone = run(engine, free)
    constrained = {"json": (ids[2], SamplingParams(max_tokens=200, temperature=1.0, seed=2, json_schema=SCHEMA)),
                   "regex": (ids[0], SamplingParams(max_tokens=60, temperature=0, regex=REGEX)),
                   "lark": (ids[1], SamplingParams(max_tokens=30, grammar='start: "It is " ("red" | "blue") "."'))}
    mixed = run(engine, {**free, **constrained})
    for rid in free:
        assert mixed[rid].token_ids == alone[rid].token_ids and mixed[rid].text == alone[rid].text
    assert engine.stats().last_batch_seqs >= 1
    jsonschema.validate(json.loads(mixed["json"].text), SCHEMA)
    assert re.fullmatch(REGEX, mixed["regex"].text)
    assert mixed["lark"].text in ("It is red.", "It is blue.")
    # each ended as its grammar completed, not at its length limit
    assert all(mixed[rid].finish_reason == "stop" for rid in constrained)


def test_a_grammar_is_compiled_once_and_a_bad_one_is_refused(loaded_model) -> None:
    engine = LLMEngine(loaded_model, backend="numpy", kv_memory="32MiB")
    params = SamplingParams(max_tokens=8, json_schema=SCHEMA)
    first = engine.constraints.compile(params)
    text = json.dumps(SCHEMA, ensure_ascii=False, separators=(",", ":"))
    assert engine.constraints.compile(SamplingParams(json_schema=text)) is not first
    assert engine.constraints.num_compiled == 1  # one grammar text, one compilation; each request its own matcher
    for bad, param in ((dict(regex="a[b"), "regex"), (dict(grammar="start: nothing_here"), "grammar"),
                       (dict(json_schema={"type": "bogus"}), "json_schema"), (dict(json_schema="[1"), "json_schema")):
        with pytest.raises(InvalidParamsError) as err:
            engine.add_request([1, 2, 3], SamplingParams(**bad))
        assert err.value.param == param
    assert not engine.has_unfinished()
    with pytest.raises(InvalidParamsError):
        SamplingParams(regex="a", grammar='start: "a"')


def test_ignore_eos_still_ends_at_the_grammars_end(tiny_model) -> None:
    engine = LLMEngine(tiny_model, backend="numpy", kv_memory="16MiB")
    out = run(engine, {"r": ([5, 6, 7], SamplingParams(max_tokens=50, ignore_eos=True, regex="ab(c|d)"))})["r"]
    assert out.text in ("abc", "abd") and out.finish_reason == "stop" and len(out.token_ids) == 3


def test_offline_generate_with_a_schema(model_path) -> None:
    llm = LLM(str(model_path), backend="numpy", kv_memory="64MiB")
    prompt = llm.engine.prompts.chat([{"role": "user", "content": "A product as JSON."}])
    results = llm.generate([prompt, prompt], [SamplingParams(max_tokens=200, temperature=t, seed=4, json_schema=SCHEMA)
                                              for t in (0.0, 1.0)])
    for result in results:
        jsonschema.validate(json.loads(result.text), SCHEMA)


def test_the_mlx_backend_masks_its_rows_too(tiny_model) -> None:
    pytest.importorskip("mlx.core", reason="MLX is not installed (pip install 'edgeserve[mlx]')")
    outputs = {}
    for backend in ("numpy", "mlx"):
        engine = LLMEngine(tiny_model, backend=backend, kv_memory="16MiB")
        outputs[backend] = run(engine, {
            "json": ([5, 6, 7, 8], SamplingParams(max_tokens=120, json_schema=SCHEMA, temperature=1.0, seed=3)),
            "free": ([9, 10, 11], SamplingParams(max_tokens=12, temperature=0))})
        jsonschema.validate(json.loads(outputs[backend]["json"].text), SCHEMA)
    assert outputs["mlx"]["free"].text and outputs["numpy"]["json"].finish_reason == "stop"


def test_cli_run_with_a_json_schema(model_path, tmp_path) -> None:
    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(SCHEMA))
    args = ["run", "-m", str(model_path), "--backend", "numpy", "--kv-memory", "32MiB", "--json",
            "--json-schema", str(schema_file), "Describe a product."]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    answer = json.loads(result.stdout.strip().splitlines()[-1])
    jsonschema.validate(json.loads(answer["text"]), SCHEMA)
    assert answer["finish_reason"] == "stop"
    schema_file.write_text('{"type": "bogus"}')
    result = CliRunner().invoke(cli, args)
    assert result.exit_code != 0 and "json_schema" in result.output and "Traceback" not in result.output
    schema_file.write_text("not json")
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2 and "--json-schema" in result.output and "is not JSON" in result.output


def test_sentencepiece_vocabularies_take_grammars(spm_model) -> None:
    tokenizer = Tokenizer.from_dir(spm_model[0])
    llt = ll_tokenizer(tokenizer, tokenizer.vocab_size)

    def accepts(regex: str, text: str) -> bool:
        matcher = llguidance.LLMatcher(llt, llguidance.LLMatcher.grammar_from_regex(regex), log_level=0)
        return matcher.consume_tokens(tokenizer.encode(text, add_bos=False)) and matcher.is_accepting()

    # SentencePiece writes a word's space before it ("▁the"), so encoded text starts with one
    assert accepts(r" the (quick|lazy) dog", "the lazy dog")
    assert not accepts(r" the (quick|lazy) dog", "the brown dog")
    assert accepts(r" Z.rich 😀", "Zürich 😀")  # pieces of raw bytes (byte fallback) spell what the vocabulary lacks


def test_a_failing_mask_fails_its_rows_alone(tiny_model, monkeypatch) -> None:
    engine = LLMEngine(tiny_model, backend="numpy", kv_memory="16MiB")
    free = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    expected = run(engine, {"free": ([5, 6, 7], free)})["free"].token_ids

    def broken(*_: object) -> None:  # a fault inside the grammar engine, injected
        raise RuntimeError("mask buffer lost")

    monkeypatch.setattr(engine.constraints, "_fill", broken)
    engine.add_request([5, 6, 7], free, "free")
    engine.add_request([8, 9], SamplingParams(max_tokens=6, regex="[ab]+"), "constrained")
    outputs: dict[str, list] = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    assert [t for out in outputs["free"] for t in out.token_ids] == expected and outputs["free"][-1].error is None
    assert "grammar mask failed: mask buffer lost" in outputs["constrained"][-1].error
