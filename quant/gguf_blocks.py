"""GGUF tensors as NumPy: float types as float32 arrays, Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 as exact affine
groups, K-quants as their blocks.

Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 blocks are 32 values sharing one float16 scale, which is an MLX
affine group of 32 with no requantization:

    Q4_1  x = d * q + m          ->  4 bits, scale d, bias m
    Q4_0  x = d * (q - 8)        ->  4 bits, scale d, bias -8d
    Q5_1  x = d * q + m          ->  8 bits holding q < 32, scale d, bias m
    Q5_0  x = d * (q - 16)       ->  8 bits holding q < 32, scale d, bias -16d
    Q8_0  x = d * q (q signed)   ->  8 bits, q + 128, scale d, bias -128d

(The 5-bit types widen to 8 bits: the CPU kernels compute from 4- and 8-bit groups, and llama.cpp
writes Q5_0 for the matrices of widths K-quants do not divide, as in Gemma 3 270M.)

A Q4_0 or Q8_0 matrix can also stay as its blocks (SymmetricBlocks): the CPU kernels repack those
straight into their panels, the affine form never built. 2-D Q4_K/Q5_K/Q6_K tensors stay as their
blocks (a KQuantTensor, see quant/kquants.py). Every other type GGUF's own library can dequantize
(1-D K-quants, ...) comes back as float32; whether to requantize it is the caller's choice.
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import numpy as np

from edgeserve.errors import ModelLoadError
from edgeserve.quant.affine import QuantizedTensor
from edgeserve.quant.gguf_file import GGUFTensor
from edgeserve.quant.kquants import KQUANT_TYPES, KQuantTensor, kquant_from_gguf

_T = gguf.GGMLQuantizationType
_BLOCK = 32  # values per Q4_0/Q4_1/Q8_0 block, and so the affine group size
_CENTERS = {_T.Q4_0: 8, _T.Q8_0: 128}  # q - center is the signed value (Q8_0's q stored + 128)


@dataclass
class SymmetricBlocks:
    """A 2-D Q4_0 or Q8_0 matrix as the file's blocks: a float16 scale d and 32 integers each, w = d * (q - center)."""

    blocks: np.ndarray  # uint8 [rows, cols / 32 * block bytes]
    qtype: gguf.GGMLQuantizationType
    cols: int
    group_size = _BLOCK

    @property
    def shape(self) -> tuple[int, int]:
        """(rows, cols) of the matrix this tensor stands for."""
        return self.blocks.shape[0], self.cols

    @property
    def bits(self) -> int:
        """Bits of each stored integer (Q8_0's signed bytes become q + 128)."""
        return 4 if self.qtype == _T.Q4_0 else 8

    @property
    def center(self) -> int:
        return _CENTERS[self.qtype]

    def scales(self) -> np.ndarray:
        """Each block's d, float16 [rows, cols / 32]."""
        return _f16_field(self._block_rows(), 0).reshape(self.shape[0], -1)

    def to_affine(self) -> QuantizedTensor:
        """The same values as MLX affine groups of 32."""
        return _AFFINE_MAPPERS[self.qtype](self._block_rows(), self.shape)

    def take_rows(self, index: np.ndarray) -> SymmetricBlocks:
        """A new matrix made of the given rows, in that order."""
        return SymmetricBlocks(np.ascontiguousarray(self.blocks[np.asarray(index)]), self.qtype, self.cols)

    def _block_rows(self) -> np.ndarray:
        return self.blocks.reshape(-1, gguf.GGML_QUANT_SIZES[self.qtype][1])


def symmetric_blocks(t: GGUFTensor) -> SymmetricBlocks:
    """A 2-D Q4_0 or Q8_0 tensor's blocks, not copied."""
    rows, cols = t.shape
    return SymmetricBlocks(np.asarray(t.data, dtype=np.uint8).reshape(rows, -1), _T(t.qtype), cols)


def gguf_tensor_to_array(t: GGUFTensor) -> np.ndarray | QuantizedTensor | KQuantTensor:
    """The tensor's values: a float32 array of shape `t.shape`, a QuantizedTensor for 2-D
    Q4_0/Q4_1/Q8_0 tensors or a KQuantTensor for 2-D K-quant ones (the same values exactly)."""
    if t.qtype == _T.F32:
        return np.array(t.data, dtype=np.float32).reshape(t.shape)
    if len(t.shape) == 2 and t.qtype in _AFFINE_MAPPERS:
        blocks = np.asarray(t.data, dtype=np.uint8).reshape(-1, gguf.GGML_QUANT_SIZES[t.qtype][1])
        return _AFFINE_MAPPERS[t.qtype](blocks, t.shape)
    if len(t.shape) == 2 and t.qtype in KQUANT_TYPES:
        return kquant_from_gguf(t.data, t.qtype, t.shape)
    try:
        values = gguf.quants.dequantize(np.asarray(t.data), t.qtype)
    except NotImplementedError:
        raise ModelLoadError(f"tensor {t.name!r}: unsupported tensor type {t.qtype.name}") from None
    return values.astype(np.float32, copy=False).reshape(t.shape)


