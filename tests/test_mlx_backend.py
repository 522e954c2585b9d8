"""The MLX backend against the NumPy backend on the real model: prompt logits, greedy output, and
batch invariance (MLX on the CPU in CI, so generations stay short)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from edgeserve.engine.llm_engine import LLMEngine
from edgeserve.sampling_params import SamplingParams
from mlx_parity import LOGITS_TOLERANCE, assert_same_up_to_near_tie

pytest.importorskip("mlx.core", reason="MLX is not installed (pip install 'edgeserve[mlx]'): MLX backend not tested")

CASES = json.loads((Path(__file__).parent / "fixtures" / "smollm2_transformers_reference.json").read_text())["cases"]
PROMPTS = [case["prompt_ids"] for case in CASES]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def numpy_engine(loaded_model) -> LLMEngine:
    return LLMEngine(loaded_model, backend="numpy", kv_memory="64MiB")


@pytest.fixture(scope="module")
def mlx_engine(loaded_model) -> LLMEngine:
    return LLMEngine(loaded_model, backend="mlx", kv_memory="64MiB")


def generate(engine: LLMEngine, arrivals: dict[int, list[tuple[str, list[int]]]]) -> dict[str, list[int]]:
    """Greedy tokens per request; arrivals[k] are added before step k."""
    steps = 0

    def arrive(outputs: list) -> None:
        nonlocal steps
        steps += 1
        for rid, ids in arrivals.get(steps, []):
            engine.add_request(ids, GREEDY, rid)

    for rid, ids in arrivals.get(0, []):
        engine.add_request(ids, GREEDY, rid)
    return {rid: c.token_ids for rid, c in engine.run_to_completion(arrive).items()}


@pytest.fixture(scope="module")
def mlx_alone(mlx_engine) -> list[int]:
    return generate(mlx_engine, {0: [("alone", PROMPTS[0])]})["alone"]


def test_backend_attributes(mlx_engine):
    assert mlx_engine.backend.name == "mlx"
    assert mlx_engine.backend.kv_dtype in ("float16", "float32")
    element = {"float16": 2, "float32": 4}[mlx_engine.backend.kv_dtype]
    assert mlx_engine.pool_size.bytes_per_token == 2 * 30 * 3 * 64 * element


def test_prompt_logits_match_numpy(numpy_engine, mlx_engine):
    agree, total, worst = 0, 0, 0.0
    for ids in PROMPTS:
        want = numpy_engine.prompt_logits(ids)
        got = mlx_engine.prompt_logits(ids)
        assert got.shape == want.shape
        agree += int((got.argmax(-1) == want.argmax(-1)).sum())
        total += len(ids)
        worst = max(worst, float(np.abs(got - want).max()))
    assert agree / total >= 0.99
    assert worst <= LOGITS_TOLERANCE[mlx_engine.backend.kv_dtype]


def test_greedy_generation_matches_numpy(numpy_engine, mlx_alone):
    want = generate(numpy_engine, {0: [("np", PROMPTS[0])]})["np"]
    assert len(mlx_alone) == GREEDY.max_tokens
    assert_same_up_to_near_tie(numpy_engine, PROMPTS[0], mlx_alone, want)


def test_batch_invariance(loaded_model, numpy_engine, mlx_alone):
    """The same request alone and among others of different lengths, started at different times,
    with a small token budget so that prefills are chunked beside running decodes."""
    engine = LLMEngine(loaded_model, backend="mlx", kv_memory="64MiB", max_num_batched_tokens=24)
    tokens = generate(engine, {0: [("b1", PROMPTS[1])], 1: [("target", PROMPTS[0])], 3: [("b2", PROMPTS[2])]})
    assert_same_up_to_near_tie(numpy_engine, PROMPTS[0], tokens["target"], mlx_alone)
    bm = engine.block_manager
    assert bm.num_used == 0 and bm.num_free == bm.num_blocks
