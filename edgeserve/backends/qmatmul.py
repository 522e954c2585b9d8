"""Matmuls straight from quantized weights: out = x @ W.T with W kept in 4/8-bit affine groups.

Layout. `prepare` stacks the parts that share an input (q/k/v, gate/up) by rows and repacks them
once, at load time, into panels of 16 output columns. A panel's weights are uint32 words
[K / (32 / bits), 16]: word (k-chunk, column) holds that column's weights of 32 / bits
consecutive k, ordered so that `(word >> shift) & mask` yields two weights of adjacent k as the
low and high int16 halves of each 32-bit lane (see `_NIBBLE_ORDER`). Scales and biases become
[panels, K / group, 16] in float16 (float32 where a value has no exact float16); symmetric groups
(GGUF Q4_0, Q5_0, Q8_0: bias = -center * scale) keep no biases, the kernels form them from the
scales. Resident bytes equal the quantized storage, plus at most 15 padding columns per matrix.

Kernel. Each row of x is quantized per weight group to integers, with its float sum kept, so that
a group contributes s * d_x * sum(q * x_q) + b * sum(x); with int8 on the AVX2 path, K-quants take
one scale per 256 values of a row (llama.cpp's Q8_K) and b * d_x * sum(x_q), their group scales
applied to integers (SmolLM2-135M requantized to Q4_K_M: perplexity 21.26 against 21.27 with a
scale per group, 20.86 with int16). `set_activations` picks the integers (or
the EDGESERVE_ACTIVATIONS environment variable, or --activations): 'int8' (scale max|x| / 127, as
llama.cpp quantizes activations; half the instructions per weight; the default) or 'int16' (scale
max|x| / 32767: an error below 2^-16 of the group's largest value, far below the weights' own
rounding; the exact path, which the test suite holds to float32's tolerances). int8 raised
perplexity by 1.0% (SmolLM2-135M Q4_1, 19.96 -> 20.16) and 1.2% (Gemma 3 270M Q4_K_M, 18.13 ->
18.35 on half the text), the cost llama.cpp pays too; on a 2-core AVX2 machine it made a 1B
model's 512-token prompt 1.6x faster (97 against 62 tokens/s: four rows share each unpacked weight
vector in registers), while a one-row decode step, which reads memory, ran at the same speed
within noise. The C extension `_qmatmul` runs the integer dot products as AVX-512 VNNI `vpdpwssd`
or AVX2 `vpmaddwd` for int16 and AVX2 `vpmaddubsw` for int8 (chosen at run time by CPU features;
plain C elsewhere, e.g. NEON through auto-vectorization), each unpacked weight vector serving
several rows from registers, on its own pthread pool over (row tile, column panel) items. Without
the extension, or with EDGESERVE_QMATMUL=numba, a numba kernel runs on the same layout with
float32 activations (a panel dequantized to float32, then vectorized dot products): exact to
float32 rounding, but several times slower than the C kernels, a fallback for correctness rather
than speed.

GGUF K-quants (Q4_K, Q5_K, Q6_K) keep their two-level scales: 4-bit panels as above, a second
plane of uint32 words [K * hbits / 32, 16] per panel with the 5th (Q5_K) or 5th and 6th (Q6_K)
bits, int8 group scales sc and mins m [panels, K / group, 16] (Q6_K's m is its sc, stored once)
and d, dmin [panels, K / 256, 16]; the kernel forms a group's scale d * sc and bias dmin * m.
That is 4.625, 5.625 and 6.625 bits per weight against GGUF's 4.5, 5.5 and 6.5625.

Widths other than 4 and 8 bits are repacked to 8 bits at load time (exact, but 8/bits times
the bytes); float parts are kept as float32 [K, n] and multiplied by BLAS.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import gguf
import numpy as np

from edgeserve.backends import ACTIVATION_MODES, DEFAULT_ACTIVATIONS
from edgeserve.backends.lazy_jit import njit, prange
from edgeserve.backends.pages import aligned_copy, aligned_zeros
from edgeserve.quant.affine import QuantizedTensor, unpack
from edgeserve.quant.gguf_blocks import SymmetricBlocks
from edgeserve.quant.kquants import Q6_K_OFFSET, SUPER, KQuantTensor
from edgeserve.system import usable_cores

try:
    from edgeserve.backends import _qmatmul as _ext
except ImportError:
    _ext = None

PANEL = 16
# Bumped whenever `prepare`'s output changes (word order, planes, scale layout): a cache of packed
# panels keyed on it is never read back by kernels that expect another layout.
PANEL_LAYOUT_VERSION = 2
_activations = DEFAULT_ACTIVATIONS
# Element (within a word's k-chunk) stored at each nibble / byte of the word: pairs of adjacent k
# land in the two int16 halves of the lane after one shift and mask.
_NIBBLE_ORDER = np.array([0, 2, 4, 6, 1, 3, 5, 7])
_BYTE_ORDER = np.array([0, 2, 1, 3])
# Shift that brings element e of a k-chunk to the bottom of its word.
_SHIFTS = {4: np.argsort(_NIBBLE_ORDER).astype(np.uint32) * 4, 8: np.argsort(_BYTE_ORDER).astype(np.uint32) * 8}
# Shift of element e of a high-bit word (32 / hbits elements): pairs of adjacent k share a bit
# offset in the two int16 halves, the offset of the 4-bit pair they complete after one shift.
_HI_SHIFTS = {h: np.array([h * (e // 2) + 16 * (e % 2) for e in range(32 // h)], dtype=np.uint32) for h in (1, 2)}

Weight = QuantizedTensor | SymmetricBlocks | KQuantTensor | np.ndarray


@dataclass
class _Segment:
    """Consecutive output columns [start, stop) with one storage format."""

    start: int
    stop: int
    bits: int = 0  # 0: float32 weights in `wt`
    group: int = 0
    packed: np.ndarray | None = None  # uint32 [panels, K * bits / 32, 16]
    scales: np.ndarray | None = None  # float16 or float32 [panels, K / group, 16]
    biases: np.ndarray | None = None  # None for symmetric groups: -center * scales
    wt: np.ndarray | None = None  # float32 [K, stop - start]
    # K-quants: scales and biases above are d and dmin per super-block
    hbits: int = 0
    hi: np.ndarray | None = None  # uint32 [panels, K * hbits / 32, 16]
    ksc: np.ndarray | None = None  # int8 [panels, K / group, 16]
    km: np.ndarray | None = None  # int8 like ksc; ksc itself for Q6_K
    # symmetric groups: bias = -center * scale; Q6_K: values are (d * sc) * (q - 32), which `_rows` computes in
    # that order
    center: int = 0

    @property
    def nbytes(self) -> int:
        arrays = (self.packed, self.scales, self.biases, self.wt, self.hi, self.ksc,
                  None if self.km is self.ksc else self.km)
        return sum(a.nbytes for a in arrays if a is not None)

    def c_args(self) -> tuple[tuple, tuple]:
        """The C kernel's arguments before and after `out` (x comes first)."""
        tail = (self.stop - self.start, self.bits, self.group, self.scales.dtype == np.float16)
        if self.ksc is not None:
            tail += (self.hi, self.hbits, self.ksc, self.km)
        return (self.packed, self.scales, float(self.center) if self.biases is None else self.biases), tail

    def bias_array(self) -> np.ndarray:
        """The biases [panels, K / group, 16] of an affine segment, formed from the scales for symmetric groups."""
        if self.biases is not None:
            return self.biases
        return (np.float32(-self.center) * self.scales.astype(np.float32)).astype(self.scales.dtype)