def _q4_0(blocks: np.ndarray, shape: tuple[int, int]) -> QuantizedTensor:
    d = _f16_field(blocks, 0)
    return _affine(_ggml_nibbles_to_mlx(blocks[:, 2:]), 4, shape, d, np.float32(-8) * d.astype(np.float32))


def _q4_1(blocks: np.ndarray, shape: tuple[int, int]) -> QuantizedTensor:
    d, m = _f16_field(blocks, 0), _f16_field(blocks, 2)
    return _affine(_ggml_nibbles_to_mlx(blocks[:, 4:]), 4, shape, d, m.astype(np.float32))


def _q8_0(blocks: np.ndarray, shape: tuple[int, int]) -> QuantizedTensor:
    d = _f16_field(blocks, 0)
    unsigned = blocks[:, 2:] ^ np.uint8(0x80)  # int8 q -> q + 128, bit for bit
    return _affine(unsigned, 8, shape, d, np.float32(-128) * d.astype(np.float32))


def _q5_0(blocks: np.ndarray, shape: tuple[int, int]) -> QuantizedTensor:
    d = _f16_field(blocks, 0)
    return _affine(_ggml_q5_values(blocks[:, 2:6], blocks[:, 6:]), 8, shape, d, np.float32(-16) * d.astype(np.float32))


def _q5_1(blocks: np.ndarray, shape: tuple[int, int]) -> QuantizedTensor:
    d, m = _f16_field(blocks, 0), _f16_field(blocks, 2)
    return _affine(_ggml_q5_values(blocks[:, 4:8], blocks[:, 8:]), 8, shape, d, m.astype(np.float32))


_AFFINE_MAPPERS = {_T.Q4_0: _q4_0, _T.Q4_1: _q4_1, _T.Q5_0: _q5_0, _T.Q5_1: _q5_1, _T.Q8_0: _q8_0}


def _affine(
    packed_bytes: np.ndarray, bits: int, shape: tuple[int, int], d: np.ndarray, bias: np.ndarray
) -> QuantizedTensor:
    """An affine tensor with scales d and the given float32 biases.

    Scales and biases stay float16 when every bias is exactly a float16 (always for Q4_1's m;
    for -8d and -128d unless they overflow float16's range); otherwise both go float32.
    """
    rows, cols = shape
    weight = np.ascontiguousarray(packed_bytes).reshape(rows, cols * bits // 8).view(np.uint32)
    with np.errstate(over="ignore"):  # an overflow is what the check below looks for
        bias16 = bias.astype(np.float16)
    if np.array_equal(bias16.astype(np.float32), bias, equal_nan=True):
        scales, biases = d, bias16
    else:
        scales, biases = d.astype(np.float32), bias
    return QuantizedTensor(weight, scales.reshape(rows, -1), biases.reshape(rows, -1), bits, _BLOCK)


def _f16_field(blocks: np.ndarray, offset: int) -> np.ndarray:
    """The float16 stored at byte `offset` of every block."""
    return np.ascontiguousarray(blocks[:, offset : offset + 2]).view(np.float16)[:, 0]


def _ggml_nibbles_to_mlx(qs: np.ndarray) -> np.ndarray:
    """Reorder 4-bit blocks from GGML's layout to MLX's.

    GGML puts element i (i < 16) in the low nibble of byte i and element i + 16 in its high
    nibble; MLX puts elements 2k and 2k + 1 in the low and high nibbles of byte k.
    """
    even, odd = qs[:, 0::2], qs[:, 1::2]
    out = np.empty(qs.shape, dtype=np.uint8)
    out[:, :8] = (even & 0x0F) | (odd << 4)
    out[:, 8:] = (even >> 4) | (odd & 0xF0)
    return out


def _ggml_q5_values(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """The 32 values (0..31) of each 5-bit block, one per byte, in order.

    GGML keeps the low nibbles as Q4_0 does (element i < 16 low in byte i, i + 16 high) and the
    fifth bits in a little-endian uint32, bit i for element i.
    """
    high = np.unpackbits(np.ascontiguousarray(qh), axis=1, bitorder="little")  # [blocks, 32], bit i = element i
    low = np.concatenate([qs & 0x0F, qs >> 4], axis=1)
    return low | (high << 4)
