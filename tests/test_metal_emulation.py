"""The Metal kernels run on the CPU: the generated Metal body inside the exact signature
mx.fast.metal_kernel writes, compiled against a C++ shim with SIMD groups in lock-step, through
the same host code as on a Mac, against the plain-MLX reference; and bugs planted in the body
(a wrong merge bound, a missing barrier, an off-by-one partition end, a lane that skips a
shuffle or a barrier, a constant buffer used as a device one, a wrong int8 scale) are caught.
The CUDA twins, run the same way, give the same bits. Both read int8 pools too. Also: the
checked-in Metal and CUDA sources are what their templates give, and the instantiations for a
compile check on a Mac."""

from __future__ import annotations

import math
import os
import re
import sys

import numpy as np
import pytest

from edgeserve.backends import kv_formats
from edgeserve.metal import codegen
from paged_cases import TOLERANCE, decode_only, random_case

mx = pytest.importorskip("mlx.core", reason="MLX is not installed (pip install 'edgeserve[mlx]')")

from edgeserve.metal.emulator.runner import EmulationError, compiler, cuda_kernel, metal_kernel  # noqa: E402
from edgeserve.metal import instantiations  # noqa: E402
from edgeserve.metal.kernels import (  # noqa: E402
    launch, make_kernels, make_write_kernel, partition_size, prepare_kernel, write_in_place)
from edgeserve.metal.reference import prepare_reference, reference_paged_attention  # noqa: E402

# CI always runs the emulation: there a missing compiler fails the tests rather than skipping them.
pytestmark = [
    pytest.mark.skipif(
        not os.environ.get("CI") and (compiler() is None or not sys.platform.startswith("linux")),
        reason="the emulation needs a C++20 compiler and an ELF linker (Linux)",
    ),
    pytest.mark.slow,  # compiles each kernel variant: a minute of CPU
]


def test_generated_sources_are_what_the_templates_give():
    assert codegen.stale() == [], "run `python -m edgeserve.metal.codegen` after editing a .kernel template"


@pytest.mark.parametrize("template", codegen.TEMPLATES)
@pytest.mark.parametrize("target", ["metal", "cuda"])
def test_every_macro_is_expanded(template, target):
    macros, _, _ = codegen.TARGETS[target]
    text = codegen.generate(template, target)
    assert not re.search(r"\b(" + "|".join(macros) + r")\b", text)
    assert ("simd_shuffle_xor" in text or "threadgroup_position_in_grid" in text) == (target == "metal")


def case(dtype: str, block_size: int, n_kv: int, group: int, head_dim: int, decode: bool, int8_pool: bool = False):
    """A ragged batch of decode rows and prefill chunks (or its decode rows alone), contexts up to 300; the
    pool in q's dtype, or in kv_formats' int8 heads."""
    batch, q, k, v = random_case(block_size * 100 + group * 10 + head_dim, block_size, n_kv, group, head_dim,
                                 max_context=300, long_chunk=(200, 24))
    if decode:
        batch, q = decode_only(batch, q)
    dt = getattr(mx, dtype)
    if int8_pool:
        return batch, mx.array(q).astype(dt), *(mx.array(kv_formats.store(a, "int8")) for a in (k, v))
    return batch, *(mx.array(a).astype(dt) for a in (q, k, v))


def emulate(batch, q, k, v, plant: dict[str, tuple[str, str]] | None = None, language: str = "metal") -> mx.array:
    """Both passes through the emulated kernels; `plant` maps a kernel name to (text, replacement)."""

    def make(*, name: str, source: str, **names):
        if plant and name in plant:
            text, replacement = plant[name]
            assert text in source, f"{text!r} is no longer in {name}: plant the bug elsewhere"
            source = source.replace(text, replacement)
        return (metal_kernel if language == "metal" else cuda_kernel)(name=name, source=source, **names)

    return launch(*make_kernels(make, language), q, k, v, prepare_kernel(batch))


def max_error(batch, q, k, v, got: mx.array) -> float:
    """Against the reference in float32 (which reads an int8 pool as it is)."""
    k, v = (a if a.dtype == mx.int8 else a.astype(mx.float32) for a in (k, v))
    want = reference_paged_attention(q.astype(mx.float32), k, v, prepare_reference(batch))
    return mx.abs(got.astype(mx.float32) - want).max().item()


@pytest.mark.parametrize(
    "dtype,block_size,n_kv,group,head_dim,decode",
    [
        ("float32", 16, 3, 3, 64, False),  # SmolLM2's shape
        ("float16", 8, 2, 8, 128, False),
        ("bfloat16", 32, 4, 1, 64, False),
        ("float16", 16, 1, 4, 256, False),  # Gemma 3 1B's shape
        ("bfloat16", 16, 2, 4, 128, True),
        ("float32", 8, 1, 1, 64, True),
    ],
)
def test_emulated_metal_kernel_matches_reference(dtype, block_size, n_kv, group, head_dim, decode):
    batch, q, k, v = case(dtype, block_size, n_kv, group, head_dim, decode)
    max_len = int(batch.positions.max()) + 1
    assert math.ceil(max_len / partition_size(q.shape[0], n_kv, max_len)) >= 2, "the case should span partitions"
    got = emulate(batch, q, k, v)
    assert got.dtype == q.dtype and got.shape == q.shape
    diff = max_error(batch, q, k, v, got)
    assert diff <= TOLERANCE[dtype], f"max abs diff {diff} over {TOLERANCE[dtype]}"


