"""Micro-benchmark of the quantized matmul kernels on SmolLM2-135M's shapes against float32 BLAS.

Prints µs per call for `qmatmul` and for `x @ Wt` (float32 [K, N], what the float32 backend
runs) at several row counts, a whole decode step's weight pass (30 layers' own matrices and the
head, so nothing stays in cache) with its achieved read bandwidth against a plain sequential
read measured in the same run, and the Python-side overhead of one call.

    python bench/qmatmul_kernels.py [--threads N] [--impl c|numba] [--rows 1,4,16,64,512]

On a busy machine compare one thread with one thread: OPENBLAS_NUM_THREADS=1 ... --threads 1.
"""

from __future__ import annotations

import argparse
import os
import threading
import time

import numpy as np

from edgeserve.backends import qmatmul as qm
from edgeserve.quant.affine import QuantizedTensor

# name: (out, in, bits) per layer of SmolLM2-135M (Q4_1: 4-bit group 32; head Q8_0: 8-bit group 32)
SHAPES = {"qkv": (960, 576, 4), "o": (576, 576, 4), "gate_up": (3072, 576, 4), "down": (576, 1536, 4),
          "head": (49152, 576, 8)}
LAYERS = 30


def random_tensor(rng: np.random.Generator, n: int, k: int, bits: int, group: int = 32) -> QuantizedTensor:
    """Random words and float16 scales: timing does not depend on the values."""
    words = rng.integers(0, 2**32, size=(n, k * bits // 32), dtype=np.uint32)
    scales = (rng.random((n, k // group)) * 0.01).astype(np.float16)
    biases = (-rng.random((n, k // group)) * 0.05).astype(np.float16)
    return QuantizedTensor(words, scales, biases, bits, group)


def timed(f, seconds: float = 0.25) -> float:
    """Best mean µs per call over 5 batches after a warm-up."""
    f()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds / 5 or n < 2:
        f()
        n += 1
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            f()
        best = min(best, (time.perf_counter() - t0) / n)
    return best * 1e6


def read_bandwidth(threads: int, nbytes: int = 1 << 30) -> float:
    """GB/s of a plain sequential read (numpy sum, one slice per thread) over `nbytes` of float32."""
    a = np.ones(nbytes // 4, dtype=np.float32)
    parts = np.array_split(a, threads)

    def run() -> None:
        workers = [threading.Thread(target=p.sum) for p in parts[1:]]
        for w in workers:
            w.start()
        parts[0].sum()
        for w in workers:
            w.join()

    return nbytes / timed(run, 1.0) / 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=None, help="kernel threads (default: all cores)")
    ap.add_argument("--impl", choices=["c", "numba"], default=None, help="kernel (default: C extension if built)")
    ap.add_argument("--rows", default="1,4,16,64,512", help="row counts R of x [R, K]")
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    threads = qm.set_num_threads(args.threads)
    impl = args.impl or ("c" if qm.kernel_name().startswith("c/") else "numba")
    name = qm.kernel_name() if impl == "c" else "numba"
    blas = os.environ.get("OPENBLAS_NUM_THREADS", "numpy's default")
    print(f"kernel {name}, {threads} threads; float32 BLAS threads: {blas} (set OPENBLAS_NUM_THREADS to change)")
    rng = np.random.default_rng(0)
    qm.compile_now()

    print(f"\n{'matrix':8} {'N x K':>12} {'R':>4} {'qmatmul µs':>11} {'BLAS f32 µs':>12} {'speed-up':>9} {'q GB/s':>7}")
    for mat, (n, k, bits) in SHAPES.items():
        t = random_tensor(rng, n, k, bits)
        m = qm.prepare([t])
        wt = np.ascontiguousarray(t.dequantize().T)
        for r in rows:
            x = rng.standard_normal((r, k)).astype(np.float32)
            out = np.empty((r, n), np.float32)
            tq = timed(lambda: qm.qmatmul(x, m, out, impl=impl))
            tb = timed(lambda: np.matmul(x, wt, out=out))
            print(f"{mat:8} {f'{n}x{k}':>12} {r:4d} {tq:11.1f} {tb:12.1f} {tb / tq:8.2f}x {m.nbytes / tq / 1e3:7.1f}")

    # a decode step's weight pass: every layer's own matrices, so reads come from memory
    layers = [[qm.prepare([random_tensor(rng, n, k, bits)]) for n, k, bits in list(SHAPES.values())[:4]]
              for _ in range(LAYERS)]
    head = qm.prepare([random_tensor(rng, *SHAPES["head"])])
    xs = {k: rng.standard_normal((1, k)).astype(np.float32) for k in (576, 1536)}
    outs = {m.shape[0]: np.empty((1, m.shape[0]), np.float32) for m in layers[0] + [head]}

    def decode_pass() -> None:
        for layer in layers:
            for m in layer:
                qm.qmatmul(xs[m.shape[1]], m, outs[m.shape[0]], impl=impl)
        qm.qmatmul(xs[576], head, outs[head.shape[0]], impl=impl)

    total = sum(m.nbytes for layer in layers for m in layer) + head.nbytes
    t_pass = timed(decode_pass, 2.0)
    probe1 = read_bandwidth(1)
    probe = read_bandwidth(threads) if threads > 1 else probe1
    calls = LAYERS * 4 + 1
    print(f"\ndecode weight pass (R=1, {calls} calls, {total / 1e6:.1f} MB): {t_pass / 1e3:.2f} ms "
          f"= {total / t_pass / 1e3:.1f} GB/s; plain read {probe1:.1f} GB/s on 1 thread, {probe:.1f} GB/s on "
          f"{threads}: {100 * total / t_pass / 1e3 / max(probe, probe1):.0f}% of the better")
    f32_bytes = sum(4 * n * k for n, k, _ in list(SHAPES.values())[:4]) * LAYERS + 4 * 49152 * 576
    print(f"the same pass from float32 weights reads {f32_bytes / 1e6:.0f} MB: at least "
          f"{f32_bytes / max(probe, probe1) / 1e6:.2f} ms at the plain read's bandwidth")

    tiny = qm.prepare([random_tensor(rng, 16, 32, 4)])
    x1 = np.ones((1, 32), np.float32)
    o1 = np.empty((1, 16), np.float32)
    print(f"overhead of one call (16x32 matrix, R=1): {timed(lambda: qm.qmatmul(x1, tiny, o1, impl=impl)):.2f} µs "
          f"with out=, {timed(lambda: qm.qmatmul(x1, tiny, impl=impl)):.2f} µs allocating the output")


if __name__ == "__main__":
    main()
