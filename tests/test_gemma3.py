"""Gemma 3 270M, the catalog's Q4_K_M GGUF, against transformers float32 on the same file
(tests/fixtures/make_gemma3_reference.py): tokenizer, logits and greedy continuations on the NumPy
float32 path (one prompt past the 512-token sliding window), the quantized kernels, the MLX
backend, its chat template, the server and the CLI, and perplexity beside llama.cpp's."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import openai
import pytest

from edgeserve.backends import get_backend
from edgeserve.config import EngineConfig
from edgeserve.engine.async_engine import AsyncEngine
from edgeserve.engine.llm_engine import LLMEngine
from edgeserve.evaluation.perplexity import text_perplexity
from edgeserve.evaluation.shipped_text import SHIPPED_TEXT
from edgeserve.models.catalog import CATALOG, pull, sha256_of
from edgeserve.models.gemma3 import FULL, SLIDING
from edgeserve.models.loader import LoadedModel, load_folder, load_model
from edgeserve.quant.gguf_file import read_gguf
from edgeserve.sampling_params import SamplingParams
from edgeserve.server.app import create_app
from edgeserve.text.chat_template import ChatTemplate, ChatTemplateError
from loopback import ServerThread
from mlx_parity import LOGITS_TOLERANCE, assert_same_up_to_near_tie

pytestmark = pytest.mark.slow  # Gemma 3 270M, the real model

NAME = "gemma3-270m"
FIXTURES = Path(__file__).parent / "fixtures"
REFERENCE = json.loads((FIXTURES / "gemma3_transformers_reference.json").read_text())
CASES = REFERENCE["cases"]
LONG = max(range(len(CASES)), key=lambda i: len(CASES[i]["prompt_ids"]))
SHORT = [i for i in range(len(CASES)) if i != LONG]
LLAMA_CPP = json.loads((FIXTURES / "gemma3_llamacpp_perplexity.json").read_text())


@pytest.fixture(scope="module")
def gemma_path() -> Path:
    return pull(NAME)


@pytest.fixture(scope="module")
def gemma(gemma_path) -> LoadedModel:
    return load_model(str(gemma_path))


@pytest.fixture(scope="module")
def engine(gemma) -> LLMEngine:
    """The exact path: float32 weights."""
    return LLMEngine(gemma, backend="numpy", weights="float32", kv_memory="256MiB")


@pytest.fixture(scope="module")
def numpy_greedy(engine) -> list[list[int]]:
    """Every case's greedy continuation, all in one batch."""
    return greedy(engine, [c["prompt_ids"] for c in CASES], max(len(c["greedy_ids"]) for c in CASES))


def greedy(engine: LLMEngine, prompts: list[list[int]], n: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    done = engine.run_to_completion()
    return [done[i].token_ids for i in ids]


def test_catalog_pull_gives_the_checked_file(gemma_path):
    assert gemma_path.name == "gemma-3-270m-q4_k_m.gguf"
    assert sha256_of(gemma_path) == CATALOG[NAME].sha256


def test_gguf_loads_as_gemma3(gemma, gemma_path):
    args = gemma.args
    assert args.model_type == "gemma3_text" and args.vocab_size == 262144 and args.head_dim == 256
    assert args.sliding_window == 512 and args.rope_local_base_freq == 10000.0 and args.rope_theta == 1e6
    assert args.layer_types.count(FULL) == 3 and args.layer_types.count(SLIDING) == 15
    assert [i for i, t in enumerate(args.layer_types) if t == FULL] == [5, 11, 17]
    # llama.cpp stores Gemma's norms as 1 + weight; the loader gives the checkpoint's weight back
    raw = read_gguf(gemma_path).tensors["blk.3.post_ffw_norm.weight"].data
    np.testing.assert_array_equal(gemma.weights["model.layers.3.post_feedforward_layernorm.weight"], raw - 1)


def test_transformers_config_gives_the_same_args(gemma):
    """config.json as transformers 5 writes this model's (per-layer-type rope_parameters, `_sliding_window_pattern`)."""
    config = {"model_type": "gemma3_text", "hidden_size": 640, "num_hidden_layers": 18, "intermediate_size": 2048,
              "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256, "vocab_size": 262144,
              "rms_norm_eps": 9.999999974752427e-07, "max_position_embeddings": 32768, "sliding_window": 512,
              "_sliding_window_pattern": 6, "query_pre_attn_scalar": 256, "final_logit_softcapping": None,
              "tie_word_embeddings": True, "hidden_activation": "gelu_pytorch_tanh",
              "rope_parameters": {"full_attention": {"rope_theta": 1000000.0, "rope_type": "default"},
                                  "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"}}}
    assert type(gemma.args).from_config(config) == gemma.args