@pytest.mark.parametrize(
    "dtype,block_size,n_kv,group,head_dim,decode",
    [("float32", 16, 3, 3, 64, False), ("float16", 16, 1, 4, 256, False), ("bfloat16", 16, 2, 4, 128, True)],
)
def test_emulated_cuda_twin_gives_the_metal_bits(dtype, block_size, n_kv, group, head_dim, decode):
    """The CUDA source, run the same way (a warp is a SIMD group), computes exactly what the Metal one does."""
    batch, q, k, v = case(dtype, block_size, n_kv, group, head_dim, decode)
    cuda = emulate(batch, q, k, v, language="cuda")
    assert mx.array_equal(cuda, emulate(batch, q, k, v))
    assert max_error(batch, q, k, v, cuda) <= TOLERANCE[dtype]


@pytest.mark.parametrize(
    "dtype,block_size,n_kv,group,head_dim,decode",
    [
        ("float32", 16, 3, 3, 64, False),  # a scale per head
        ("float16", 16, 1, 4, 256, False),  # four scales per head
        ("bfloat16", 8, 2, 8, 128, True),
    ],
)
def test_emulated_kernels_read_an_int8_pool(dtype, block_size, n_kv, group, head_dim, decode):
    """int8 K/V with their float16 scales, dequantized in registers: the Metal kernel against the reference
    reading the same pool, and its CUDA twin to the same bits."""
    batch, q, k, v = case(dtype, block_size, n_kv, group, head_dim, decode, int8_pool=True)
    assert k.dtype == mx.int8 and k.shape[-1] == kv_formats.kv_head_bytes("int8", head_dim)
    got = emulate(batch, q, k, v)
    assert got.dtype == q.dtype and got.shape == q.shape
    diff = max_error(batch, q, k, v, got)
    assert diff <= TOLERANCE[dtype], f"max abs diff {diff} over {TOLERANCE[dtype]}"
    assert mx.array_equal(emulate(batch, q, k, v, language="cuda"), got)


def test_small_inputs_bound_in_constant_memory():
    """Fewer than 8 rows: row_seq and row_len are `constant` buffers, as on a Mac (the block tables, padded to
    MIN_TABLE_WIDTH blocks, stay in device memory)."""
    batch, q, k, v = random_case(7, 16, 3, 3, 64, max_context=5, long_chunk=(4, 2))
    batch, q = decode_only(batch, q)
    q, k, v = (mx.array(a).astype(mx.float16) for a in (q, k, v))
    meta = prepare_kernel(batch)
    partition, _ = make_kernels(metal_kernel, "metal")
    source = partition.generated_source(
        [q, k, v, meta.block_tables, meta.row_seq, meta.row_len, meta.row_len], [mx.float32] * 3,
        [("T", mx.float16), ("HEAD_DIM", 64), ("GROUP", 3), ("N_KV", 3), ("BLOCK_SIZE", 16), ("PART", 64),
         ("KV_SCALES", 0)],
    )
    for name in ("row_seq", "row_len"):
        assert f"const constant int32_t* {name} [[buffer(" in source
    assert "const device int32_t* block_tables [[buffer(" in source
    assert "const device float16_t* q [[buffer(0)]]" in source
    diff = max_error(batch, q, k, v, emulate(batch, q, k, v))
    assert diff <= TOLERANCE["float16"]


BARRIER = "threadgroup_barrier(mem_flags::mem_threadgroup);"
WRONG_RESULTS = {
    "wrong merge bound": ("edgeserve_paged_attention", "for (int o = LANES; o < 32; o *= 2)", "for (int o = LANES; o < 16; o *= 2)"),
    "partitions merged short": ("edgeserve_paged_attention_reduce", "for (int p = 0; p < parts; ++p) {\n  const float f",
                                "for (int p = 0; p < parts - 1; ++p) {\n  const float f"),
    "missing barrier": ("edgeserve_paged_attention", BARRIER, ""),
    "off-by-one partition end": ("edgeserve_paged_attention", "min(begin + PART, len)", "min(begin + PART - 1, len)"),
}


@pytest.mark.parametrize("bug", WRONG_RESULTS)
def test_planted_bug_gives_wrong_results(bug):
    name, text, replacement = WRONG_RESULTS[bug]
    batch, q, k, v = case("float32", 16, 3, 3, 64, decode=True)
    diff = max_error(batch, q, k, v, emulate(batch, q, k, v, {name: (text, replacement)}))
    assert not diff <= TOLERANCE["float32"], f"{bug}: max abs diff {diff} passes"  # NaN fails too


