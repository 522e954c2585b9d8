"""Paged attention: the plain-MLX reference against the NumPy backend (everywhere), the custom
kernels against the reference on random pools, int8 ones too (where MLX has a Metal or CUDA GPU),
and greedy output of the default model with kernel and reference, on its default and int8 pools
(GPU only)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from edgeserve.backends import kv_formats
from edgeserve.backends.numpy_backend import NumpyBackend
from edgeserve.batch import Batch
from edgeserve.engine.llm_engine import LLMEngine
from edgeserve.cli.main import cli
from edgeserve.metal.launch_limits import (
    MAX_THREADGROUP_MEMORY,
    describe_attention,
    threadgroup_memory,
    unsupported_reason,
)
from edgeserve.sampling_params import SamplingParams
from paged_cases import TOLERANCE, decode_only, random_case

mx = pytest.importorskip("mlx.core", reason="MLX is not installed (pip install 'edgeserve[mlx]')")

from edgeserve.metal.dispatch import kernel_platform, select_attention  # noqa: E402
from edgeserve.metal.kernels import kernel_paged_attention, prepare_kernel  # noqa: E402
from edgeserve.metal.reference import prepare_reference, reference_paged_attention  # noqa: E402

PLATFORM = kernel_platform()
needs_gpu = pytest.mark.skipif(
    PLATFORM is None, reason="no Metal or CUDA GPU for MLX here: custom kernels not run (reference tested instead)"
)


def numpy_attention(batch: Batch, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    backend = NumpyBackend()
    half = q.shape[-1] // 2
    rope = (np.zeros((int(batch.positions.max()) + 1, half), np.float32),) * 2
    return backend.paged_attention(q, k, v, backend.batch_meta(batch, rope))


@pytest.mark.parametrize(
    "block_size,n_kv,group,head_dim",
    # two shapes in the quick loop, the rest in the full suite
    [(8, 4, 1, 64), (16, 3, 3, 128), *(pytest.param(*shape, marks=pytest.mark.slow) for shape in
                                       [(32, 2, 8, 64), (8, 2, 8, 128), (16, 4, 1, 128), (32, 3, 3, 64)])],
)
def test_reference_matches_numpy(block_size, n_kv, group, head_dim):
    batch, q, k, v = random_case(block_size * 100 + group * 10 + head_dim, block_size, n_kv, group, head_dim)
    with mx.stream(mx.cpu):
        out = reference_paged_attention(mx.array(q), mx.array(k), mx.array(v), prepare_reference(batch))
        out = np.array(out)
    np.testing.assert_allclose(out, numpy_attention(batch, q, k, v), atol=1e-4, rtol=0)


@pytest.mark.parametrize("window", [1, 7, 300])
def test_reference_window_matches_numpy(window):
    """Sliding-window layers: decode rows and prefill chunks (one crossing its window mid-chunk) see
    their last `window` keys, as on the NumPy backend; a kernel path hands such a layer to the reference."""
    from edgeserve.metal.dispatch import _kernel_or_windowed_reference

    batch, q, k, v = random_case(window, 16, 2, 3, 64)
    backend = NumpyBackend()
    rope = (np.zeros((int(batch.positions.max()) + 1, 32), np.float32),) * 2
    want = backend.paged_attention(q, k, v, backend.batch_meta(batch, rope), window)
    with mx.stream(mx.cpu):
        got = np.array(reference_paged_attention(mx.array(q), mx.array(k), mx.array(v), prepare_reference(batch), window))
        # every context outgrows the window, so no kernel runs (no GPU needed)
        routed = _kernel_or_windowed_reference(mx.array(q), mx.array(k), mx.array(v), prepare_kernel(batch), window,
                                               platform="metal")
        np.testing.assert_array_equal(np.array(routed), got)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    assert np.abs(want - numpy_attention(batch, q, k, v)).max() > 1e-2  # the window matters here


@needs_gpu
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("n_kv,group", [(4, 1), (3, 3), (2, 8)])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_kernel_matches_reference(dtype, block_size, n_kv, group, head_dim):
    if reason := unsupported_reason(head_dim, n_kv * group, n_kv):
        pytest.skip(f"takes the reference path: {reason}")
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
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("n_kv,group,head_dim", [(3, 3, 64), (2, 8, 128), (1, 4, 256)])
def test_kernel_reads_an_int8_pool(dtype, n_kv, group, head_dim):
    """kv_formats' int8 heads (one, two or four float16 scales each), dequantized in registers."""
    batch, q, k, v = random_case(group * 10 + head_dim, 16, n_kv, group, head_dim)
    q = mx.array(q).astype(getattr(mx, dtype))
    k, v = (mx.array(kv_formats.store(a, "int8")) for a in (k, v))
    got = kernel_paged_attention(q, k, v, prepare_kernel(batch), PLATFORM)
    assert got.dtype == q.dtype
    with mx.stream(mx.cpu):
        want = reference_paged_attention(q.astype(mx.float32), k, v, prepare_reference(batch))
    diff = mx.abs(got.astype(mx.float32) - want).max().item()
    assert diff <= TOLERANCE[dtype], f"max abs diff {diff} over {TOLERANCE[dtype]}"


