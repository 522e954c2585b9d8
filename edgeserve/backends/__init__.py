"""Choosing an array backend: MLX where it has a GPU (Metal or CUDA), NumPy otherwise.

Callers ask this package, not a backend module: `get_backend` builds one, and the NumPy backend's
weights modes (how it holds weights: float32 copies or the quantized storage) are named here.
The backend modules import NumPy (and MLX): they load when a backend is built or one of their
names is first asked for, so reading the choices (a command's --help) stays instant.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from edgeserve.errors import EdgeserveError
from edgeserve.metal import mlx_gpu_available
from edgeserve.system import available_memory_bytes

if TYPE_CHECKING:
    from edgeserve.backends.base import Backend
    from edgeserve.backends.numpy_backend import resident_weight_bytes

BACKENDS = ("auto", "numpy", "mlx")
# the KV pool's element types ("auto": the backend's best, see get_backend)
KV_DTYPES = ("float32", "float16", "int8")
# the NumPy backend's KV pool under "auto", by weights mode: the float32 reference keeps float32 K/V; quantized weights
# take float16 (half the memory, and decode reads half as much: 1.24x faster after 2,048 tokens of a 1B model, with
# perplexity unchanged)
CPU_KV_DTYPES = {"float32": "float32", "quantized": "float16"}
WEIGHT_MODES = ("float32", "quantized")
# the integers the quantized CPU kernels turn activations into (see qmatmul for what each costs)
ACTIVATION_MODES = ("int8", "int16")
DEFAULT_ACTIVATIONS = "int8"

__all__ = ["ACTIVATION_MODES", "BACKENDS", "DEFAULT_ACTIVATIONS", "KV_DTYPES", "WEIGHT_MODES",
           "Backend", "get_backend", "resident_weight_bytes"]

# names this package hands out from a backend module, loaded on first use
_LAZY = {"Backend": "edgeserve.backends.base", "resident_weight_bytes": "edgeserve.backends.numpy_backend"}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class HasWeights(Protocol):
    """What `get_backend` reads of a model (a `models.loader.LoadedModel`): its tensors by name."""

    @property
    def weights(self) -> Mapping[str, Any]: ...


def get_backend(name: str = "auto", weights: str = "auto", model: HasWeights | None = None,
                threads: int | None = None, activations: str | None = None, kv_dtype: str = "auto") -> Backend:
    """A backend instance; 'auto' takes MLX on a GPU and NumPy on a plain CPU (MLX's CPU GEMMs are slow).

    weights: the NumPy backend's weights mode, one of WEIGHT_MODES or "auto": see
    `choose_weights_mode` (float32 when no model is given).
    MLX keeps weights quantized whatever the mode. threads: the NumPy kernels' CPU threads (None: every core);
    activations: their activation integers, "int8" or "int16" (None: `qmatmul`'s default). kv_dtype:
    the KV pool's element type, one of KV_DTYPES or "auto" (MLX: its activations' dtype; NumPy:
    CPU_KV_DTYPES by weights mode).
    """
    if name not in BACKENDS:
        raise EdgeserveError(f"unknown backend {name!r} (choose from {', '.join(BACKENDS)})")
    if kv_dtype not in ("auto", *KV_DTYPES):
        raise EdgeserveError(f"unknown KV dtype {kv_dtype!r} (choose from auto, {', '.join(KV_DTYPES)})")
    if name == "auto":
        name = "mlx" if mlx_gpu_available() else "numpy"
    if name == "mlx":
        try:
            from edgeserve.backends.mlx_backend import MLXBackend
        except ImportError as exc:
            raise EdgeserveError(f"the mlx backend needs MLX: pip install 'edgeserve[mlx]' ({exc})") from exc
        return MLXBackend(kv_dtype)
    from edgeserve.backends.numpy_backend import NumpyBackend, choose_weights_mode

    if weights == "auto":
        weights = "float32" if model is None else choose_weights_mode(model, available_memory_bytes())
    return NumpyBackend(weights=weights, threads=threads, activations=activations,
                        kv_dtype=CPU_KV_DTYPES[weights] if kv_dtype == "auto" else kv_dtype)
