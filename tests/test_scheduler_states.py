"""The scheduler as a state machine: random arrivals with shared prefixes, aborts and steps on a tiny pool.

The pool holds a few sequences at most, so preemption, prefix-cache hits and chunked prefills all happen,
in continuous and static batching. After every step the blocks and queues must be consistent, and at the
end every request must run to completion and give back every block.
"""

import os

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from edgeserve.engine.block_manager import BlockManager, blocks_for
from edgeserve.engine.scheduler import ScheduledSeq, Scheduler
from edgeserve.engine.sequence import Sequence, SequenceStatus
from edgeserve.sampling_params import SamplingParams

BLOCK = 4
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [5, 5, 5, 5, 5]]  # the first two share a block


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(static=st.booleans(), num_blocks=st.integers(6, 10), budget=st.integers(1, 16),
                max_seqs=st.integers(1, 4), caching=st.booleans())
    def start(self, static: bool, num_blocks: int, budget: int, max_seqs: int, caching: bool) -> None:
        self.bm = BlockManager(num_blocks, BLOCK, enable_prefix_caching=caching)
        self.scheduler = Scheduler(self.bm, max_seqs, budget, static_batching=static)
        self.live: list[Sequence] = []  # added, neither finished nor aborted
        self.arrivals = 0

    @rule(burst=st.lists(st.tuples(st.sampled_from(range(len(PREFIXES) + 1)), st.sampled_from([0, 4, 5, 8]),
                                   st.lists(st.integers(0, 3), min_size=1, max_size=6), st.integers(1, 8)),
                         min_size=1, max_size=4))
    def add(self, burst: list[tuple[int, int, list[int], int]]) -> None:
        """Requests arriving together (as between two steps), often on a cached prefix."""
        for prefix, cut, suffix, max_tokens in burst:
            prompt = (PREFIXES[prefix][:cut] if prefix < len(PREFIXES) else []) + suffix
            # the engine caps a request to what the pool holds on its own; so does this test
            max_tokens = min(max_tokens, self.bm.num_blocks * BLOCK - len(prompt))
            self.arrivals += 1
            seq = Sequence(f"r{self.arrivals}", prompt, SamplingParams(max_tokens=max_tokens),
                           arrival_time=float(self.arrivals))
            self.scheduler.add(seq)
            self.live.append(seq)

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 100))
    def abort(self, pick: int) -> None:
        seq = self.live.pop(pick % len(self.live))
        self.scheduler.finish(seq)

    @rule()
    def step(self) -> None:
        scheduled = self.scheduler.schedule()
        self.check_step(scheduled)
        self.bm.take_pending_copies()
        for item in scheduled:
            if item.padding:
                continue
            seq, samples = item.seq, item.samples
            seq.num_computed_tokens += item.num_new_tokens
            self.bm.register_full_blocks(seq)
            if samples:
                seq.token_ids.append(seq.num_tokens % 4)
                if seq.num_output_tokens >= seq.params.max_tokens:
                    self.live.remove(seq)
                    self.scheduler.finish(seq)

    def check_step(self, scheduled: list[ScheduledSeq]) -> None:
        seqs = [item.seq for item in scheduled]
        assert len(set(map(id, seqs))) == len(seqs), "a sequence scheduled twice in one step"
        assert sum(item.num_new_tokens for item in scheduled) <= self.scheduler.max_num_batched_tokens
        free = set(self.bm.free)
        for item in scheduled:
            seq = item.seq
            assert item.num_new_tokens > 0 and seq in self.scheduler.running
            assert item.padding == seq.is_finished
            # what building the batch indexes: a block of its own for every position it computes
            assert len(seq.block_table) >= blocks_for(item.first_position + item.num_new_tokens, BLOCK), \
                f"{seq.request_id} scheduled without its blocks"
            assert not free & set(seq.block_table), f"{seq.request_id} scheduled on a free block"

    @invariant()
    def queues_are_consistent(self) -> None:
        running, waiting = self.scheduler.running, list(self.scheduler.waiting)
        assert not set(map(id, running)) & set(map(id, waiting)), "a sequence both running and waiting"
        assert len(running) <= self.scheduler.max_num_seqs
        assert {id(s) for s in running if not s.is_finished} | {id(s) for s in waiting} == set(map(id, self.live)), \
            "a live sequence lost, or a finished one still queued"
        assert all(s.status is SequenceStatus.WAITING and not s.block_table for s in waiting)
        held = [s for s in running if s.is_finished]
        assert not held or self.scheduler.static_batching, "only a static batch holds finished sequences"

    @invariant()
    def blocks_are_consistent(self) -> None:
        counts = [0] * self.bm.num_blocks
        for seq in self.scheduler.running:
            for b in seq.block_table:
                counts[b] += 1
        assert counts == self.bm.ref_count, "reference counts differ from the block tables"
        free = set(self.bm.free)
        assert all((b in free) == (counts[b] == 0) for b in range(self.bm.num_blocks)), \
            "a block both free and referenced, or neither"
        cached = sum(1 for b in free if self.bm.block_hash[b] is not None)
        assert self.bm.usage().cached == cached, "the count of cached free blocks drifted"

    def teardown(self) -> None:
        if not hasattr(self, "scheduler"):
            return
        # every request finishes: nothing waits forever behind a stuck batch. Each step computes at least one
        # token, and a preempted sequence computes its tokens again, so this bounds the steps a healthy
        # scheduler needs (a budget of 1 token a step takes one step per prompt and output token)
        work = sum(s.num_prompt_tokens + s.params.max_tokens for s in self.live)
        for _ in range(4 * work + 100):
            if not self.scheduler.has_unfinished():
                break
            self.step()
            self.queues_are_consistent()
            self.blocks_are_consistent()
        assert not self.scheduler.has_unfinished() and not self.live, "requests never finished"
        assert self.bm.num_free == self.bm.num_blocks


# a few seconds in the quick loop; CI explores more: against the scheduler that kept an evicted sequence in
# its step, runs found it after 120 to 480 examples (test_scheduler.py pins that case in the quick loop)
SchedulerMachine.TestCase.settings = settings(max_examples=600 if "CI" in os.environ else 30,
                                              stateful_step_count=40, deadline=None)
test_scheduler_states = SchedulerMachine.TestCase