class QMatrix:
    """Kernel-ready weights [N, K] (rows = output columns), stacked from one or more parts."""

    def __init__(self, segments: list[_Segment], k: int):
        self.segments = segments
        self.shape = (segments[-1].stop, k)
        self.nbytes = sum(s.nbytes for s in segments)
        # One packed segment covers nearly every real matrix: its C call arguments are kept ready.
        self._fast = segments[0].c_args() if len(segments) == 1 and segments[0].bits else None

    def packed_args(self) -> tuple | None:
        """The C gemm's weight arguments (all but x and out), where one packed segment holds the whole matrix."""
        return None if self._fast is None else (*self._fast[0], *self._fast[1])

    def __repr__(self) -> str:
        kinds = ", ".join(_describe(s) for s in self.segments)
        return f"QMatrix(shape={self.shape}, {kinds}, {self.nbytes / 2**20:.1f} MiB)"


def _describe(s: _Segment) -> str:
    if not s.bits:
        return "float32"
    if s.ksc is not None:
        return f"K-quant {4 + s.hbits}-bit g{s.group}"
    return f"{s.bits}-bit g{s.group}"


def prepare(parts: list[Weight]) -> QMatrix:
    """Stack weights [n_i, K] sharing an input by rows and repack them for `qmatmul`."""
    ks = {p.shape[1] for p in parts}
    if len(ks) != 1:
        raise ValueError(f"parts of one matrix must share their input size, got {sorted(ks)}")
    k = ks.pop()
    segments: list[_Segment] = []
    col = 0
    run: list[Weight] = []
    for part in parts + [None]:
        if run and (part is None or _format(part) != _format(run[0])):
            n = sum(p.shape[0] for p in run)
            segments.append(_pack(run, col, col + n))
            col += n
            run = []
        if part is not None:
            run.append(part)
    return QMatrix(segments, k)


