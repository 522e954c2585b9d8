"""Paged attention: the plain-MLX reference against the NumPy backend (everywhere), the custom
kernels against the reference on random pools (where MLX has a Metal or CUDA GPU), and greedy
output of the default model with kernel and reference (GPU only)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from edgeserve.backends.numpy_backend import NumpyBackend
from edgeserve.batch import Batch, random_paged_batch
from edgeserve.engine.llm_engine import LLMEngine
from edgeserve.sampling_params import SamplingParams

mx = pytest.importorskip("mlx.core", reason="MLX is not installed (pip install 'edgeserve[mlx]')")

from edgeserve.metal.dispatch import kernel_platform, select_attention  # noqa: E402
from edgeserve.metal.kernels import kernel_paged_attention, prepare_kernel  # noqa: E402
from edgeserve.metal.reference import prepare_reference, reference_paged_attention  # noqa: E402

PLATFORM = kernel_platform()
needs_gpu = pytest.mark.skipif(
    PLATFORM is None, reason="no Metal or CUDA GPU for MLX here: custom kernels not run (reference tested instead)"
)
# Max abs difference allowed against a float32 reference on the same inputs: the kernels
# accumulate in float32, so what is left is the rounding of the output to its dtype.
TOLERANCE = {"float32": 1e-4, "float16": 2e-3, "bfloat16": 1.6e-2}


def random_case(seed: int, block_size: int, n_kv: int, group: int, head_dim: int, max_context: int = 2000):
    """A ragged batch over a shuffled random pool: decode rows and prefill chunks, contexts 1..max_context."""
    rng = np.random.default_rng(seed)
    contexts = [1, max_context, *rng.integers(2, max_context, size=4).tolist()]
    query_lens = [1 if i % 3 else min(c, int(rng.integers(2, 48))) for i, c in enumerate(contexts)]
    contexts.append(700)  # a long chunk in mid-context: several query tiles in the NumPy backend
    query_lens.append(300)
    batch, num_blocks = random_paged_batch(contexts, query_lens, block_size, rng, spare_blocks=3)
    q = rng.standard_normal((len(batch.positions), n_kv * group, head_dim)).astype(np.float32) * 3.0  # peaked softmax
    k = rng.standard_normal((num_blocks, block_size, n_kv, head_dim)).astype(np.float32)
    v = rng.standard_normal((num_blocks, block_size, n_kv, head_dim)).astype(np.float32)
    return batch, q, k, v


def numpy_attention(batch: Batch, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    backend = NumpyBackend()
    half = q.shape[-1] // 2
    rope = (np.zeros((int(batch.positions.max()) + 1, half), np.float32),) * 2
    return backend.paged_attention(q, k, v, backend.batch_meta(batch, rope))


@pytest.mark.parametrize(
    "block_size,n_kv,group,head_dim",
    [(8, 4, 1, 64), (16, 3, 3, 128), (32, 2, 8, 64), (8, 2, 8, 128), (16, 4, 1, 128), (32, 3, 3, 64)],
)
def test_reference_matches_numpy(block_size, n_kv, group, head_dim):
    batch, q, k, v = random_case(block_size * 100 + group * 10 + head_dim, block_size, n_kv, group, head_dim)
    with mx.stream(mx.cpu):
        out = reference_paged_attention(mx.array(q), mx.array(k), mx.array(v), prepare_reference(batch))
        out = np.array(out)
    np.testing.assert_allclose(out, numpy_attention(batch, q, k, v), atol=1e-4, rtol=0)


@needs_gpu
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("n_kv,group", [(4, 1), (3, 3), (2, 8)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_kernel_matches_reference(dtype, block_size, n_kv, group, head_dim):
    batch, q, k, v = random_case(block_size * 100 + group * 10 + head_dim, block_size, n_kv, group, head_dim)
    dt = getattr(mx, dtype)
    q, k, v = (mx.array(a).astype(dt) for a in (q, k, v))
    got = kernel_paged_attention(q, k, v, prepare_kernel(batch), PLATFORM)
    assert got.dtype == dt
    with mx.stream(mx.cpu):  # exact float32 (GPU matmuls may round through TF32)
        want = reference_paged_attention(*(a.astype(mx.float32) for a in (q, k, v)), prepare_reference(batch))
    diff = mx.abs(got.astype(mx.float32) - want).max().item()
    assert diff <= TOLERANCE[dtype], f"max abs diff {diff} over {TOLERANCE[dtype]}"


@needs_gpu
def test_kernel_decode_only_batch_small_contexts():
    """Decode rows alone, contexts shorter than a block, and a batch smaller than the constant-buffer size."""
    batch, q, k, v = random_case(7, 16, 3, 3, 64, max_context=5)
    rows = np.flatnonzero(batch.query_lens == 1)
    keep = np.isin(np.repeat(np.arange(batch.num_seqs), batch.query_lens), rows)
    decode = Batch(
        token_ids=batch.token_ids[keep],
        positions=batch.positions[keep],
        slot_mapping=batch.slot_mapping[keep],
        query_start=np.arange(len(rows) + 1),
        context_lens=batch.context_lens[rows],
        block_tables=batch.block_tables[rows],
        logits_indices=batch.logits_indices,
        block_size=batch.block_size,
    )
    q = mx.array(q[keep]).astype(mx.float16)
    k, v = mx.array(k).astype(mx.float16), mx.array(v).astype(mx.float16)
    got = kernel_paged_attention(q, k, v, prepare_kernel(decode), PLATFORM)
    with mx.stream(mx.cpu):
        want = reference_paged_attention(*(a.astype(mx.float32) for a in (q, k, v)), prepare_reference(decode))
    assert mx.abs(got.astype(mx.float32) - want).max().item() <= TOLERANCE["float16"]


def test_reference_forced_by_environment(monkeypatch):
    monkeypatch.setenv("EDGESERVE_ATTENTION", "reference")
    assert select_attention().name == "mlx-reference"


@needs_gpu
def test_greedy_output_same_with_kernel_and_reference(loaded_model, monkeypatch):
    cases = json.loads((Path(__file__).parent / "fixtures" / "smollm2_transformers_reference.json").read_text())
    prompts = [c["prompt_ids"] for c in cases["cases"]]
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)

    def generate(path: str) -> tuple[str, dict[str, list[int]]]:
        monkeypatch.setenv("EDGESERVE_ATTENTION", path)
        engine = LLMEngine(loaded_model, backend="mlx", kv_memory="256MiB")
        for i, ids in enumerate(prompts):
            engine.add_request(ids, params, f"r{i}")
        done = engine.run_to_completion()
        return engine.backend.attention.name, {rid: c.token_ids for rid, c in done.items()}

    kernel_name, with_kernel = generate("auto")
    reference_name, with_reference = generate("reference")
    assert (kernel_name, reference_name) == (f"{PLATFORM}-kernel", "mlx-reference")
    assert with_kernel == with_reference
