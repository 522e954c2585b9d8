"""Which attention shapes the custom paged-attention kernels can launch; the others take the
plain-MLX reference. Kept free of MLX so that `edgeserve info` can say so anywhere."""

from __future__ import annotations

THREADS = 128  # 4 SIMD groups / warps per threadgroup, as the sources assume
# A lane group of HEAD_DIM / 8 lanes (8 elements each) must tile a 32-lane SIMD group.
SUPPORTED_HEAD_DIMS = (64, 128, 256)
# Apple GPUs give a threadgroup 32 KB; CUDA's static shared memory (48 KB) is larger.
MAX_THREADGROUP_MEMORY = 32 * 1024


def threadgroup_memory(group: int, head_dim: int) -> int:
    """Bytes of threadgroup memory pass 1 declares: per SIMD group, GROUP float outputs of
    HEAD_DIM plus GROUP running maxima and sums."""
    warps = THREADS // 32
    return 4 * warps * group * head_dim + 2 * 4 * warps * group


def unsupported_reason(head_dim: int, n_heads: int, n_kv: int) -> str | None:
    """Why the kernels cannot run this attention shape, or None when they can."""
    if head_dim not in SUPPORTED_HEAD_DIMS:
        return f"head dim {head_dim} is not one of {', '.join(map(str, SUPPORTED_HEAD_DIMS))}"
    if n_heads % n_kv:
        return f"{n_heads} query heads do not divide into {n_kv} KV heads"
    group = n_heads // n_kv
    if (need := threadgroup_memory(group, head_dim)) > MAX_THREADGROUP_MEMORY:
        return (f"{group} query heads per KV head x head dim {head_dim} need {need:,} bytes of threadgroup "
                f"memory, over {MAX_THREADGROUP_MEMORY:,}")
    return None


def kernel_supports(head_dim: int, n_heads: int, n_kv: int) -> bool:
    """Whether the kernels' thread layout and threadgroup memory fit this attention shape."""
    return unsupported_reason(head_dim, n_heads, n_kv) is None


def describe_attention(path: str, head_dim: int, n_heads: int, n_kv: int) -> str:
    """The attention path for a model of this shape, as `edgeserve info` says it: a kernel path
    becomes the reference where the kernels cannot run the shape."""
    reason = unsupported_reason(head_dim, n_heads, n_kv)
    if path.endswith("-kernel"):
        return path if reason is None else f"mlx-reference ({path} does not fit: {reason})"
    return f"{path} (GPU kernels: {'fit this model' if reason is None else 'reference path, ' + reason})"
