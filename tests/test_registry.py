"""The model registry: what is supported, how config.json and GGUF names map onto it, and that the
runner builds whatever class is registered, with its overridden parts."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from edgeserve.backends import get_backend
from edgeserve.batch import random_paged_batch
from edgeserve.engine.kv_budget import PoolSize
from edgeserve.engine.model_runner import ModelRunner
from edgeserve.errors import ModelLoadError
from edgeserve.models.llama import MLP, Llama
from edgeserve.models.loader import load_folder
from edgeserve.models.registry import ARCHITECTURES, GGUF_MODEL_TYPES, architecture, gguf_model_type

TINY_CONFIG = {"hidden_size": 64, "num_hidden_layers": 1, "intermediate_size": 64, "num_attention_heads": 4,
               "vocab_size": 8}


def test_what_is_supported():
    assert set(ARCHITECTURES) == {"gemma3_text", "llama", "mistral", "phi3", "qwen2", "qwen3", "smollm", "smollm2"}
    assert GGUF_MODEL_TYPES == {"gemma3": "gemma3_text", "llama": "llama", "phi3": "phi3", "qwen2": "qwen2",
                                "qwen3": "qwen3"}
    assert architecture("qwen2", "x").hf_name == "Qwen2ForCausalLM"
    assert gguf_model_type("llama", "x") == "llama" and architecture("llama", "x").gguf_rope_permuted


@pytest.mark.parametrize("lookup", [architecture, gguf_model_type])
def test_an_unknown_architecture_names_the_source_and_the_supported_ones(lookup):
    with pytest.raises(ModelLoadError,
                       match=r"^m\.gguf: unsupported architecture 'gpt2' \(supported: gemma3(_text)?, llama, "):
        lookup("gpt2", "m.gguf")


def test_a_folder_of_an_unknown_model_type_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**TINY_CONFIG, "model_type": "gemma3"}))
    with pytest.raises(ModelLoadError, match="unsupported architecture 'gemma3'"):
        load_folder(tmp_path)


def test_family_arguments_come_from_the_registry():
    qwen2 = architecture("qwen2", "x").args
    assert qwen2.from_config({**TINY_CONFIG, "model_type": "qwen2"}).attention_bias  # implied by the family
    assert not qwen2.from_config({**TINY_CONFIG, "model_type": "qwen2", "attention_bias": False}).attention_bias
    assert not architecture("llama", "x").args.from_config(TINY_CONFIG).attention_bias


class CountingMLP(MLP):
    calls = 0

    def __call__(self, be, x):
        CountingMLP.calls += 1
        return super().__call__(be, x)


class CountingLlama(Llama):
    mlp_class = CountingMLP


def _logits(runner: ModelRunner, vocab: int) -> np.ndarray:
    rng = np.random.default_rng(0)
    batch, _ = random_paged_batch([9], [9], 16, rng)
    batch.token_ids = rng.integers(0, vocab, 9)
    batch.logits_indices = np.arange(9)
    return runner.backend.to_numpy(runner.model.forward(batch, runner.kv))


def test_the_runner_builds_the_registered_class_with_its_parts(tiny_model, monkeypatch):
    backend = get_backend("numpy")
    size = PoolSize(num_blocks=2, block_size=16, bytes_per_token=0)
    plain = _logits(ModelRunner(tiny_model, backend, size), tiny_model.args.vocab_size)
    monkeypatch.setitem(ARCHITECTURES, "llama", replace(ARCHITECTURES["llama"], model=CountingLlama))
    runner = ModelRunner(tiny_model, backend, size)
    assert type(runner.model) is CountingLlama
    assert all(type(layer.mlp) is CountingMLP for layer in runner.model.layers)
    CountingMLP.calls = 0
    assert np.array_equal(_logits(runner, tiny_model.args.vocab_size), plain)
    assert CountingMLP.calls == tiny_model.args.num_hidden_layers
