"""The MLX backend against the NumPy backend on the real model: prompt logits, greedy output, and
batch invariance (MLX on the CPU in CI, so generations stay short). Its KV pools in other dtypes:
int8 heads written to kv_formats' bits and read back as kv_formats.load reads them, and float16
and int8 pools giving the NumPy backend's answers on the tiny model."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from edgeserve.backends import kv_formats
from edgeserve.engine.kv_budget import kv_bytes_per_token
from edgeserve.engine.llm_engine import LLMEngine
from edgeserve.errors import EdgeserveError
from edgeserve.sampling_params import SamplingParams
from mlx_parity import LOGITS_TOLERANCE, assert_same_up_to_near_tie
from paged_cases import random_case

mx = pytest.importorskip("mlx.core", reason="MLX is not installed (pip install 'edgeserve[mlx]'): MLX backend not tested")

from edgeserve.backends.mlx_backend import MLXBackend  # noqa: E402
from edgeserve.metal.reference import prepare_reference, reference_paged_attention  # noqa: E402

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


# KV pools in other dtypes ------------------------------------------------------------------------


@pytest.mark.parametrize("head_dim", [64, 256, 48, 16])
def test_int8_write_gives_the_numpy_bits(head_dim):
    """write_kv quantizes on the device to kv_formats.store's bytes, scales included, at the step's slots;
    read_blocks gives them back in the NumPy pool's layout."""
    rng = np.random.default_rng(head_dim)
    x = (rng.standard_normal((300, 3, head_dim)) * rng.uniform(0.001, 80, (300, 3, 1))).astype(np.float32)
    x[7, 1] = 0  # a head of zeros: scale 0, values 0
    be = MLXBackend("int8")
    pool = be.allocate_kv(40, 16, 3, head_dim)
    assert pool.dtype == mx.int8 and pool.shape == kv_formats.allocate("int8", 40, 16, 3, head_dim).shape
    slots = rng.permutation(40 * 16)[:300]
    meta = SimpleNamespace(slot_blocks=mx.array(slots // 16), slot_offsets=mx.array(slots % 16))
    pool = be.write_kv(pool, mx.array(x), meta)
    be.to_numpy(mx.zeros(1))  # evaluates the step's pool writes
    blocks = be.read_blocks(pool, list(range(40)))
    assert blocks.dtype == np.int8
    np.testing.assert_array_equal(blocks.reshape(-1, 3, pool.shape[-1])[slots], kv_formats.store(x, "int8"))


@pytest.mark.parametrize("head_dim,group", [(64, 3), (256, 4), (16, 2)])
def test_reference_reads_int8_as_kv_formats_loads(head_dim, group):
    """The plain-MLX attention on an int8 pool gives what it gives on kv_formats.load of that pool in float32."""
    batch, q, k, v = random_case(head_dim, 16, 2, group, head_dim, max_context=100, long_chunk=(60, 20))
    k8, v8 = kv_formats.store(k, "int8"), kv_formats.store(v, "int8")
    meta = prepare_reference(batch)
    got = reference_paged_attention(mx.array(q), mx.array(k8), mx.array(v8), meta)
    want = reference_paged_attention(mx.array(q), *(mx.array(kv_formats.load(a, head_dim)) for a in (k8, v8)), meta)
    assert got.dtype == mx.float32
    np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-6, rtol=0)
    assert not np.allclose(np.array(got), np.array(reference_paged_attention(*map(mx.array, (q, k, v)), meta)),
                           atol=1e-4), "int8 rounding should show"


@pytest.mark.parametrize("kv_dtype", ["float16", "int8"])
def test_the_tiny_model_matches_numpy_on_the_same_pool_dtype(mlx_on_cpu, tiny_model, kv_dtype):
    """The tiny model with an MLX pool of kv_dtype: the NumPy backend's greedy tokens on its pool of that
    dtype, and its prompt logits, far closer than either to the float32 pool's; the pool takes the bytes
    --kv-memory was sized for."""
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    ids = [int(t) for t in np.random.default_rng(1).integers(3, 90, 40)]
    engines = {(backend, dtype): LLMEngine(tiny_model, backend=backend, kv_memory="1MiB", kv_dtype=dtype)
               for backend in ("numpy", "mlx") for dtype in (kv_dtype, "float32")}
    logits = {key: engine.prompt_logits(ids) for key, engine in engines.items()}
    assert np.abs(logits["mlx", kv_dtype] - logits["numpy", kv_dtype]).max() <= 5e-4
    assert np.abs(logits["mlx", kv_dtype] - logits["mlx", "float32"]).max() >= 1e-3  # the pool's rounding shows
    tokens = {}
    for backend in ("numpy", "mlx"):
        rid = engines[backend, kv_dtype].add_request(ids, params)
        tokens[backend] = engines[backend, kv_dtype].run_to_completion()[rid].token_ids
    assert_same_up_to_near_tie(engines["numpy", kv_dtype], ids, tokens["mlx"], tokens["numpy"])
    engine = engines["mlx", kv_dtype]
    assert engine.backend.kv_dtype == kv_dtype and engine.runner.kv.k[0].dtype == getattr(mx, kv_dtype)
    assert engine.pool_size.bytes_per_token == kv_bytes_per_token(tiny_model.args, kv_dtype)
    assert sum(a.nbytes for a in engine.runner.kv.k + engine.runner.kv.v) == engine.pool_size.bytes


def test_kv_dtype_choices(mlx_on_cpu, monkeypatch):
    assert MLXBackend("auto").kv_dtype == "float32"  # on the CPU, as its activations
    assert MLXBackend("float16").kv_dtype == "float16"
    with pytest.raises(EdgeserveError, match="int4"):
        MLXBackend("int4")
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.gpu))
    assert MLXBackend("auto").kv_dtype == "float16"
    assert MLXBackend("int8").kv_dtype == "int8"
    with pytest.raises(EdgeserveError, match="twice the memory"):
        MLXBackend("float32")


