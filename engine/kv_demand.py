"""Projected KV demand: the blocks live sequences will hold when they finish, not only what they hold now.

What the autoscaler and router need to know ahead of time. A sequence's output length is estimated as
the 90th percentile of recently finished ones (its own max_tokens until 16 have finished), never below
what it has already generated plus one, never above its max_tokens. Pure Python: the simulator in
bench/autoscale_sim.py uses the same estimate.
"""
from __future__ import annotations

from collections.abc import Iterable

from engine.block_manager import BlockManager, cdiv
from engine.sequence import Sequence

MIN_FINISHED_FOR_ESTIMATE = 16


def expected_output_len_p90(recent_output_lens: Iterable[int]) -> int | None:
    recent = sorted(recent_output_lens)
    if len(recent) < MIN_FINISHED_FOR_ESTIMATE:
        return None
    return recent[int(0.9 * (len(recent) - 1))]


def projected_demand_blocks(seqs: Iterable[Sequence], recent_output_lens: Iterable[int],
                            block_manager: BlockManager) -> int:
    """Blocks of block_manager's pool the sequences will hold at their end, over every KV group: a full group
    holds the whole sequence, a sliding group at most the blocks its window spans while it decodes (blocks
    behind it go back to the pool: BlockManager.release_out_of_window). Hybrid models: plus each sequence's
    recurrent-state slot, in blocks of the same bytes (BlockManager.state_blocks_per_seq). A block several
    sequences share (a cached prompt prefix, the prompt of n samples) is counted once: the pool holds it once.
    `seqs` are all the sequences holding blocks of the pool (the scheduler's live ones); O(sequences)."""
    p90 = expected_output_len_p90(recent_output_lens)
    bm = block_manager
    caps = [None if w is None else bm.window_blocks(w) for w in bm.group_windows]
    total = held = 0
    for seq in seqs:
        max_out = seq.params.max_tokens
        expected_out = max_out if p90 is None else min(max_out, max(p90, seq.num_output_tokens + 1))
        blocks = cdiv(seq.num_prompt_tokens + expected_out, bm.block_size)
        total += sum(blocks if cap is None else min(blocks, cap) for cap in caps) + bm.state_blocks_per_seq
        held += sum(len(table) - released for table, released in zip(seq.block_tables, seq.num_released_blocks))
    # what the sequences hold beyond the distinct blocks in use is held twice or more: count it once
    return total - max(0, held - bm.num_used_blocks)
