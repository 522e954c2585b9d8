"""Matmuls straight from quantized weights: out = x @ W.T with W kept in 4/8-bit affine groups.

Layout. `prepare` stacks the parts that share an input (q/k/v, gate/up) by rows and repacks them
once, at load time, into panels of 16 output columns. A panel's weights are uint32 words
[K / (32 / bits), 16]: word (k-chunk, column) holds that column's weights of 32 / bits
consecutive k, ordered so that `(word >> shift) & mask` yields two weights of adjacent k as the
low and high int16 halves of each 32-bit lane (see `_NIBBLE_ORDER`). Scales and biases become
[panels, K / group, 16] in float16 (float32 where a value has no exact float16). Resident bytes
equal the quantized storage, plus at most 15 padding columns per matrix.

Kernel. Each row of x is quantized per weight group to int16 (scale max|x| / 32767: an error
below 2^-16 of the group's largest value, far below the weights' own rounding), with its float
sum kept, so that a group contributes s * d_x * sum(q * x_q) + b * sum(x). The C extension
`_qmatmul` runs the integer dot products as AVX-512 VNNI `vpdpwssd` or AVX2 `vpmaddwd` (chosen
at run time by CPU features; plain C elsewhere, e.g. NEON through auto-vectorization), each
unpacked weight vector serving up to 8 rows from registers, on its own pthread pool over
(row tile, column panel) items. Without the extension, or with EDGESERVE_QMATMUL=numba, a numba
kernel runs on the same layout with float32 activations (a panel dequantized to float32, then
vectorized dot products): exact to float32 rounding, but several times slower than the C
kernels, a fallback for correctness rather than speed.

Widths other than 4 and 8 bits are repacked to 8 bits at load time (exact, but 8/bits times
the bytes); float parts are kept as float32 [K, n] and multiplied by BLAS.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numba
import numpy as np
from numba import njit, prange

from edgeserve.quant.affine import QuantizedTensor, unpack

try:
    from edgeserve.backends import _qmatmul as _ext
except ImportError:
    _ext = None

PANEL = 16
# Element (within a word's k-chunk) stored at each nibble / byte of the word: pairs of adjacent k
# land in the two int16 halves of the lane after one shift and mask.
_NIBBLE_ORDER = np.array([0, 2, 4, 6, 1, 3, 5, 7])
_BYTE_ORDER = np.array([0, 2, 1, 3])
# Shift that brings element e of a k-chunk to the bottom of its word.
_SHIFTS = {4: np.argsort(_NIBBLE_ORDER).astype(np.uint32) * 4, 8: np.argsort(_BYTE_ORDER).astype(np.uint32) * 8}


@dataclass
class _Segment:
    """Consecutive output columns [start, stop) with one storage format."""

    start: int
    stop: int
    bits: int = 0  # 0: float32 weights in `wt`
    group: int = 0
    packed: np.ndarray | None = None  # uint32 [panels, K * bits / 32, 16]
    scales: np.ndarray | None = None  # float16 or float32 [panels, K / group, 16]
    biases: np.ndarray | None = None
    wt: np.ndarray | None = None  # float32 [K, stop - start]

    @property
    def nbytes(self) -> int:
        arrays = (self.packed, self.scales, self.biases, self.wt)
        return sum(a.nbytes for a in arrays if a is not None)


class QMatrix:
    """Kernel-ready weights [N, K] (rows = output columns), stacked from one or more parts."""

    def __init__(self, segments: list[_Segment], k: int):
        self.segments = segments
        self.shape = (segments[-1].stop, k)
        self.nbytes = sum(s.nbytes for s in segments)
        s = segments[0]
        # One packed segment covers nearly every real matrix: its C call arguments are kept ready.
        self._fast = None
        if len(segments) == 1 and s.bits:
            self._fast = (s.packed, s.scales, s.biases, self.shape[0], s.bits, s.group, s.scales.dtype == np.float16)

    def __repr__(self) -> str:
        kinds = ", ".join(f"{s.bits}-bit g{s.group}" if s.bits else "float32" for s in self.segments)
        return f"QMatrix(shape={self.shape}, {kinds}, {self.nbytes / 2**20:.1f} MiB)"


def prepare(parts: list[QuantizedTensor | np.ndarray]) -> QMatrix:
    """Stack weights [n_i, K] sharing an input by rows and repack them for `qmatmul`."""
    ks = {p.shape[1] for p in parts}
    if len(ks) != 1:
        raise ValueError(f"parts of one matrix must share their input size, got {sorted(ks)}")
    k = ks.pop()
    segments: list[_Segment] = []
    col = 0
    run: list[QuantizedTensor | np.ndarray] = []
    for part in parts + [None]:
        if run and (part is None or _format(part) != _format(run[0])):
            n = sum(p.shape[0] for p in run)
            segments.append(_pack(run, col, col + n))
            col += n
            run = []
        if part is not None:
            run.append(part)
    return QMatrix(segments, k)


def qmatmul(x: np.ndarray, w: QMatrix, out: np.ndarray | None = None, impl: str | None = None) -> np.ndarray:
    """x @ W.T for x float32 [R, K] C-contiguous; impl 'c' or 'numba' overrides the default kernel."""
    if out is None:
        out = np.empty((x.shape[0], w.shape[0]), dtype=np.float32)
    fast = w._fast
    if fast is not None and (impl or _IMPL) == "c":
        _ext.gemm(x, fast[0], fast[1], fast[2], out, fast[3], fast[4], fast[5], fast[6])
        return out
    for s in w.segments:
        view = out[:, s.start : s.stop]
        if not s.bits:
            np.matmul(x, s.wt, out=view)
        elif (impl or _IMPL) == "c":
            _ext.gemm(x, s.packed, s.scales, s.biases, view, s.stop - s.start, s.bits, s.group,
                      s.scales.dtype == np.float16)
        else:
            _numba_gemm(x, s, view)
    return out


def qembed(w: QMatrix | QuantizedTensor, ids: np.ndarray) -> np.ndarray:
    """Rows `ids` of W as float32 [len(ids), K]: an embedding lookup from quantized storage."""
    ids = np.asarray(ids, dtype=np.int64)
    if isinstance(w, QuantizedTensor):
        return w.take_rows(ids).dequantize(np.float32)
    out = np.empty((len(ids), w.shape[1]), dtype=np.float32)
    for s in w.segments:
        sel = np.flatnonzero((ids >= s.start) & (ids < s.stop))
        if len(sel) == len(ids):
            out[:] = _rows(s, ids - s.start)
        elif len(sel):
            out[sel] = _rows(s, ids[sel] - s.start)
    return out


def set_num_threads(n: int | None = None) -> int:
    """Threads the kernels use per call (default: every core this process may run on); returns it."""
    if n is None:
        n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if _ext is not None and _IMPL == "c":
        return _ext.set_num_threads(n)
    # numba starts its own pool here, so only when its kernels are the ones in use
    numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))
    return numba.get_num_threads()


def compiled() -> bool:
    """Whether the compiled C kernels are in use (not the numba fallback)."""
    return _IMPL == "c"


def kernel_name() -> str:
    """The kernel in use, e.g. 'c/avx512vnni' or 'numba'."""
    return f"c/{_ext.isa()}" if _IMPL == "c" else "numba"


def compile_now() -> None:
    """Compile (or load from numba's cache) the fallback kernels, so no call waits for it."""
    if _IMPL == "numba":
        for bits in (4, 8):
            q = QuantizedTensor(np.zeros((1, bits), np.uint32), np.zeros((1, 1), np.float16),
                                np.zeros((1, 1), np.float16), bits, 32)
            qmatmul(np.zeros((1, 32), np.float32), prepare([q]), impl="numba")


# ---- load-time repacking ----


def _format(p: QuantizedTensor | np.ndarray) -> tuple[int, int]:
    if isinstance(p, QuantizedTensor):
        return (p.bits if p.bits in (4, 8) else 8, p.group_size)
    return (0, 0)


def _pack(parts: list[QuantizedTensor | np.ndarray], start: int, stop: int) -> _Segment:
    """One segment from parts of one format: float32 transposed, or panels of packed words."""
    bits, group = _format(parts[0])
    if not bits:
        wt = np.concatenate([np.asarray(p, dtype=np.float32) for p in parts]).T
        return _Segment(start, stop, wt=np.ascontiguousarray(wt))
    n, k = stop - start, parts[0].shape[1]
    panels = -(-n // PANEL)
    q = np.zeros((panels * PANEL, k), dtype=np.uint8)
    scales = [_float_scales(p.scales) for p in parts]
    biases = [_float_scales(p.biases) for p in parts]
    row = 0
    for p in parts:
        q[row : row + p.shape[0]] = unpack(p.weight, p.bits)
        row += p.shape[0]
    epw = 32 // bits
    order = _NIBBLE_ORDER if bits == 4 else _BYTE_ORDER
    chunks = q.reshape(panels, PANEL, k // epw, epw)[..., order].astype(np.uint32)
    words = np.bitwise_or.reduce(chunks << (np.arange(epw, dtype=np.uint32) * bits), axis=-1)
    packed = np.ascontiguousarray(words.transpose(0, 2, 1))
    return _Segment(start, stop, bits, group, packed, _panel_scales(scales, panels), _panel_scales(biases, panels))


def _float_scales(a: np.ndarray) -> np.ndarray:
    if a.dtype == np.uint16:  # bfloat16 bit patterns
        return (a.astype(np.uint32) << 16).view(np.float32)
    return a


def _panel_scales(parts: list[np.ndarray], panels: int) -> np.ndarray:
    """[rows, groups] per part -> [panels, groups, 16], float16 when every value is exactly one."""
    a = np.concatenate([p.astype(np.float32) for p in parts])
    with np.errstate(over="ignore"):
        half = a.astype(np.float16)
    dtype = np.float16 if np.array_equal(half.astype(np.float32), a) else np.float32
    padded = np.zeros((panels * PANEL, a.shape[1]), dtype=dtype)
    padded[: len(a)] = a
    return np.ascontiguousarray(padded.reshape(panels, PANEL, -1).transpose(0, 2, 1))


def _rows(s: _Segment, rows: np.ndarray) -> np.ndarray:
    """Rows of one segment as float32 [len(rows), K]."""
    if not s.bits:
        return s.wt[:, rows].T
    panel, lane = rows // PANEL, rows % PANEL
    words = s.packed[panel, :, lane]  # [n, K / epw]
    q = (words[:, :, None] >> _SHIFTS[s.bits]) & np.uint32((1 << s.bits) - 1)
    q = q.reshape(len(rows), -1, s.group).astype(np.float32)
    scale = s.scales[panel, :, lane].astype(np.float32)[:, :, None]
    bias = s.biases[panel, :, lane].astype(np.float32)[:, :, None]
    return (q * scale + bias).reshape(len(rows), -1)


# ---- numba fallback: same layout, float32 activations ----


def _numba_gemm(x: np.ndarray, s: _Segment, out: np.ndarray) -> None:
    # numba has no float16: such scales travel as their bit patterns, decoded through a table
    half = s.scales.dtype == np.float16
    h_s, h_b = (s.scales.view(np.uint16), s.biases.view(np.uint16)) if half else (_NO_HALF, _NO_HALF)
    f_s, f_b = (_NO_FLOAT, _NO_FLOAT) if half else (s.scales, s.biases)
    _gemm(x, s.packed, h_s, h_b, f_s, f_b, half, _HALF_TABLE, out, s.stop - s.start, s.group, s.bits, _SHIFTS[s.bits])


_NO_HALF = np.zeros((0, 0, PANEL), np.uint16)
_NO_FLOAT = np.zeros((0, 0, PANEL), np.float32)
_HALF_TABLE = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)


@njit(cache=True, nogil=True, fastmath=True, parallel=True)
def _gemm(x, packed, h_scales, h_biases, f_scales, f_biases, half, half_table, out, n, group, bits, shifts):
    rows, k = x.shape
    epw = 32 // bits
    mask = (1 << bits) - 1
    words_per_group = group // epw
    # a run-time trip count: with the constant 16 LLVM unrolls these loops into scalar code
    lanes = packed.shape[2]
    for p in prange(packed.shape[0]):
        # The panel's weights as float32 [16, K]: each output is then a contiguous dot product,
        # a reduction LLVM vectorizes with the sum kept in registers (a [K, 16] layout would
        # update a 16-float array in memory at every k, since numba cannot rule out aliasing).
        wt = np.empty((lanes, k), dtype=np.float32)
        for g in range(k // group):
            for c in range(lanes):
                if half:
                    sc = half_table[h_scales[p, g, c]]
                    bi = half_table[h_biases[p, g, c]]
                else:
                    sc = f_scales[p, g, c]
                    bi = f_biases[p, g, c]
                dst = wt[c]
                for j in range(g * words_per_group, (g + 1) * words_per_group):
                    word = packed[p, j, c]
                    for e in range(epw):
                        dst[j * epw + e] = np.float32((word >> shifts[e]) & mask) * sc + bi
        for r in range(rows):
            xr = x[r]
            for c in range(min(lanes, n - p * lanes)):
                src = wt[c]
                total = np.float32(0)
                for kk in range(k):
                    total += src[kk] * xr[kk]
                out[r, p * lanes + c] = total


_IMPL = "c" if _ext is not None and os.environ.get("EDGESERVE_QMATMUL", "").lower() != "numba" else "numba"
set_num_threads()