def quantized_nbytes(w: QuantizedTensor | SymmetricBlocks | KQuantTensor) -> int:
    """Bytes `prepare` holds for one quantized weight at most, panel padding aside (symmetric groups
    hold no biases)."""
    if isinstance(w, QuantizedTensor):
        return w.weight.nbytes + w.scales.nbytes + w.biases.nbytes
    rows, cols = w.shape
    groups = cols // w.group_size
    if isinstance(w, SymmetricBlocks):  # the values, and a float16 scale a group
        return rows * (cols * w.bits // 8 + 2 * groups)
    int_scales = groups if w.qtype == gguf.GGMLQuantizationType.Q6_K else 2 * groups  # Q6_K's m is its sc
    return rows * (cols * w.bits // 8 + int_scales + 4 * (cols // SUPER))


def qmatmul(x: np.ndarray, w: QMatrix, out: np.ndarray | None = None, impl: str | None = None) -> np.ndarray:
    """x @ W.T for x float32 [R, K] C-contiguous; impl 'c' or 'numba' overrides the default kernel."""
    if out is None:
        out = np.empty((x.shape[0], w.shape[0]), dtype=np.float32)
    fast = w._fast
    if fast is not None and (impl or _IMPL) == "c":
        _ext.gemm(x, *fast[0], out, *fast[1])
        return out
    for s in w.segments:
        view = out[:, s.start : s.stop]
        if not s.bits:
            np.matmul(x, s.wt, out=view)
        elif (impl or _IMPL) == "c":
            head, tail = s.c_args()
            _ext.gemm(x, *head, view, *tail)
        elif s.ksc is not None:
            _numba_kgemm(x, s, view)
        else:
            _numba_gemm(x, s, view)
    return out


def qembed(w: QMatrix | QuantizedTensor | KQuantTensor, ids: np.ndarray) -> np.ndarray:
    """Rows `ids` of W as float32 [len(ids), K]: an embedding lookup from quantized storage."""
    ids = np.asarray(ids, dtype=np.int64)
    if isinstance(w, (QuantizedTensor, KQuantTensor)):
        return w.take_rows(ids).dequantize(np.float32)
    if len(w.segments) == 1:  # a token's lookup: each NumPy call here costs more than the row's dequantizing
        return np.ascontiguousarray(_rows(w.segments[0], ids))
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
        n = usable_cores()
    if _ext is not None and _IMPL == "c":
        return _ext.set_num_threads(n)
    # numba starts its own pool here, so only when its kernels are the ones in use
    import numba

    numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))
    return numba.get_num_threads()


