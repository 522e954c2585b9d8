"""How many KV blocks a memory budget holds: the pool's size, from the model's shape and the backend's dtype."""

from __future__ import annotations

from dataclasses import dataclass

from edgeserve.backends.kv_formats import kv_head_bytes
from edgeserve.models.base import ModelArgs


def kv_bytes_per_token(args: ModelArgs, kv_dtype: str) -> int:
    return 2 * args.num_hidden_layers * args.num_key_value_heads * kv_head_bytes(kv_dtype, args.head_dim)


@dataclass
class PoolSize:
    num_blocks: int
    block_size: int
    bytes_per_token: int
    kv_dtype: str = "float32"

    @property
    def tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def bytes(self) -> int:
        return self.tokens * self.bytes_per_token

    def describe(self) -> str:
        return (f"KV pool: {self.num_blocks} blocks x {self.block_size} tokens = {self.tokens} tokens, "
                f"{self.bytes / 2**20:.1f} MiB of {self.kv_dtype} ({self.bytes_per_token} bytes/token, "
                f"{2**30 // self.bytes_per_token} tokens/GiB)")


def size_pool(args: ModelArgs, budget_bytes: int, block_size: int, kv_dtype: str) -> PoolSize:
    per_token = kv_bytes_per_token(args, kv_dtype)
    return PoolSize(max(1, budget_bytes // (per_token * block_size)), block_size, per_token, kv_dtype)
