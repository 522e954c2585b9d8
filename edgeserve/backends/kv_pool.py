"""The paged KV pool's arrays: per layer K and V of [num_blocks, block_size, n_kv_heads, head_dim]."""

from __future__ import annotations

import threading

import numpy as np

from edgeserve.backends.base import Array, Backend, StepMeta
from edgeserve.backends.pages import populate_in_background


class KVPool:
    """The pool's arrays, owned by one backend; the engine sizes the pool and its BlockManager decides who uses which block."""

    def __init__(self, backend: Backend, num_layers: int, num_blocks: int, block_size: int, n_kv_heads: int,
                 head_dim: int):
        self.backend = backend
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (num_blocks, block_size, n_kv_heads, head_dim)
        self.k = [backend.allocate_kv(*shape) for _ in range(num_layers)]
        self.v = [backend.allocate_kv(*shape) for _ in range(num_layers)]

    def populate(self) -> threading.Thread | None:
        """Map a NumPy pool's memory in now, on a background thread (backends/pages.py), so that no step waits for
        pages it touches first; the thread, or None where nothing is done (MLX allocates on its own terms)."""
        return populate_in_background([a for a in self.k + self.v if isinstance(a, np.ndarray)])

    def write(self, layer: int, k: Array, v: Array, meta: StepMeta) -> None:
        """Store this step's K/V rows at their slots (backends with immutable arrays return new ones)."""
        self.k[layer] = self.backend.write_kv(self.k[layer], k, meta)
        self.v[layer] = self.backend.write_kv(self.v[layer], v, meta)
