"""The NumPy backend's fused decoder blocks (one C call per step) against its block-by-block path:
the same C ops in the same order, so the same bits, for every family (Llama, Qwen2's biases, Qwen
3's q/k norms, Phi-3's window and LongRoPE, Mistral's window, Gemma 3's four norms, GELU, query
scale and local layers), on tiny models and on the real ones."""

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from conftest import tiny_tokenizer
from edgeserve.backends import cpu_kernels, qmatmul
from edgeserve.backends.cpu_decoder import CPUDecoder
from edgeserve.config import EngineConfig
from edgeserve.engine.llm_engine import LLMEngine
from edgeserve.models.catalog import pull
from edgeserve.models.gemma3 import FULL, SLIDING, Gemma3Args
from edgeserve.models.llama import Qwen2Args
from edgeserve.models.loader import LoadedModel, load_folder, load_model
from edgeserve.quant.affine import quantize
from edgeserve.sampling_params import SamplingParams
from test_families import family_folder

pytestmark = pytest.mark.skipif(not qmatmul.compiled(), reason="the C extension did not build")

# ~30 tokens each: with 24 more they outgrow the windows of 8 and stay inside the family fixtures' 64 positions
PROMPTS = ["The capital of France is", "List three colours:", "1, 2, 3, 4,", "The capital of France is a city"]
WINDOW = 8
FAMILIES = ["llama", "llama-mixed-qkv", "qwen2-bias", "qwen3", "phi3", "mistral", "gemma3"]


def quantized(model: LoadedModel, bias: bool = False, v_bits: int = 4) -> LoadedModel:
    """The model with every layer matrix quantized to 4 bits (v to `v_bits`: another format makes q/k/v
    two segments), and, with bias, Qwen2's q/k/v biases."""
    weights = {name: quantize(w, 32, v_bits if "v_proj" in name else 4) if w.ndim == 2 and "layers" in name else w
               for name, w in model.weights.items()}
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


def tiny_gemma3(folder: Path) -> LoadedModel:
    """Gemma 3 at test size, random weights: layers local, global, local (window 8), a query scale
    other than 1, norms other than 0, soft-capped logits."""
    tokenizer = tiny_tokenizer(folder)
    args = Gemma3Args(hidden_size=64, num_hidden_layers=3, intermediate_size=128, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32, vocab_size=tokenizer.vocab_size, max_position_embeddings=256,
                      sliding_window=WINDOW, sliding_window_pattern=2, query_pre_attn_scalar=16.0,
                      final_logit_softcapping=30.0, model_type="gemma3_text")
    assert args.layer_types == [SLIDING, FULL, SLIDING]
    rng = np.random.default_rng(2)

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (0.2 * rng.standard_normal(n)).astype(np.float32)  # Gemma's norms scale by 1 + weight

    h, q, kv, f = args.hidden_size, 4 * args.head_dim, 2 * args.head_dim, args.intermediate_size
    weights = {"model.embed_tokens.weight": w(args.vocab_size, h), "model.norm.weight": norm(h)}
    for i in range(args.num_hidden_layers):
        p = f"model.layers.{i}."
        norms = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")
        weights.update({p + n + ".weight": norm(h) for n in norms})
        weights.update({
            p + "self_attn.q_proj.weight": w(q, h), p + "self_attn.k_proj.weight": w(kv, h),
            p + "self_attn.v_proj.weight": w(kv, h), p + "self_attn.o_proj.weight": w(h, q),
            p + "self_attn.q_norm.weight": norm(args.head_dim), p + "self_attn.k_norm.weight": norm(args.head_dim),
            p + "mlp.gate_proj.weight": w(f, h), p + "mlp.up_proj.weight": w(f, h), p + "mlp.down_proj.weight": w(h, f),
        })
    return LoadedModel(args, weights, tokenizer, folder, "safetensors")


