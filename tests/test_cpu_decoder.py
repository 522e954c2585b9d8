"""The NumPy backend's fused decoder blocks (one C call per step) against its block-by-block path:
the same C ops in the same order, so the same bits, on the tiny model and on the real one."""

import dataclasses

import numpy as np
import pytest

from edgeserve.backends import qmatmul
from edgeserve.config import EngineConfig
from edgeserve.engine.llm_engine import LLMEngine
from edgeserve.models.llama import Qwen2Args
from edgeserve.quant.affine import quantize
from edgeserve.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not qmatmul.compiled(), reason="the C extension did not build")

PROMPTS = ["The capital of France is", "List three colours:", "1, 2, 3, 4,", "The capital of France is a city"]


def quantized(model, bias: bool = False):
    """The model with every matrix quantized to 4 bits (and, with bias, Qwen2's q/k/v biases)."""
    weights = {name: quantize(w, 32, 4) if w.ndim == 2 and "layers" in name else w for name, w in model.weights.items()}
    args = model.args
    if bias:
        args = Qwen2Args(**{f.name: getattr(args, f.name) for f in dataclasses.fields(args)})
        rng = np.random.default_rng(1)
        for i in range(args.num_hidden_layers):
            for n, size in (("q", args.num_attention_heads), ("k", args.num_key_value_heads),
                            ("v", args.num_key_value_heads)):
                weights[f"model.layers.{i}.self_attn.{n}_proj.bias"] = rng.standard_normal(size * args.head_dim,
                                                                                         ).astype(np.float32)
    return dataclasses.replace(model, args=args, weights=weights)


def engine(model, fused: bool, **config) -> LLMEngine:
    eng = LLMEngine(model, EngineConfig(backend="numpy", weights="quantized", kv_memory="32MiB", **config))
    assert (eng.runner.model.fused_blocks is not None) or not fused
    if not fused:
        eng.runner.model.fused_blocks = None
    return eng


def generate(eng: LLMEngine, temperature: float = 0.0) -> dict[str, tuple[list[int], list]]:
    """Every prompt at once (prefill chunks beside decode rows), with each token's logprobs."""
    ids = [eng.add_request(p, SamplingParams(max_tokens=24, temperature=temperature, seed=i, logprobs=3,
                                                ignore_eos=True))
           for i, p in enumerate(PROMPTS)]
    out: dict[str, tuple[list[int], list]] = {i: ([], []) for i in ids}
    while eng.scheduler.has_unfinished():
        for o in eng.step():
            out[o.request_id][0].extend(o.token_ids)
            out[o.request_id][1].extend(o.logprobs or [])
    return out


@pytest.mark.parametrize("bias", [False, True], ids=["llama", "qwen2-bias"])
def test_fused_blocks_give_the_same_bits_as_block_by_block_on_the_tiny_model(tiny_model, bias):
    model = quantized(tiny_model, bias)
    fused, plain = engine(model, True, max_num_batched_tokens=16), engine(model, False, max_num_batched_tokens=16)
    ids = fused.tokenizer.encode("A prompt long enough to take a few prefill chunks of sixteen tokens each.")
    assert np.array_equal(fused.prompt_logits(ids), plain.prompt_logits(ids))
    a, b = generate(fused, temperature=1.0), generate(plain, temperature=1.0)
    assert list(a.values()) == list(b.values()) and all(len(t) == 24 for t, _ in a.values())


def test_fused_blocks_only_where_the_blocks_are_plain_and_packed(tiny_model):
    assert engine(quantized(tiny_model), True).runner.model.fused_blocks is not None
    # float32 weights go to BLAS block by block; so do the tiny model's float matrices in quantized mode
    for model, weights in ((quantized(tiny_model), "float32"), (tiny_model, "quantized")):
        eng = LLMEngine(model, EngineConfig(backend="numpy", weights=weights, kv_memory="32MiB"))
        assert eng.runner.model.fused_blocks is None


def test_fused_blocks_refuse_slots_and_block_ids_outside_the_pool(tiny_model):
    eng = engine(quantized(tiny_model), True)
    model, kv = eng.runner.model, eng.runner.kv
    h = np.zeros((1, tiny_model.args.hidden_size), np.float32)
    cos = sin = np.zeros((1, 1, tiny_model.args.head_dim // 2), np.float32)
    rows = kv.num_blocks * kv.block_size
    for slots, tables in (([rows], [[0]]), ([0], [[kv.num_blocks]]), ([-1], [[0]])):
        with pytest.raises(ValueError, match="outside the pool"):
            qmatmul._ext.decoder_run(model.fused_blocks.plan, h, kv.k, kv.v, cos, sin, np.array(slots),
                                     np.array(tables), np.array([1]))


@pytest.mark.slow
def test_fused_blocks_give_the_same_answers_as_block_by_block_on_the_real_model(loaded_model):
    fused, plain = engine(loaded_model, True), engine(loaded_model, False)
    assert generate(fused) == generate(plain)
