"""Qwen 3, Phi-3 and Mistral against transformers (float32) on tiny random-weight models built from
transformers' own configs (tests/fixtures/make_family_references.py): every position's logits from
their Hugging Face folders and from GGUF files written the way llama.cpp's converter writes them,
on the NumPy and the MLX backend."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import openai
import pytest
import tokenizers
from click.testing import CliRunner

from conftest import tiny_tokenizer
from loopback import ServerThread
from edgeserve.cli.main import cli
from edgeserve.engine.async_engine import AsyncEngine
from edgeserve.engine.llm_engine import LLMEngine
from edgeserve.engine.prompts import Prompts
from edgeserve.errors import ModelLoadError
from edgeserve.models.base import rope_attention_factor
from edgeserve.models.loader import LoadedModel, load_folder, load_gguf
from edgeserve.sampling_params import SamplingParams
from edgeserve.server.app import create_app

FIXTURES = Path(__file__).parent / "fixtures" / "families"
FAMILIES = ["qwen3", "phi3", "mistral"]
GGUF_ARCH = {"qwen3": "qwen3", "phi3": "phi3", "mistral": "llama"}  # llama.cpp writes Mistral as llama
TOLERANCE = 1e-4  # max |logit difference| from transformers, float32 on both sides
# the NumPy kernels computing from quantized weights against the same weights in float32: they
# round activations to int16 per group (measured here: under 1e-4)
QUANTIZED_TOLERANCE = 1e-3
F32 = gguf.GGMLQuantizationType.F32


def family_folder(name: str, dest: Path, **overrides) -> Path:
    """A copy of the family's fixture folder with the test tokenizer, and config.json overrides."""
    folder = dest / name
    shutil.copytree(FIXTURES / name, folder)
    tiny_tokenizer(folder)
    if overrides:
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, **overrides}))
    return folder


def reference(name: str, variant: str = "") -> list[tuple[list[int], np.ndarray]]:
    """(prompt ids, transformers' logits at every position) of each fixture prompt."""
    ref = np.load(FIXTURES / name / "reference.npz")
    n = sum(1 for k in ref.files if k.startswith("prompt_"))
    return [(ref[f"prompt_{i}"].tolist(), ref[f"{variant}logits_{i}"]) for i in range(n)]


def mlx_tolerance(engine: LLMEngine) -> float:
    """The bound the MLX backend is held to on the default Llama model, by its activation width."""
    from test_mlx_backend import LOGITS_TOLERANCE  # here: that module skips itself where MLX is missing

    return LOGITS_TOLERANCE[engine.backend.kv_dtype]


def worst_difference(engine: LLMEngine, cases: list[tuple[list[int], np.ndarray]]) -> float:
    worst = 0.0
    for ids, want in cases:
        got = engine.prompt_logits(ids)
        assert got.shape == want.shape
        worst = max(worst, float(np.abs(got - want).max()))
    return worst


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory) -> tuple[str, LoadedModel]:
    name = request.param
    return name, load_folder(family_folder(name, tmp_path_factory.mktemp(name)))


