"""MLX affine group quantization in NumPy, bit for bit the same as `mlx.core.quantize`/`dequantize`.

A row of `cols` values is cut into groups of `group_size`; each group stores one scale and one
bias, and every value becomes an unsigned `bits`-bit integer q with w ≈ scale * q + bias.
The integers of a row are packed as one little-endian bit stream into uint32 words: element j
occupies bits [j * bits, (j + 1) * bits) of the row (the layout of mlx-lm and mlx-community
folders).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike, DTypeLike

from edgeserve.errors import EdgeserveError, ModelLoadError

SUPPORTED_BITS = (2, 3, 4, 5, 6, 8)
SUPPORTED_GROUP_SIZES = (32, 64, 128)

# MLX's lower bound on a group's scale, so a constant group does not divide by zero.
_MIN_SCALE = np.float32(1e-7)

# 8 elements of any width fill exactly `bits` whole bytes, so the bit stream is cut into such
# chunks. Every platform MLX runs on is little-endian, so viewing uint32 words as bytes (and
# back) keeps the stream's order without a byte swap.
_ELEMENTS_PER_CHUNK = 8


@dataclass
class QuantizedTensor:
    """A [rows, cols] matrix stored as affine groups: w = scales * q + biases, group by group.

    `scales` and `biases` are float16 or float32, or bfloat16 kept as its raw uint16 bit
    patterns (NumPy has no bfloat16 type), as mlx-community folders often store them.
    """

    weight: np.ndarray  # uint32 [rows, cols * bits // 32]
    scales: np.ndarray  # [rows, cols // group_size]
    biases: np.ndarray  # same shape and dtype as scales
    bits: int
    group_size: int

    def __post_init__(self) -> None:
        _check_params(self.bits, self.group_size)
        if self.weight.dtype != np.uint32 or self.weight.ndim != 2:
            raise ModelLoadError(
                f"quantized weight must be a 2-D uint32 array, got {self.weight.dtype} {self.weight.shape}"
            )
        if self.scales.dtype not in (np.float16, np.float32, np.uint16):
            raise ModelLoadError(f"quantization scales must be float16, float32 or bfloat16, got {self.scales.dtype}")
        rows, cols = self.shape
        if self.weight.shape[1] * 32 != cols * self.bits or cols % self.group_size:
            raise ModelLoadError(
                f"quantized weight {self.weight.shape} does not hold whole groups of {self.group_size} "
                f"values at {self.bits} bits"
            )
        expected = (rows, cols // self.group_size)
        if self.scales.shape != expected or self.biases.shape != expected or self.biases.dtype != self.scales.dtype:
            raise ModelLoadError(
                f"quantized weight {self.weight.shape} at {self.bits} bits, group size {self.group_size} needs "
                f"scales and biases of shape {expected} and one dtype, got scales {self.scales.dtype} "
                f"{self.scales.shape} and biases {self.biases.dtype} {self.biases.shape}"
            )

    @property
    def shape(self) -> tuple[int, int]:
        """(rows, cols) of the matrix this tensor stands for."""
        rows, words = self.weight.shape
        return rows, words * 32 // self.bits

    def dequantize(self, dtype: DTypeLike = np.float32) -> np.ndarray:
        """The float matrix, computed as `scales * q + biases` with one rounding per operation.

        The arithmetic runs in float16 only when the scales are float16 and float16 is asked
        for, exactly as MLX does; otherwise it runs in float32 on the exactly widened scales
        and biases, which for float16 scales is also exactly what gguf's dequantizer computes.
        """
        dtype = np.dtype(dtype)
        if self.scales.dtype == np.float16 and dtype == np.float16:
            compute = np.dtype(np.float16)
            scales, biases = self.scales, self.biases
        else:
            compute = np.dtype(np.float32)
            scales, biases = _as_float32(self.scales), _as_float32(self.biases)
        rows, cols = self.shape
        groups = cols // self.group_size
        q = unpack(self.weight, self.bits).reshape(rows, groups, self.group_size)
        out = np.multiply(q, scales[:, :, None], dtype=compute)
        out += biases[:, :, None]
        return out.reshape(rows, cols).astype(dtype, copy=False)

    def take_rows(self, index: ArrayLike) -> QuantizedTensor:
        """A new tensor made of the given rows (in that order), with their scales and biases."""
        index = np.asarray(index)
        return QuantizedTensor(
            np.ascontiguousarray(self.weight[index]),
            np.ascontiguousarray(self.scales[index]),
            np.ascontiguousarray(self.biases[index]),
            self.bits,
            self.group_size,
        )


def quantize(w: np.ndarray, group_size: int = 64, bits: int = 4) -> QuantizedTensor:
    """Quantize a [rows, cols] float matrix exactly as `mlx.core.quantize(w, group_size, bits)`.

    Scales and biases take the input's dtype (float16 stays float16, anything else is float32).
    """
    _check_params(bits, group_size)
    w = np.asarray(w)
    if w.ndim != 2 or w.shape[1] % group_size:
        raise EdgeserveError(
            f"cannot quantize an array of shape {w.shape}: it must be 2-D with columns divisible by {group_size}"
        )
    out_dtype = np.float16 if w.dtype == np.float16 else np.float32
    rows, cols = w.shape
    # MLX reads every element as float32 and does all its arithmetic in float32.
    g = w.astype(np.float32).reshape(rows, cols // group_size, group_size)
    n_bins = np.float32((1 << bits) - 1)
    w_max = g.max(axis=-1)
    w_min = g.min(axis=-1)
    # Anchor the group on its edge of larger magnitude and snap the scale so that edge is hit
    # exactly by an integer: the edge becomes the bias (unless it rounds to zero).
    min_is_edge = np.abs(w_min) > np.abs(w_max)
    scale = np.maximum((w_max - w_min) / n_bins, _MIN_SCALE)
    scale = np.where(min_is_edge, scale, -scale)
    edge = np.where(min_is_edge, w_min, w_max)
    q0 = np.rint(edge / scale)
    snapped = q0 != 0
    scale = np.where(snapped, edge / np.where(snapped, q0, np.float32(1)), scale)
    bias = np.where(snapped, edge, np.float32(0))
    q = np.rint((g - bias[:, :, None]) / scale[:, :, None])
    q = np.clip(q, 0, n_bins).astype(np.uint8).reshape(rows, cols)
    return QuantizedTensor(pack(q, bits), scale.astype(out_dtype), bias.astype(out_dtype), bits, group_size)


def dequantize(
    weight: np.ndarray,
    scales: np.ndarray,
    biases: np.ndarray,
    group_size: int = 64,
    bits: int = 4,
    dtype: DTypeLike = np.float32,
) -> np.ndarray:
    """Dequantize MLX-layout arrays; see QuantizedTensor.dequantize for the arithmetic."""
    return QuantizedTensor(weight, scales, biases, bits, group_size).dequantize(dtype)


def pack(q: np.ndarray, bits: int) -> np.ndarray:
    """Pack unsigned integers [rows, cols] (each below 2**bits) into MLX's uint32 words."""
    rows, cols = q.shape
    if bits == 8:
        return np.ascontiguousarray(q, dtype=np.uint8).view(np.uint32)
    chunks = q.reshape(rows, cols // _ELEMENTS_PER_CHUNK, _ELEMENTS_PER_CHUNK).astype(np.uint64)
    shifts = np.arange(_ELEMENTS_PER_CHUNK, dtype=np.uint64) * np.uint64(bits)
    stream = np.bitwise_or.reduce(chunks << shifts, axis=-1)
    packed = stream[:, :, None].view(np.uint8)[:, :, :bits]
    return np.ascontiguousarray(packed).reshape(rows, cols * bits // 8).view(np.uint32)


def unpack(weight: np.ndarray, bits: int) -> np.ndarray:
    """Unpack MLX's uint32 words [rows, words] into uint8 integers [rows, words * 32 // bits]."""
    raw = np.ascontiguousarray(weight).view(np.uint8)
    rows, n_bytes = raw.shape
    if bits == 8:
        return raw
    if bits == 4:  # the load path: two nibbles per byte, low one first
        q = np.empty((rows, n_bytes * 2), dtype=np.uint8)
        np.bitwise_and(raw, 0x0F, out=q[:, 0::2])
        np.right_shift(raw, 4, out=q[:, 1::2])
        return q
    chunks = np.zeros((rows, n_bytes // bits, 8), dtype=np.uint8)
    chunks[:, :, :bits] = raw.reshape(rows, -1, bits)
    stream = chunks.view(np.uint64)  # [rows, n_chunks, 1]
    shifts = np.arange(_ELEMENTS_PER_CHUNK, dtype=np.uint64) * np.uint64(bits)
    q = (stream >> shifts) & np.uint64((1 << bits) - 1)
    return q.astype(np.uint8).reshape(rows, -1)


def _as_float32(a: np.ndarray) -> np.ndarray:
    if a.dtype == np.uint16:  # bfloat16 bits are the top half of a float32
        return (a.astype(np.uint32) << 16).view(np.float32)
    return a.astype(np.float32, copy=False)


def _check_params(bits: int, group_size: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise EdgeserveError(f"unsupported quantization width: {bits} bits (supported: {SUPPORTED_BITS})")
    if group_size not in SUPPORTED_GROUP_SIZES:
        raise EdgeserveError(f"unsupported quantization group size: {group_size} (supported: {SUPPORTED_GROUP_SIZES})")
