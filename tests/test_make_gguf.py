"""bench/make_gguf.py: random-weight Llama-shaped GGUF files that edgeserve loads and runs."""

import dataclasses

import gguf
import numpy as np
import pytest
from gguf.quants import dequantize
from bench_scripts import TINY, make_gguf, write_tiny

from edgeserve.config import EngineConfig
from edgeserve.engine.llm_engine import LLMEngine
from edgeserve.models.loader import load_model
from edgeserve.quant.gguf_file import read_gguf


@pytest.mark.parametrize("qtype", [gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q8_0,
                                   gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K])
def test_random_blocks_dequantize_to_centred_weights_of_the_target_spread(qtype):
    blocks = make_gguf.random_blocks(np.random.default_rng(1), qtype, 64, 1024)
    w = dequantize(blocks, qtype)
    assert w.shape == (64, 1024) and np.isfinite(w).all()
    assert abs(w.mean()) < 0.002
    assert 0.015 < w.std() < 0.025


def test_q4_k_m_keeps_attn_v_and_ffn_down_at_q6_k_in_llama_cpp_layers():
    q6 = [i for i in range(16) if make_gguf.tensor_type("q4_k_m", "ffn_down", i, 16) == gguf.GGMLQuantizationType.Q6_K]
    assert q6 == [0, 1, 4, 7, 10, 13, 14, 15]
    assert make_gguf.tensor_type("q4_k_m", "ffn_up", 0, 16) == gguf.GGMLQuantizationType.Q4_K
    assert make_gguf.tensor_type("q4_0", "output", 0, 16) == gguf.GGMLQuantizationType.Q6_K
    assert make_gguf.tensor_type("q8_0", "output", 0, 16) == gguf.GGMLQuantizationType.Q8_0


@pytest.mark.parametrize("file_type", ["q4_0", "q4_k_m", "q8_0"])
def test_a_written_file_loads_and_gives_finite_spread_logits(file_type, model_path, tmp_path):
    path = write_tiny(tmp_path / f"tiny-{file_type}.gguf", file_type, model_path)
    assert path.stat().st_size > 1_000_000 and not list(tmp_path.glob("*.partial"))

    model = load_model(str(path))
    args = model.args
    assert (args.hidden_size, args.num_hidden_layers, args.intermediate_size) == (256, 8, 512)
    assert (args.num_attention_heads, args.num_key_value_heads) == (4, 2)
    assert args.vocab_size == model.tokenizer.vocab_size > 1000  # the donor's vocabulary
    assert "<|im_start|>" in model.tokenizer.chat_template  # the donor's chat template came along

    engine = LLMEngine(model, EngineConfig(backend="numpy", kv_memory="16MiB"))
    logits = engine.prompt_logits(model.tokenizer.encode("The quick brown fox"))
    assert np.isfinite(logits).all()
    assert 0.1 < logits.std() < 10  # neither collapsed nor blown up through the layers


def test_unknown_file_type_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown file type"):
        make_gguf.plan(TINY, "q3_k", 1000)


@pytest.mark.parametrize("arch", ["qwen3", "phi3"])
def test_other_families_shapes_load_as_their_family(arch, model_path, tmp_path):
    shape = dataclasses.replace(TINY, arch=arch, head_width=128 if arch == "qwen3" else None)
    path = write_tiny(tmp_path / f"tiny-{arch}.gguf", "q4_k_m", model_path, shape=shape)
    tensors = read_gguf(path).tensors
    if arch == "phi3":
        assert tensors["blk.0.attn_qkv.weight"].qtype == gguf.GGMLQuantizationType.Q5_K  # llama.cpp's Q4_K_M pick
        assert "blk.0.ffn_gate.weight" not in tensors
    else:
        assert "blk.0.attn_q_norm.weight" in tensors

    model = load_model(str(path))
    assert model.args.model_type == arch
    assert model.args.head_dim == shape.head_dim
    engine = LLMEngine(model, EngineConfig(backend="numpy", kv_memory="16MiB"))
    logits = engine.prompt_logits(model.tokenizer.encode("The quick brown fox"))
    assert np.isfinite(logits).all() and 0.1 < logits.std() < 10
