"""Block manager: exact block ids, prefix-cache hits, LRU eviction order, counts. No torch involved."""
from __future__ import annotations

import sys

import pytest

from engine.block_manager import BlockManager, hash_block
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence


def seq(tokens, rid="r"):
    return Sequence(rid, 0, list(tokens), SamplingParams(max_tokens=4))


def test_pure_python_no_torch():
    import subprocess

    code = ("import sys; import engine.block_manager, engine.scheduler; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def cached_then_freed(bm, tokens, rid):
    """A sequence that computed all its tokens, offered its full blocks to the cache, and ended."""
    s = seq(tokens, rid)
    assert bm.admit(s, None, len(s.token_ids))
    s.num_computed_tokens = len(s.token_ids)
    bm.register_full_blocks(s)
    bm.free(s)
    return s


def test_hash_is_stable_and_chained():
    a = hash_block(None, [1, 2, 3, 4])
    assert a == hash_block(None, [1, 2, 3, 4])
    assert hash_block(a, [5, 6, 7, 8]) != hash_block(None, [5, 6, 7, 8])
    assert a.hex() == hash_block(None, (1, 2, 3, 4)).hex()  # content, not object identity


def test_admit_and_grow_exact_ids():
    bm = BlockManager(num_blocks=6, block_size=4)
    s = seq(range(10))
    assert bm.admit(s, None, 10)
    assert s.block_tables[0] == [0, 1, 2]
    s.num_computed_tokens = 10
    s.token_ids.append(99)
    assert bm.allocate_slots(s, 1) and s.block_tables[0] == [0, 1, 2]  # slot 11 still fits block 2
    s.num_computed_tokens = 11
    s.token_ids.append(98)
    assert bm.allocate_slots(s, 1)
    s.num_computed_tokens = 12
    assert bm.allocate_slots(s, 1) and s.block_tables[0] == [0, 1, 2, 3]
    assert (bm.num_free_blocks, bm.num_used_blocks) == (2, 4)
    bm.check_invariants([s])


def test_all_or_nothing_when_pool_is_short():
    bm = BlockManager(num_blocks=2, block_size=4)
    s = seq(range(12))
    assert not bm.admit(s, None, 12)
    assert s.block_tables == [] and bm.num_free_blocks == 2
    bm.check_invariants([s])


def test_prefix_hit_reuses_cached_free_blocks_and_keeps_one_token_to_compute():
    bm = BlockManager(num_blocks=8, block_size=4)
    cached_then_freed(bm, range(8), "a")
    assert bm.num_cached_free_blocks == 2 and bm.num_free_blocks == 8
    b = seq(list(range(8)) + [50], "b")
    hits = bm.find_cached_prefix(b)
    assert hits.tables == [[0, 1]]
    assert bm.admit(b, hits, 1)
    assert b.block_tables[0][:2] == [0, 1] and b.num_computed_tokens == 8 and b.num_cached_tokens == 8
    assert bm.num_cached_free_blocks == 0
    # same 8 tokens exactly: only the first block may hit, the last token must be computed
    c = seq(range(8), "c")
    assert bm.find_cached_prefix(c).tables == [[0]]
    bm.check_invariants([b])


def test_lru_eviction_takes_oldest_freed_and_tail_first():
    bm = BlockManager(num_blocks=4, block_size=2)
    cached_then_freed(bm, range(4), "a")  # blocks 0, 1 cached; freed tail first: free order 2, 3, 1, 0
    assert list(bm.free_block_ids) == [2, 3, 1, 0]
    b = seq(range(100, 106), "b")
    assert bm.admit(b, None, 6)  # takes 2, 3 (never cached), then evicts 1 (a's tail) before 0 (a's head)
    assert b.block_tables[0] == [2, 3, 1]
    assert bm.find_cached_prefix(seq(list(range(4)) + [7])).tables == [[0]]
    bm.check_invariants([b])


def test_shared_block_needs_all_holders_to_free():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = seq([1, 2, 3], "a")
    assert bm.admit(a, None, 3)
    a.num_computed_tokens = 3
    bm.register_full_blocks(a)
    b = seq([1, 2, 9], "b")
    assert bm.admit(b, bm.find_cached_prefix(b), 1)
    assert bm.ref_counts[a.block_tables[0][0]] == 2
    bm.free(a)
    assert bm.ref_counts[b.block_tables[0][0]] == 1 and bm.num_used_blocks == 2
    bm.free(b)
    assert bm.num_free_blocks == 4
    bm.check_invariants([])


def test_prefix_caching_off_never_hits():
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=False)
    a = seq([1, 2, 3, 4, 5], "a")
    assert bm.admit(a, None, 5)
    a.num_computed_tokens = 5
    bm.register_full_blocks(a)
    bm.free(a)
    assert bm.find_cached_prefix(seq([1, 2, 3, 4, 5])).tables == [[]] and bm.num_cached_free_blocks == 0


def test_double_free_is_caught():
    bm = BlockManager(num_blocks=2, block_size=2)
    a = seq([1, 2], "a")
    assert bm.admit(a, None, 2)
    tables = [list(t) for t in a.block_tables]
    bm.free(a)
    a.block_tables, a.num_released_blocks = tables, [0]
    with pytest.raises(AssertionError):
        bm.free(a)