def write_gguf(model: LoadedModel, arch: str, path: Path, qtype: gguf.GGMLQuantizationType = F32,
               floats: dict[str, float] | None = None) -> Path:
    """The model as llama.cpp's converter writes it: tensors under GGUF names (matrices in `qtype`),
    Llama's q/k rows permuted for interleaved RoPE, Phi-3's LongRoPE factors as tensors, the vocabulary;
    `floats`: more float32 metadata."""
    a = model.args
    w = gguf.GGUFWriter(path, arch)
    for key, value in (floats or {}).items():
        w.add_float32(key, value)
    w.add_block_count(a.num_hidden_layers)
    w.add_context_length(a.max_position_embeddings)
    w.add_embedding_length(a.hidden_size)
    w.add_feed_forward_length(a.intermediate_size)
    w.add_head_count(a.num_attention_heads)
    w.add_head_count_kv(a.num_key_value_heads)
    w.add_key_length(a.head_dim)
    w.add_value_length(a.head_dim)
    w.add_rope_dimension_count(a.head_dim)
    w.add_rope_freq_base(a.rope_theta)
    w.add_layer_norm_rms_eps(a.rms_norm_eps)
    w.add_vocab_size(a.vocab_size)
    vocab = tokenizers.Tokenizer.from_file(str(model.source / "tokenizer.json")).get_vocab()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([*sorted(vocab, key=vocab.get), "\u0120a"])  # one merge: a GGUF BPE vocabulary has some
    w.add_token_merges(["\u0120 a"])
    w.add_eos_token_id(model.tokenizer.eos_token_id)
    scaling = a.rope_scaling or {}
    if arch == "phi3":
        w.add_sliding_window(a.sliding_window or 0)  # 0: none
        w.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])
        w.add_rope_scaling_attn_factors(rope_attention_factor(a))
        w.add_tensor("rope_factors_long.weight", np.asarray(scaling["long_factor"], np.float32))
        w.add_tensor("rope_factors_short.weight", np.asarray(scaling["short_factor"], np.float32))
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "self_attn.qkv_proj": "attn_qkv", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.gate_up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}
    globals_ = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}
    for name, weight in model.weights.items():
        t = np.asarray(weight, np.float32)
        if name in globals_:
            w.add_tensor(globals_[name], t)
            continue
        _, _, layer, *kind, _ = name.split(".")
        kind = ".".join(kind)
        if arch == "llama" and kind in ("self_attn.q_proj", "self_attn.k_proj"):
            heads = a.num_attention_heads if kind == "self_attn.q_proj" else a.num_key_value_heads
            t = t.reshape(heads, 2, t.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(t.shape)
        if qtype != F32 and t.ndim == 2:
            w.add_tensor(f"blk.{layer}.{names[kind]}.weight", gguf.quants.quantize(t, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(f"blk.{layer}.{names[kind]}.weight", t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_numpy_logits_match_transformers_at_every_position(family):
    name, model = family
    engine = LLMEngine(model, backend="numpy", weights="float32", kv_memory="16MiB")
    assert worst_difference(engine, reference(name)) <= TOLERANCE


def test_mlx_logits_match_transformers_at_every_position(family):
    pytest.importorskip("mlx.core", reason="MLX is not installed (pip install 'edgeserve[mlx]')")
    name, model = family
    engine = LLMEngine(model, backend="mlx", kv_memory="16MiB")
    assert worst_difference(engine, reference(name)) <= mlx_tolerance(engine)


def test_gguf_loads_to_the_same_model(family, tmp_path):
    name, model = family
    from_gguf = load_gguf(write_gguf(model, GGUF_ARCH[name], tmp_path / f"{name}.gguf"))
    assert from_gguf.args.model_type == ("llama" if name == "mistral" else name)
    for field in ("head_dim", "rope_theta", "tie_word_embeddings", "num_key_value_heads", "max_position_embeddings"):
        assert getattr(from_gguf.args, field) == getattr(model.args, field), field
    engine = LLMEngine(from_gguf, backend="numpy", weights="float32", kv_memory="16MiB")
    assert worst_difference(engine, reference(name)) <= TOLERANCE


def test_a_phi3_gguf_keeps_its_window_and_longrope(tmp_path):
    """phi3.attention.sliding_window and the LongRoPE tensors and keys come back as the folder had them."""
    folder = load_folder(family_folder("phi3", tmp_path, sliding_window=8))
    from_gguf = load_gguf(write_gguf(folder, "phi3", tmp_path / "phi3.gguf"))
    assert from_gguf.args.sliding_window == folder.args.sliding_window == 8
    assert from_gguf.args.rope_scaling["original_max_position_embeddings"] == 16
    engine = LLMEngine(folder, backend="numpy", weights="float32", kv_memory="16MiB")
    cases = [(ids, engine.prompt_logits(ids)) for ids, _ in reference("phi3")]
    assert worst_difference(engine, reference("phi3")) > 100 * TOLERANCE  # the window counts
    assert worst_difference(LLMEngine(from_gguf, backend="numpy", weights="float32", kv_memory="16MiB"),
                            cases) <= TOLERANCE


@pytest.mark.parametrize("qtype", [gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_0])
def test_quantized_gguf_runs_from_its_blocks(family, tmp_path, qtype):
    """A quantized GGUF of the family on the NumPy kernels that compute from the blocks, and on MLX:
    the logits of its own float32 values (the exact oracle), within the kernels' activation rounding."""
    name, model = family
    from_gguf = load_gguf(write_gguf(model, GGUF_ARCH[name], tmp_path / f"{name}.gguf", qtype))
    exact = LLMEngine(from_gguf, backend="numpy", weights="float32", kv_memory="16MiB")
    cases = [(ids, exact.prompt_logits(ids)) for ids, _ in reference(name)]
    quantized = LLMEngine(from_gguf, backend="numpy", weights="quantized", kv_memory="16MiB")
    assert worst_difference(quantized, cases) <= QUANTIZED_TOLERANCE
    pytest.importorskip("mlx.core", reason="MLX is not installed (pip install 'edgeserve[mlx]')")
    engine = LLMEngine(from_gguf, backend="mlx", kv_memory="16MiB")
    assert worst_difference(engine, cases) <= mlx_tolerance(engine)


def transformers4_config(folder: Path) -> None:
    """Rewrite config.json the way transformers 4 (and so most published models) wrote RoPE: a top-level
    rope_theta and, where scaled, rope_scaling with a "type" (mlx-lm reads Phi-3's LongRoPE only there)."""
    config = json.loads((folder / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    if rope["rope_type"] != "default":
        config["rope_scaling"] = {"type": rope.pop("rope_type"), **rope}
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("converter", ["mlx-lm", "edgeserve"])
def test_mlx_folders_load_here_as_in_mlx_lm(family, tmp_path, converter):
    """The Hugging Face folder converted to 8-bit MLX groups by mlx-lm (config.json rewritten as
    transformers 4 wrote it) or by `edgeserve convert`: mlx-lm's own model (float32) and ours on
    that folder agree at every position."""
    mx = pytest.importorskip("mlx.core", reason="MLX is not installed (pip install 'edgeserve[mlx]')")
    import mlx_lm

    name, model = family
    folder = tmp_path / "mlx"
    if converter == "mlx-lm":
        mlx_lm.convert(str(model.source), mlx_path=str(folder), quantize=True, q_bits=8, q_group_size=32)
        transformers4_config(folder)
    else:
        result = CliRunner().invoke(cli, ["convert", str(model.source), "-o", str(folder), "--bits", "8",
                                          "--group-size", "32"])
        assert result.exit_code == 0, result.output
    peer, _ = mlx_lm.load(str(folder))
    peer.set_dtype(mx.float32)
    ours = load_folder(folder)
    assert ours.format == "mlx" and ours.quantization().startswith("8-bit g32")
    cases = [(ids, np.array(peer(mx.array([ids]))[0])) for ids, _ in reference(name)]
    engine = LLMEngine(ours, backend="numpy", weights="float32", kv_memory="16MiB")
    assert worst_difference(engine, cases) <= TOLERANCE
    # from the 8-bit groups themselves (a window-less Mistral through the fused Llama blocks)
    engine = LLMEngine(ours, backend="numpy", weights="quantized", kv_memory="16MiB")
    assert worst_difference(engine, cases) <= QUANTIZED_TOLERANCE


def test_greedy_decoding_agrees_with_the_prompt_logits(family):
    """Tokens decoded one at a time through the paged pool, after a prefill in small chunks, are the
    argmax of one whole-sequence pass: the per-family parts act alike on both paths."""
    name, model = family
    engine = LLMEngine(model, backend="numpy", weights="float32", kv_memory="16MiB", max_num_batched_tokens=8)
    prompt = reference(name)[0][0]
    engine.add_request(prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), "r")
    out = engine.run_to_completion()["r"].token_ids
    logits = engine.prompt_logits(prompt + out[:-1])
    assert logits[len(prompt) - 1 :].argmax(-1).tolist() == out


@pytest.mark.parametrize("backend", ["numpy", "mlx"])
def test_a_mistral_window_shorter_than_the_prompts(tmp_path, backend):
    """A window of 8 tokens (the fixture's "window" variant) over prompts of 7, 24 and 40: each
    position sees its last 8 keys, in one pass and when decoded after a prefill in chunks of 8."""
    if backend == "mlx":
        pytest.importorskip("mlx.core", reason="MLX is not installed (pip install 'edgeserve[mlx]')")
    overrides = json.loads((FIXTURES / "mistral" / "config_overrides.json").read_text())["window"]
    assert overrides == {"sliding_window": 8}
    model = load_folder(family_folder("mistral", tmp_path, **overrides))
    engine = LLMEngine(model, backend=backend, kv_memory="16MiB", max_num_batched_tokens=8)
    assert [layer.attention.window for layer in engine.runner.model.layers] == [8, 8]
    cases = reference("mistral", "window_")
    bound = TOLERANCE if backend == "numpy" else mlx_tolerance(engine)
    assert worst_difference(engine, cases) <= bound
    assert worst_difference(engine, reference("mistral")[1:]) > 100 * TOLERANCE  # the window changes them
    prompt = cases[1][0]
    engine.add_request(prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), "r")
    out = engine.run_to_completion()["r"].token_ids
    assert engine.prompt_logits(prompt + out[:-1])[len(prompt) - 1 :].argmax(-1).tolist() == out


def test_phi3_with_partial_rotary_embeddings_is_refused(tmp_path):
    config = json.loads((FIXTURES / "phi3" / "config.json").read_text())
    folder = family_folder("phi3", tmp_path, rope_parameters={**config["rope_parameters"], "partial_rotary_factor": 0.75})
    with pytest.raises(ModelLoadError, match="partial_rotary_factor 0.75"):
        load_folder(folder)


def test_served_over_http_as_in_process(family):
    """The family behind `edgeserve serve`'s app, asked by the openai client for a greedy chat answer:
    the same tokens as the engine's own greedy decode of the rendered prompt."""
    name, model = family
    messages = [{"role": "user", "content": "Say something."}]
    engine = LLMEngine(model, backend="numpy", kv_memory="16MiB")
    prompt = Prompts.for_engine(engine).chat(messages)
    engine.add_request(prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), "r")
    want = model.tokenizer.decode(engine.run_to_completion()["r"].token_ids, skip_special_tokens=True)
    aengine = AsyncEngine(engine)
    server = ServerThread(create_app(aengine, name))
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
        answer = client.chat.completions.create(model=name, messages=messages, max_tokens=8, temperature=0,
                                                extra_body={"ignore_eos": True})
    finally:
        server.stop()
        aengine.shutdown()
    assert answer.usage.completion_tokens == 8
    assert answer.choices[0].message.content == want


def test_an_unsupported_rope_scaling_is_refused(tmp_path):
    """Qwen 3's optional YaRN scaling is not computed here: refused, never run as plain RoPE."""
    folder = family_folder("qwen3", tmp_path, rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                               "original_max_position_embeddings": 16,
                                                               "rope_theta": 1e6})
    with pytest.raises(ModelLoadError, match="unsupported RoPE scaling 'yarn'"):
        load_folder(folder)


@pytest.mark.parametrize("name, shape", [
    ("qwen3", "qwen3: 2 layers, hidden 64, 4 heads / 2 KV heads x 32"),
    ("phi3", "phi3: 2 layers, hidden 64, 4 heads / 2 KV heads x 16"),
    ("mistral", "mistral: 2 layers, hidden 64, 4 heads / 2 KV heads x 16"),
])
def test_info_shows_each_family(tmp_path, name, shape):
    result = CliRunner().invoke(cli, ["info", str(family_folder(name, tmp_path)), "--backend", "numpy"])
    assert result.exit_code == 0, result.output
    assert shape in result.output
    kv = 2 * 2 * 2 * (32 if name == "qwen3" else 16) * 4  # K and V, layers, KV heads, head_dim, float32
    assert f"{kv} bytes (float32)" in result.output