def set_activations(mode: str) -> None:
    """Quantize the C kernels' activations to 'int8' or 'int16' integers per weight group (see the module notes)."""
    if mode not in ACTIVATION_MODES:
        raise ValueError(f"activations must be one of {', '.join(ACTIVATION_MODES)}, got {mode!r}")
    global _activations
    if _ext is not None:
        _ext.set_activation_bits(8 if mode == "int8" else 16)
    _activations = mode


def get_activations() -> str:
    """The C kernels' activation integers: 'int8' or 'int16'."""
    return _activations


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
        kq = KQuantTensor(np.zeros((1, 210), np.uint8), gguf.GGMLQuantizationType.Q6_K, SUPER)
        qmatmul(np.zeros((1, SUPER), np.float32), prepare([kq]), impl="numba")


# ---- load-time repacking ----


def _format(p: Weight) -> tuple:
    if isinstance(p, KQuantTensor):
        return ("K", p.qtype)
    if isinstance(p, (QuantizedTensor, SymmetricBlocks)):
        return (p.bits if p.bits in (4, 8) else 8, p.group_size)
    return (0, 0)


def _pack(parts: list[Weight], start: int, stop: int) -> _Segment:
    """One segment from parts of one format: float32 transposed, or panels of packed words."""
    if isinstance(parts[0], KQuantTensor):
        return _pack_kquants(parts, start, stop)
    if _ext is not None and all(isinstance(p, SymmetricBlocks) and p.qtype == parts[0].qtype for p in parts):
        return _pack_blocks(parts, start, stop)
    parts = [p.to_affine() if isinstance(p, SymmetricBlocks) else p for p in parts]
    bits, group = _format(parts[0])
    if not bits:
        wt = np.concatenate([np.asarray(p, dtype=np.float32) for p in parts]).T
        return _Segment(start, stop, wt=np.ascontiguousarray(wt))
    n, k = stop - start, parts[0].shape[1]
    panels = -(-n // PANEL)
    scales = [_float_scales(p.scales) for p in parts]
    biases = [_float_scales(p.biases) for p in parts]
    if _ext is not None and all(p.bits == bits for p in parts):
        # each word reordered straight into its panel in C, one pass (through _panel_words a 3B file's first start
        # took ~9 s longer)
        packed = aligned_zeros((panels, k * bits // 32, PANEL), np.uint32)
        for p, row in _first_rows(parts):
            _ext.panel_words(np.ascontiguousarray(p.weight, dtype=np.uint32), packed, bits, row)
    else:
        q = np.zeros((panels * PANEL, k), dtype=np.uint8)
        for p, row in _first_rows(parts):
            q[row : row + p.shape[0]] = unpack(p.weight, p.bits)
        packed = _panel_words(q, bits, panels)
    scales, biases = _panel_scales(scales, biases, panels)
    center = _center(scales, biases, bits)
    return _Segment(start, stop, bits, group, packed, scales, None if center else biases, center=center)


def _pack_blocks(parts: list[SymmetricBlocks], start: int, stop: int) -> _Segment:
    """One segment from Q4_0 or Q8_0 parts of one type, their blocks repacked into panels in C on the kernels' threads
    (through the affine form, a 3B file's first start took ~4 s longer)."""
    n, k, first = stop - start, parts[0].shape[1], parts[0]
    panels = -(-n // PANEL)
    packed = aligned_zeros((panels, k * first.bits // 32, PANEL), np.uint32)
    for p, row in _first_rows(parts):
        _ext.block_words(p.blocks, int(p.qtype), packed, None, row)
    scales = _panel_rows([p.scales() for p in parts], panels, np.float16)
    return _Segment(start, stop, first.bits, first.group_size, packed, scales, None, center=first.center)


def _pack_kquants(parts: list[KQuantTensor], start: int, stop: int) -> _Segment:
    """One segment from K-quant parts of one type: 4-bit panels, a high-bit plane, two-level scales."""
    n, k = stop - start, parts[0].shape[1]
    panels = -(-n // PANEL)
    hbits = parts[0].bits - 4
    planes = [p.planes(values=_ext is None) for p in parts]
    if _ext is not None:  # the blocks' values straight into panels (in NumPy: 7 of a 1B Q4_K_M file's 9 s first start)
        packed = aligned_zeros((panels, k // 8, PANEL), np.uint32)
        hi = aligned_zeros((panels, k * hbits // 32, PANEL), np.uint32) if hbits else None
        for p, row in _first_rows(parts):
            _ext.block_words(p.blocks, int(p.qtype), packed, hi, row)
    else:
        q = np.zeros((panels * PANEL, k), dtype=np.uint8)
        q[:n] = np.concatenate([pl.q for pl in planes])
        hi = _high_bit_words(q >> 4, hbits, panels) if hbits else None
        packed = _panel_words(q & np.uint8(0x0F), 4, panels)
    ksc = _panel_rows([pl.sc for pl in planes], panels, np.int8)
    km = ksc if planes[0].m is None else _panel_rows([pl.m for pl in planes], panels, np.int8)
    d, dmin = _panel_scales([pl.d for pl in planes], [pl.dmin for pl in planes], panels)
    center = Q6_K_OFFSET if planes[0].m is None else 0
    return _Segment(start, stop, 4, parts[0].group_size, packed, d, dmin,
                    hbits=hbits, hi=hi, ksc=ksc, km=km, center=center)


def _first_rows(parts: list[Weight]) -> list[tuple[Weight, int]]:
    """Each part with the row of the stacked matrix it starts at."""
    starts = np.cumsum([0] + [p.shape[0] for p in parts[:-1]])
    return [(p, int(row)) for p, row in zip(parts, starts)]


def _panel_words(q: np.ndarray, bits: int, panels: int) -> np.ndarray:
    """Unsigned integers [panels * 16, K] as panels of words [panels, K * bits / 32, 16].

    A word's values are shuffled into place with shifts of the 8 (or 4) bytes that hold them read as one
    integer: a uint32 per value and a reduction made a 3B model's first start twice as long."""
    if bits == 4:
        # y's byte i = w_i | w_(i+2) << 4 (values < 16), so the word is y's bytes 0, 4, 1, 5 (_NIBBLE_ORDER)
        x = np.ascontiguousarray(q).view("<u8")
        y = x | (x >> np.uint64(12))
        w = (y & np.uint64(0xFF)) | ((y >> np.uint64(24)) & np.uint64(0xFF00)) | \
            ((y << np.uint64(8)) & np.uint64(0xFF0000)) | ((y >> np.uint64(16)) & np.uint64(0xFF000000))
    else:  # bytes w0, w2, w1, w3 (_BYTE_ORDER)
        x = np.ascontiguousarray(q).view("<u4")
        w = (x & np.uint32(0xFF0000FF)) | ((x >> np.uint32(8)) & np.uint32(0xFF00)) | \
            ((x << np.uint32(8)) & np.uint32(0xFF0000))
    return _panels(w.astype(np.uint32), panels)


def _high_bit_words(high: np.ndarray, hbits: int, panels: int) -> np.ndarray:
    """K-quants' high bits [panels * 16, K] as the plane of words [panels, K * hbits / 32, 16]: value e of a
    word at bit hbits * (e // 2) of its low (even e) or high (odd e) int16 half."""
    per_byte = 8 // hbits
    c = high.reshape(panels, PANEL, high.shape[1] * hbits // 32, 32 // hbits)
    out = np.zeros(c.shape[:-1] + (4,), dtype=np.uint8)
    for b in range(4):
        half, first = b // 2, (b % 2) * per_byte
        for j in range(per_byte):
            out[..., b] |= c[..., 2 * (first + j) + half] << (hbits * j)
    return _panels(np.ascontiguousarray(out).view("<u4")[..., 0].astype(np.uint32), panels)


def _panels(words: np.ndarray, panels: int) -> np.ndarray:
    """A matrix's words [panels * 16, words a row] as panels [panels, words a row, 16]."""
    return aligned_copy(words.reshape(panels, PANEL, -1).transpose(0, 2, 1))


def _panel_rows(parts: list[np.ndarray], panels: int, dtype: np.dtype) -> np.ndarray:
    """Per-row values [rows, groups] per part (scales, group integers) -> [panels, groups, 16] of dtype."""
    a = np.concatenate(parts)
    padded = np.zeros((panels * PANEL, a.shape[1]), dtype=dtype)
    padded[: len(a)] = a
    return aligned_copy(padded.reshape(panels, PANEL, -1).transpose(0, 2, 1))


def _float_scales(a: np.ndarray) -> np.ndarray:
    if a.dtype == np.uint16:  # bfloat16 bit patterns
        return (a.astype(np.uint32) << 16).view(np.float32)
    return a


def _panel_scales(scales: list[np.ndarray], biases: list[np.ndarray], panels: int) -> tuple[np.ndarray, np.ndarray]:
    """[rows, groups] per part -> [panels, groups, 16] each, float16 when every value of both is
    exactly one (the kernel takes one dtype for the two)."""
    if all(p.dtype == np.float16 for parts in (scales, biases) for p in parts):  # GGUF's: nothing to check
        pair, dtype = [np.concatenate(parts) for parts in (scales, biases)], np.float16
    else:
        pair = [np.concatenate([p.astype(np.float32) for p in parts]) for parts in (scales, biases)]
        with np.errstate(over="ignore"):
            exact = all(np.array_equal(a.astype(np.float16).astype(np.float32), a) for a in pair)
        dtype = np.float16 if exact else np.float32
    return _panel_rows([pair[0]], panels, dtype), _panel_rows([pair[1]], panels, dtype)


def _center(scales: np.ndarray, biases: np.ndarray, bits: int) -> int:
    """c where every bias is -c * its scale exactly in float32 (GGUF Q4_0: 8; Q8_0: 128; Q5_0 widened to
    8 bits: 16), else 0."""
    s, b = scales.astype(np.float32), biases.astype(np.float32)
    for c in (8,) if bits == 4 else (128, 16):
        if np.array_equal(b, np.float32(-c) * s):
            return c
    return 0


def _rows(s: _Segment, rows: np.ndarray) -> np.ndarray:
    """Rows of one segment as float32 [len(rows), K]."""
    if not s.bits:
        return s.wt[:, rows].T
    if _ext is not None and _IMPL == "c":
        head, tail = s.c_args()
        out = np.empty((len(rows), s.packed.shape[1] * (32 // s.bits)), np.float32)
        _ext.rows(np.ascontiguousarray(rows, np.int64), out, float(s.center) if s.ksc is not None else 0.0,
                  *head, *tail)
        return out
    panel, lane = rows // PANEL, rows % PANEL
    words = s.packed[panel, :, lane]  # [n, K / epw]
    q = (words[:, :, None] >> _SHIFTS[s.bits]) & np.uint32((1 << s.bits) - 1)
    if s.ksc is not None:
        return _kquant_rows(s, panel, lane, q.reshape(len(rows), -1))
    q = q.reshape(len(rows), -1, s.group).astype(np.float32)
    scale = s.scales[panel, :, lane].astype(np.float32)[:, :, None]
    if s.biases is None:
        bias = np.float32(-s.center) * scale
    else:
        bias = s.biases[panel, :, lane].astype(np.float32)[:, :, None]
    return (q * scale + bias).reshape(len(rows), -1)


def _kquant_rows(s: _Segment, panel: np.ndarray, lane: np.ndarray, low: np.ndarray) -> np.ndarray:
    """Rows of a K-quant segment, with gguf's float32 operations in gguf's order (so bit-exact)."""
    n = len(panel)
    q = low
    if s.hbits:
        words = s.hi[panel, :, lane]  # [n, K * hbits / 32]
        high = (words[:, :, None] >> _HI_SHIFTS[s.hbits]) & np.uint32((1 << s.hbits) - 1)
        q = q | (high.reshape(n, -1) << np.uint32(4))
    per_super = SUPER // s.group
    d = np.repeat(s.scales[panel, :, lane].astype(np.float32), per_super, axis=1)
    scale = (d * s.ksc[panel, :, lane].astype(np.float32))[:, :, None]
    q = q.reshape(n, -1, s.group).astype(np.float32)
    if s.center:
        return (scale * (q - np.float32(s.center))).reshape(n, -1)
    dmin = np.repeat(s.biases[panel, :, lane].astype(np.float32), per_super, axis=1)
    bias = (dmin * s.km[panel, :, lane].astype(np.float32))[:, :, None]
    return (scale * q + bias).reshape(n, -1)


# ---- numba fallback: same layout, float32 activations ----


def _numba_gemm(x: np.ndarray, s: _Segment, out: np.ndarray) -> None:
    # numba has no float16: such scales travel as their bit patterns, decoded through a table
    half = s.scales.dtype == np.float16
    biases = s.bias_array()
    h_s, h_b = (s.scales.view(np.uint16), biases.view(np.uint16)) if half else (_NO_HALF, _NO_HALF)
    f_s, f_b = (_NO_FLOAT, _NO_FLOAT) if half else (s.scales, biases)
    _gemm(x, s.packed, h_s, h_b, f_s, f_b, half, _HALF_TABLE, out, s.stop - s.start, s.group, s.bits, _SHIFTS[s.bits])


_NO_HALF = np.zeros((0, 0, PANEL), np.uint16)
_NO_FLOAT = np.zeros((0, 0, PANEL), np.float32)
_HALF_TABLE = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)


@njit(cache=True, nogil=True, fastmath=True)
def _panel_dots(x, wt, out, first, cols):
    """out[:, first + c] = x @ wt[c] for the panel's `cols` columns of float32 weights."""
    for r in range(x.shape[0]):
        xr = x[r]
        for c in range(cols):
            src = wt[c]
            total = np.float32(0)
            for kk in range(x.shape[1]):
                total += src[kk] * xr[kk]
            out[r, first + c] = total


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
        _panel_dots(x, wt, out, p * lanes, min(lanes, n - p * lanes))


def _numba_kgemm(x: np.ndarray, s: _Segment, out: np.ndarray) -> None:
    hi = s.hi if s.hbits else _NO_WORDS
    _kgemm(x, s.packed, hi, s.hbits, s.ksc, s.km, s.scales.astype(np.float32), s.biases.astype(np.float32),
           out, s.stop - s.start, s.group, _SHIFTS[4], _HI_SHIFTS.get(s.hbits, _NO_SHIFTS))


_NO_WORDS = np.zeros((0, 0, PANEL), np.uint32)
_NO_SHIFTS = np.zeros(0, np.uint32)


@njit(cache=True, nogil=True, fastmath=True, parallel=True)
def _kgemm(x, packed, hi, hbits, ksc, km, d, dmin, out, n, group, shifts, hi_shifts):
    rows, k = x.shape
    per_word = 32 // hbits if hbits else 1
    hmask = (1 << hbits) - 1
    lanes = packed.shape[2]
    for p in prange(packed.shape[0]):
        wt = np.empty((lanes, k), dtype=np.float32)
        for g in range(k // group):
            sb = g * group // 256
            for c in range(lanes):
                sc = d[p, sb, c] * np.float32(ksc[p, g, c])
                bi = dmin[p, sb, c] * np.float32(km[p, g, c])
                dst = wt[c]
                for kk in range(g * group, (g + 1) * group):
                    q = (packed[p, kk // 8, c] >> shifts[kk % 8]) & 15
                    if hbits:
                        q |= ((hi[p, kk // per_word, c] >> hi_shifts[kk % per_word]) & hmask) << 4
                    dst[kk] = np.float32(q) * sc + bi
        _panel_dots(x, wt, out, p * lanes, min(lanes, n - p * lanes))


_IMPL = "c" if _ext is not None and os.environ.get("EDGESERVE_QMATMUL", "").lower() != "numba" else "numba"
set_num_threads()
set_activations(os.environ.get("EDGESERVE_ACTIVATIONS", DEFAULT_ACTIVATIONS))
