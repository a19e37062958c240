"""Scheduler rules, step by step with exact numbers, and a hypothesis-driven fuzz of add/step/abort that
checks the block invariants after every operation. A fake model appends tokens; no torch."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.block_manager import BlockManager
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence, SequenceStatus


def make(num_blocks=8, block_size=4, max_seqs=8, budget=16, caching=True, windows=(None,), state_slots=0):
    bm = BlockManager(num_blocks, block_size, caching, windows, state_slots)
    return bm, Scheduler(bm, max_seqs, budget)


def new_seq(rid, n_prompt, max_tokens=4, n=1, first_token=0):
    p = SamplingParams(max_tokens=max_tokens, n=n)
    seqs = [Sequence(rid, j, list(range(first_token, first_token + n_prompt)), p) for j in range(n)]
    for s in seqs[1:]:
        s.parent = seqs[0]
    return seqs


def run_step(sch: Scheduler, next_token=7):
    """A step with a fake model that samples `next_token` for every sequence that samples, through the
    engine's own update path (Scheduler.update_from_output)."""
    batch = sch.schedule()
    sch.update_from_output(batch, [next_token] * len(batch.sample_rows()))
    return batch


def test_chunked_prefill_mixes_with_decode():
    bm, sch = make(num_blocks=16, budget=8)
    (a,) = new_seq("a", 3)
    (b,) = new_seq("b", 20)
    sch.add(a)
    sch.add(b)
    batch = run_step(sch)
    assert [s.request_id for s in batch.seqs] == ["a", "b"] and batch.num_new_tokens == [3, 5]
    batch = run_step(sch)  # a decodes one token, b's prefill continues with the rest of the budget
    assert batch.num_new_tokens == [1, 7]
    assert b.num_computed_tokens == 12 and not batch.will_sample(1)


def test_fcfs_head_blocks_queue():
    bm, sch = make(num_blocks=4, block_size=4, budget=64)
    (a,) = new_seq("a", 12)  # 3 blocks
    (b,) = new_seq("b", 8)  # 2 blocks: does not fit after a
    (c,) = new_seq("c", 2)  # 1 block: would fit, but must not overtake b
    for s in (a, b, c):
        sch.add(s)
    batch = sch.schedule()
    assert [s.request_id for s in batch.seqs] == ["a"]
    assert list(sch.waiting) == [b, c]


def test_preempts_most_recent_and_requeues_it_first():
    bm, sch = make(num_blocks=3, block_size=4, budget=64)
    (a,) = new_seq("a", 4, max_tokens=8)
    (b,) = new_seq("b", 4, max_tokens=8)
    sch.add(a)
    sch.add(b)
    run_step(sch)  # each holds 1 full block and has sampled 1 token
    assert bm.num_free_blocks == 1
    run_step(sch)  # a takes the last block for token 5; b needs one too: b is preempted
    assert sch.num_preemptions_total == 1
    assert b.status is SequenceStatus.WAITING and sch.waiting[0] is b and b.block_tables == []
    assert b.num_computed_tokens == 0 and b.num_output_tokens == 1  # its token is kept and recomputed
    bm.check_invariants(sch.live_sequences())


def test_siblings_share_prompt_blocks_after_leader_prefill():
    bm, sch = make(num_blocks=16, block_size=4, budget=64)
    seqs = new_seq("r", 10, n=3)
    for s in seqs:
        sch.add(s)
    run_step(sch)
    assert seqs[0].status is SequenceStatus.RUNNING
    assert seqs[1].status is SequenceStatus.WAITING  # waits for the leader's prompt
    run_step(sch)
    assert all(s.status is SequenceStatus.RUNNING for s in seqs)
    assert seqs[1].block_tables[0][:2] == seqs[0].block_tables[0][:2] == seqs[2].block_tables[0][:2]
    assert bm.ref_counts[seqs[0].block_tables[0][0]] == 3
    assert seqs[1].num_cached_tokens == 8
    bm.check_invariants(sch.live_sequences())


def test_projected_demand_counts_a_shared_prompt_block_once():
    """Three samples of one 10-token prompt share its 2 full blocks: the pool holds them once, and so does the
    demand the autoscaler and router read (2 shared + 3 x (3 - 2) of their own at the end: 10 + 4 tokens)."""
    bm, sch = make(num_blocks=16, block_size=4, budget=64)
    for s in new_seq("r", 10, n=3):
        sch.add(s)
    run_step(sch)
    run_step(sch)
    assert bm.num_used_blocks == 2 + 3  # the shared prompt blocks, and each sample's own third block
    assert sch.projected_demand_blocks() == 2 + 3 * (4 - 2)