def test_converted_folder_runs_as_gemma3(gemma, tmp_path):
    """`edgeserve convert` to an MLX int8 folder: the same arguments and norms back, logits near the GGUF's."""
    done = subprocess.run([sys.executable, "-m", "edgeserve.cli", "convert", NAME, "-o", str(tmp_path / "m"),
                           "--bits", "8"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    folder = load_folder(tmp_path / "m")
    assert folder.args == gemma.args and folder.tokenizer.chat_template == gemma.tokenizer.chat_template
    ids = CASES[0]["prompt_ids"]
    want, got = (LLMEngine(m, backend="numpy", kv_memory="32MiB").prompt_logits(ids)[-1] for m in (gemma, folder))
    assert got.argmax() == want.argmax() and np.abs(got - want).max() < 1.0


def test_tokenizer_matches_transformers(gemma):
    for case in CASES:
        assert gemma.tokenizer.encode(case["text"]) == case["prompt_ids"]
        assert gemma.tokenizer.decode(case["greedy_ids"]) == case["greedy_text"]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_numpy_float32_matches_transformers(engine, numpy_greedy, case):
    """Greedy tokens identical for every step; every step's top-10 logits within 1e-3 relative."""
    ref = CASES[case]
    prompt, want = ref["prompt_ids"], ref["greedy_ids"]
    assert len(want) >= 32
    assert numpy_greedy[case][: len(want)] == want
    logits = engine.prompt_logits(prompt + want[:-1])
    assert np.array_equal(logits[: len(prompt)].argmax(-1), ref["prompt_argmax_per_position"])
    for step, top in zip(logits[len(prompt) - 1 :], ref["step_logits_top10"]):
        ids, values = np.asarray(top).T
        np.testing.assert_allclose(step[ids.astype(int)], values, rtol=1e-3, atol=0)


def test_the_long_prompt_needs_the_window(gemma):
    """Past 512 tokens the local layers' window changes the answer: without it the logits leave the reference."""
    full = dataclasses.replace(gemma.args, layer_types=[FULL] * gemma.args.num_hidden_layers)
    windowless = LLMEngine(LoadedModel(full, gemma.weights, gemma.tokenizer, gemma.source, gemma.format),
                           backend="numpy", weights="float32", kv_memory="128MiB")
    ref = CASES[LONG]
    assert len(ref["prompt_ids"]) > gemma.args.sliding_window
    last = windowless.prompt_logits(ref["prompt_ids"])[-1]
    ids, values = np.asarray(ref["step_logits_top10"][0]).T
    assert np.abs(last[ids.astype(int)] - values).max() > 0.1


def test_quantized_kernels_stay_near_transformers(gemma):
    """The default CPU path computes from the Q4_K/Q5_0/Q6_K/Q8_0 blocks, activations quantized to int16."""
    quantized = LLMEngine(gemma, backend="numpy", weights="quantized", kv_memory="128MiB")
    for case in SHORT:
        ref = CASES[case]
        last = quantized.prompt_logits(ref["prompt_ids"])[-1]
        ids, values = np.asarray(ref["step_logits_top10"][0]).T
        assert np.abs(last[ids.astype(int)] - values).max() < 0.1


def test_final_logit_soft_capping_where_configured(gemma):
    """Gemma 3's configs have none (Gemma 2's have 30): with one, the logits are cap * tanh(logits / cap)."""
    capped = dataclasses.replace(gemma.args, final_logit_softcapping=30.0)
    ids = CASES[0]["prompt_ids"]
    plain, soft = (LLMEngine(LoadedModel(a, gemma.weights, gemma.tokenizer, gemma.source, gemma.format),
                             backend="numpy", kv_memory="32MiB").prompt_logits(ids) for a in (gemma.args, capped))
    np.testing.assert_allclose(soft, 30.0 * np.tanh(plain / 30.0), rtol=1e-5, atol=1e-5)
    assert np.abs(soft - plain).max() > 1.0


@pytest.mark.parametrize("backend", ["numpy", "mlx"])
def test_gelu_tanh_gate_and_soft_cap_ops(backend):
    if backend == "mlx":
        pytest.importorskip("mlx.core", reason="MLX is not installed: MLX backend not tested")
    be = get_backend(backend)
    gate_up = np.random.default_rng(0).standard_normal((5, 2 * 96)).astype(np.float32) * 4
    g, u = gate_up[:, :96].astype(np.float64), gate_up[:, 96:]
    want = 0.5 * g * (1 + np.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g**3))) * u
    as_array = be.vector if backend == "mlx" else np.asarray
    tol = 1e-5 if be.kv_dtype == "float32" else 2e-2  # float16 activations on a GPU
    np.testing.assert_allclose(be.to_numpy(be.gelu_tanh_mul(as_array(gate_up))), want, rtol=tol, atol=tol)
    np.testing.assert_allclose(be.to_numpy(be.soft_cap(as_array(gate_up), 5.0)), 5 * np.tanh(gate_up / 5.0),
                               rtol=tol, atol=tol)


