"""Micro-benchmark of the quantized matmul kernels: SmolLM2-135M's shapes against float32 BLAS, or
the weight pass of a Llama-shaped 1B / 3B decode step against a plain read of memory.

Default (SmolLM2-135M): µs per call for `qmatmul` and for `x @ Wt` (float32 [K, N], what the
float32 backend runs) at several row counts, a whole decode step's weight pass (30 layers' own
matrices and the head, so nothing stays in cache) with its achieved read bandwidth against a
plain sequential read measured in the same run, and the Python-side overhead of one call.

--model 1b / 3b: a decode step's weight pass over every layer's own matrices (q/k/v stacked,
o, gate/up stacked, down; Q4_0, Q4_K or Q6_K) for each thread count, as GB/s of weights read and as a
share of a plain read with the same threads, measured alternately in the same run.

    python bench/qmatmul_kernels.py [--threads N] [--impl c|numba] [--rows 1,4,16,64,512]
    python bench/qmatmul_kernels.py --model 1b --quant q4_k --threads 1,2 [--activations int8]

On a busy machine compare one thread with one thread: OPENBLAS_NUM_THREADS=1 ... --threads 1.
"""

from __future__ import annotations

import argparse
import os
import threading
import time

import numpy as np

import gguf

from edgeserve.backends import qmatmul as qm
from edgeserve.quant.affine import QuantizedTensor
from edgeserve.quant.kquants import SUPER, KQuantTensor

# name: (out, in, bits) per layer of SmolLM2-135M (Q4_1: 4-bit group 32; head Q8_0: 8-bit group 32)
SHAPES = {"qkv": (960, 576, 4), "o": (576, 576, 4), "gate_up": (3072, 576, 4), "down": (576, 1536, 4),
          "head": (49152, 576, 8)}
LAYERS = 30
# Llama shapes: (hidden, layers, kv width, MLP width)
LLAMA = {"1b": (2048, 16, 512, 8192), "3b": (3072, 28, 1024, 8192)}


