"""One set of sampling defaults for every front end: the model's own (generation_config.json, GGUF metadata),
else the fallback; the repeat-penalty flags; base models answered raw; why `run` stopped."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from model_folder import write_model_folder
from test_families import write_gguf
from edgeserve.cli.main import cli
from edgeserve.cli.run_cmd import is_base_model
from edgeserve.models.catalog import CATALOG
from edgeserve.models.loader import LoadedModel, load_folder, load_gguf
from edgeserve.sampling_params import FALLBACK_SAMPLING, SamplingDefaults, SamplingParams
from edgeserve.server.openai.protocol import ChatCompletionRequest

ENGINE = ["--backend", "numpy", "--kv-memory", "16MiB"]


def run(*args: str):
    return CliRunner().invoke(cli, ["run", *ENGINE, *args])


@pytest.fixture
def folder(tiny_model: LoadedModel, tmp_path: Path) -> Path:
    out = tmp_path / "tiny"
    write_model_folder(tiny_model, out)
    return out


def test_a_folder_without_generation_config_gets_the_fallback(folder):
    defaults = load_folder(folder).sampling_defaults
    assert defaults.settings == FALLBACK_SAMPLING
    assert SamplingParams(**defaults.apply({})).repetition_penalty > 1.0  # out of the box, repeats cost


def test_generation_config_json_sets_the_defaults(folder):
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.3, "top_k": 20, "top_p": 0.8}))
    defaults = load_folder(folder).sampling_defaults
    assert defaults.settings == {**FALLBACK_SAMPLING, "temperature": 0.3, "top_k": 20, "top_p": 0.8}
    assert defaults.source == "generation_config.json"
    (folder / "generation_config.json").write_text(json.dumps({"do_sample": False}))
    assert SamplingParams(**load_folder(folder).sampling_defaults.apply({})).greedy


def test_gguf_sampling_metadata_sets_the_defaults(tiny_model, tmp_path):
    path = write_gguf(tiny_model, "llama", tmp_path / "tiny.gguf",
                      floats={"general.sampling.temp": 0.5, "general.sampling.penalty_repeat": 1.25})
    defaults = load_gguf(path).sampling_defaults
    assert defaults.settings == {**FALLBACK_SAMPLING, "temperature": 0.5, "repetition_penalty": 1.25}
    plain = write_gguf(tiny_model, "llama", tmp_path / "plain.gguf")
    assert load_gguf(plain).sampling_defaults.settings == FALLBACK_SAMPLING


def test_what_the_user_gives_wins_over_the_model(folder):
    defaults = SamplingDefaults.from_generation_config({"temperature": 0.3})
    assert defaults.apply({"temperature": 0.0, "top_p": None})["temperature"] == 0.0
    assert defaults.apply({"top_p": None})["top_p"] == FALLBACK_SAMPLING["top_p"]


def test_temperature_0_alone_is_plain_greedy():
    defaults = SamplingDefaults()
    assert defaults.apply({"temperature": 0.0})["repetition_penalty"] == 1.0
    assert defaults.apply({"temperature": 0.0, "repetition_penalty": 1.3})["repetition_penalty"] == 1.3
    assert defaults.apply({})["repetition_penalty"] == FALLBACK_SAMPLING["repetition_penalty"]


def test_the_server_samples_with_the_model_defaults_where_the_request_is_silent():
    defaults = SamplingDefaults.from_generation_config({"temperature": 0.2, "repetition_penalty": 1.05})
    body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}])
    params = body.sampling_params(16, None, defaults=defaults)
    assert (params.temperature, params.repetition_penalty) == (0.2, 1.05)
    body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], temperature=0.9)
    assert body.sampling_params(16, None, defaults=defaults).temperature == 0.9


def test_run_samples_with_the_folder_defaults(folder):
    (folder / "generation_config.json").write_text(json.dumps({"do_sample": False, "repetition_penalty": 1.0}))
    by_default = [json.loads(run("-m", str(folder), "-n", "24", "--json", "hello").stdout)["text"] for _ in range(2)]
    greedy = json.loads(run("-m", str(folder), "-n", "24", "--json", "--temp", "0", "--repeat-penalty", "1",
                            "hello").stdout)["text"]
    assert by_default == [greedy, greedy]


def test_the_repeat_penalty_flags_reach_the_sampler(folder):
    prompt = "abcd"
    result = run("-m", str(folder), "-n", "40", "--json", "--temp", "0", "--repeat-penalty", "1e9",
                 "--repeat-last-n", "4", "--raw", prompt)
    assert result.exit_code == 0, result.output
    text = prompt + json.loads(result.stdout)["text"]  # one character per token in the tiny vocabulary
    # a huge penalty over the last 4 tokens: no token repeats one of the 4 before it
    assert all(text[i] not in text[max(0, i - 4):i] for i in range(len(prompt), len(text)))
    bad = run("-m", str(folder), "--repeat-last-n", "-2", "hi")
    assert bad.exit_code != 0 and "repeat_last_n" in bad.stderr


def test_a_model_without_a_chat_template_runs_raw_with_a_note(folder):
    config = json.loads((folder / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    result = run("-m", str(folder), "-n", "4", "hello")
    assert result.exit_code == 0, result.output
    assert "is a base model" in result.stderr and "--chat" in result.stderr


def test_the_catalog_marks_base_models():
    assert CATALOG["gemma3-270m"].base and not CATALOG["smollm2-135m-instruct"].base
    assert is_base_model("gemma3-270m", "{{ messages }}")
    assert not is_base_model("smollm2-135m-instruct", "{{ messages }}")


@pytest.mark.slow
def test_gemma3_270m_continues_the_readme_prompt_raw():
    result = CliRunner().invoke(cli, ["run", "-m", "gemma3-270m", "--backend", "numpy", "-n", "8", "--seed", "1",
                                      "Once upon a time"])
    assert result.exit_code == 0, result.output
    assert "gemma3-270m is a base model" in result.stderr
    assert "<start_of_turn>" not in result.stdout


@pytest.mark.parametrize("limit, note", [(["-n", "3"], "stopped at max_tokens"),
                                         (["-n", "200", "-c", "32"], "stopped at the context limit")])
def test_run_says_why_it_stopped(folder, limit, note):
    (folder / "generation_config.json").write_text(json.dumps({"do_sample": False}))
    result = run("-m", str(folder), *limit, "--raw", "hello")
    assert result.exit_code == 0, result.output
    assert note in result.stderr
