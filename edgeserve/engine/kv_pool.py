"""The paged KV pool: per layer K and V arrays of [num_blocks, block_size, n_kv_heads, head_dim]."""

from __future__ import annotations

from dataclasses import dataclass
from edgeserve.backends.base import Array, Backend, StepMeta
from edgeserve.models.base import ModelArgs


def kv_bytes_per_token(args: ModelArgs, dtype_bytes: int) -> int:
    return 2 * args.num_hidden_layers * args.num_key_value_heads * args.head_dim * dtype_bytes


@dataclass
class PoolSize:
    num_blocks: int
    block_size: int
    bytes_per_token: int

    @property
    def tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def bytes(self) -> int:
        return self.tokens * self.bytes_per_token

    def describe(self) -> str:
        return (f"KV pool: {self.num_blocks} blocks x {self.block_size} tokens = {self.tokens} tokens, "
                f"{self.bytes / 2**20:.1f} MiB ({self.bytes_per_token} bytes/token)")


def size_pool(args: ModelArgs, budget_bytes: int, block_size: int, dtype_bytes: int) -> PoolSize:
    per_token = kv_bytes_per_token(args, dtype_bytes)
    return PoolSize(max(1, budget_bytes // (per_token * block_size)), block_size, per_token)


class KVPool:
    """The pool's arrays, owned by one backend; the BlockManager decides who uses which block."""

    def __init__(self, backend: Backend, args: ModelArgs, size: PoolSize):
        self.backend = backend
        self.size = size
        shape = (size.num_blocks, size.block_size, args.num_key_value_heads, args.head_dim)
        self.k = [backend.allocate_kv(*shape) for _ in range(args.num_hidden_layers)]
        self.v = [backend.allocate_kv(*shape) for _ in range(args.num_hidden_layers)]

    def write(self, layer: int, k: Array, v: Array, meta: StepMeta) -> None:
        """Store this step's K/V rows at their slots (backends with immutable arrays return new ones)."""
        self.k[layer] = self.backend.write_kv(self.k[layer], k, meta)
        self.v[layer] = self.backend.write_kv(self.v[layer], v, meta)
