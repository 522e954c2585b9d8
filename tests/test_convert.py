"""`edgeserve convert` on the real model: GGUF to 8- and 4-bit MLX folders that edgeserve (both
backends) and mlx-lm load, a float16 folder to 4 bits, perplexity, the NumPy weights modes, and
bad input that must leave nothing behind."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
from click.testing import CliRunner
from safetensors.numpy import save_file

from edgeserve.backends import resident_weight_bytes
from edgeserve.backends.qmatmul import QMatrix
from edgeserve.cli.main import cli
from edgeserve.engine.llm_engine import LLMEngine
from edgeserve.engine.prompts import Prompts
from edgeserve.evaluation.perplexity import perplexity, windows
from edgeserve.evaluation.quality_report import SHIPPED_TEXT, layer_error_table, quality_report
from edgeserve.models.base import ModelArgs, rope_inv_freq
from edgeserve.models.catalog import CATALOG, DEFAULT_MODEL, sha256_of
from edgeserve.models.convert import TensorPlan, convert, convert_tensor
from edgeserve.models.loader import LoadedModel, load_folder
from edgeserve.quant.affine import QuantizedTensor, quantize
from edgeserve.sampling_params import SamplingParams

PROMPT = [{"role": "user", "content": "What is the capital of France?"}]
SHORT_PROMPT = "The capital of France is"  # for MLX on the CPU, which runs about a token a second
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
LOGITS_TOLERANCE = 0.1


@pytest.fixture(scope="module")
def folders(loaded_model, model_path, tmp_path_factory) -> dict[int, Path]:
    """The default GGUF converted to 8 and 4 bits (mixed: 8-bit embeddings by default)."""
    root = tmp_path_factory.mktemp("converted")
    out = {bits: convert(loaded_model, root / f"int{bits}", bits=bits, progress=False).out for bits in (8, 4)}
    assert sha256_of(model_path) == CATALOG[DEFAULT_MODEL].sha256  # the source is untouched
    return out


@pytest.fixture(scope="module")
def source_engine(loaded_model) -> LLMEngine:
    return LLMEngine(loaded_model, backend="numpy", weights="float32", kv_memory="64MiB")


@pytest.fixture(scope="module")
def folder_engines(folders) -> dict[int, LLMEngine]:
    return {bits: LLMEngine(load_folder(path), backend="numpy", kv_memory="64MiB") for bits, path in folders.items()}


@pytest.fixture(scope="module")
def prompt_ids(source_engine) -> list[int]:
    return Prompts.for_engine(source_engine).chat(PROMPT)


@pytest.fixture(scope="module")
def short_ids(source_engine) -> list[int]:
    return source_engine.tokenizer.encode(SHORT_PROMPT)


@pytest.fixture(scope="module")
def source_logits(source_engine, prompt_ids, short_ids) -> dict[str, np.ndarray]:
    return {"chat": source_engine.prompt_logits(prompt_ids), "short": source_engine.prompt_logits(short_ids)}


@pytest.fixture(scope="module")
def source_greedy(source_engine, prompt_ids) -> list[int]:
    return _greedy(source_engine, prompt_ids)


def _greedy(engine: LLMEngine, ids: list[int]) -> list[int]:
    engine.add_request(ids, GREEDY, "greedy")
    return engine.run_to_completion()["greedy"].token_ids


def test_gguf_becomes_mlx_folders(folders):
    for bits, folder in folders.items():
        names = {p.name for p in folder.iterdir()}
        assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
        config = json.loads((folder / "config.json").read_text())
        assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
        # Q4_1 layers and the Q8_0 embedding carry over at their GGUF group size of 32.
        assert config["quantization"] == {
            "group_size": 32, "bits": bits, "mode": "affine",
            **({"model.embed_tokens": {"group_size": 32, "bits": 8}} if bits == 4 else {}),
        }
        assert "<|im_start|>" in json.loads((folder / "tokenizer_config.json").read_text())["chat_template"]
        loaded = load_folder(folder)
        assert loaded.format == "mlx"
        assert {w.bits for w in loaded.weights.values() if isinstance(w, QuantizedTensor)} == {8, bits}
    assert not [p for p in folders[8].parent.iterdir() if p.name.startswith(".")]  # no temporary folder left


@pytest.mark.parametrize("bits", [8, 4])
def test_converted_logits_and_greedy_text_match_the_source(folder_engines, source_logits, source_greedy, prompt_ids,
                                                          bits):
    engine = folder_engines[bits]
    assert np.abs(engine.prompt_logits(prompt_ids) - source_logits["chat"]).max() <= LOGITS_TOLERANCE
    assert _greedy(engine, prompt_ids) == source_greedy


@pytest.mark.parametrize("bits", [8, 4])
def test_converted_folders_run_on_the_mlx_backend(folders, source_logits, short_ids, bits):
    pytest.importorskip("mlx.core", reason="MLX is not installed: MLX backend not tested")
    engine = LLMEngine(load_folder(folders[bits]), backend="mlx", kv_memory="64MiB")
    last = engine.prompt_logits(short_ids)[-1]
    assert np.abs(last - source_logits["short"][-1]).max() <= LOGITS_TOLERANCE
    tokens = _greedy(engine, short_ids)
    assert len(tokens) == GREEDY.max_tokens and tokens[0] == int(np.argmax(last))


@pytest.mark.parametrize("bits", [8, 4])
def test_mlx_lm_loads_the_folder_and_agrees(folders, folder_engines, short_ids, bits):
    mx = pytest.importorskip("mlx.core", reason="MLX is not installed: mlx-lm not tested")
    mlx_lm = pytest.importorskip("mlx_lm", reason="mlx-lm is not installed (a test extra)")
    model, tokenizer = mlx_lm.load(str(folders[bits]))
    assert tokenizer.encode(SHORT_PROMPT) == short_ids
    model.set_dtype(mx.float32)  # compute as edgeserve does on the CPU (float16 scales widen exactly)
    theirs = np.array(model(mx.array([short_ids]))[0, -1])
    ours = folder_engines[bits].prompt_logits(short_ids)[-1]
    assert np.abs(theirs - ours).max() <= LOGITS_TOLERANCE


@pytest.fixture(scope="module")
def float16_folder(loaded_model, tmp_path_factory) -> Path:
    """A Hugging Face style float16 safetensors folder of the model (the Q4_1 values, widened)."""
    folder = tmp_path_factory.mktemp("float16") / "model"
    folder.mkdir()
    weights = {
        name: (w.dequantize(np.float16) if isinstance(w, QuantizedTensor) else np.asarray(w, dtype=np.float16))
        for name, w in loaded_model.weights.items()
    }
    save_file(weights, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(loaded_model.args.to_config()))
    loaded_model.tokenizer.save_pretrained(folder)
    return folder


def test_float16_folder_converts_to_4_bits_in_shards(float16_folder, tmp_path, short_ids):
    f16 = load_folder(float16_folder)
    result = convert(f16, tmp_path / "int4", bits=4, progress=False, max_shard_bytes=40 * 10**6)
    shards = sorted(p.name for p in result.out.glob("*.safetensors"))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((result.out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)

    back = load_folder(result.out)
    name = "model.layers.3.mlp.down_proj.weight"
    want = quantize(np.asarray(f16.weights[name]), 64, 4)  # float16 sources: mlx-lm's group size 64
    got = back.weights[name]
    assert (got.bits, got.group_size) == (4, 64) and back.weights["model.embed_tokens.weight"].bits == 8
    for ours, mlx_layout in ((got.weight, want.weight), (got.scales, want.scales), (got.biases, want.biases)):
        assert np.array_equal(ours, mlx_layout)
    engine = LLMEngine(back, backend="numpy", kv_memory="64MiB")
    assert len(_greedy(engine, short_ids)) == GREEDY.max_tokens


def _slice_perplexity(engine: LLMEngine) -> float:
    """Perplexity on the first 128 tokens of the shipped text, in two windows of 64."""
    ids = engine.tokenizer.encode(SHIPPED_TEXT.read_text(encoding="utf-8"))[:128]
    result = perplexity(engine, ids, ctx=64, stride=64, progress=False)
    assert result.windows == 2 and result.tokens == len(ids) - 2
    return result.perplexity


def test_requantized_int8_keeps_the_perplexity_of_its_float16_source(float16_folder, tmp_path):
    f16 = load_folder(float16_folder)
    result = convert(f16, tmp_path / "int8", bits=8, measure_errors=True, progress=False)
    assert {p.action for p in result.plans if p.is_matrix} == {"quantize"}
    assert max(result.relative_errors.values()) < 0.01
    source = _slice_perplexity(LLMEngine(f16, backend="numpy", weights="float32", kv_memory="64MiB"))
    int8 = _slice_perplexity(LLMEngine(load_folder(result.out), backend="numpy", kv_memory="64MiB"))
    assert abs(int8 / source - 1) <= 0.01, (int8, source)


def test_perplexity_of_the_converted_models(folder_engines, source_engine):
    source = _slice_perplexity(source_engine)
    assert 1 < source < 100
    for bits, limit in ((8, 0.01), (4, 0.10)):  # here exact: the GGUF's groups carry over
        assert abs(_slice_perplexity(folder_engines[bits]) / source - 1) <= limit, bits


def test_sliding_windows_score_every_token_once():
    spans = windows(1000, ctx=256, stride=128)
    scored = [t for _, end, first in spans for t in range(first, end)]
    assert scored == list(range(1, 1000))
    assert all(end - begin <= 256 for begin, end, _ in spans)
    assert all(first - begin >= 128 for begin, _, first in spans[1:])  # context of at least ctx - stride


def test_quantized_weights_mode_matches_float32(loaded_model, source_logits, short_ids):
    engine = LLMEngine(loaded_model, backend="numpy", weights="quantized", kv_memory="64MiB")
    qkv = engine.runner.model.layers[0].attention.qkv
    assert isinstance(qkv, QMatrix)  # the quantized storage, repacked: no float32 copy
    parts = [loaded_model.weights[f"model.layers.0.self_attn.{n}_proj.weight"] for n in "qkv"]
    assert qkv.nbytes <= 1.02 * sum(p.weight.nbytes + p.scales.nbytes + p.biases.nbytes for p in parts)
    # the kernels round activations to int16 per group: logits (about 20 at the top) move by ~1e-3 of their size
    assert np.abs(engine.prompt_logits(short_ids) - source_logits["short"]).max() < 5e-2
    float32, quantized = (resident_weight_bytes(loaded_model, mode) for mode in ("float32", "quantized"))
    head = loaded_model.weights["model.embed_tokens.weight"].shape  # tied: also held transposed as the head
    assert float32 == 4 * (loaded_model.num_parameters + head[0] * head[1]) and quantized < float32 / 4


def test_quality_report_of_a_requantized_model(loaded_model, tmp_path, capsys):
    result = convert(loaded_model, tmp_path / "g64", bits=4, group_size=64, measure_errors=True, progress=False)
    errors = dict(result.relative_errors)
    assert 0 < errors.pop("model.embed_tokens.weight") < 0.01  # Q8_0 groups of 32 regrouped by 64 at 8 bits
    assert len(errors) == 7 * 30 and all(0.01 < e < 0.5 for e in errors.values())  # likewise Q4_1 at 4 bits
    text = tmp_path / "text.txt"
    text.write_text(SHIPPED_TEXT.read_text(encoding="utf-8")[:250], encoding="utf-8")
    report = quality_report(loaded_model, result, text_path=text, ctx=64, backend="numpy")
    progress = capsys.readouterr().err
    assert progress.index("perplexity 1/2: source") < progress.index("perplexity 2/2: converted")
    lines = report.splitlines()
    assert lines[0].startswith(f"Quality of {result.out} (4-bit, group 64; model.embed_tokens 8-bit, group 64)")
    assert [line.split()[0] for line in lines if line[:5].strip().isdigit()] == [str(i) for i in range(30)]
    source, converted = (float(line.split()[1]) for line in lines[-2:])
    assert lines[-2].startswith("  source") and lines[-1].startswith("  result") and source > 1 and converted > 1


def test_kept_groups_keep_their_values_exactly():
    rng = np.random.default_rng(0)
    q4 = quantize(rng.standard_normal((8, 64)).astype(np.float32), 32, 4)
    # mlx-community folders often hold bfloat16 scales, which NumPy keeps as their uint16 bits.
    bf16 = QuantizedTensor(q4.weight, (q4.scales.view(np.uint32) >> 16).astype(np.uint16),
                           (q4.biases.view(np.uint32) >> 16).astype(np.uint16), 4, 32)
    for action, bits in (("copy", 4), ("widen", 8)):
        plan = TensorPlan("w", True, bits, 32, action, 0)
        out = convert_tensor(bf16, plan)
        assert out.bits == bits and out.scales.dtype == np.float32
        assert np.array_equal(out.dequantize(), bf16.dequantize())


def test_report_lays_out_errors_per_layer():
    errors = {f"model.layers.{i}.self_attn.{k}_proj.weight": 0.01 * (i + 1) for i in range(2) for k in "qkvo"}
    errors["model.embed_tokens.weight"] = 0.5
    table = layer_error_table(errors)
    assert "    1    2.00%   2.00%   2.00%   2.00%       -       -       -   2.00%" in table
    assert "model.embed_tokens: 50.00%" in table and "max 50.00% (model.embed_tokens)" in table


def test_llama3_rope_scaling_is_recovered_from_gguf_factors():
    base = dict(hidden_size=2048, num_hidden_layers=1, intermediate_size=8, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=8, rope_theta=500000.0)
    llama3 = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}
    divisors = rope_inv_freq(ModelArgs(**base)) / rope_inv_freq(ModelArgs(**base, rope_scaling=llama3))
    factors = divisors.astype(np.float32).tolist()  # as a GGUF rope_freqs tensor stores them
    from_gguf = ModelArgs(**base, rope_scaling={"rope_type": "factors", "factors": factors})
    assert from_gguf.to_config()["rope_scaling"] == llama3


# Bad input ----------------------------------------------------------------------------------


def _tiny_gguf(path: Path, arch: str = "llama", qtype: gguf.GGMLQuantizationType | None = None) -> Path:
    w = gguf.GGUFWriter(path, arch)
    for add in (w.add_block_count, w.add_head_count):
        add(1)
    w.add_embedding_length(256)
    w.add_feed_forward_length(256)
    if qtype is None:
        w.add_tensor("token_embd.weight", np.zeros((4, 256), np.float32))
    else:
        w.add_tensor("token_embd.weight", np.zeros((2, gguf.GGML_QUANT_SIZES[qtype][1]), np.uint8), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _folder_without_tokenizer(path: Path) -> Path:
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 1,
                                                  "intermediate_size": 64, "num_attention_heads": 1, "vocab_size": 8}))
    layer = {f"model.layers.0.{name}.weight": np.zeros((64, 64), np.float16)
             for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                          "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    layer.update({f"model.layers.0.{name}.weight": np.ones(64, np.float16)
                  for name in ("input_layernorm", "post_attention_layernorm")})
    save_file({"model.embed_tokens.weight": np.zeros((8, 64), np.float16), "model.norm.weight": np.ones(64, np.float16),
               **layer}, str(path / "model.safetensors"))
    return path


def _convert_cli(*args: str):
    return CliRunner().invoke(cli, ["convert", *args])


def _assert_failed_cleanly(result, message: str, folder: Path, before: set[str]) -> None:
    assert result.exit_code != 0, result.output
    assert message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert {p.name for p in folder.iterdir()} == before  # no OUT, no temporary folder


@pytest.mark.parametrize("kind", ["architecture", "tensor type", "tokenizer"])
def test_bad_sources_leave_nothing_behind(tmp_path, kind):
    source, message = {
        "architecture": (lambda: _tiny_gguf(tmp_path / "m.gguf", arch="gpt2"), "unsupported architecture 'gpt2'"),
        "tensor type": (lambda: _tiny_gguf(tmp_path / "m.gguf", qtype=gguf.GGMLQuantizationType.Q8_K),
                        "unsupported tensor type Q8_K"),
        "tokenizer": (lambda: _folder_without_tokenizer(tmp_path / "m"), "no tokenizer.json or tokenizer.model"),
    }[kind]
    src = source()
    before = {p.name for p in tmp_path.iterdir()}
    _assert_failed_cleanly(_convert_cli(str(src), "-o", str(tmp_path / "out")), message, tmp_path, before)


def test_existing_output_needs_force(model_path, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    before = {p.name for p in tmp_path.iterdir()}
    result = _convert_cli(str(model_path), "-o", str(tmp_path / "out"))
    _assert_failed_cleanly(result, "already exists (use --force to replace it)", tmp_path, before)
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"


@pytest.fixture
def cli_source(loaded_model, monkeypatch) -> LoadedModel:
    """The model loader answers with the already loaded model, whatever the name."""
    monkeypatch.setattr("edgeserve.models.loader.load_model", lambda name: loaded_model)
    return loaded_model


def test_no_disk_space_leaves_nothing_behind(cli_source, tmp_path, monkeypatch):
    monkeypatch.setattr("edgeserve.models.convert.shutil.disk_usage", lambda path: SimpleNamespace(free=10**6))
    result = _convert_cli("any", "-o", str(tmp_path / "out"))
    _assert_failed_cleanly(result, "not enough disk space", tmp_path, set())


def test_ctrl_c_while_writing_leaves_nothing_behind(cli_source, tmp_path, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("edgeserve.models.convert.save_file", interrupted)
    result = _convert_cli("any", "-o", str(tmp_path / "new" / "out"))
    assert result.exit_code == 130
    assert list(tmp_path.iterdir()) == []  # neither OUT, its temporary folder, nor the parent made for it


def test_output_may_not_hold_the_source(cli_source):
    result = _convert_cli("any", "-o", str(cli_source.source.parent), "--force")
    assert result.exit_code == 1 and "holds the source model" in result.stderr
    assert cli_source.source.is_file()


def test_group_size_must_divide_the_columns(cli_source, tmp_path):
    result = _convert_cli("any", "-o", str(tmp_path / "out"), "--group-size", "128")
    _assert_failed_cleanly(result, "group size 128 does not divide the 576 columns", tmp_path, set())
    assert "use --group-size 32 or 64" in result.stderr