@needs_gpu
def test_kernel_decode_only_batch_small_contexts():
    """Decode rows alone, contexts shorter than a block, and a batch smaller than the constant-buffer size."""
    batch, q, k, v = random_case(7, 16, 3, 3, 64, max_context=5)
    decode, q = decode_only(batch, q)
    q = mx.array(q).astype(mx.float16)
    k, v = mx.array(k).astype(mx.float16), mx.array(v).astype(mx.float16)
    got = kernel_paged_attention(q, k, v, prepare_kernel(decode), PLATFORM)
    with mx.stream(mx.cpu):
        want = reference_paged_attention(*(a.astype(mx.float32) for a in (q, k, v)), prepare_reference(decode))
    assert mx.abs(got.astype(mx.float32) - want).max().item() <= TOLERANCE["float16"]


@pytest.mark.skipif(PLATFORM != "cuda", reason="K/V are written in place on CUDA only")
@pytest.mark.parametrize("pool_dtype", ["float16", "int8"])
def test_attention_waits_for_the_kv_written_in_place(pool_dtype):
    """Each decode row's own key and value written in place (the CUDA write kernel), then attended to, for 24
    layers in one graph: every output is the reference's over a pool written by MLX's scatter. MLX orders CUDA
    kernels only by the buffers they share, so a kernel reading rows that do not wait for their write would
    read the old ones."""
    from edgeserve.backends.mlx_backend import store_int8
    from edgeserve.metal.kernels import write_in_place

    batch, q, k, v = random_case(11, 16, 2, 4, 64, max_context=200)
    decode, q = decode_only(batch, q)
    rows = np.random.default_rng(5).standard_normal((2, len(decode.positions), 2, 64)).astype(np.float32)
    with mx.stream(mx.cpu):  # the pools' bits made once, on the CPU, for both sides
        as_pool = store_int8 if pool_dtype == "int8" else (lambda a: a.astype(mx.float16))
        new_k, new_v = (np.array(as_pool(mx.array(a))) for a in rows)
        layers = [[np.array(as_pool(mx.array(a * (1 + layer / 24)))) for a in (k, v)] for layer in range(24)]
    q = mx.array(q).astype(mx.float16)
    slots = mx.array(decode.slot_mapping.astype(np.int32))
    meta = prepare_kernel(decode)
    outs, pools = [], []
    for k_pool, v_pool in layers:
        k_pool, v_pool = mx.array(k_pool), mx.array(v_pool)
        mx.eval(k_pool, v_pool)
        after = write_in_place(k_pool, v_pool, mx.array(new_k), mx.array(new_v), slots)
        outs.append(kernel_paged_attention(q, k_pool, v_pool, meta, PLATFORM, after))
        pools.append((k_pool, v_pool))
    mx.eval(*outs)
    with mx.stream(mx.cpu):
        for layer, (out, (k_pool, v_pool)) in enumerate(zip(outs, layers)):
            for pool, new in ((k_pool, new_k), (v_pool, new_v)):
                pool.reshape(-1, *pool.shape[2:])[decode.slot_mapping] = new
            np.testing.assert_array_equal(np.array(pools[layer][0]), k_pool)
            np.testing.assert_array_equal(np.array(pools[layer][1]), v_pool)
            pool_q = q.astype(mx.float32)
            k_ref, v_ref = (mx.array(a) if pool_dtype == "int8" else mx.array(a).astype(mx.float32)
                            for a in (k_pool, v_pool))
            want = reference_paged_attention(pool_q, k_ref, v_ref, prepare_reference(decode))
            diff = mx.abs(out.astype(mx.float32) - want).max().item()
            assert diff <= TOLERANCE["float16"], f"layer {layer}: max abs diff {diff}"


