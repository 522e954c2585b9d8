"""The custom paged-attention kernels: Metal sources through mx.fast.metal_kernel, CUDA twins through
mx.fast.cuda_kernel (both generated from one template by `codegen`), and the host side that sizes
their launches.

One kernel serves the whole ragged batch: every query row (a decode token or a row of a prefill
chunk) attends to the first `position + 1` tokens of its sequence, read straight from the pool
through the block table, with no gathered copy of K/V (an int8 pool's heads are dequantized in
registers). Long contexts are split into partitions so that small batches still fill the GPU; a
second, small kernel merges the partitions.

Prefill rows take the same kernel although each row reads its K/V again: on an H100 (float16)
a 512-row chunk ran in about half the gather path's time at context 512 and within 15% of it at
context 2048 (`python -m edgeserve.bench.metal_kernels`). The KV write stays MLX's own scatter:
it updates the pool's buffer in place, while a custom kernel always writes a fresh output
buffer and so would have to copy the whole pool for every layer of every step. On CUDA, where the
engine launches a decode step while the one before still computes (and so still holds the pool,
which makes MLX's scatter copy it), `write_in_place` writes the step's K/V through the pool's
pointer instead (`kv_write.cu`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
import numpy as np

from edgeserve.backends.kv_formats import int8_kv_group
from edgeserve.batch import Batch
from edgeserve.metal.codegen import generated_path
from edgeserve.metal.launch_limits import THREADS, kernel_supports
from edgeserve.metal.reference import ReferenceMeta, prepare_reference, reference_paged_attention

# Enough threadgroups to keep every core of a large GPU busy; partitions are cut to reach it.
TARGET_THREADGROUPS = 512
MIN_PARTITION, MAX_PARTITION = 64, 1024
# blocks (256 tokens of 16-token blocks): wider, the step's partitions, sized for the width, grow past what short
# contexts need
MIN_TABLE_WIDTH = 16


@dataclass
class KernelMeta:
    """Per-step arrays of the kernel path, computed once and shared by every layer."""

    row_seq: mx.array  # [T] the sequence of each query row
    row_len: mx.array  # [T] how many of its sequence's tokens the row sees (position + 1)
    block_tables: mx.array  # [B, max_blocks]
    block_size: int
    max_len: int
    batch: Batch | None = None  # kept for shapes the kernels do not cover, which take the reference path
    fallback: ReferenceMeta | None = None


def upload_ints(*arrays: np.ndarray) -> list[mx.array]:
    """Integer arrays as int32 MLX arrays of their shapes, made from one host array: on a GPU that is one copy
    to the device for a step's few small arrays rather than one apiece."""
    flat = [np.ravel(a) for a in arrays]
    packed = mx.array(np.concatenate(flat, dtype=np.int32, casting="unsafe"))
    parts = mx.split(packed, np.cumsum([f.size for f in flat[:-1]]).tolist())
    return [part if np.ndim(a) == 1 else part.reshape(np.shape(a)) for part, a in zip(parts, arrays)]


def padded_width(width: int) -> int:
    """A block table's width padded to a power of two, MIN_TABLE_WIDTH at least."""
    return max(MIN_TABLE_WIDTH, 1 << (width - 1).bit_length())


def prepare_kernel(batch: Batch) -> KernelMeta:
    """Row-to-sequence map, visible lengths and block tables for this batch."""
    row_len = batch.positions + 1
    # the tables' width padded to a power of two, MIN_TABLE_WIDTH at least: a compiled step is traced once per
    # width (mlx_blocks), and a trace costs far more than the empty partitions the padding adds
    tables = batch.block_tables
    padding = padded_width(tables.shape[1]) - tables.shape[1]
    row_seq, row_len_device, block_tables = upload_ints(
        np.repeat(np.arange(batch.num_seqs), batch.query_lens), row_len, np.pad(tables, ((0, 0), (0, padding))))
    return KernelMeta(
        row_seq=row_seq,
        row_len=row_len_device,
        block_tables=block_tables,
        block_size=batch.block_size,
        max_len=int(row_len.max()),
        batch=batch,
    )


def partition_size(num_rows: int, n_kv: int, max_len: int) -> int:
    """Tokens per partition: a power of two, small enough that the launch fills the GPU."""
    parts_wanted = max(1, math.ceil(TARGET_THREADGROUPS / (num_rows * n_kv)))
    tokens = math.ceil(max_len / parts_wanted)
    return min(MAX_PARTITION, max(MIN_PARTITION, 1 << (tokens - 1).bit_length()))