def random_tensor(rng: np.random.Generator, n: int, k: int, bits: int, group: int = 32) -> QuantizedTensor:
    """Random words and float16 scales: timing does not depend on the values."""
    words = rng.integers(0, 2**32, size=(n, k * bits // 32), dtype=np.uint32)
    scales = (rng.random((n, k // group)) * 0.01).astype(np.float16)
    biases = (-rng.random((n, k // group)) * 0.05).astype(np.float16)
    return QuantizedTensor(words, scales, biases, bits, group)


def random_q4_0(rng: np.random.Generator, n: int, k: int) -> QuantizedTensor:
    """random_tensor with GGUF Q4_0's symmetric groups (bias -8 * scale): what a Q4_0 file's decode reads."""
    t = random_tensor(rng, n, k, 4)
    return QuantizedTensor(t.weight, t.scales, (np.float32(-8) * t.scales.astype(np.float32)).astype(np.float16), 4, 32)


def random_kquant(rng: np.random.Generator, n: int, k: int, qtype: str = "q4_k") -> KQuantTensor:
    """Random Q4_K (or Q6_K) blocks with small float16 d (and Q4_K's dmin; the rest of a block is any bytes)."""
    size = 144 if qtype == "q4_k" else 210
    blocks = rng.integers(0, 256, size=(n, k // SUPER, size), dtype=np.uint8)
    if qtype == "q4_k":
        blocks[..., 0:2] = np.frombuffer(np.float16(0.001).tobytes(), np.uint8)
        blocks[..., 2:4] = np.frombuffer(np.float16(0.0005).tobytes(), np.uint8)
    else:
        blocks[..., 208:210] = np.frombuffer(np.float16(0.001).tobytes(), np.uint8)
    kind = gguf.GGMLQuantizationType.Q4_K if qtype == "q4_k" else gguf.GGMLQuantizationType.Q6_K
    return KQuantTensor(blocks.reshape(n, -1), kind, k)


def timed(f, seconds: float = 0.25, clock=time.perf_counter) -> float:
    """Best mean µs per call over 5 batches after a warm-up, by `clock` (time.process_time: CPU time
    of every thread of the process, which a busy machine's time slicing leaves out)."""
    f()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds / 5 or n < 2:
        f()
        n += 1
    best = float("inf")
    for _ in range(5):
        t0 = clock()
        for _ in range(n):
            f()
        best = min(best, (clock() - t0) / n)
    return best * 1e6


def read_bandwidth(threads: int, nbytes: int = 1 << 30, clock=time.perf_counter) -> float:
    """GB/s of a plain sequential read (numpy's max over bytes, one slice per thread) over `nbytes`;
    by CPU time (clock time.process_time), as if every thread ran all the time. A float sum is
    slower than memory on some CPUs (a float64 sum reads 8-10 GB/s a core where the bus gives 15),
    a byte max is not."""
    a = np.ones(nbytes, dtype=np.uint8)
    parts = np.array_split(a, threads)

    def run() -> None:
        workers = [threading.Thread(target=p.max) for p in parts[1:]]
        for w in workers:
            w.start()
        parts[0].max()
        for w in workers:
            w.join()

    return nbytes / timed(run, 1.0, clock) / 1e3 * (threads if clock is time.process_time else 1)


def llama_pass(args: argparse.Namespace) -> None:
    """A Llama-shaped decode step's weight pass per thread count, against a plain read with as many threads."""
    hidden, n_layers, kv, mlp = LLAMA[args.model]
    rng = np.random.default_rng(0)

    def weight(n: int, k: int) -> QuantizedTensor | KQuantTensor:
        return random_q4_0(rng, n, k) if args.quant == "q4_0" else random_kquant(rng, n, k, args.quant)

    shapes = [(hidden + 2 * kv, hidden), (hidden, hidden), (2 * mlp, hidden), (hidden, mlp)]
    layers = [[qm.prepare([weight(n, k)]) for n, k in shapes] for _ in range(n_layers)]
    total = sum(m.nbytes for layer in layers for m in layer)
    xs = {k: rng.standard_normal((1, k)).astype(np.float32) for k in (hidden, mlp)}
    outs = {n: np.empty((1, n), np.float32) for n, _ in shapes}

    def decode_pass() -> None:
        for layer in layers:
            for m in layer:
                qm.qmatmul(xs[m.shape[1]], m, outs[m.shape[0]])

    print(f"{args.model} {args.quant}: {n_layers} layers, {total / 1e6:.0f} MB of weights; kernel "
          f"{qm.kernel_name()}, activations {qm.get_activations()}")
    for threads in [int(t) for t in args.threads.split(",")]:
        qm.set_num_threads(threads)
        qm.qmatmul(xs[hidden], layers[0][0])  # start the workers
        runs = {"wall": ([], []), "cpu": ([], [])}
        for _ in range(args.repeat):  # alternate, so that a neighbour's load hits both alike
            for name, clock in (("wall", time.perf_counter), ("cpu", time.process_time)):
                scale = threads if clock is time.process_time else 1
                runs[name][0].append(total / timed(decode_pass, 1.0, clock) / 1e3 * scale)
                runs[name][1].append(read_bandwidth(threads, 256 << 20, clock))
        for name, (rates, probes) in runs.items():
            r, p = max(rates), max(probes)
            print(f"  {threads} thread(s), {name:4} time: {r:5.1f} GB/s (runs {min(rates):.1f}-{r:.1f}), plain read "
                  f"{p:5.1f} GB/s (runs {min(probes):.1f}-{p:.1f}): {100 * r / p:3.0f}% of the read; "
                  f"{1e3 * total / r / 1e9:.1f} ms a pass")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default=None, help="kernel threads (default: all cores); --model: a list, e.g. 1,2")
    ap.add_argument("--impl", choices=["c", "numba"], default=None, help="kernel (default: C extension if built)")
    ap.add_argument("--rows", default="1,4,16,64,512", help="row counts R of x [R, K]")
    ap.add_argument("--model", choices=sorted(LLAMA), default=None, help="a Llama shape's decode weight pass")
    ap.add_argument("--quant", choices=["q4_0", "q4_k", "q6_k"], default="q4_0", help="--model's weights")
    ap.add_argument("--activations", choices=["int8", "int16"], default=None, help="the kernels' activation integers")
    ap.add_argument("--repeat", type=int, default=3, help="--model: alternating runs of pass and read")
    args = ap.parse_args()
    if args.activations:
        qm.set_activations(args.activations)
    if args.model:
        args.threads = args.threads or str(qm.set_num_threads())
        llama_pass(args)
        return
    if args.threads is not None:
        args.threads = int(args.threads)
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