def test_reference_forced_by_environment(monkeypatch):
    monkeypatch.setenv("EDGESERVE_ATTENTION", "reference")
    assert select_attention().name == "mlx-reference"


@needs_gpu
@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_greedy_output_same_with_kernel_and_reference(loaded_model, monkeypatch, kv_dtype):
    cases = json.loads((Path(__file__).parent / "fixtures" / "smollm2_transformers_reference.json").read_text())
    prompts = [c["prompt_ids"] for c in cases["cases"]]
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)

    def generate(path: str) -> tuple[str, dict[str, list[int]]]:
        monkeypatch.setenv("EDGESERVE_ATTENTION", path)
        engine = LLMEngine(loaded_model, backend="mlx", kv_memory="256MiB", kv_dtype=kv_dtype)
        for i, ids in enumerate(prompts):
            engine.add_request(ids, params, f"r{i}")
        done = engine.run_to_completion()
        return engine.backend.attention.name, {rid: c.token_ids for rid, c in done.items()}

    kernel_name, with_kernel = generate("auto")
    reference_name, with_reference = generate("reference")
    assert (kernel_name, reference_name) == (f"{PLATFORM}-kernel", "mlx-reference")
    assert with_kernel == with_reference


def test_threadgroup_memory_over_the_apple_limit_takes_the_reference():
    """16 query heads per KV head at head dim 128 need 33,280 B of threadgroup memory, over Apple's 32 KB."""
    assert threadgroup_memory(16, 128) == 33_280 > MAX_THREADGROUP_MEMORY
    assert "33,280 bytes of threadgroup memory" in unsupported_reason(128, 16, 1)
    assert unsupported_reason(128, 8, 1) is None and unsupported_reason(256, 4, 1) is None  # Gemma 3 1B: 4 / 1 x 256
    assert "head dim 96" in unsupported_reason(96, 4, 1)
    batch, q, k, v = random_case(3, 16, 1, 16, 128, max_context=200, long_chunk=(100, 20))
    q, k, v = mx.array(q), mx.array(k), mx.array(v)
    # The Metal kernel cannot launch on this machine: a result at all means the reference ran.
    got = kernel_paged_attention(q, k, v, prepare_kernel(batch), "metal")
    want = reference_paged_attention(q, k, v, prepare_reference(batch))
    assert mx.array_equal(got, want)


def test_info_says_whether_the_kernels_fit(model_path):
    assert describe_attention("metal-kernel", 64, 9, 3) == "metal-kernel"
    assert describe_attention("cuda-kernel", 96, 8, 8).startswith("mlx-reference (cuda-kernel does not fit: head dim 96")
    assert describe_attention("numpy", 128, 16, 1).startswith("numpy (GPU kernels: reference path, 16 query heads")
    result = CliRunner().invoke(cli, ["info", str(model_path), "--backend", "numpy"])  # 9 heads / 3 KV x 64
    assert result.exit_code == 0, result.output
    assert "attention  numpy (GPU kernels: fit this model)" in result.output