def test_chat_template_renders_gemma_turns(gemma):
    template = ChatTemplate.for_tokenizer(gemma.tokenizer)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]
    prompt = template.render(messages)
    assert prompt == ("<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello.<end_of_turn>\n"
                      "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n")
    ids = gemma.tokenizer.encode(prompt)
    assert ids.count(gemma.tokenizer.bos_token_id) == 1 and ids[0] == gemma.tokenizer.bos_token_id
    end_of_turn = gemma.tokenizer.token_to_id("<end_of_turn>")
    assert ids.count(end_of_turn) == 3 and end_of_turn in gemma.tokenizer.eos_token_ids
    with pytest.raises(ChatTemplateError, match="alternate"):
        template.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_server_chat_over_http(gemma, gemma_path):
    aengine = AsyncEngine(LLMEngine(gemma, EngineConfig(backend="numpy", kv_memory="128MiB")))
    server = ServerThread(create_app(aengine, NAME))
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        reply = client.chat.completions.create(model=NAME, messages=messages, max_tokens=12, temperature=0)
        prompt = ChatTemplate.for_tokenizer(gemma.tokenizer).render(messages)
        assert reply.usage.prompt_tokens == len(gemma.tokenizer.encode(prompt))
        assert reply.choices[0].finish_reason in ("stop", "length") and reply.choices[0].message.content
        stream = client.chat.completions.create(model=NAME, messages=messages, max_tokens=12, temperature=0,
                                                stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == reply.choices[0].message.content
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "a"}] * 2, max_tokens=4)
    finally:
        server.stop()
        aengine.shutdown()