def make_kernels(make: Callable[..., Any], target: str) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """The (partition, reduce) kernel objects `make` builds from the target's generated sources:
    make is mx.fast.metal_kernel or mx.fast.cuda_kernel, or the CPU emulation's metal_kernel."""
    partition = make(
        name="edgeserve_paged_attention",
        input_names=["q", "k_cache", "v_cache", "block_tables", "row_seq", "row_len", "after"],
        output_names=["part_acc", "part_max", "part_sum"],
        source=generated_path("paged_attention", target).read_text(),
    )
    reduce = make(
        name="edgeserve_paged_attention_reduce",
        input_names=["part_acc", "part_max", "part_sum"],
        output_names=["out"],
        source=generated_path("paged_attention_reduce", target).read_text(),
    )
    return partition, reduce


@cache
def _kernels(platform: str) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """The (partition, reduce) kernel objects for one platform, built once."""
    return make_kernels(mx.fast.metal_kernel if platform == "metal" else mx.fast.cuda_kernel, platform)


def make_write_kernel(make: Callable[..., Any]) -> Callable[..., Any]:
    """The in-place K/V write's kernel object: make is mx.fast.cuda_kernel, or the CPU emulation's cuda_kernel."""
    return make(
        name="edgeserve_kv_write",
        input_names=["k", "v", "slots", "k_pool", "v_pool"],
        output_names=["written"],
        source=(Path(__file__).parent / "kv_write.cu").read_text(),
        ensure_row_contiguous=False,
    )


@cache
def _write_kernel() -> Callable[..., Any]:
    return make_write_kernel(mx.fast.cuda_kernel)


def write_in_place(k_pool: mx.array, v_pool: mx.array, k: mx.array, v: mx.array, slots: mx.array,
                   kernel: Callable[..., Any] | None = None) -> mx.array:
    """Rows k, v [T, n_kv_heads, head] (in the pool's element type) written at pool slots [T] in place, on
    CUDA; returns the array the attention must take as `after` so that it runs after the write.
    kernel: the kernel object (`make_write_kernel`'s); MLX's CUDA kernel where None."""
    per_row = k.shape[1] * k.shape[2]
    threads = 256
    (written,) = (kernel or _write_kernel())(
        inputs=[k, v, slots, k_pool, v_pool],
        template=[("T", k_pool.dtype)],
        grid=(max(1, math.ceil(k.shape[0] * per_row / threads)) * threads, 1, 1),
        threadgroup=(threads, 1, 1),
        output_shapes=[(1,)],
        output_dtypes=[mx.int32],
    )
    return written


def kernel_paged_attention(
    q: mx.array, k_cache: mx.array, v_cache: mx.array, meta: KernelMeta, platform: str, after: mx.array | None = None
) -> mx.array:
    """Attention of each row [T, n_heads, head_dim] over its sequence's K/V, read in place from the pool;
    after: what it must run after (`write_in_place`'s result), if anything."""
    _, n_heads, hd = q.shape
    n_kv = k_cache.shape[2]
    if not kernel_supports(hd, n_heads, n_kv):
        if meta.fallback is None:
            meta.fallback = prepare_reference(meta.batch)
        return reference_paged_attention(q, k_cache, v_cache, meta.fallback)
    if k_cache.dtype not in (q.dtype, mx.int8) or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"q is {q.dtype} but the pool is {k_cache.dtype}/{v_cache.dtype}")
    return launch(*_kernels(platform), q, k_cache, v_cache, meta, after)


def launch(
    partition: Callable[..., Any], reduce: Callable[..., Any], q: mx.array, k_cache: mx.array, v_cache: mx.array,
    meta: KernelMeta, after: mx.array | None = None,
) -> mx.array:
    """Both passes through the given kernel objects, sized for this batch; the first takes `after` as an input
    it does not read (an array already computed where there is nothing to wait for)."""
    t, n_heads, hd = q.shape
    n_kv = k_cache.shape[2]
    part = partition_size(t, n_kv, meta.max_len)
    num_parts = math.ceil(meta.max_len / part)
    part_acc, part_max, part_sum = partition(
        inputs=[q, k_cache, v_cache, meta.block_tables, meta.row_seq, meta.row_len,
                meta.row_len if after is None else after],
        template=[
            ("T", q.dtype),
            ("HEAD_DIM", hd),
            ("GROUP", n_heads // n_kv),
            ("N_KV", n_kv),
            ("BLOCK_SIZE", meta.block_size),
            ("PART", part),
            ("KV_SCALES", hd // int8_kv_group(hd) if k_cache.dtype == mx.int8 else 0),
        ],
        grid=(t * THREADS, n_kv, num_parts),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(t, n_heads, num_parts, hd), (t, n_heads, num_parts), (t, n_heads, num_parts)],
        output_dtypes=[mx.float32, mx.float32, mx.float32],
    )
    (out,) = reduce(
        inputs=[part_acc, part_max, part_sum],
        template=[("T", q.dtype), ("HEAD_DIM", hd)],
        grid=(t * n_heads * hd, 1, 1),
        threadgroup=(hd, 1, 1),
        output_shapes=[(t, n_heads, hd)],
        output_dtypes=[q.dtype],
    )
    return out
