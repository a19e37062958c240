"""BlockManager: the paged KV pool's bookkeeping. Pure Python, no torch: unit-test it alone.

Blocks are fixed-size slots of KV memory. Each has a reference count; a block with count 0 sits in the free
list, in LRU order of when it was freed. With prefix caching, a block that is full of computed tokens is
registered under a chained hash (hash of the previous block's hash and this block's tokens), so a later
sequence with the same prefix takes it instead of recomputing it. A free block keeps its hash until it is
handed out again, which makes cached-but-free blocks both reusable and evictable: the counts below treat
them as free, because that is what they are to the autoscaler.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence as SequenceABC
from typing import Protocol


class BlockTableOwner(Protocol):
    """What the block manager needs of a sequence (engine.sequence.Sequence satisfies it)."""

    token_ids: list[int]
    num_computed_tokens: int
    num_cached_tokens: int
    block_ids: list[int]
    block_hashes: list[bytes]
    num_registered_blocks: int
    num_released_blocks: int  # leading entries of block_ids that are placeholders (see release_out_of_window)


def hash_block(prev_hash: bytes | None, token_ids: SequenceABC[int]) -> bytes:
    """Stable chained hash of one full block (never Python's hash(), which is salted per process)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(prev_hash or b"\x00" * 16)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1; got {num_blocks}, {block_size}")
        self.block_size = block_size
        self.num_total_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks  # checked on every hit
        self.hash_to_block: dict[bytes, int] = {}
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._num_free_cached = 0
        # prefix-cache counters (in tokens), for metrics
        self.num_prefix_queried_tokens = 0
        self.num_prefix_hit_tokens = 0

    # ---- counts the scheduler, metrics and autoscaler read (all O(1)) ----
    @property
    def num_free_blocks(self) -> int:
        """Blocks no running sequence holds, cached-but-evictable ones included."""
        return len(self.free_block_ids)

    @property
    def num_cached_free_blocks(self) -> int:
        return self._num_free_cached

    @property
    def num_used_blocks(self) -> int:
        return self.num_total_blocks - len(self.free_block_ids)

    def num_blocks_for_tokens(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    # ---- prefix cache ----
    def _compute_block_hashes(self, seq: BlockTableOwner, num_full_blocks: int) -> list[bytes]:
        hashes, bs = seq.block_hashes, self.block_size
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            hashes.append(hash_block(hashes[-1] if hashes else None, seq.token_ids[i * bs : (i + 1) * bs]))
        return hashes

    def find_cached_prefix(self, seq: BlockTableOwner) -> list[int]:
        """Block ids that already hold this sequence's leading full blocks.

        At least one token is always left to compute, since the step that computes it yields the logits.
        """
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        max_blocks = (len(seq.token_ids) - 1) // bs
        hits: list[int] = []
        for i, h in enumerate(self._compute_block_hashes(seq, max_blocks)):
            block_id = self.hash_to_block.get(h)
            if block_id is None or self.block_tokens[block_id] != tuple(seq.token_ids[i * bs : (i + 1) * bs]):
                break
            hits.append(block_id)
        self.num_prefix_queried_tokens += len(seq.token_ids)
        self.num_prefix_hit_tokens += len(hits) * bs
        return hits

    def register_full_blocks(self, seq: BlockTableOwner) -> None:
        """Offer the sequence's newly full, computed blocks to the prefix cache."""
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_ids))
        if num_full <= seq.num_registered_blocks:
            return
        hashes = self._compute_block_hashes(seq, num_full)
        bs = self.block_size
        for i in range(seq.num_registered_blocks, num_full):
            block_id = seq.block_ids[i]
            if self.block_hash[block_id] is None and hashes[i] not in self.hash_to_block:
                self.block_hash[block_id] = hashes[i]
                self.block_tokens[block_id] = tuple(seq.token_ids[i * bs : (i + 1) * bs])
                self.hash_to_block[hashes[i]] = block_id
        seq.num_registered_blocks = num_full

    # ---- allocation ----
    def num_new_blocks_needed(self, seq: BlockTableOwner, num_new_tokens: int) -> int:
        return max(0, cdiv(seq.num_computed_tokens + num_new_tokens, self.block_size) - len(seq.block_ids))

    def admit(self, seq: BlockTableOwner, prefix_block_ids: Iterable[int], num_new_tokens: int,
              num_released: int = 0) -> bool:
        """Give a sequence with no blocks its shared prefix blocks plus room for num_new_tokens. The first
        num_released prefix entries are placeholders (a sliding-window sibling's released blocks, which this
        sequence's queries cannot see either): kept in the table, not taken.

        All or nothing: returns False and changes nothing when the pool cannot cover it.
        """
        assert not seq.block_ids, "admit() is for sequences that hold no blocks"
        prefix = list(prefix_block_ids)
        num_prefix_tokens = len(prefix) * self.block_size
        num_new_blocks = cdiv(num_prefix_tokens + num_new_tokens, self.block_size) - len(prefix)
        num_prefix_from_free = sum(1 for b in prefix[num_released:] if self.ref_counts[b] == 0)
        if num_new_blocks + num_prefix_from_free > len(self.free_block_ids):
            return False
        for block_id in prefix[num_released:]:
            self._take(block_id)
        seq.block_ids = prefix
        seq.num_released_blocks = num_released
        seq.num_computed_tokens = num_prefix_tokens
        seq.num_cached_tokens = num_prefix_tokens
        seq.num_registered_blocks = len(prefix) if self.enable_prefix_caching else 0
        for _ in range(num_new_blocks):
            seq.block_ids.append(self._pop_free())
        return True

    def allocate_slots(self, seq: BlockTableOwner, num_new_tokens: int) -> bool:
        """Grow a running sequence's table to hold num_new_tokens more. All or nothing."""
        num_new_blocks = self.num_new_blocks_needed(seq, num_new_tokens)
        if num_new_blocks > len(self.free_block_ids):
            return False
        for _ in range(num_new_blocks):
            seq.block_ids.append(self._pop_free())
        return True

    def free(self, seq: BlockTableOwner) -> None:
        """Return all of a sequence's blocks. Tail blocks go first in line for eviction, the shared head last."""
        for block_id in reversed(seq.block_ids[seq.num_released_blocks:]):
            self._put(block_id)
        seq.block_ids = []
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0
        seq.num_released_blocks = 0

    def first_visible_block(self, position: int, window: int) -> int:
        """The first block a query at `position` or later can see through a sliding window of `window` tokens
        (it sees keys from position - window + 1 on): every block before it is behind the window for good."""
        return max(0, position - window + 1) // self.block_size

    def release_out_of_window(self, seq: BlockTableOwner, window: int) -> int:
        """Sliding-window attention (every layer's window `window`): give back the leading blocks no future
        query can see. The next query sits at position num_computed_tokens and sees keys from there - window + 1
        on; blocks wholly before that go to the free list (a registered one stays in the prefix cache, as a
        free cached block), and their table entries stay as placeholders. Returns how many it released."""
        first_needed = min(self.first_visible_block(seq.num_computed_tokens, window), len(seq.block_ids))
        released = 0
        while seq.num_released_blocks < first_needed:
            self._put(seq.block_ids[seq.num_released_blocks])
            seq.num_released_blocks += 1
            released += 1
        return released

    def reset_prefix_cache(self) -> None:
        """Forget every cached-but-free block (used ones keep serving their sequences)."""
        for block_id in self.free_block_ids:
            self._forget(block_id)

    # ---- internals ----
    def _take(self, block_id: int) -> None:
        if self.ref_counts[block_id] == 0:
            del self.free_block_ids[block_id]
            if self.block_hash[block_id] is not None:
                self._num_free_cached -= 1
        self.ref_counts[block_id] += 1

    def _put(self, block_id: int) -> None:
        self.ref_counts[block_id] -= 1
        if self.ref_counts[block_id] < 0:
            raise AssertionError(f"block {block_id} freed more often than taken")
        if self.ref_counts[block_id] == 0:
            self.free_block_ids[block_id] = None
            if self.block_hash[block_id] is not None:
                self._num_free_cached += 1

    def _pop_free(self) -> int:
        block_id, _ = self.free_block_ids.popitem(last=False)  # least recently freed first
        self._forget(block_id)
        self.ref_counts[block_id] = 1
        return block_id

    def _forget(self, block_id: int) -> None:
        h = self.block_hash[block_id]
        if h is None:
            return
        if self.ref_counts[block_id] == 0:
            self._num_free_cached -= 1
        if self.hash_to_block.get(h) == block_id:
            del self.hash_to_block[h]
        self.block_hash[block_id] = None
        self.block_tokens[block_id] = None

    def check_invariants(self, live: Iterable[BlockTableOwner]) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent with `live`, every sequence that may hold
        blocks (pass [] when none should): a block whose reference count no live table explains is a leak.
        For tests and debugging."""
        holders = [0] * self.num_total_blocks
        for seq in live:
            held = seq.block_ids[seq.num_released_blocks:]
            if len(set(held)) != len(held):
                raise AssertionError(f"a sequence holds a block twice: {held}")
            for block_id in held:
                holders[block_id] += 1
        if holders != self.ref_counts:
            leaked = [b for b, (h, r) in enumerate(zip(holders, self.ref_counts)) if r > h]
            raise AssertionError(f"reference counts differ from the block tables that hold them (blocks counted "
                                 f"but held by no live sequence, i.e. leaked: {leaked[:10]})")
        if any(r < 0 for r in self.ref_counts):
            raise AssertionError("negative reference count")
        free = {b for b, r in enumerate(self.ref_counts) if r == 0}
        if free != set(self.free_block_ids) or len(free) != len(self.free_block_ids):
            raise AssertionError("free list differs from the blocks with reference count 0")
        num_held = sum(1 for r in self.ref_counts if r > 0)
        if num_held != self.num_used_blocks or num_held + self.num_free_blocks != self.num_total_blocks:
            raise AssertionError(f"{num_held} blocks are held, but used={self.num_used_blocks} and "
                                 f"free={self.num_free_blocks} of {self.num_total_blocks}")
        if self._num_free_cached != sum(1 for b in self.free_block_ids if self.block_hash[b] is not None):
            raise AssertionError("cached-free counter is off")
        for h, block_id in self.hash_to_block.items():
            if self.block_hash[block_id] != h:
                raise AssertionError(f"hash map points at block {block_id}, which holds another hash")