def test_invariant_checker_finds_a_leaked_block():
    """The fuzz's strongest claim is only as good as this: a block whose count no live table explains."""
    bm = BlockManager(num_blocks=6, block_size=4)
    s = seq(range(8))
    assert bm.admit(s, None, 8)
    bm.check_invariants([s])
    leaked = bm._pop_free()  # taken by nobody: what a missing free() on some exit path leaves behind
    with pytest.raises(AssertionError, match=rf"leaked: \[{leaked}\]"):
        bm.check_invariants([s])
    bm = BlockManager(num_blocks=6, block_size=4)
    s = seq(range(8))
    bm.admit(s, None, 8)
    with pytest.raises(AssertionError, match="leaked"):  # a sequence that ended without giving its blocks back
        bm.check_invariants([])
    bm.free(s)
    bm.check_invariants([])


# ---- KV groups: a sliding and a full group sharing one pool (Gemma 3's layout, engine/kv_groups.py) ----
def test_groups_take_blocks_from_one_pool_and_only_the_sliding_one_releases():
    bm = BlockManager(num_blocks=12, block_size=4, group_windows=(6, None))
    s = seq(range(10))
    assert bm.admit(s, None, 10)
    assert s.block_tables == [[0, 1, 2], [3, 4, 5]] and bm.num_used_blocks == 6
    s.num_computed_tokens = 10  # the next query (position 10) sees keys 5..10: block 0 (0..3) is behind it
    assert bm.release_out_of_window(s) == 1
    assert s.num_released_blocks == [1, 0] and bm.num_used_blocks == 5
    s.token_ids += [50, 51, 52]
    assert bm.allocate_slots(s, 3)  # 13 tokens: a fourth block in each group
    assert [len(t) for t in s.block_tables] == [4, 4] and bm.num_used_blocks == 7
    s.num_computed_tokens = 13  # query at 13 sees 8..13: blocks 0 and 1 behind
    assert bm.release_out_of_window(s) == 1 and s.num_released_blocks == [2, 0]
    bm.check_invariants([s])
    bm.free(s)
    assert bm.num_free_blocks == 12
    bm.check_invariants([])


def test_groups_are_all_or_nothing_over_every_group():
    bm = BlockManager(num_blocks=5, block_size=4, group_windows=(6, None))
    s = seq(range(12))
    assert not bm.admit(s, None, 12)  # 3 blocks in each of 2 groups: 6 > 5
    assert s.block_tables == [] and bm.num_free_blocks == 5
    assert bm.blocks_held(12) == 6 and bm.blocks_held(400) == 100 + 3  # the sliding group stays at its window


def test_group_prefix_hit_needs_every_full_block_but_only_the_window_of_a_sliding_group():
    bm = BlockManager(num_blocks=16, block_size=4, group_windows=(6, None))
    cached_then_freed(bm, range(16), "a")  # 4 full blocks cached in each group (sliding ones too)
    sliding, full = a_tables(bm, range(16))
    b = seq(list(range(16)) + [99], "b")
    hit = bm.find_cached_prefix(b)
    assert hit.num_blocks == 4
    # the next query (position 16) sees keys 11..16: the sliding group needs blocks 2 and 3 only
    assert hit.num_released == [2, 0] and hit.tables[1] == full and hit.tables[0][2:] == sliding[2:]
    assert bm.admit(b, hit, 1)
    assert bm.num_used_blocks == 2 + 4 + 2  # the sliding group took 2 cached blocks, the full one 4, plus 1 new each
    bm.check_invariants([b])
    bm.free(b)

    # the sliding group's leading blocks gone from the cache: a hit still works, they are not needed
    bm._forget(sliding[0])
    assert bm.find_cached_prefix(seq(list(range(16)) + [99], "c")).num_blocks == 4
    # a block inside the window gone: the hit falls back to where the window's blocks are all there
    bm._forget(sliding[3])
    short = bm.find_cached_prefix(seq(list(range(16)) + [99], "d"))
    assert short.num_blocks == 3 and short.num_released == [1, 0]  # the query at 12 sees 7..12: blocks 1, 2
    assert short.tables == [[0] + sliding[1:3], full[:3]]  # 0: a placeholder, not taken
    bm._forget(full[1])  # a full group needs its whole run: 1 block, but then the sliding group needs block 0
    assert bm.find_cached_prefix(seq(list(range(16)) + [99], "e")).num_blocks == 0
    bm.check_invariants([])


def a_tables(bm, tokens):
    """Block ids the cache holds for each group's leading full blocks of `tokens`."""
    hashes, prev, bs = [], None, bm.block_size
    tokens = list(tokens)
    for i in range(len(tokens) // bs):
        prev = hash_block(prev, tokens[i * bs : (i + 1) * bs])
        hashes.append(prev)
    return [[bm.hash_to_block[(g, h)] for h in hashes] for g in range(bm.num_groups)]


def test_a_live_copy_replaces_a_free_cached_one():
    """A sequence that recomputed a block another one left in the cache (say after a preemption) gets its own
    copy cached: the free copy may be evicted any time, the live one not while the sequence runs."""
    bm = BlockManager(num_blocks=6, block_size=2)
    cached_then_freed(bm, [1, 2, 3], "a")  # block 0 caches [1, 2], free
    b = seq([1, 2, 3, 4, 5], "b")
    assert bm.admit(b, None, 5)  # no prefix given: computes [1, 2] again, in a new block
    b.num_computed_tokens = 5
    bm.register_full_blocks(b)
    copy = b.block_tables[0][0]
    assert copy != 0 and bm.find_cached_prefix(seq([1, 2, 9], "c")).tables == [[copy]]
    assert bm.block_hash[0] is None and bm.num_cached_free_blocks == 0
    bm.check_invariants([b])
