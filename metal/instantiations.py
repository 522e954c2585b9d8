"""The Metal sources the host compiles, written out as files for a compile-only check on a Mac:

    python -m edgeserve.metal.instantiations build/metal
    for f in build/metal/*.metal; do xcrun -sdk macosx metal -std=metal3.1 -c "$f" -o /dev/null || break; done

The kernels are launched through the host code (`kernels.launch`) with a stand-in for
mx.fast.metal_kernel that records the source MLX would generate for each launch: every dtype and
supported head dim, on a pool of that dtype and on an int8 pool, a spread of query heads per KV
head, and batches small enough that their block tables and row arrays are bound in the constant
address space as well as larger ones.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from edgeserve.backends.kv_formats import kv_head_bytes
from edgeserve.batch import random_paged_batch
from edgeserve.metal.emulator.runner import EmulatedKernel
from edgeserve.metal.kernels import launch, make_kernels, prepare_kernel
from edgeserve.metal.launch_limits import SUPPORTED_HEAD_DIMS, kernel_supports

# What MLX's own prelude (mlx/backend/metal/kernels/utils.h) gives the bodies; bfloat needs Metal 3.1.
PRELUDE = "#include <metal_stdlib>\nusing namespace metal;\ntypedef half float16_t;\ntypedef bfloat bfloat16_t;\n\n"
DTYPES = (mx.float32, mx.float16, mx.bfloat16)
GROUPS = (1, 4, 8)
N_KV, BLOCK_SIZE = 2, 16


class _Recorder(EmulatedKernel):
    """Stands in for a kernel object: records the source of each launch and returns zeros."""

    def __init__(self, sources: dict[str, str], **kernel: Any):
        super().__init__("metal", **kernel)
        self.sources = sources

    def __call__(self, *, inputs, output_shapes, output_dtypes, grid, threadgroup, template=()) -> list[mx.array]:
        source = self.generated_source(inputs, output_dtypes, template)
        host_name = source.rsplit('[[host_name("', 1)[1].split('"', 1)[0]
        self.sources[host_name] = PRELUDE + source
        return [mx.zeros(shape, dtype) for shape, dtype in zip(output_shapes, output_dtypes)]


def instantiations() -> dict[str, str]:
    """Host name -> complete Metal source, for each instantiation of the spread above."""
    sources: dict[str, str] = {}
    partition, reduce = make_kernels(lambda **kernel: _Recorder(sources, **kernel), "metal")
    rng = np.random.default_rng(0)
    # One decode row of 60 tokens: its row arrays and partition states sit in constant memory.
    for rows, context in ((1, 60), (16, 300)):
        batch, num_blocks = random_paged_batch([context] * rows, [1] * rows, BLOCK_SIZE, rng)
        meta = prepare_kernel(batch)
        for dtype in DTYPES:
            for head_dim in SUPPORTED_HEAD_DIMS:
                for group in GROUPS:
                    n_kv = 1 if rows == 1 else N_KV
                    if kernel_supports(head_dim, group * n_kv, n_kv):
                        q = mx.zeros((rows, group * n_kv, head_dim), dtype)
                        for kv_dtype, width in ((dtype, head_dim), (mx.int8, kv_head_bytes("int8", head_dim))):
                            kv = mx.zeros((num_blocks, BLOCK_SIZE, n_kv, width), kv_dtype)
                            launch(partition, reduce, q, kv, kv, meta)
    return sources


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m edgeserve.metal.instantiations", description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="folder for the .metal files")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    sources = instantiations()
    for name, text in sources.items():
        (args.out / f"{name}.metal").write_text(text)
    print(f"{len(sources)} instantiations in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
