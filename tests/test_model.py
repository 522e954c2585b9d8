"""The core runtime on the real model: GGUF reading, NumPy forward vs transformers, loaders, bad input."""

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from edgeserve.engine.llm_engine import LLMEngine
from edgeserve.models.loader import load_folder
from edgeserve.quant.gguf_file import read_gguf
from edgeserve.sampling_params import SamplingParams
from bench_scripts import patch_metadata, write_tiny
from model_folder import write_model_folder

FIXTURES = Path(__file__).parent / "fixtures"
REFERENCE = json.loads((FIXTURES / "smollm2_transformers_reference.json").read_text())


def edgeserve_cli(*args: str, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edgeserve.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.fixture(scope="module")
def engine(loaded_model):
    return LLMEngine(loaded_model, backend="numpy", kv_memory="128MiB")


def test_gguf_reader_matches_gguf_package(model_path):
    ours = read_gguf(model_path)
    theirs = gguf.GGUFReader(model_path)
    assert ours.metadata == {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert len(ours.tensors) == len(theirs.tensors) == 272
    for t in theirs.tensors[:40]:
        mine = ours.tensors[t.name]
        assert mine.qtype == t.tensor_type and mine.data.dtype == t.data.dtype
        assert np.array_equal(mine.data, t.data)


@pytest.mark.parametrize("case", range(len(REFERENCE["cases"])))
def test_numpy_forward_matches_transformers(engine, case):
    ref = REFERENCE["cases"][case]
    logits = engine.prompt_logits(ref["prompt_ids"])
    top2 = np.sort(logits, axis=-1)[:, -2:]
    near_tie = top2[:, 1] - top2[:, 0] < 0.05
    agree = logits.argmax(-1) == np.asarray(ref["prompt_argmax_per_position"])
    assert np.all(agree | near_tie)
    for token, value in ref["last_logits_top10"]:
        assert abs(logits[-1, token] - value) < 0.1


def test_greedy_continuations_match_transformers(engine):
    params = SamplingParams(max_tokens=48, temperature=0.0)
    ids = [engine.add_request(c["prompt_ids"], params) for c in REFERENCE["cases"]]
    done = engine.run_to_completion()
    for rid, case in zip(ids, REFERENCE["cases"]):
        # the reference drops the stop id
        tokens = [t for t in done[rid].token_ids if t not in engine.tokenizer.eos_token_ids]
        assert tokens == case["greedy_ids"]


@pytest.mark.parametrize("quantized", [False, True], ids=["safetensors", "mlx"])
def test_folders_give_the_gguf_logits(loaded_model, tmp_path, quantized):
    write_model_folder(loaded_model, tmp_path / "m", quantized)
    folder = load_folder(tmp_path / "m")
    assert folder.format == ("mlx" if quantized else "safetensors")
    ids = REFERENCE["cases"][1]["prompt_ids"]
    # float32 weights on both sides: the exact forward, so only the loading can differ
    other, gguf = (LLMEngine(m, backend="numpy", weights="float32", kv_memory="32MiB") for m in (folder, loaded_model))
    assert np.abs(other.prompt_logits(ids) - gguf.prompt_logits(ids)).max() < 1e-3
    assert folder.tokenizer.encode("Hello world") == loaded_model.tokenizer.encode("Hello world")


def test_run_json(model_path):
    done = edgeserve_cli("run", "--model", str(model_path), "--backend", "numpy", "--kv-memory", "64MiB",
                         "--max-tokens", "8", "--temperature", "0", "--json", "What is the capital of France?")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert "Paris" in out["text"]
    assert out["completion_tokens"] == 8 or out["finish_reason"] == "stop"
    assert out["prompt_tokens"] > 10 and out["decode_tokens_per_s"] > 0 and out["ttft_s"] > 0


def test_run_with_quantized_weights(model_path):
    """As a user runs it: the default int8 activations (the suite itself pins int16)."""
    env = {k: v for k, v in os.environ.items() if k != "EDGESERVE_ACTIVATIONS"}
    done = edgeserve_cli("run", "--model", str(model_path), "--backend", "numpy", "--weights", "quantized",
                         "--threads", "1", "--kv-memory", "64MiB", "--max-tokens", "8", "--temperature", "0",
                         "What is the capital of France?", env=env)
    assert done.returncode == 0, done.stderr
    assert "numpy (quantized weights, " in done.stderr and "kernels, int8 activations, 1 thread)" in done.stderr
    assert "Paris" in done.stdout


def _patch_tensor_type(src: Path, dst: Path, tensor: str, new_type: int) -> None:
    data = bytearray(src.read_bytes())
    name = tensor.encode()
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    n_dims = struct.unpack_from("<I", data, at)[0]
    struct.pack_into("<I", data, at + 4 + 8 * n_dims, new_type)
    dst.write_bytes(bytes(data))


def _nan_norm(src: Path, dst: Path) -> None:
    data = bytearray(src.read_bytes())
    norm = next(t for t in gguf.GGUFReader(src).tensors if t.name == "output_norm.weight")
    struct.pack_into("<f", data, int(norm.data_offset) + 4, float("nan"))
    dst.write_bytes(bytes(data))


DAMAGED = {  # metadata key, value, what the error names
    "no heads": ("llama.attention.head_count", 0, "num_attention_heads is 0"),
    "2^32 layers": ("llama.block_count", 2**32 - 1, "num_hidden_layers is 4294967295"),
    "2^32 context": ("llama.context_length", 2**32 - 1, "max_position_embeddings is 4294967295"),
    "kv heads not dividing": ("llama.attention.head_count_kv", 2, "num_key_value_heads is 2"),
    "narrower than its tensors": ("llama.embedding_length", 512, "model.embed_tokens.weight is (49152, 576)"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGED))
def test_damaged_metadata_is_refused_before_anything_is_allocated(model_path, tmp_path, damage):
    from edgeserve.errors import ModelLoadError
    from edgeserve.models.loader import load_model

    key, value, message = DAMAGED[damage]
    damaged = tmp_path / "damaged.gguf"
    patch_metadata(model_path, damaged, key, value)
    with pytest.raises(ModelLoadError, match="damaged") as refused:
        load_model(str(damaged))
    assert message in str(refused.value)


def test_a_nan_norm_is_refused(model_path, tmp_path):
    from edgeserve.errors import ModelLoadError
    from edgeserve.models.loader import load_model

    _nan_norm(model_path, tmp_path / "nan.gguf")
    with pytest.raises(ModelLoadError, match="model.norm.weight holds NaN"):
        load_model(str(tmp_path / "nan.gguf"))


def _bad_models(model_path: Path, tmp: Path) -> dict[str, tuple[Path, str]]:
    raw = model_path.read_bytes()
    truncated, magic, arch, qtype = tmp / "truncated.gguf", tmp / "magic.gguf", tmp / "arch.gguf", tmp / "qtype.gguf"
    truncated.write_bytes(raw[: len(raw) // 2])
    magic.write_bytes(b"GGUX" + raw[4:1000])
    w = gguf.GGUFWriter(arch, "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _patch_tensor_type(model_path, qtype, "blk.0.attn_q.weight", int(gguf.GGMLQuantizationType.I32))
    patch_metadata(model_path, tmp / "heads.gguf", "llama.attention.head_count", 0)
    return {
        "heads": (tmp / "heads.gguf", "num_attention_heads is 0"),
        "truncated": (truncated, "truncated (tensor"),
        "magic": (magic, "not a GGUF file"),
        "arch": (arch, "unsupported architecture 'gpt2'"),
        "qtype": (qtype, "unsupported tensor type"),
        "missing": (tmp / "nope.gguf", "not found"),
    }


@pytest.mark.parametrize("kind", ["truncated", "magic", "arch", "qtype", "heads", "missing"])
def test_bad_model_files_get_one_clear_line(model_path, tmp_path, kind):
    path, message = _bad_models(model_path, tmp_path)[kind]
    done = edgeserve_cli("run", "--model", str(path), "--backend", "numpy", "hi", timeout=120)
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], done.stderr


def test_unknown_backend_and_long_prompt(model_path):
    done = edgeserve_cli("run", "--model", str(model_path), "--backend", "tpu", "hi")
    assert done.returncode == 1 and done.stderr.strip() == "error: unknown backend 'tpu' (choose from auto, numpy, mlx)"
    done = edgeserve_cli("run", "--model", str(model_path), "--backend", "numpy", "--raw", "--kv-memory", "64MiB",
                         "word " * 9000)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("error: prompt has 9001 tokens but the model's context is 8192")


CHECK_CORPUS = """
import json, resource, sys
from pathlib import Path
limit = int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))  # a damaged size must not become a huge allocation
from edgeserve.config import EngineConfig
from edgeserve.engine.llm_engine import LLMEngine
from edgeserve.errors import EdgeserveError
from edgeserve.models.loader import load_model
outcomes = {}
for path in sorted(Path(sys.argv[1]).glob("*.gguf")):
    try:
        LLMEngine(load_model(str(path)), EngineConfig(backend="numpy", kv_memory="64MiB"))
        outcomes[path.name] = "loaded"
    except EdgeserveError as exc:
        outcomes[path.name] = "error: " + str(exc)
    except BaseException as exc:
        outcomes[path.name] = f"{type(exc).__name__}: {exc}"
print(json.dumps(outcomes))
"""


def test_a_corpus_of_damaged_files_each_loads_or_fails_in_one_line(model_path, tmp_path):
    # a tiny Llama file with the real tokenizer has the same metadata, tensor table and vocabulary to
    # damage as the real model, at a fifth of its bytes to copy and load 64 times
    source = write_tiny(tmp_path / "tiny.gguf", "q4_0", model_path)
    corpus = tmp_path / "corpus"
    script = Path(__file__).parents[1] / "bench" / "corrupt_gguf.py"
    subprocess.run([sys.executable, str(script), str(source), str(corpus)], check=True, capture_output=True)
    done = subprocess.run([sys.executable, "-c", CHECK_CORPUS, str(corpus), str(16 * 2**30)], capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr
    outcomes = json.loads(done.stdout)
    assert len(outcomes) >= 64
    bad = {name: outcome for name, outcome in outcomes.items()
           if outcome != "loaded" and not (outcome.startswith("error: ") and "\n" not in outcome)}
    assert not bad
    assert sum(o.startswith("error: ") for o in outcomes.values()) > len(outcomes) // 2
