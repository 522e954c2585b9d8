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
        if item.padding:
            continue
        seq, samples = item.seq, item.samples
        seq.num_computed_tokens += item.num_new_tokens
        scheduler.bm.register_full_blocks(seq)
        if samples:
            seq.token_ids.append(7)
            if seq.num_output_tokens >= seq.params.max_tokens:
                scheduler.finish(seq)
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


def test_a_victim_scheduled_earlier_in_the_step_leaves_it():
    """Static batch on a cached prefix: the later arrival, nearly all cached, is scheduled first as a decode;
    the earlier one's prefill chunk then runs out of blocks and evicts it, so it must leave the step."""
    bm = BlockManager(num_blocks=6, block_size=4)
    scheduler = Scheduler(bm, max_num_batched_tokens=8, static_batching=True)
    shared = [1, 2, 3, 4, 5, 6, 7, 8]
    warm = Sequence("warm", [*shared, 9], SamplingParams(max_tokens=1), arrival_time=0.0)
    scheduler.add(warm)
    advance(scheduler)
    advance(scheduler)  # computed in two chunks, sampled, finished: its two full blocks stay cached
    assert not scheduler.has_unfinished() and bm.usage().cached == 2
    early = Sequence("early", list(range(20, 40)), PARAMS, arrival_time=1.0)
    late = Sequence("late", [*shared, 10], PARAMS, arrival_time=2.0)
    scheduler.add(early)
    scheduler.add(late)
    assert [(i.seq, i.num_new_tokens) for i in advance(scheduler)] == [(early, 8)]  # late admitted on its hits
    assert late.num_computed_tokens == 8 and not late.is_prefilling
    step = scheduler.schedule()
    assert scheduler.num_preemptions == 1 and late.status is SequenceStatus.WAITING and not late.block_table
    assert [(i.seq, i.num_new_tokens) for i in step] == [(early, 7)]  # late's token went back to the budget
    assert len(early.block_table) * 4 >= early.num_computed_tokens + 7


def test_a_static_batch_ends_when_its_last_live_sequence_runs_out_of_blocks():
    """A finished sequence held in a static batch is evicted before a live one, never requeued."""
    bm = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    scheduler = Scheduler(bm, static_batching=True)
    done = Sequence("done", [1] * 8, SamplingParams(max_tokens=1), arrival_time=0.0)
    live = Sequence("live", [2] * 8, SamplingParams(max_tokens=3), arrival_time=1.0)
    scheduler.add(done)
    scheduler.add(live)
    advance(scheduler)  # both prompts fill the pool; done finishes and stays as padding
    assert done.is_finished and scheduler.running == [done, live] and bm.num_free == 0
    step = advance(scheduler)  # live needs a third block: the padding row gives it back
    assert [(i.seq, i.padding) for i in step] == [(live, False)]
    assert scheduler.running == [live] and not scheduler.waiting and done.is_finished
    for _ in range(3):
        advance(scheduler)
    assert not scheduler.has_unfinished() and bm.num_free == 4


def test_padding_rows_never_take_the_budget_of_live_sequences():
    bm = BlockManager(num_blocks=8, block_size=4)
    scheduler = Scheduler(bm, max_num_batched_tokens=1, static_batching=True)
    first, second = Sequence("a", [0], SamplingParams(max_tokens=1)), Sequence("b", [0], SamplingParams(max_tokens=1))
    scheduler.add(first)
    scheduler.add(second)
    for _ in range(3):
        advance(scheduler)
    assert first.is_finished and second.is_finished and not scheduler.has_unfinished()


def test_a_proposer_learns_the_steps_rows_and_its_drafts_take_budget():
    calls = []

    def propose(seq: Sequence, room: int, rows: int, decodes: int) -> list[int]:
        calls.append((seq.request_id, room, rows, decodes))
        return [5, 5] if seq.request_id == "a" else []

    scheduler = Scheduler(BlockManager(num_blocks=32, block_size=4), max_num_batched_tokens=16, propose=propose)
    for i, name in enumerate("abc"):
        scheduler.add(Sequence(name, [1 + i, 2, 3], PARAMS))  # distinct prompts: equal ones share one prefill
    advance(scheduler)  # the prompts: nobody decodes yet, so nobody is asked
    assert calls == []
    step = scheduler.schedule()
    assert [(item.seq.request_id, item.num_new_tokens, item.draft) for item in step] == [
        ("a", 3, [5, 5]), ("b", 1, []), ("c", 1, [])]
    # room: the budget less a row for each decode still due; rows: the step's without the asker's draft
    assert calls == [("a", 13, 3, 3), ("b", 11, 5, 3), ("c", 11, 5, 3)]


def test_the_answers_of_one_prompt_compute_it_once():
    bm = BlockManager(num_blocks=32, block_size=4)
    scheduler = Scheduler(bm, max_num_batched_tokens=64)
    prompt = list(range(10, 20))  # two full blocks and two tokens
    first, *rest = [Sequence(f"n{i}", list(prompt), PARAMS) for i in range(4)]
    for seq in (first, *rest):
        scheduler.add(seq)
    # the prompt once: the other answers wait for it rather than compute it too
    assert [(item.seq, item.num_new_tokens) for item in advance(scheduler)] == [(first, 10)]
    # then each computes only the prompt's last token, for its own first token, on the first one's blocks; the
    # block that token falls in is copied for each (the first one writes its next token there)
    assert [(item.seq, item.num_new_tokens) for item in advance(scheduler)] == [(first, 1)] + [(s, 1) for s in rest]
    assert all(s.block_table[:2] == first.block_table[:2] and s.block_table[2] != first.block_table[2] for s in rest)
    assert len({s.block_table[2] for s in rest}) == 3 and bm.ref_count[first.block_table[0]] == 4
    assert [dst for _, dst in bm.take_pending_copies()] == [s.block_table[2] for s in rest]
    assert all(s.num_output_tokens == 1 and s.num_cached_tokens == 9 for s in rest)
