"""How many KV blocks a memory budget holds: the pool's size, from the model's shape and the backend's dtype."""

from __future__ import annotations

from dataclasses import dataclass

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
