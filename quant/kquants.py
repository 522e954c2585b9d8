"""GGUF K-quant matrices (Q4_K, Q5_K, Q6_K) kept as their raw blocks, and their exact planes.

Every K-quant cuts a row into super-blocks of 256 values sharing float16 factors, and each
super-block into small groups with 6- or 8-bit integer scales:

    Q4_K  groups of 32, 4-bit q:  w = (d * sc) * q - (dmin * m)      sc, m 6-bit unsigned
    Q5_K  groups of 32, 5-bit q:  the same with a fifth bit per value
    Q6_K  groups of 16, 6-bit q:  w = (d * sc) * (q - 32)            sc int8

`planes` spells each format as one two-level affine form, w = (d * sc) * q + (dmin * m) with
q unsigned, sc and m int8 per group and d, dmin per super-block: Q4_K/Q5_K negate dmin, and Q6_K
takes m = sc and dmin = -32 d. That is what the NumPy backend's kernels compute from.
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import numpy as np
from numpy.typing import ArrayLike, DTypeLike

from edgeserve.errors import ModelLoadError
from edgeserve.quant.affine import QuantizedTensor, pack

_T = gguf.GGMLQuantizationType
SUPER = 256  # values per super-block
KQUANT_TYPES = (_T.Q4_K, _T.Q5_K, _T.Q6_K)
# bits of q, and values per group sharing one (sc, m)
_BITS = {_T.Q4_K: 4, _T.Q5_K: 5, _T.Q6_K: 6}
_GROUP = {_T.Q4_K: 32, _T.Q5_K: 32, _T.Q6_K: 16}
Q6_K_OFFSET = 32


@dataclass
class KPlanes:
    """A K-quant matrix unpacked: w = (d * sc) * q + dmin * m, per group and super-block."""

    q: np.ndarray | None  # uint8 [rows, cols], below 2**bits; None where not asked for
    sc: np.ndarray  # int8 [rows, cols / group]
    m: np.ndarray | None  # int8 like sc; None where m is sc itself (Q6_K)
    d: np.ndarray  # float32 [rows, cols / 256], each exactly a float16
    dmin: np.ndarray  # float32 like d; may not be a float16 (-32 d overflowing)


@dataclass
class KQuantTensor:
    """A [rows, cols] matrix stored as GGUF K-quant blocks, row by row."""

    blocks: np.ndarray  # uint8 [rows, cols / 256 * block bytes]
    qtype: gguf.GGMLQuantizationType
    cols: int

    def __post_init__(self) -> None:
        if self.qtype not in KQUANT_TYPES:
            raise ModelLoadError(f"not a K-quant type: {self.qtype!r}")
        block_bytes = gguf.GGML_QUANT_SIZES[self.qtype][1]
        if self.cols % SUPER or self.blocks.dtype != np.uint8 or self.blocks.ndim != 2 or \
                self.blocks.shape[1] != self.cols // SUPER * block_bytes:
            raise ModelLoadError(
                f"{self.qtype.name} blocks {self.blocks.dtype} {self.blocks.shape} do not hold rows of {self.cols} values"
            )

    @property
    def shape(self) -> tuple[int, int]:
        """(rows, cols) of the matrix this tensor stands for."""
        return self.blocks.shape[0], self.cols

    @property
    def nbytes(self) -> int:
        """Bytes of the GGUF blocks."""
        return self.blocks.nbytes

    @property
    def bits(self) -> int:
        """Bits of each value's integer."""
        return _BITS[self.qtype]

    @property
    def group_size(self) -> int:
        """Values sharing one integer scale."""
        return _GROUP[self.qtype]

    def dequantize(self, dtype: DTypeLike = np.float32) -> np.ndarray:
        """The float matrix, bit for bit gguf's own dequantization (float32), cast to dtype."""
        values = gguf.quants.dequantize(self.blocks, self.qtype)
        return values.reshape(self.shape).astype(dtype, copy=False)

    def take_rows(self, index: ArrayLike) -> KQuantTensor:
        """A new tensor made of the given rows, in that order."""
        return KQuantTensor(np.ascontiguousarray(self.blocks[np.asarray(index)]), self.qtype, self.cols)

    def planes(self, values: bool = True) -> KPlanes:
        """The integers and scales as separate arrays, in the two-level affine form (q None unless `values`)."""
        rows, cols = self.shape
        n = rows * cols // SUPER
        b = self.blocks.reshape(n, -1)
        if self.qtype == _T.Q6_K:
            ql, qh, scales, d = b[:, :128], b[:, 128:192], b[:, 192:208], b[:, 208:210]
            q = None
            if values:
                lo = (ql.reshape(n, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & np.uint8(0x0F)
                hi = (qh.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & np.uint8(3)
                q = (lo.reshape(n, SUPER) | (hi.reshape(n, SUPER) << np.uint8(4))).reshape(rows, cols)
            d32 = _f16(d)
            sc = np.ascontiguousarray(scales).view(np.int8)
            return KPlanes(q, sc.reshape(rows, -1), None,
                           d32.reshape(rows, -1), (np.float32(-Q6_K_OFFSET) * d32).reshape(rows, -1))
        d32, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
        sc, m = gguf.quants.Q4_K.get_scale_min(np.ascontiguousarray(b[:, 4:16]))
        sc, m = sc.astype(np.int8).reshape(rows, -1), m.astype(np.int8).reshape(rows, -1)
        if not values:
            return KPlanes(None, sc, m, d32.reshape(rows, -1), (-dmin).reshape(rows, -1))
        if self.qtype == _T.Q4_K:
            qs = b[:, 16:144]
            high = np.zeros((n, SUPER), np.uint8)
        else:
            qh, qs = b[:, 16:48], b[:, 48:176]
            bit = (qh.reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & np.uint8(1)
            high = bit.reshape(n, SUPER) << np.uint8(4)
        lo = (qs.reshape(n, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & np.uint8(0x0F)
        q = lo.reshape(n, SUPER) | high
        return KPlanes(q.reshape(rows, cols), sc, m, d32.reshape(rows, -1), (-dmin).reshape(rows, -1))


    def to_affine(self) -> QuantizedTensor | None:
        """Q4_K/Q5_K as MLX affine groups of 32 with float32 scales d * sc and biases -dmin * m
        (the same float32 values); None for Q6_K, whose groups of 16 MLX has no size for."""
        if self.qtype == _T.Q6_K:
            return None
        p = self.planes()
        per_super = SUPER // self.group_size
        scales = np.repeat(p.d, per_super, axis=1) * p.sc.astype(np.float32)
        biases = np.repeat(p.dmin, per_super, axis=1) * p.m.astype(np.float32)
        return QuantizedTensor(pack(p.q, self.bits), scales, biases, self.bits, self.group_size)


def kquant_from_gguf(data: np.ndarray, qtype: gguf.GGMLQuantizationType, shape: tuple[int, int]) -> KQuantTensor:
    """A 2-D GGUF tensor's raw bytes as a KQuantTensor (no copy where the bytes allow)."""
    rows, cols = shape
    return KQuantTensor(np.asarray(data, dtype=np.uint8).reshape(rows, -1), gguf.GGMLQuantizationType(qtype), cols)


def _f16(field: np.ndarray) -> np.ndarray:
    """The float16 stored in each row's two bytes, as float32."""
    return np.ascontiguousarray(field).view(np.float16)[:, 0].astype(np.float32)
