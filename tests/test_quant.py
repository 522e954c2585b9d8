"""Affine quantization against MLX itself, and GGUF block mapping against gguf's own dequantizer."""

from __future__ import annotations

import gguf
import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from edgeserve.errors import EdgeserveError, ModelLoadError
from edgeserve.quant.gguf_file import GGUFTensor, read_gguf
from edgeserve.quant.affine import (
    SUPPORTED_BITS,
    SUPPORTED_GROUP_SIZES,
    QuantizedTensor,
    dequantize,
    quantize,
)
from edgeserve.quant.gguf_blocks import gguf_tensor_to_array
from edgeserve.quant.kquants import KQuantTensor

T = gguf.GGMLQuantizationType


def _test_matrix(dtype: type, seed: int) -> np.ndarray:
    """Random rows at many magnitudes, plus the groups that stress the rounding rules."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((12, 256)) * rng.uniform(1e-3, 10, (12, 1))
    w[0] = 0.0
    w[1] = 0.37
    w[2] = -5.0
    w[3, :128] = 2.5  # constant groups beside random ones
    w[4] = 3e3 * rng.standard_normal(256)  # large, yet well inside float16's range
    w[5] = 1e-4 * rng.standard_normal(256)
    w[6] = np.where(rng.random(256) < 0.05, 1e3, 1e-3 * rng.standard_normal(256))  # outliers among tiny values
    w[7, 0::2], w[7, 1::2] = -1.0, 1.0  # both edges of equal size: the snapped grid misses one
    return w.astype(dtype)


def _assert_bitwise_equal(ours: np.ndarray, ref: np.ndarray) -> None:
    assert ours.dtype == ref.dtype and ours.shape == ref.shape
    assert np.array_equal(np.ascontiguousarray(ours).view(np.uint8), np.ascontiguousarray(ref).view(np.uint8))


def _mx_quantize(w: np.ndarray, group_size: int, bits: int) -> list[np.ndarray]:
    return [np.array(a) for a in mx.quantize(mx.array(w), group_size=group_size, bits=bits)]


def _mx_dequantize(weight, scales, biases, group_size: int, bits: int) -> np.ndarray:
    arrays = (mx.array(a) for a in (weight, scales, biases))
    return np.array(mx.dequantize(*arrays, group_size=group_size, bits=bits))


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("bits", SUPPORTED_BITS)
@pytest.mark.parametrize("group_size", SUPPORTED_GROUP_SIZES)
def test_quantize_matches_mlx_bit_for_bit(dtype, bits, group_size):
    w = _test_matrix(dtype, seed=bits * 1000 + group_size)
    ref_weight, ref_scales, ref_biases = _mx_quantize(w, group_size, bits)
    qt = quantize(w, group_size, bits)
    assert qt.shape == w.shape and (qt.bits, qt.group_size) == (bits, group_size)
    _assert_bitwise_equal(qt.weight, ref_weight)
    _assert_bitwise_equal(qt.scales, ref_scales)
    _assert_bitwise_equal(qt.biases, ref_biases)
    # MLX computes in the scales' dtype, so the float16 twin of its result is dequantize(float16)
    _assert_bitwise_equal(qt.dequantize(dtype), _mx_dequantize(ref_weight, ref_scales, ref_biases, group_size, bits))


@settings(max_examples=60, deadline=None)
@given(data=st.data(), dtype=st.sampled_from([np.float32, np.float16]), bits=st.sampled_from([4, 8]))
def test_quantize_matches_mlx_on_generated_groups(data, dtype, bits):
    width = np.dtype(dtype).itemsize * 8
    w = data.draw(hnp.arrays(dtype, (2, 64), elements=st.floats(-6e4, 6e4, width=width)))
    ref_weight, ref_scales, ref_biases = _mx_quantize(w, 32, bits)
    qt = quantize(w, 32, bits)
    _assert_bitwise_equal(qt.weight, ref_weight)
    _assert_bitwise_equal(qt.scales, ref_scales)
    _assert_bitwise_equal(qt.biases, ref_biases)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("bits", SUPPORTED_BITS)
def test_dequantize_matches_mlx_for_any_scales_and_biases(dtype, bits):
    rng = np.random.default_rng(bits)
    rows, cols, group_size = 16, 512, 64
    weight = rng.integers(0, 2**32, (rows, cols * bits // 32), dtype=np.uint32)
    scales = (rng.standard_normal((rows, cols // group_size)) * 0.37).astype(dtype)
    biases = (rng.standard_normal((rows, cols // group_size)) * 5.1).astype(dtype)
    ours = dequantize(weight, scales, biases, group_size, bits, dtype=dtype)
    _assert_bitwise_equal(ours, _mx_dequantize(weight, scales, biases, group_size, bits))


@pytest.mark.parametrize("bits", SUPPORTED_BITS)
@pytest.mark.parametrize("group_size", SUPPORTED_GROUP_SIZES)
def test_round_trip_error_within_analytic_bound(bits, group_size):
    w = _test_matrix(np.float32, seed=bits + group_size)
    qt = quantize(w, group_size, bits)
    rows, cols = w.shape
    groups = w.reshape(rows, -1, group_size)
    err = np.abs(qt.dequantize().reshape(groups.shape) - groups)
    step = np.broadcast_to(np.abs(qt.scales)[:, :, None], groups.shape)
    grid_ends = qt.biases[:, :, None], qt.biases[:, :, None] + (2**bits - 1) * qt.scales[:, :, None]
    on_grid = (groups >= np.minimum(*grid_ends)) & (groups <= np.maximum(*grid_ends))
    tol = 4 * np.finfo(np.float32).eps * np.abs(groups).max(axis=-1, keepdims=True)
    tol = np.broadcast_to(tol, groups.shape)
    # Between the grid's ends, rounding to the nearest step costs at most half a step.
    assert np.all(err[on_grid] <= step[on_grid] / 2 + tol[on_grid])
    # MLX snaps the step so the larger-magnitude edge lies exactly on the grid; the other edge
    # can then fall outside it and be clipped, by less than one step (w[7]: exactly one step).
    assert np.all(err <= step + tol)
    assert not np.all(on_grid)


def test_take_rows_permutes_rows_with_their_groups():
    qt = quantize(_test_matrix(np.float32, seed=7), 64, 4)
    order = np.random.default_rng(7).permutation(qt.shape[0])
    permuted = qt.take_rows(order)
    assert permuted.shape == qt.shape
    np.testing.assert_array_equal(permuted.dequantize(), qt.dequantize()[order])


def test_bfloat16_scales_as_stored_dequantize_like_their_float32_values():
    qt = quantize(_test_matrix(np.float32, seed=3), 32, 4)
    # bfloat16 keeps a float32's top 16 bits; truncating gives values bfloat16 holds exactly
    scales_bits, biases_bits = (a.view(np.uint32) >> 16 for a in (qt.scales, qt.biases))
    as_bf16 = QuantizedTensor(qt.weight, scales_bits.astype(np.uint16), biases_bits.astype(np.uint16), 4, 32)
    scales32, biases32 = ((b << 16).view(np.float32) for b in (scales_bits, biases_bits))
    np.testing.assert_array_equal(as_bf16.dequantize(), _mx_dequantize(qt.weight, scales32, biases32, 32, 4))


def test_bad_parameters_and_shapes_raise_clear_errors():
    w = np.ones((4, 64), dtype=np.float32)
    with pytest.raises(EdgeserveError, match="unsupported quantization width: 7 bits"):
        quantize(w, 32, 7)
    with pytest.raises(EdgeserveError, match="unsupported quantization group size: 48"):
        quantize(w, 48, 4)
    with pytest.raises(EdgeserveError, match="columns divisible by 128"):
        quantize(w, 128, 4)
    qt = quantize(w, 32, 4)
    with pytest.raises(ModelLoadError, match="needs scales and biases of shape"):
        QuantizedTensor(qt.weight, qt.scales[:, :1], qt.biases, 4, 32)
    with pytest.raises(ModelLoadError, match="does not hold whole groups of 32 values at 3 bits"):
        QuantizedTensor(qt.weight[:, :7], qt.scales, qt.biases, 3, 32)


# --- GGUF blocks ---------------------------------------------------------------------------


def _gguf_tensor(qtype: T, values: np.ndarray) -> GGUFTensor:
    return GGUFTensor("test.weight", qtype, values.shape, gguf.quants.quantize(values, qtype))


def _gguf_reference(t: GGUFTensor) -> np.ndarray:
    return gguf.quants.dequantize(np.asarray(t.data), t.qtype).reshape(t.shape)


def _random_weights(shape: tuple[int, int], seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape) * rng.uniform(1e-3, 3, (shape[0], 1))).astype(np.float32)


def _assert_maps_exactly(t: GGUFTensor, bits: int) -> QuantizedTensor:
    qt = gguf_tensor_to_array(t)
    assert isinstance(qt, QuantizedTensor)
    assert (qt.shape, qt.bits, qt.group_size) == (t.shape, bits, 32)
    ref = _gguf_reference(t)
    # d*q, 8d and 128d are exact in float32 and d*(q - 8) is exactly d*q + (-8d), so one
    # float32 rounding (Q4_1's + m) happens on both sides in the same place: equal, not close.
    np.testing.assert_array_equal(qt.dequantize(), ref)
    # MLX reading the same packed words (float32 scales, so it too computes in float32)
    # checks the nibble layout independently of our own unpacking.
    mlx_values = _mx_dequantize(qt.weight, qt.scales.astype(np.float32), qt.biases.astype(np.float32), 32, bits)
    np.testing.assert_array_equal(mlx_values, ref)
    return qt


@pytest.mark.parametrize("qtype, bits", [(T.Q4_0, 4), (T.Q4_1, 4), (T.Q5_0, 8), (T.Q5_1, 8), (T.Q8_0, 8)])
def test_gguf_block_types_map_onto_affine_groups_exactly(qtype, bits):
    qt = _assert_maps_exactly(_gguf_tensor(qtype, _random_weights((48, 320), seed=bits)), bits)
    assert qt.scales.dtype == qt.biases.dtype == np.float16


@pytest.mark.parametrize("qtype, bits", [(T.Q4_0, 4), (T.Q5_0, 8), (T.Q8_0, 8)])
def test_scales_widen_to_float32_when_the_bias_overflows_float16(qtype, bits):
    values = _random_weights((4, 64), seed=1)
    values[0, :32] *= 2e5 / np.abs(values[0, :32]).max()  # d fits float16; -8d and -128d do not
    qt = _assert_maps_exactly(_gguf_tensor(qtype, values), bits)
    assert qt.scales.dtype == qt.biases.dtype == np.float32


@pytest.mark.parametrize("qtype", [T.F32, T.F16, T.BF16])
@pytest.mark.parametrize("shape", [(576,), (6, 40)])
def test_gguf_float_types_come_back_as_float32(qtype, shape):
    t = _gguf_tensor(qtype, np.random.default_rng(0).standard_normal(shape).astype(np.float32))
    out = gguf_tensor_to_array(t)
    assert isinstance(out, np.ndarray) and out.dtype == np.float32 and out.shape == shape
    np.testing.assert_array_equal(out, _gguf_reference(t))


def test_gguf_block_types_of_a_vector_come_back_as_float32():
    t = _gguf_tensor(T.Q5_0, _random_weights((1, 128), seed=5)[0])
    out = gguf_tensor_to_array(t)
    assert isinstance(out, np.ndarray) and out.dtype == np.float32
    np.testing.assert_array_equal(out, _gguf_reference(t))


def test_gguf_q4_k_stays_as_blocks():
    # gguf has no Q4_K quantizer, so build blocks by hand: valid float16 d and dmin up front,
    # random 6-bit sub-scales and 4-bit values after them
    rows, cols = 4, 512
    block_size, type_size = gguf.GGML_QUANT_SIZES[T.Q4_K]
    rng = np.random.default_rng(4)
    blocks = rng.integers(0, 256, (rows, cols // block_size, type_size), dtype=np.uint8)
    blocks[:, :, 0:4] = (rng.standard_normal((rows, cols // block_size, 2)) * 0.01).astype(np.float16).view(np.uint8)
    t = GGUFTensor("test.weight", T.Q4_K, (rows, cols), blocks.reshape(rows, -1))
    out = gguf_tensor_to_array(t)
    assert isinstance(out, KQuantTensor) and out.shape == (rows, cols) and out.nbytes == blocks.nbytes
    np.testing.assert_array_equal(out.dequantize(np.float32), _gguf_reference(t))


def test_gguf_1d_q4_k_comes_back_as_float32():
    block_size, type_size = gguf.GGML_QUANT_SIZES[T.Q4_K]
    t = GGUFTensor("test.norm", T.Q4_K, (block_size,), np.zeros(type_size, dtype=np.uint8))
    out = gguf_tensor_to_array(t)
    assert isinstance(out, np.ndarray) and out.dtype == np.float32 and out.shape == (block_size,)


def test_unsupported_gguf_type_names_tensor_and_type():
    t = GGUFTensor("blk.0.odd.weight", T.I32, (4, 8), np.zeros((4, 8), dtype=np.int32))
    with pytest.raises(ModelLoadError, match=r"tensor 'blk\.0\.odd\.weight': unsupported tensor type I32"):
        gguf_tensor_to_array(t)


@pytest.fixture(scope="module")
def real_gguf(model_path):
    return read_gguf(model_path)


def test_real_q4_1_tensor_maps_exactly_and_permutes(real_gguf):
    t = real_gguf.tensors["blk.0.attn_q.weight"]
    assert t.qtype == T.Q4_1
    qt = _assert_maps_exactly(t, 4)
    order = np.random.default_rng(0).permutation(t.shape[0])
    np.testing.assert_array_equal(qt.take_rows(order).dequantize(), _gguf_reference(t)[order])


def test_whole_real_model_maps_exactly(real_gguf):
    quantized = 0
    for name, t in real_gguf.tensors.items():
        out = gguf_tensor_to_array(t)
        if isinstance(out, QuantizedTensor):
            quantized += 1
            out = out.dequantize()
        np.testing.assert_array_equal(out, _gguf_reference(t), err_msg=name)
    assert quantized == sum(t.qtype in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0) for t in real_gguf.tensors.values()) > 0