@pytest.fixture(scope="module", params=FAMILIES)
def family_model(request, tiny_model, tmp_path_factory) -> LoadedModel:
    """Each family's tiny model, quantized, with windows of 8 where the family has windows."""
    name, tmp = request.param, tmp_path_factory.mktemp(request.param)
    if name in ("llama", "llama-mixed-qkv", "qwen2-bias"):
        return quantized(tiny_model, bias=name == "qwen2-bias", v_bits=8 if name == "llama-mixed-qkv" else 4)
    if name == "gemma3":
        return quantized(tiny_gemma3(tmp))
    overrides = {"sliding_window": WINDOW} if name in ("phi3", "mistral") else {}
    return quantized(load_folder(family_folder(name, tmp, **overrides)))


def _no_block(*args) -> None:
    raise AssertionError("a fused model ran a block from Python")


def engine(model: LoadedModel, fused: bool, **config) -> LLMEngine:
    """An engine on the quantized kernels: the fused blocks (any block run from Python fails), or block by block."""
    eng = LLMEngine(model, EngineConfig(backend="numpy", weights="quantized", **{"kv_memory": "32MiB", **config}))
    assert eng.runner.model.fused_blocks is not None
    if fused:
        eng.runner.model.block = _no_block
    else:
        eng.runner.model.fused_blocks = None
    return eng


def generate(eng: LLMEngine, temperature: float = 0.0, max_tokens: int = 24) -> dict[str, tuple[list[int], list]]:
    """Every prompt at once (prefill chunks beside decode rows), with each token's logprobs."""
    ids = [eng.add_request(p, SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=i, logprobs=3,
                                                ignore_eos=True))
           for i, p in enumerate(PROMPTS)]
    out: dict[str, tuple[list[int], list]] = {i: ([], []) for i in ids}
    while eng.scheduler.has_unfinished():
        for o in eng.step():
            out[o.request_id][0].extend(o.token_ids)
            out[o.request_id][1].extend(o.logprobs or [])
    return out


def test_every_family_gives_the_same_bits_fused_as_block_by_block(family_model):
    """Prompt logits, and sampled tokens with their logprobs over mixed steps (prefill chunks of 16
    beside decode rows), past the windows of 8 where the family has them."""
    fused, plain = engine(family_model, True, max_num_batched_tokens=16), engine(family_model, False,
                                                                                max_num_batched_tokens=16)
    windows = {layer.attention.window for layer in fused.runner.model.layers} - {None}
    assert windows <= {WINDOW}
    ids = fused.tokenizer.encode("A prompt past any window of eight: " + PROMPTS[0])
    assert np.array_equal(fused.prompt_logits(ids), plain.prompt_logits(ids))
    a, b = generate(fused, temperature=1.0), generate(plain, temperature=1.0)
    assert list(a.values()) == list(b.values()) and all(len(t) == 24 for t, _ in a.values())


def test_each_family_describes_what_it_differs_in(family_model):
    """What each family differs in is in its layers' description, which the plan reads (the bits above
    show it honours them)."""
    model = engine(family_model, True).runner.model
    att = [layer.attention for layer in model.layers]
    name = family_model.args.model_type
    if name == "qwen3":
        assert all(a.q_norm is not None and a.q_scale == 1.0 for a in att)
    if name in ("phi3", "mistral"):
        assert all(a.window == WINDOW for a in att)
    if name == "phi3":
        assert all(a.q_scale > 1.0 for a in att)  # LongRoPE past the original context: its attention factor
    if name == "gemma3_text":
        assert [(a.window, a.rope) for a in att] == [(WINDOW, 1), (None, 0), (WINDOW, 1)]
        assert all(a.q_scale == np.sqrt(2.0) and a.q_norm is not None for a in att)
        assert all(layer.post_attn_norm is not None and layer.mlp.activation == "gelu_tanh" for layer in model.layers)
        assert len(model.ropes) == 2


def test_fused_blocks_only_where_the_blocks_are_computed_by_the_shared_code_and_packed(tiny_model):
    assert engine(quantized(tiny_model), True).runner.model.fused_blocks is not None
    # float32 weights go to BLAS block by block; so do the tiny model's float matrices in quantized mode
    for model, weights in ((quantized(tiny_model), "float32"), (tiny_model, "quantized")):
        eng = LLMEngine(model, EngineConfig(backend="numpy", weights=weights, kv_memory="32MiB"))
        assert eng.runner.model.fused_blocks is None


