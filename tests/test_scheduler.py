"""The scheduler on its own: token budget, decodes before prefill chunks, admission, preemption."""

from edgeserve.engine.block_manager import BlockManager
from edgeserve.engine.scheduler import ScheduledSeq, Scheduler
from edgeserve.engine.sequence import Sequence, SequenceStatus
from edgeserve.sampling_params import SamplingParams

PARAMS = SamplingParams(max_tokens=100)


def advance(scheduler: Scheduler) -> list[ScheduledSeq]:
    """Schedule a step and do what running it does: new tokens computed, a token sampled where due."""
    scheduled = scheduler.schedule()
    for item in scheduled:
        samples = item.samples
        item.seq.num_computed_tokens += item.num_new_tokens
        scheduler.bm.register_full_blocks(item.seq)
        if samples:
            item.seq.token_ids.append(7)
    return scheduled


def test_decodes_first_then_prefill_chunks_under_the_budget():
    scheduler = Scheduler(BlockManager(num_blocks=32, block_size=4), max_num_batched_tokens=8)
    short = Sequence("short", [1, 2, 3], PARAMS)
    scheduler.add(short)
    advance(scheduler)  # its whole prompt, and a first token
    long = Sequence("long", list(range(20)), PARAMS)
    scheduler.add(long)
    steps = [advance(scheduler) for _ in range(4)]
    for step in steps:
        assert [item.seq for item in step] == [short, long]  # the decode comes first
    assert [[item.num_new_tokens for item in step] for step in steps] == [[1, 7], [1, 7], [1, 6], [1, 1]]
    assert long.num_output_tokens == 2 and short.num_output_tokens == 5


def test_the_latest_arrival_is_preempted_when_the_pool_runs_out():
    bm = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    scheduler = Scheduler(bm)
    first, second = Sequence("first", [1] * 8, PARAMS), Sequence("second", [2] * 8, PARAMS)
    scheduler.add(first)
    scheduler.add(second)
    advance(scheduler)  # both prompts: two blocks each, the pool is full
    assert bm.num_free == 0
    advance(scheduler)  # each needs a third block for its 9th token: the later one gives way
    assert scheduler.num_preemptions == 1
    assert second.status is SequenceStatus.WAITING and second.block_table == [] and second.num_computed_tokens == 0
    assert scheduler.running == [first] and list(scheduler.waiting) == [second]
    assert second.num_output_tokens == 1  # its token stays; it is recomputed with the prompt on readmission


def test_finish_frees_blocks_at_once():
    bm = BlockManager(num_blocks=8, block_size=4)
    scheduler = Scheduler(bm)
    seq = Sequence("a", [1] * 9, PARAMS)
    scheduler.add(seq)
    advance(scheduler)
    assert bm.num_used == 3
    scheduler.finish(seq)
    assert seq.status is SequenceStatus.FINISHED and not scheduler.has_unfinished()
    assert bm.usage().used == 0 and bm.usage().cached == 2  # its two full blocks stay in the prefix cache
