"""Choosing an array backend: MLX where it has a GPU (Metal or CUDA), NumPy otherwise.

Callers ask this package, not a backend module: `get_backend` builds one, and the NumPy backend's
weights modes (how it holds weights: float32 copies or the quantized storage) are named here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from edgeserve.backends.base import Backend
from edgeserve.backends.numpy_backend import WEIGHT_MODES, NumpyBackend, choose_weights_mode, resident_weight_bytes
from edgeserve.errors import EdgeserveError
from edgeserve.metal import mlx_gpu_available
from edgeserve.system import available_memory_bytes

if TYPE_CHECKING:
    from edgeserve.models.loader import LoadedModel

BACKENDS = ("auto", "numpy", "mlx")

__all__ = ["BACKENDS", "WEIGHT_MODES", "Backend", "get_backend", "resident_weight_bytes"]


def get_backend(name: str = "auto", weights: str = "auto", model: LoadedModel | None = None,
                threads: int | None = None, activations: str | None = None) -> Backend:
    """A backend instance; 'auto' takes MLX on a GPU and NumPy on a plain CPU (MLX's CPU GEMMs are slow).

    weights: the NumPy backend's weights mode, one of WEIGHT_MODES or "auto": see
    `choose_weights_mode` (float32 when no model is given).
    MLX keeps weights quantized whatever the mode. threads: the NumPy kernels' CPU threads (None: every core);
    activations: their activation integers, "int8" or "int16" (None: `qmatmul`'s default).
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
    if weights == "auto":
        weights = "float32" if model is None else choose_weights_mode(model, available_memory_bytes())
    return NumpyBackend(weights=weights, threads=threads, activations=activations)