def test_fused_blocks_refuse_slots_block_ids_and_positions_outside_the_pool_and_tables(tiny_model):
    eng = engine(quantized(tiny_model), True)
    model, kv = eng.runner.model, eng.runner.kv
    h = np.zeros((1, tiny_model.args.hidden_size), np.float32)
    rows, positions = kv.num_blocks * kv.block_size, tiny_model.args.max_position_embeddings
    cases = (([rows], [[0]], [0], "slot falls outside the pool"), ([-1], [[0]], [0], "slot falls outside the pool"),
             ([0], [[kv.num_blocks]], [0], "block ids fall outside the pool"),
             ([0], [[0]], [positions], "position falls outside the RoPE tables"),
             ([0], [[0]], [-1], "position falls outside the RoPE tables"))
    for slots, tables, pos, message in cases:
        with pytest.raises(ValueError, match=message):
            qmatmul._ext.decoder_run(model.fused_blocks.plan, h, kv.k, kv.v, np.array(pos), np.array(slots),
                                     np.array(tables), np.array([1]))


def test_a_plan_refuses_a_layer_it_cannot_run_as_described(tiny_model):
    model = engine(quantized(tiny_model), True).runner.model
    layers, eps = model.layers, tiny_model.args.rms_norm_eps
    half_normed = [dataclasses.replace(layers[0], attention=dataclasses.replace(layers[0].attention,
                                                                                q_norm=layers[0].attn_norm[:16]))]
    with pytest.raises(ValueError, match="one head norm"):
        CPUDecoder.build(half_normed, eps, model.ropes, "float32")
    with pytest.raises(ValueError, match="names no RoPE table of the plan"):
        CPUDecoder.build([dataclasses.replace(layers[0], attention=dataclasses.replace(layers[0].attention, rope=1))],
                         eps, model.ropes, "float32")


def test_the_gelu_gate_matches_its_definition():
    """gelu_tanh(g) * u from the C op, against 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))) u in float64,
    written g / (1 + exp(-2 sqrt(2/pi) (...))) u: equal, without 1 + tanh's cancellation for negative g."""
    rng = np.random.default_rng(0)
    gate_up = (rng.standard_normal((7, 2 * 300)) * 4).astype(np.float32)
    gate_up[0, :4] = [-100.0, 100.0, 0.0, -1e-30]
    got = cpu_kernels.gelu_tanh_mul(gate_up)
    g, u = gate_up[:, :300].astype(np.float64), gate_up[:, 300:].astype(np.float64)
    with np.errstate(over="ignore"):
        want = g / (1 + np.exp(-2 * np.sqrt(2 / np.pi) * (g + 0.044715 * g**3))) * u
    # float32's rounding of exp's argument (up to ~90) grows ~90x in its result: relative 5e-6 at worst
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-30)
    near = np.abs(g) < 3  # where the gate is open: as close as float32 rounding
    np.testing.assert_allclose(got[near], want[near], rtol=1e-6, atol=1e-12)


@pytest.mark.slow
def test_fused_blocks_give_the_same_answers_as_block_by_block_on_the_real_model(loaded_model):
    fused, plain = engine(loaded_model, True), engine(loaded_model, False)
    assert generate(fused) == generate(plain)


@pytest.mark.slow
def test_gemma3_270m_runs_fused_with_the_same_bits_as_block_by_block():
    """The catalog's Gemma 3 270M Q4_K_M: a prompt past its 512-token window scored, and greedy answers."""
    model = load_model(str(pull("gemma3-270m")))
    fused, plain = engine(model, True, kv_memory="128MiB"), engine(model, False, kv_memory="128MiB")
    ids = fused.tokenizer.encode("Tell me about the sea and the sky. " * 60)
    assert len(ids) > model.args.sliding_window
    assert np.array_equal(fused.prompt_logits(ids), plain.prompt_logits(ids))
    assert generate(fused, max_tokens=16) == generate(plain, max_tokens=16)
