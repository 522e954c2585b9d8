"""Choosing an array backend: MLX where it has a GPU (Metal or CUDA), NumPy otherwise."""

from __future__ import annotations

from typing import Any

from edgeserve.errors import EdgeserveError

BACKENDS = ("auto", "numpy", "mlx")


def mlx_gpu_available() -> bool:
    try:
        import mlx.core as mx
    except ImportError:
        return False
    return mx.metal.is_available() or (hasattr(mx, "cuda") and mx.cuda.is_available())


def get_backend(name: str = "auto", weights: str = "float32") -> Any:
    """A backend instance; 'auto' takes MLX on a GPU and NumPy on a plain CPU (MLX's CPU GEMMs are slow).

    weights: the NumPy backend's weights mode ("float32" or "quantized"); MLX keeps weights quantized.
    """
    if name not in BACKENDS:
        raise EdgeserveError(f"unknown backend {name!r} (choose from {', '.join(BACKENDS)})")
    if name == "auto":
        name = "mlx" if mlx_gpu_available() else "numpy"
    if name == "mlx":
        try:
            from edgeserve.backends.mlx_backend import MLXBackend
        except ImportError as exc:
            raise EdgeserveError(f"the mlx backend needs MLX: pip install 'edgeserve[mlx]' ({exc})") from exc
        return MLXBackend()
    from edgeserve.backends.numpy_backend import NumpyBackend

    return NumpyBackend(weights=weights)
