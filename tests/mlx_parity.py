"""How close the MLX backend must come to the float32 NumPy backend, shared by the MLX tests of each model."""

from __future__ import annotations

import numpy as np

from edgeserve.engine.llm_engine import LLMEngine

# Max logit difference from the float32 NumPy backend, by the MLX backend's kv_dtype, which is its
# activations' dtype (float32 on the CPU, float16 on a GPU).
LOGITS_TOLERANCE = {"float32": 0.1, "float16": 0.3}
NEAR_TIE = 0.1


def assert_same_up_to_near_tie(numpy_engine: LLMEngine, prompt: list[int], got: list[int], want: list[int]) -> None:
    """Equal token lists, or lists that part only where NumPy's top two logits are within tolerance."""
    if got == want:
        return
    i = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
    last = numpy_engine.prompt_logits(prompt + want[:i])[-1]
    top_two = np.sort(last)[-2:]
    assert top_two[1] - top_two[0] <= NEAR_TIE, f"outputs part at token {i} without a near-tie"
    assert {got[i], want[i]} <= set(np.argsort(last)[-2:].tolist())
