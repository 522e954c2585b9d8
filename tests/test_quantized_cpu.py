"""The NumPy backend computing from the quantized storage, end to end on the real model, against
its own float32 mode (the exact oracle): memory, agreement, perplexity, and the numba fallback."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from edgeserve.backends import get_backend, qmatmul, resident_weight_bytes
from edgeserve.backends.qmatmul import QMatrix
from edgeserve.config import EngineConfig
from edgeserve.engine.llm_engine import LLMEngine
from edgeserve.evaluation.perplexity import text_perplexity
from edgeserve.evaluation.quality_report import SHIPPED_TEXT

pytestmark = pytest.mark.slow

FIXTURES = Path(__file__).parent / "fixtures"


def engine(model, weights: str) -> LLMEngine:
    return LLMEngine(model, EngineConfig(backend="numpy", weights=weights, kv_memory="64MiB"))


@pytest.fixture(scope="module")
def engines(loaded_model):
    return engine(loaded_model, "quantized"), engine(loaded_model, "float32")


def test_quantized_weights_are_the_default_where_the_kernels_are_compiled(loaded_model):
    assert qmatmul.compiled(), "the C kernels did not build: pip install needs a C compiler"
    backend = get_backend("numpy", model=loaded_model)
    assert backend.weights == "quantized" and qmatmul.kernel_name() in backend.describe()


def test_resident_weights_stay_within_the_model_file(engines, loaded_model, model_path):
    quantized, _ = engines
    model = quantized.runner.model
    assert isinstance(model.layers[0].attention.qkv, QMatrix)
    assert model.lm_head is model.embed  # the tied table is held once, for lookup and head alike
    held = resident_weight_bytes(loaded_model, "quantized")
    assert held <= 1.15 * model_path.stat().st_size
    assert resident_weight_bytes(loaded_model, "float32") > 5 * held


def test_greedy_top1_agrees_with_float32_on_the_fixture_prompts(engines):
    cases = json.loads((FIXTURES / "smollm2_transformers_reference.json").read_text())["cases"]
    agree = total = 0
    for case in cases:
        ids = case["prompt_ids"] + case["greedy_ids"]
        quantized, exact = (e.prompt_logits(ids).argmax(axis=-1) for e in engines)
        agree += int((quantized == exact).sum())
        total += len(ids)
    assert total > 250 and agree / total >= 0.98


def test_perplexity_within_half_a_percent_of_float32(engines):
    text = SHIPPED_TEXT.read_text(encoding="utf-8")
    text = text[: len(text) // 6]  # two windows of 512: the two differ by ~0.001% here, as on the whole text
    quantized, exact = (text_perplexity(e, text, ctx=512, stride=512, progress=False) for e in engines)
    assert quantized.tokens == exact.tokens > 950
    assert abs(quantized.perplexity / exact.perplexity - 1) < 0.005


def test_numba_fallback_answers_end_to_end(model_path, tmp_path):
    """With the compiled kernels switched off, `edgeserve run` computes through the numba fallback."""
    env = {**os.environ, "EDGESERVE_QMATMUL": "numba"}
    out = subprocess.run(
        [sys.executable, "-m", "edgeserve.cli", "run", "--model", str(model_path), "--backend", "numpy",
         "--weights", "quantized", "--kv-memory", "64MiB", "--max-tokens", "12", "--temperature", "0", "--json",
         "What is the capital of France?"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert "numba kernels" in result["runs_on"] and "Paris" in result["text"]
