"""Which paged-attention implementation the MLX backend runs: a custom kernel where MLX has a GPU
it covers (Metal, CUDA), the plain-MLX reference otherwise, or the reference when forced.

MLX is imported only when a path is chosen, so NumPy-only installs can still ask which path
is active.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable

from edgeserve.errors import EdgeserveError

ENV_VAR = "EDGESERVE_ATTENTION"
CHOICES = ("auto", "reference")


@dataclass(frozen=True)
class AttentionPath:
    """An implementation of the backend's paged-attention op: per-step preparation, then one call per layer."""

    name: str  # "metal-kernel", "cuda-kernel" or "mlx-reference"
    prepare: Callable[[Any], Any]  # Batch -> the path's per-step arrays
    run: Callable[..., Any]  # (q, k_cache, v_cache, prepared, window) -> output [T, n_heads, head_dim]


def mlx_gpu_available() -> bool:
    """Whether MLX is installed and sees a Metal or CUDA GPU."""
    try:
        import mlx.core as mx
    except ImportError:
        return False
    return mx.metal.is_available() or (hasattr(mx, "cuda") and mx.cuda.is_available())


def kernel_platform() -> str | None:
    """'metal' or 'cuda' when MLX computes on such a GPU; None on the CPU."""
    import mlx.core as mx

    if mx.default_device().type != mx.DeviceType.gpu:
        return None
    if mx.metal.is_available():
        return "metal"
    if hasattr(mx, "cuda") and mx.cuda.is_available():
        return "cuda"
    return None


def reference_forced() -> bool:
    """Whether EDGESERVE_ATTENTION=reference asks for the plain-MLX path."""
    value = os.environ.get(ENV_VAR, "").strip().lower() or "auto"
    if value not in CHOICES:
        raise EdgeserveError(f"{ENV_VAR} must be one of {', '.join(CHOICES)}, got {value!r}")
    return value == "reference"


def select_attention() -> AttentionPath:
    """The paged-attention path for this process's MLX device."""
    from edgeserve.metal.kernels import prepare_kernel
    from edgeserve.metal.reference import prepare_reference, reference_paged_attention

    platform = None if reference_forced() else kernel_platform()
    if platform is None:
        return AttentionPath("mlx-reference", prepare_reference, reference_paged_attention)
    return AttentionPath(f"{platform}-kernel", prepare_kernel, partial(_kernel_or_windowed_reference, platform=platform))


def _kernel_or_windowed_reference(q: Any, k_cache: Any, v_cache: Any, meta: Any, window: int | None = None, *,
                                  platform: str) -> Any:
    """The custom kernel; the reference where a sliding window hides keys from some row (the kernels
    have no window), which on a step whose sequences all fit in the window is never."""
    from edgeserve.metal.kernels import kernel_paged_attention
    from edgeserve.metal.reference import prepare_reference, reference_paged_attention

    if window is not None and window < meta.max_len:
        if meta.fallback is None:
            meta.fallback = prepare_reference(meta.batch)
        return reference_paged_attention(q, k_cache, v_cache, meta.fallback, window)
    return kernel_paged_attention(q, k_cache, v_cache, meta, platform)


def active_attention_path(backend: str = "auto") -> str:
    """The attention path a backend ('auto', 'numpy' or 'mlx') runs here: 'numpy', 'mlx-reference',
    'metal-kernel' or 'cuda-kernel'."""
    if backend == "numpy" or (backend == "auto" and not mlx_gpu_available()):
        return "numpy"
    platform = None if reference_forced() else kernel_platform()
    return "mlx-reference" if platform is None else f"{platform}-kernel"