def test_cli_info_and_run():
    info = subprocess.run([sys.executable, "-m", "edgeserve.cli", "info", NAME], capture_output=True, text=True,
                          timeout=300)
    assert info.returncode == 0, info.stderr
    assert "gemma3_text: 18 layers" in info.stdout and "vocab 262144" in info.stdout
    run = subprocess.run([sys.executable, "-m", "edgeserve.cli", "run", "--model", NAME, "--backend", "numpy",
                          "--kv-memory", "64MiB", "--max-tokens", "8", "--json", "The capital of France is"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert out["completion_tokens"] >= 1 and out["text"]


def llama_cpp_perplexity(engine: LLMEngine, text: str, ctx: int, chunks: int) -> float:
    """Perplexity the way llama.cpp's llama-perplexity measures it: the text (BOS first) in whole
    chunks of ctx tokens, each chunk's first token replaced by BOS, its second half scored."""
    ids = engine.tokenizer.encode(text)
    nll, count, first = 0.0, 0, ctx // 2
    for i in range(min(chunks, len(ids) // ctx)):
        chunk = ids[i * ctx : (i + 1) * ctx]
        chunk[0] = engine.tokenizer.bos_token_id
        rows = engine.prompt_logits(chunk)[first : ctx - 1].astype(np.float64)
        targets = np.asarray(chunk[first + 1 :])
        top = rows.max(axis=-1)
        log_z = top + np.log(np.exp(rows - top[:, None]).sum(axis=-1))
        nll += float((log_z - rows[np.arange(len(targets)), targets]).sum())
        count += len(targets)
    return math.exp(nll / count)


def test_perplexity_beside_llama_cpp(gemma):
    """On the shipped text, by llama-perplexity's own recipe, within 1% of its figure on the same file."""
    text = (SHIPPED_TEXT.parent / LLAMA_CPP["text"]).read_text()
    engine = LLMEngine(gemma, backend="numpy", kv_memory="128MiB")
    chunks = LLAMA_CPP["chunks_tested"]  # of 11: each 512-token chunk costs seconds on a small CPU
    ours = llama_cpp_perplexity(engine, text, LLAMA_CPP["ctx"], chunks)
    theirs = LLAMA_CPP["estimate_after_chunk"][chunks - 1]
    assert abs(ours / theirs - 1) < 0.01, (ours, theirs)


def test_eval_perplexity_puts_bos_first_in_every_window(gemma):
    """Gemma reads a window that does not start with BOS badly (47 here without it): `edgeserve eval
    perplexity`'s sliding windows each start with it, and land near llama.cpp's recipe (which scores
    only tokens with half a window of context, so it reads lower)."""
    text = (SHIPPED_TEXT.parent / LLAMA_CPP["text"]).read_text()[:3000]
    engine = LLMEngine(gemma, backend="numpy", kv_memory="128MiB")
    ours = text_perplexity(engine, text, ctx=256, progress=False)
    recipe = llama_cpp_perplexity(engine, text, 256, chunks=2)
    assert ours.windows >= 3 and abs(ours.perplexity / recipe - 1) < 0.25, (ours.perplexity, recipe)


@pytest.fixture(scope="module")
def mlx_engine(gemma) -> LLMEngine:
    pytest.importorskip("mlx.core", reason="MLX is not installed (pip install 'edgeserve[mlx]'): MLX backend not tested")
    return LLMEngine(gemma, backend="mlx", kv_memory="128MiB")


def test_mlx_matches_numpy_and_transformers(engine, mlx_engine):
    """Within the bounds the MLX tests hold Llama to (test_mlx_backend): logits near NumPy's, and the
    greedy tokens transformers gives (short prompts: MLX on the CPU is slow at Gemma's 262k-entry head)."""
    tolerance = LOGITS_TOLERANCE[mlx_engine.backend.kv_dtype]
    prompts = [CASES[i]["prompt_ids"] for i in SHORT]
    for ids in prompts[:2]:
        assert np.abs(mlx_engine.prompt_logits(ids) - engine.prompt_logits(ids)).max() < tolerance
    for prompt, got, case in zip(prompts, greedy(mlx_engine, prompts, 8), SHORT):
        assert_same_up_to_near_tie(engine, prompt, got, CASES[case]["greedy_ids"][:8])


def test_mlx_sliding_window_matches_numpy(gemma, mlx_engine):
    """The window on both backends, made short (8) so that short prompts cross it."""
    narrow = dataclasses.replace(gemma.args, sliding_window=8)
    model = LoadedModel(narrow, gemma.weights, gemma.tokenizer, gemma.source, gemma.format)
    ids = max((CASES[i]["prompt_ids"] for i in SHORT), key=len)
    want = LLMEngine(model, backend="numpy", weights="float32", kv_memory="64MiB").prompt_logits(ids)
    got = LLMEngine(model, backend="mlx", kv_memory="64MiB").prompt_logits(ids)
    assert np.abs(got - want).max() < LOGITS_TOLERANCE[mlx_engine.backend.kv_dtype]
    assert np.abs(want - mlx_engine.prompt_logits(ids)).max() > 1.0  # the narrow window changes the answer
