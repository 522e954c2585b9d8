"""Property-based tests of the BlockManager's invariants over random allocate/append/fork/free sequences."""

from unittest import mock

from hypothesis import given, settings
from hypothesis import strategies as st

from edgeserve.engine.block_manager import BlockManager
from edgeserve.sampling_params import SamplingParams
from edgeserve.engine.sequence import Sequence

BLOCK = 4
PARAMS = SamplingParams(max_tokens=1)


def check_invariants(bm: BlockManager, live: list[Sequence]) -> None:
    assert all(r >= 0 for r in bm.ref_count)
    owned = {b for s in live for b in s.block_table}
    free = set(bm.free)
    assert not owned & free, "a block is both free and owned"
    assert owned | free == set(range(bm.num_blocks)), "a block is neither free nor owned"
    counts = {}
    for s in live:
        for b in s.block_table:
            counts[b] = counts.get(b, 0) + 1
    assert all(bm.ref_count[b] == counts.get(b, 0) for b in range(bm.num_blocks))
    for h, b in bm.hash_to_block.items():
        assert bm.block_hash[b] == h
    for s in live:
        assert len(s.block_table) * BLOCK >= s.num_computed_tokens
        # a cached block a sequence holds was filled from that sequence's own tokens
        for i, b in enumerate(s.block_table[: s.num_computed_tokens // BLOCK]):
            if bm.block_key[b] is not None:
                assert bm.block_key[b][1] == tuple(s.token_ids[i * BLOCK : (i + 1) * BLOCK])


ops = st.lists(
    st.tuples(st.sampled_from(["new", "grow", "fork", "free"]), st.integers(0, 50), st.integers(1, 12)),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops=ops, caching=st.booleans(), vocab=st.integers(2, 6))
def test_invariants_hold(ops, caching, vocab):
    run_ops(ops, caching, vocab)


@settings(max_examples=100, deadline=None)
@given(ops=ops, vocab=st.integers(2, 6))
def test_colliding_hashes_never_share_a_block(ops, vocab):
    """Every block hashing alike (as a weak or predictable hash lets a crafted prompt do): a hit is
    still only ever a block filled from the same tokens after the same prefix."""
    with mock.patch.object(BlockManager, "_chain", staticmethod(lambda parent, tokens: b"collision")):
        run_ops(ops, True, vocab)


def test_a_collision_is_a_miss_not_another_prompts_kv():
    with mock.patch.object(BlockManager, "_chain", staticmethod(lambda parent, tokens: b"collision")):
        bm = BlockManager(num_blocks=8, block_size=BLOCK)
        a = Sequence("a", [1, 2, 3, 4, 5], PARAMS)
        bm.admit(a, [])
        bm.allocate_slots(a, 5)
        a.num_computed_tokens = 5
        bm.register_full_blocks(a)
        assert bm.match_prefix(Sequence("b", [9, 9, 9, 9, 9], PARAMS)) == []
        assert bm.match_prefix(Sequence("a2", [1, 2, 3, 4, 7], PARAMS)) == [a.block_table[0]]


def test_block_hashes_are_blake2b_chains():
    """Not Python's hash(): the same in every process, 128 bits, and covering the parent."""
    first = BlockManager._chain(None, [1, 2, 3, 4])
    assert len(first) == 16 and first == BlockManager._chain(None, [1, 2, 3, 4])
    assert BlockManager._chain(first, [5, 6, 7, 8]) != BlockManager._chain(None, [5, 6, 7, 8])


def run_ops(ops: list[tuple[str, int, int]], caching: bool, vocab: int) -> None:
    bm = BlockManager(num_blocks=16, block_size=BLOCK, enable_prefix_caching=caching)
    live: list[Sequence] = []
    for i, (op, pick, n) in enumerate(ops):
        if op == "new" or not live:
            # small vocabularies make shared prefixes (cache hits) common
            seq = Sequence(f"s{i}", [(pick * 7 + k) % vocab for k in range(n)], PARAMS)
            hits = bm.match_prefix(seq)
            todo = seq.num_tokens - len(hits) * BLOCK
            if bm.can_admit(seq, hits, todo):
                bm.admit(seq, hits)
                assert bm.allocate_slots(seq, todo)
                seq.num_computed_tokens += todo
                bm.register_full_blocks(seq)
                live.append(seq)
        else:
            seq = live[pick % len(live)]
            if op == "grow":
                seq.token_ids.extend([pick % vocab] * n)
                todo = seq.num_tokens - seq.num_computed_tokens
                if bm.allocate_slots(seq, todo):
                    seq.num_computed_tokens += todo
                    bm.register_full_blocks(seq)
                else:
                    del seq.token_ids[seq.num_computed_tokens:]
            elif op == "fork":
                child = Sequence(f"c{i}", list(seq.token_ids), PARAMS)
                bm.fork(seq, child)
                live.append(child)
            else:
                bm.free_seq(seq)
                live.remove(seq)
        bm.take_pending_copies()
        check_invariants(bm, live)
    for seq in live:
        bm.free_seq(seq)
    check_invariants(bm, [])
    assert bm.num_free == bm.num_blocks


def test_double_free_is_caught():
    bm = BlockManager(num_blocks=4, block_size=BLOCK)
    seq = Sequence("a", [1, 2, 3, 4, 5], PARAMS)
    bm.admit(seq, [])
    bm.allocate_slots(seq, 5)
    table = list(seq.block_table)
    bm.free_seq(seq)
    seq.block_table = table
    try:
        bm.free_seq(seq)
    except RuntimeError as exc:
        assert "double free" in str(exc)
    else:
        raise AssertionError("double free went unnoticed")


def test_copy_on_write_for_shared_partial_block():
    bm = BlockManager(num_blocks=8, block_size=BLOCK)
    parent = Sequence("p", [1, 2, 3, 4, 5, 6], PARAMS)
    bm.admit(parent, [])
    bm.allocate_slots(parent, 6)
    parent.num_computed_tokens = 6
    child = Sequence("c", list(parent.token_ids), PARAMS)
    bm.fork(parent, child)
    child.token_ids.append(9)
    assert bm.allocate_slots(child, 1)
    assert bm.take_pending_copies() == [(parent.block_table[-1], child.block_table[-1])]
    assert bm.take_pending_copies() == []
    assert parent.block_table[0] == child.block_table[0] and parent.block_table[1] != child.block_table[1]
    assert bm.ref_count[parent.block_table[0]] == 2 and bm.ref_count[parent.block_table[1]] == 1


def test_lru_eviction_prefers_oldest_cached():
    bm = BlockManager(num_blocks=4, block_size=BLOCK)
    a = Sequence("a", [1, 1, 1, 1, 1], PARAMS)
    b = Sequence("b", [2, 2, 2, 2, 2], PARAMS)
    for s in (a, b):
        bm.admit(s, [])
        bm.allocate_slots(s, 5)
        s.num_computed_tokens = 5
        bm.register_full_blocks(s)
    a_full, b_full = a.block_table[0], b.block_table[0]
    bm.free_seq(a)
    bm.free_seq(b)
    assert bm.usage().cached == 2 and bm.block_states().count("cached") == 2
    c = Sequence("c", [3] * 9, PARAMS)  # needs 3 blocks: 2 truly free + the oldest cached one (a's)
    bm.admit(c, [])
    assert bm.allocate_slots(c, 9)
    assert a_full in c.block_table and b_full not in c.block_table
    assert bm.match_prefix(Sequence("b2", [2, 2, 2, 2, 2], PARAMS)) == [b_full]


def test_a_miss_says_where_the_prompt_left_the_cache():
    bm = BlockManager(num_blocks=8, block_size=BLOCK)
    a = Sequence("a", list(range(13)), PARAMS)
    assert bm.match_prefix(a) == [] and a.prefix_diverged_at == 0  # nothing cached yet
    bm.admit(a, [])
    bm.allocate_slots(a, 13)
    a.num_computed_tokens = 13
    bm.register_full_blocks(a)
    # the same first block, then two more tokens of the second, then a change (as a timestamp would)
    b = Sequence("b", list(range(6)) + [99] * 7, PARAMS)
    assert bm.match_prefix(b) == a.block_table[:1] and b.prefix_diverged_at == 6
    c = Sequence("c", list(range(13)), PARAMS)
    assert bm.match_prefix(c) == a.block_table[:3] and c.prefix_diverged_at is None