def test_abort_frees_at_once_from_either_queue():
    bm, sch = make(num_blocks=4, block_size=4, budget=64)
    (a,) = new_seq("a", 8)
    (b,) = new_seq("b", 12)
    sch.add(a)
    sch.add(b)
    run_step(sch)
    assert bm.num_free_blocks == 2 and b in sch.waiting  # b needs 3 blocks
    sch.finish(a, "abort")
    sch.finish(b, "abort")
    assert bm.num_free_blocks == 4 and not sch.has_unfinished
    bm.check_invariants([])


ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 40), st.integers(1, 12), st.integers(1, 3), st.integers(0, 3)),
        st.tuples(st.just("step")),
        st.tuples(st.just("abort"), st.integers(0, 50)),
    ),
    min_size=1, max_size=80,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops, num_blocks=st.integers(11, 24), block_size=st.sampled_from([2, 4, 8]),
       budget=st.integers(1, 48), max_seqs=st.integers(1, 6), caching=st.booleans(),
       window=st.integers(1, 20),
       layout=st.sampled_from(["full", "sliding", "hybrid", "hybrid3", "linear", "linear-sliding"]))
def test_fuzz_invariants(ops, num_blocks, block_size, budget, max_seqs, caching, window, layout):
    """KV groups as the engine forms them: one full group; one sliding group (every layer on `window`, Mistral);
    a sliding and a full group (Gemma 3); a full and two sliding groups; and linear-attention hybrids (Qwen3.5):
    a recurrent-state slot per running sequence beside its blocks, no prefix sharing. Sliding groups release
    the blocks behind the window as sequences advance, full groups keep theirs; state slots come and go with
    a sequence's blocks (finish, abort, preemption)."""
    windows = {"full": (None,), "sliding": (window,), "hybrid": (window, None), "hybrid3": (None, window, window),
               "linear": (None,), "linear-sliding": (window, None)}
    state_slots = max_seqs if layout.startswith("linear") else 0
    bm, sch = make(num_blocks, block_size, max_seqs, budget, caching and not state_slots, windows[layout],
                   state_slots)
    added: list[Sequence] = []
    for op in ops:
        if op[0] == "add":
            _, n_prompt, max_tokens, n, prefix_family = op
            if bm.blocks_held(n_prompt + max_tokens, budget) > num_blocks:  # what LLMEngine refuses up front
                continue
            group = new_seq(f"r{len(added)}", n_prompt, max_tokens, n, first_token=prefix_family * 1000)
            for s in group:
                sch.add(s)
            added.extend(group)
        elif op[0] == "step":
            run_step(sch, next_token=len(added))
        else:
            if added:
                victim = added[op[1] % len(added)]
                for s in [x for x in added if x.request_id == victim.request_id]:
                    sch.finish(s, "abort")
        bm.check_invariants(list(sch.live_sequences()))
        assert bm.num_free_blocks + bm.num_used_blocks == bm.num_total_blocks
        assert all(r >= 0 for r in bm.ref_counts)
        for s in sch.running:  # nothing a future query can see was given back; nothing behind a window is held
            first_needed = max(0, s.num_computed_tokens - window + 1) // block_size
            for g, w in enumerate(bm.group_windows):
                released = s.num_released_blocks[g]
                assert released == (0 if w is None else min(first_needed, len(s.block_tables[g])))
    for _ in range(2000):  # drain: everything that was not aborted must finish
        if not sch.has_unfinished:
            break
        run_step(sch)
    assert not sch.has_unfinished, "requests were left waiting forever"
    assert bm.num_free_blocks == bm.num_total_blocks
    assert all(r == 0 for r in bm.ref_counts)
    assert sorted(bm.free_state_slots) == list(range(state_slots))
    bm.check_invariants([])


def test_waiting_for_kv_is_told_apart_from_waiting_for_a_step():
    """The autoscaler scales up on requests that wait for memory; a full step budget is not that."""
    bm, sch = make(num_blocks=16, block_size=4, budget=8)
    for rid in "ab":
        sch.add(new_seq(rid, 8)[0])  # the budget takes only a this step
    run_step(sch)
    assert sch.num_waiting == 1 and sch.num_waiting_for_kv == 0
    bm, sch = make(num_blocks=4, block_size=4, budget=64)
    for rid in "ab":
        sch.add(new_seq(rid, 12)[0])  # 3 blocks each; the pool holds 4
    run_step(sch)
    assert sch.num_waiting == 1 and sch.num_waiting_for_kv == 1
    while sch.has_unfinished:
        run_step(sch)
    assert sch.num_waiting_for_kv == 0 and bm.num_free_blocks == bm.num_total_blocks