@pytest.mark.skipif(not (hasattr(mx, "cuda") and mx.cuda.is_available()), reason="K/V are written in place on CUDA only")
def test_one_compiled_call_for_every_layer_gives_the_layer_by_layer_step(tmp_path):
    """On CUDA a decode step runs every layer as one compiled call (K/V written in place, the attention's
    partitions sized for the padded block tables): its hidden states and the K/V it writes are those of the same
    step run layer by layer, for contexts in three block-table widths (16, 64 and 128 blocks)."""
    from conftest import tiny_model_from
    from edgeserve.backends.kv_pool import KVPool
    from edgeserve.batch import random_paged_batch

    engine = LLMEngine(tiny_model_from(tmp_path, heads=1), backend="mlx")  # head_dim 64: the kernels' shape
    be, blocks = engine.backend, engine.runner.model.fused_blocks
    compiled = blocks.stack
    assert blocks.in_place and compiled is not None and be.launch_early
    rng = np.random.default_rng(2)
    for contexts, query_lens in (([40, 70, 130], [1, 1, 1]), ([9, 1100], [1, 1]), ([600], [1])):
        batch, num_blocks = random_paged_batch(contexts, query_lens, 16, rng)
        pools = [rng.standard_normal((num_blocks, 16, 1, 64)).astype(np.float16) for _ in range(4)]
        h = mx.array(rng.standard_normal((sum(query_lens), 64)).astype(np.float16))
        meta = be.batch_meta(batch, blocks.ropes[0])
        results = []
        for stack in (compiled, None):
            kv = KVPool(be, 2, num_blocks, 16, 1, 64)
            kv.k, kv.v = [mx.array(p) for p in pools[:2]], [mx.array(p) for p in pools[2:]]
            blocks.stack = stack
            out = blocks(h, kv, meta)
            mx.eval(out, *kv.k, *kv.v)
            results.append((np.array(out.astype(mx.float32)), [np.array(a.astype(mx.float32)) for a in kv.k + kv.v]))
        (got, got_pools), (want, want_pools) = results
        np.testing.assert_allclose(got, want, atol=2e-2, rtol=0)
        for a, b in zip(got_pools, want_pools):
            np.testing.assert_allclose(a, b, atol=2e-2, rtol=0)
        assert not np.array_equal(got_pools[0], pools[0].astype(np.float32))  # the step wrote its rows


def counted(f: Callable, calls: list) -> Callable:
    """f, noting in calls each call that gives something."""
    def call(*args: Any) -> Any:
        out = f(*args)
        if out is not None:
            calls.append(1)
        return out
    return call


def test_a_decode_step_in_one_compiled_call_matches_layer_by_layer(tiny_model):
    """Where attention is the reference's ops (MLX on the CPU), a greedy decode step is one compiled call from the
    embedding to each row's likeliest token, and a decode step that samples is one compiled call for its layers;
    both write K/V with MLX's scatter: the same tokens as the layers one by one, and the pools they give back in
    use."""
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = [list(range(3, 3 + n)) for n in (5, 17, 40)]  # block tables of 1 to 4 blocks, padded alike

    def run(whole_step: bool, layers_in_one_call: bool) -> tuple[dict[str, list[int]], int, int]:
        engine = LLMEngine(tiny_model, backend="mlx", kv_memory="16MiB")
        model = engine.runner.model
        blocks = model.fused_blocks
        assert blocks.reference_stack is not None and model.greedy is not None
        if not whole_step:
            model.greedy = None
        if not layers_in_one_call:
            blocks.reference_stack = None
        steps, calls = [], []
        blocks._decode_in_one_call = counted(blocks._decode_in_one_call, calls)
        if whole_step:
            model.greedy = counted(model.greedy, steps)
        pool = engine.runner.kv.k[0]
        ids = [engine.add_request(p, params) for p in prompts]
        done = engine.run_to_completion()
        if whole_step or layers_in_one_call:  # the K/V the steps wrote: in the pool's first layer the engine holds
            assert engine.runner.kv.k[0] is not pool and np.abs(np.array(engine.runner.kv.k[0])).max() > 0
        return {i: done[i].token_ids for i in ids}, len(steps), len(calls)

    whole, steps, _ = run(True, True)
    fused, no_steps, calls = run(False, True)
    plain, _, no_calls = run(False, False)
    assert whole == fused == plain
    assert steps >= 20 and no_steps == 0 and calls >= 20 and no_calls == 0
