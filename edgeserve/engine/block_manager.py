"""Who holds which KV block: free list, reference counts, block tables and the prefix cache.

A full block's hash is a BLAKE2b digest of its parent's hash and its tokens, and a cache hit is
checked against the tokens and parent the block was filled with, so one client's prompt can never
be served another's K/V: not by a collision of a predictable hash, nor by a crafted prompt.
Blocks nobody references stay in the cache (and in the free list, oldest first) until evicted.

With a prefix store (prefix_store.py), an evicted block that held a prefix is recorded, so the engine moves its
K/V there before the step writes the pool, and a lookup that misses in the pool goes on in the store: its hits
take fresh blocks, whose K/V the engine writes from the store before the step's forward.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from edgeserve.engine.prefix_store import BlockKey, PrefixStore, StoredBlock
from edgeserve.engine.sequence import Sequence

Hit = int | StoredBlock  # a prefix block found in the pool (its index), or in a tier of the prefix store


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


@dataclass(frozen=True)
class BlockUsage:
    total: int
    used: int  # referenced by at least one sequence
    cached: int  # unreferenced but holding a prefix (evicted when needed)
    free: int  # holding nothing
    prefix_hit_tokens: int  # prompt tokens found in the prefix cache
    prefix_query_tokens: int  # prompt tokens looked up


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 store: PrefixStore | None = None):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_count = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        # what a cached block was filled from: its parent's hash and its tokens, checked on every hit
        self.block_key: list[BlockKey | None] = [None] * num_blocks
        self.hash_to_block: dict[bytes, int] = {}
        self.children: dict[bytes | None, set[int]] = {}  # cached blocks by their parent's hash
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))  # LRU first
        self._free_cached = 0  # free blocks holding a prefix, kept as they come and go (usage() runs every step)
        self._pending_copies: list[tuple[int, int]] = []  # copy-on-write (src, dst) for the next step
        self.hit_tokens = 0
        self.query_tokens = 0
        self.store = store if enable_prefix_caching else None
        self.tier_hit_tokens = {"ram": 0, "disk": 0}  # of hit_tokens, those loaded from the store's tiers
        self._evicted: list[tuple[int, bytes, BlockKey]] = []  # cached blocks taken since the last step
        self._pending_loads: dict[int, StoredBlock] = {}  # blocks to fill from the store before the next step

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (truly free or cached and unreferenced)."""
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free)

    def usage(self) -> BlockUsage:
        cached = self._free_cached
        return BlockUsage(self.num_blocks, self.num_used, cached, self.num_free - cached, self.hit_tokens,
                          self.query_tokens)

    def block_states(self) -> list[str]:
        """Each block's state: 'free', 'cached' (unreferenced, holding a prefix), 'used' or 'shared'."""
        return [("cached" if h is not None else "free") if r == 0 else ("shared" if r > 1 else "used")
                for r, h in zip(self.ref_count, self.block_hash)]

    def has_pending_moves(self) -> bool:
        """Whether block copies, prefix-store saves or loads wait to be made before the next step."""
        return bool(self._pending_copies or self._evicted or self._pending_loads)

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """The copy-on-write block copies (src, dst) to make before the next step writes the pool."""
        copies, self._pending_copies = self._pending_copies, []
        return copies

    def take_evicted(self) -> list[tuple[int, bytes, BlockKey]]:
        """The cached blocks (block, hash, key) taken since the last call, whose K/V the pool still holds until
        the next step writes it: the prefix store's to keep."""
        evicted, self._evicted = self._evicted, []
        return evicted

    def take_pending_loads(self) -> dict[int, StoredBlock]:
        """The blocks given to prefix-store hits since the last call, each with the K/V to write into it."""
        loads, self._pending_loads = self._pending_loads, {}
        return loads

    def cached_blocks(self) -> list[tuple[int, bytes, BlockKey]]:
        """Every pool block holding a prefix (block, hash, key), referenced or not."""
        return [(b, h, self.block_key[b]) for b, h in enumerate(self.block_hash) if h is not None]  # type: ignore[misc]

    def _take(self) -> int:
        block, _ = self.free.popitem(last=False)
        h = self.block_hash[block]
        if h is not None:
            self._free_cached -= 1
            if self._pending_loads.pop(block, None) is None and self.store is not None:
                self._evicted.append((block, h, self.block_key[block]))  # type: ignore[arg-type]
            # (a block whose load is still pending holds nothing yet: its K/V are the store's already)
            del self.hash_to_block[h]
            self.children[self.block_key[block][0]].discard(block)  # type: ignore[index]
            self.block_hash[block] = self.block_key[block] = None
        self.ref_count[block] = 1
        return block

    def _ref(self, block: int) -> None:
        if self.ref_count[block] == 0:
            del self.free[block]
            self._free_cached -= self.block_hash[block] is not None
        self.ref_count[block] += 1

    def _release(self, block: int) -> None:
        """One reference fewer; the last one puts the block on the free list (most recently used last)."""
        self.ref_count[block] -= 1
        if self.ref_count[block] == 0:
            self.free[block] = None
            self._free_cached += self.block_hash[block] is not None

    @staticmethod
    def _chain(parent: bytes | None, tokens: list[int]) -> bytes:
        """The hash of a block of tokens following the prefix whose last block hashed to parent."""
        h = hashlib.blake2b(parent or b"", digest_size=16)
        h.update(np.asarray(tokens, dtype=np.int64).tobytes())
        return h.digest()

    def _lookup(self, parent: bytes | None, tokens: list[int]) -> tuple[bytes, int | None]:
        """The chained hash of tokens after parent, and the cached block holding exactly them, if any."""
        h = self._chain(parent, tokens)
        block = self.hash_to_block.get(h)
        if block is not None and self.block_key[block] != (parent, tuple(tokens)):
            block = None
        return h, block

    def match_prefix(self, seq: Sequence) -> list[Hit]:
        """Cached blocks holding the longest prefix of seq (never its last token, which must be computed), each
        from the pool or else from the prefix store; sets seq.prefix_diverged_at where they end short of that."""
        seq.prefix_diverged_at = None
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        hits: list[Hit] = []
        parent = None
        for i in range((seq.num_tokens - 1) // bs):
            tokens = seq.token_ids[i * bs : (i + 1) * bs]
            known = parent
            parent, block = self._lookup(parent, tokens)
            if block is None and self.store is not None:
                block = self.store.get(parent, (known, tuple(tokens)))
            if block is None:
                seq.prefix_diverged_at = i * bs + self._common_run(known, tokens)
                break
            hits.append(block)
        return hits

    def _common_run(self, parent: bytes | None, tokens: list[int]) -> int:
        """How many leading tokens some cached block after parent shares with tokens."""
        best = 0
        for block in self.children.get(parent, ()):
            cached = self.block_key[block][1]  # type: ignore[index]
            n = 0
            while n < len(tokens) and cached[n] == tokens[n]:
                n += 1
            best = max(best, n)
        return best

    def can_admit(self, seq: Sequence, hits: list[Hit], num_new_tokens: int) -> bool:
        in_pool = [b for b in hits if isinstance(b, int)]
        reused_free = sum(1 for b in in_pool if self.ref_count[b] == 0)
        # a store hit needs a fresh block like a computed one
        fresh = blocks_for(len(hits) * self.block_size + num_new_tokens, self.block_size) - len(in_pool)
        return fresh + reused_free <= self.num_free

    def admit(self, seq: Sequence, hits: list[Hit]) -> None:
        """Start seq on the cached prefix blocks it matched: the pool's referenced first (so taking blocks for the
        store's hits cannot evict them), then a block for each store hit, filled before the next step."""
        for b in hits:
            if isinstance(b, int):
                self._ref(b)
        seq.tier_cached_tokens = {}
        table = []
        for hit in hits:
            if isinstance(hit, int):
                table.append(hit)
                continue
            block = self._take()
            self._cache(block, hit.block_hash, hit.key)
            self._pending_loads[block] = hit
            table.append(block)
            seq.tier_cached_tokens[hit.tier] = seq.tier_cached_tokens.get(hit.tier, 0) + self.block_size
            self.tier_hit_tokens[hit.tier] += self.block_size
        seq.block_table = table
        seq.block_hashes = [self.block_hash[b] for b in table]  # type: ignore[misc]
        seq.num_computed_tokens = seq.num_cached_tokens = len(hits) * self.block_size
        self.query_tokens += seq.num_tokens
        self.hit_tokens += seq.num_cached_tokens

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Make room for seq's next num_new_tokens; False (and nothing changed) when the pool is short."""
        bs = self.block_size
        table = seq.block_table
        need = blocks_for(seq.num_computed_tokens + num_new_tokens, bs) - len(table)
        partial = seq.num_computed_tokens % bs != 0
        cow = partial and self.ref_count[table[-1]] > 1  # a shared, partly filled block about to be written
        if max(need, 0) + cow > self.num_free:
            return False
        if cow:
            src = table[-1]
            table[-1] = self._take()
            self.ref_count[src] -= 1
            self._pending_copies.append((src, table[-1]))
        for _ in range(need):
            table.append(self._take())
        return True

    def register_full_blocks(self, seq: Sequence) -> None:
        """Put seq's newly completed blocks into the prefix cache."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        for i in range(len(seq.block_hashes), seq.num_computed_tokens // bs):
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            tokens = seq.token_ids[i * bs : (i + 1) * bs]
            h = self._chain(parent, tokens)
            seq.block_hashes.append(h)
            block = seq.block_table[i]
            if h not in self.hash_to_block and self.block_hash[block] is None:
                self._cache(block, h, (parent, tuple(tokens)))

    def _cache(self, block: int, h: bytes, key: BlockKey) -> None:
        self.hash_to_block[h] = block
        self.block_hash[block] = h
        self.block_key[block] = key
        self.children.setdefault(key[0], set()).add(block)

    def trim(self, seq: Sequence) -> None:
        """Free seq's blocks past those its tokens need (slots a rejected draft was given)."""
        keep = blocks_for(seq.num_tokens, self.block_size)
        for b in reversed(seq.block_table[keep:]):
            self._release(b)
        del seq.block_table[keep:]

    def share_prompt(self, source: Sequence, seq: Sequence, num_new_tokens: int) -> bool:
        """Start seq on the blocks of source, whose prompt is seq's, holding all of it but its last token, and make
        room for seq's next num_new_tokens from there (that token is computed again for seq's own logits, into a copy
        of the block it falls in where that is shared); False (and nothing changed) when the pool is short."""
        bs = self.block_size
        computed = seq.num_prompt_tokens - 1
        shared = blocks_for(computed, bs)
        fresh = blocks_for(computed + num_new_tokens, bs) - shared + (computed % bs != 0)
        if fresh > self.num_free:
            return False
        for b in source.block_table[:shared]:
            self._ref(b)
        seq.block_table = source.block_table[:shared]
        seq.block_hashes = source.block_hashes[: computed // bs]
        seq.num_computed_tokens = seq.num_cached_tokens = computed
        self.query_tokens += seq.num_tokens
        self.hit_tokens += computed
        return self.allocate_slots(seq, num_new_tokens)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Let child share every block of parent (copy-on-write when either writes a shared block)."""
        for b in parent.block_table:
            self._ref(b)
        child.block_table = list(parent.block_table)
        child.block_hashes = list(parent.block_hashes)
        child.num_computed_tokens = parent.num_computed_tokens

    def free_seq(self, seq: Sequence) -> None:
        """Release seq's blocks, tail first, so its tail is evicted before its (more shareable) head."""
        for b in reversed(seq.block_table):
            if self.ref_count[b] <= 0:
                raise RuntimeError(f"double free of KV block {b}")
            self._release(b)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0