def test_planted_int8_scale_bug_gives_wrong_results():
    """Every lane taking its head's first scale: right where a head has one scale, wrong where it has four."""
    plant = {"edgeserve_paged_attention": ("2 * (dim0 * KV_SCALES / HEAD_DIM)", "0")}
    batch, q, k, v = case("float32", 16, 1, 4, 256, decode=True, int8_pool=True)
    diff = max_error(batch, q, k, v, emulate(batch, q, k, v, plant))
    assert not diff <= TOLERANCE["float32"], f"max abs diff {diff} passes"


DIVERGENT = {
    "a lane skips a shuffle": ("dot += simd_shuffle_xor(dot, ushort(o));",
                               "if (lane != 5) {\n  dot += simd_shuffle_xor(dot, ushort(o));\n}",
                               r"lane 5\) .*shuffle"),
    "a lane skips the barrier": (BARRIER, f"if (lane != 3) {{\n  {BARRIER}\n}}",
                                 r"lane 3\) finished while its SIMD group waits"),
    "a SIMD group skips the barrier": (BARRIER, f"if (warp != 2) {{\n  {BARRIER}\n}}",
                                       r"SIMD group 2, lane 0\) finished while its threadgroup waits at a barrier"),
}


@pytest.mark.parametrize("bug", DIVERGENT)
def test_planted_divergence_aborts(bug):
    text, replacement, message = DIVERGENT[bug]
    batch, q, k, v = case("float16", 16, 3, 3, 64, decode=True)
    with pytest.raises(EmulationError, match=message):
        emulate(batch, q, k, v, {"edgeserve_paged_attention": (text, replacement)})


def test_constant_buffer_cannot_pass_as_a_device_pointer():
    """As in Metal: the same body compiles while row_len is a device buffer, not once it is constant."""
    plant = {"edgeserve_paged_attention": ("const int len = row_len[row];",
                                           "const device int* lens = row_len;\nconst int len = lens[row];")}
    batch, q, k, v = case("float32", 16, 3, 3, 64, decode=False)
    assert max_error(batch, q, k, v, emulate(batch, q, k, v, plant)) <= TOLERANCE["float32"]
    batch, q, k, v = random_case(7, 16, 3, 3, 64, max_context=5, long_chunk=(4, 2))
    batch, q = decode_only(batch, q)
    with pytest.raises(EmulationError, match="did not compile"):
        emulate(batch, *(mx.array(a) for a in (q, k, v)), plant)


def test_instantiations_for_a_compile_check_on_a_mac(tmp_path):
    """Each dtype and head dim, with the small inputs in device and in constant memory, as files xcrun can compile."""
    assert instantiations.main([str(tmp_path)]) == 0
    files = {f.name: f.read_text() for f in tmp_path.glob("*.metal")}
    partitions = [text for name, text in files.items() if "_reduce_" not in name]
    # address spaces x dtypes x (a pool of the dtype, an int8 pool) x (head dims x groups that fit)
    assert len(partitions) == 2 * 3 * 2 * 8
    assert len(files) - len(partitions) == 2 * 3 * 3
    # (block tables are padded to MIN_TABLE_WIDTH blocks, too many for constant memory)
    assert sum("const constant int32_t* row_len" in text for text in partitions) == 3 * 2 * 8
    assert not any("const constant int32_t* block_tables" in text for text in partitions)
    assert sum("const device int8_t* k_cache" in text for text in partitions) == 2 * 3 * 8
    for dtype in ("float", "float16_t", "bfloat16_t"):
        for head_dim in (64, 128, 256):
            assert any(f"<{dtype}, {head_dim}, 4, " in text for text in partitions)
    for text in files.values():
        assert text.startswith("#include <metal_stdlib>\n") and '[[host_name("' in text


@pytest.mark.parametrize("pool_dtype", ["float32", "float16", "int8"])
def test_kv_write_puts_each_row_at_its_slot_through_the_pools_pointers(pool_dtype):
    """The CUDA in-place K/V write (run emulated) leaves both pools as MLX's scatter would: rows read through their
    strides (K a slice of a wider array, as the compiled blocks give it), every other slot untouched."""
    rng = np.random.default_rng(3)
    blocks, block_size, n_kv, head_dim = 6, 4, 2, 64
    dt = getattr(mx, pool_dtype)
    row = kv_formats.kv_head_bytes(pool_dtype, head_dim) // dt.size
    pools = [mx.array(rng.integers(-100, 100, (blocks, block_size, n_kv, row))).astype(dt) for _ in range(2)]
    slots = np.array([5, 17, 2, 22, 9])
    wide = mx.array(rng.integers(-100, 100, (len(slots), n_kv + 3, row))).astype(dt)
    k, v = wide[:, 3:], mx.array(rng.integers(-100, 100, (len(slots), n_kv, row))).astype(dt)
    kernel = make_write_kernel(cuda_kernel)
    write_in_place(*pools, k, v, mx.array(slots.astype(np.int32)), kernel=kernel)
    for pool, rows, got in zip(pools, (k, v), kernel.inputs_after[3:]):
        want = np.array(pool).reshape(blocks * block_size, n_kv, row)
        want[slots] = np.array(rows)
        np.testing.assert_array_equal(np.array(got).reshape(want.shape), want)
