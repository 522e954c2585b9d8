"""The KV pool element types: float32, float16, and int8 with a scale per token, KV head and 64 dims.

A pool is [blocks, block_size, n_kv_heads, head] per layer. float32 and float16 heads are head_dim
values; an int8 head is head_dim int8 values followed by the float16 scales s = max|x| / 127 of each
group of `int8_kv_group` of them (values x / s rounded to nearest even), so a block carries its own
scales and whatever moves blocks (copy-on-write, prefix caching, preemption) moves them too. The C
kernels (_cpu_ops.c) and the MLX backend (its write, its reference attention and the Metal and CUDA
kernels) read and write the same layout to the same bits; these functions are its NumPy reference,
used where the C kernels do not run.
"""

from __future__ import annotations

import numpy as np

from edgeserve.backends.pages import aligned_zeros

_DTYPES = {"float32": np.float32, "float16": np.float16, "int8": np.int8}


def int8_kv_group(head_dim: int) -> int:
    """Values of an int8 KV head that share one scale: 64, or the whole head where 64 does not divide it."""
    return 64 if head_dim % 64 == 0 else head_dim


def kv_head_bytes(kv_dtype: str, head_dim: int) -> int:
    """Bytes of one KV head in the pool: int8 keeps a float16 scale per int8_kv_group values beside them."""
    int8 = head_dim + 2 * (head_dim // int8_kv_group(head_dim))
    return {"float32": 4 * head_dim, "float16": 2 * head_dim, "int8": int8}[kv_dtype]



def allocate(kv_dtype: str, num_blocks: int, block_size: int, n_kv_heads: int, head_dim: int) -> np.ndarray:
    """A zeroed pool of one layer's K or V."""
    width = kv_head_bytes(kv_dtype, head_dim) // np.dtype(_DTYPES[kv_dtype]).itemsize
    # float16 and float32 heads of 64 or 128 values then lie in whole cache lines (16 bytes in, each spanned one more)
    return aligned_zeros((num_blocks, block_size, n_kv_heads, width), _DTYPES[kv_dtype])


def store(values: np.ndarray, kv_dtype: str) -> np.ndarray:
    """float32 heads [..., head_dim] as the pool's heads."""
    values = np.asarray(values, np.float32)
    if kv_dtype != "int8":
        return values.astype(_DTYPES[kv_dtype])
    head_dim = values.shape[-1]
    groups = values.reshape(*values.shape[:-1], -1, int8_kv_group(head_dim))
    scale = (np.abs(groups).max(axis=-1, keepdims=True) / np.float32(127)).astype(np.float16)
    wide = scale.astype(np.float32)
    inv = np.divide(np.float32(1), wide, out=np.zeros_like(wide), where=wide > 0)
    q = np.clip(np.rint(groups * inv), -127, 127).astype(np.int8).reshape(values.shape)
    return np.concatenate([q, scale[..., 0].view(np.int8)], axis=-1)


def load(heads: np.ndarray, head_dim: int) -> np.ndarray:
    """The pool's heads [..., head] as float32 [..., head_dim]."""
    if heads.dtype != np.int8:
        return heads.astype(np.float32)
    scale = np.ascontiguousarray(heads[..., head_dim:]).view(np.float16).astype(np.float32)
    groups = heads[..., :head_dim].astype(np.float32).reshape(*heads.shape[:-1], -1, int8_kv_group(head_dim))
    return (groups * scale[..., None]).reshape(*heads.shape[:-1], head_dim)