def test_projected_demand_counts_what_sequences_will_hold_at_their_end():
    from engine.kv_demand import projected_demand_blocks

    (a,) = new_seq("a", 10, max_tokens=30)  # block_size 4: (10 + 30) / 4 = 10 blocks at the end
    (b,) = new_seq("b", 3, max_tokens=2)  # 2 blocks
    bm = BlockManager(64, 4)
    assert projected_demand_blocks([a, b], [], bm) == 12  # too few finished: trust max_tokens
    recent = [6] * 20  # most outputs end after 6 tokens: a is expected at (10 + 6) / 4 = 4 blocks
    assert projected_demand_blocks([a, b], recent, bm) == 4 + 2
    a.token_ids.extend([7] * 9)  # a already has 9 outputs: never expect fewer than it has + 1
    assert projected_demand_blocks([a], recent, bm) == 5
    sliding = BlockManager(64, 4, group_windows=(6,))
    assert projected_demand_blocks([a], recent, sliding) == 3  # a window of 6 spans 3 blocks of 4
    # Gemma 3-like: a full group holds all 5 blocks, each of two sliding groups at most 3
    assert projected_demand_blocks([a], recent, BlockManager(64, 4, group_windows=(6, None, 6))) == 3 + 5 + 3
    # a hybrid (Qwen3.5): its blocks plus one recurrent-state slot, in blocks of the same bytes
    hybrid = BlockManager(64, 4, False, num_state_slots=4, state_blocks_per_seq=7)
    assert projected_demand_blocks([a], recent, hybrid) == 5 + 7


def test_update_from_output_ends_on_eos_stop_ids_and_length_and_frees_blocks():
    """The one update path: EOS (not before min_tokens, not with ignore_eos), stop token ids (named in
    stop_reason), max_tokens and max_model_len each end a sequence and give its blocks back at once."""
    bm = BlockManager(16, 4)
    sch = Scheduler(bm, 8, 64, eos_token_ids=[2], max_model_len=12)
    a = Sequence("a", 0, [5, 6, 7], SamplingParams(max_tokens=8, min_tokens=2))
    b = Sequence("b", 0, [5, 6, 7], SamplingParams(max_tokens=8, stop_token_ids=[9]))
    c = Sequence("c", 0, [5, 6, 7], SamplingParams(max_tokens=8, ignore_eos=True))
    d = Sequence("d", 0, list(range(10, 20)), SamplingParams(max_tokens=8))  # 10 + 2 = max_model_len
    for s in (a, b, c, d):
        sch.add(s)
    batch = sch.schedule()
    assert sch.update_from_output(batch, [2, 9, 2, 3]) == [a, b, c, d]
    assert a.finish_reason is None  # EOS before min_tokens does not count
    assert b.finish_reason == "stop" and b.stop_reason == 9 and b.block_tables == []
    assert c.finish_reason is None  # ignore_eos
    assert d.finish_reason is None and d.num_tokens == 11
    batch = sch.schedule()
    assert sch.update_from_output(batch, [2, 2, 4]) == [a, c, d]
    assert a.finish_reason == "stop" and a.stop_reason is None  # EOS: no stop_reason, as in vLLM
    assert c.finish_reason is None
    assert d.finish_reason == "length" and d.num_tokens == 12
    assert list(sch.recent_output_lens) == [1, 2, 2]  # b, a, d: what the demand estimate learns from
    assert sch.num_generation_tokens_total == 7
    sch.finish(c, "abort")  # an abort says nothing about how long outputs run
    assert list(sch.recent_output_lens) == [1, 2, 2]
    assert not sch.has_unfinished
    bm.check_invariants([])


def test_update_from_output_needs_one_token_per_sampling_row():
    bm, sch = make(num_blocks=16, block_size=4, budget=64)
    for rid in "ab":
        sch.add(new_seq(rid, 3)[0])
    batch = sch.schedule()
    with pytest.raises(ValueError):
        sch.update_from_output(batch, [7])


def test_scheduler_projects_demand_from_its_own_finished_sequences():
    bm, sch = make(num_blocks=64, block_size=4, budget=64)
    for i in range(16):  # 16 finish after 2 tokens: enough for the p90 estimate
        sch.add(new_seq(f"f{i}", 4, max_tokens=2)[0])
    while sch.has_unfinished:
        run_step(sch)
    (a,) = new_seq("a", 10, max_tokens=30)
    sch.add(a)
    assert sch.projected_demand_blocks() == -(-(10 + 2) // 4)  # expected 2 outputs, not max_tokens=30
