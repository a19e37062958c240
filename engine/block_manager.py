"""BlockManager: the paged KV pool's bookkeeping. Pure Python, no torch: unit-test it alone.

Blocks are fixed-size slots of KV memory. Each has a reference count; a block with count 0 sits in the free
list, in LRU order of when it was freed. With prefix caching, a block that is full of computed tokens is
registered under a chained hash (hash of the previous block's hash and this block's tokens), so a later
sequence with the same prefix takes it instead of recomputing it. A free block keeps its hash until it is
handed out again, which makes cached-but-free blocks both reusable and evictable: the counts below treat
them as free, because that is what they are to the autoscaler.

KV groups (engine.kv_groups): a model whose layers attend differently (Gemma 3's sliding and full layers)
has several groups, each with its own block table per sequence, all drawing blocks from this one pool. A
sliding group gives back the blocks behind its window; each group caches its own blocks under its own key.
A model whose layers all attend alike is one group, and everything above reads as if groups did not exist.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence as SequenceABC
from dataclasses import dataclass
from typing import Protocol


class BlockTableOwner(Protocol):
    """What the block manager needs of a sequence (engine.sequence.Sequence satisfies it)."""

    token_ids: list[int]
    num_computed_tokens: int
    num_cached_tokens: int
    block_tables: list[list[int]]  # one per KV group (engine.kv_groups), all the same length; [] holds nothing
    block_hashes: list[bytes]
    num_registered_blocks: int
    num_released_blocks: list[int]  # per group: leading table entries that are placeholders (release_out_of_window)
    state_slot: int | None  # hybrid models: its slot of the recurrent-state pool while it holds blocks


@dataclass
class PrefixBlocks:
    """Leading blocks a sequence starts with (a prefix-cache hit or a sibling's prompt): per group, a table of
    the same length whose first num_released[g] entries are placeholders the group's window no longer needs."""

    tables: list[list[int]]
    num_released: list[int]

    @property
    def num_blocks(self) -> int:
        return len(self.tables[0])


def hash_block(prev_hash: bytes | None, token_ids: SequenceABC[int]) -> bytes:
    """Stable chained hash of one full block (never Python's hash(), which is salted per process)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(prev_hash or b"\x00" * 16)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 group_windows: SequenceABC[int | None] = (None,), num_state_slots: int = 0,
                 state_blocks_per_seq: int = 0) -> None:
        """group_windows: per KV group (engine.kv_groups), its sliding window or None (full attention). Every
        group has its own block table per sequence and draws from this one pool; a sliding group gives back
        the blocks behind its window while the sequence runs.

        num_state_slots: hybrid models (linear-attention layers beside the attention ones) keep a fixed-size
        recurrent state per sequence in a pool of this many slots; a sequence takes one with its first blocks
        and gives it back with them (finish, abort, preemption: it recomputes its state when it runs again).
        A state is only valid at the end of what its own sequence computed, so a hybrid model shares no
        prefix blocks (prefix caching off, no sibling sharing): every sequence computes its whole prompt.
        state_blocks_per_seq: one slot's bytes in blocks (rounded up), so that demand and capacity counted in
        blocks include the state (engine.kv_demand, the autoscaler, the router)."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1; got {num_blocks}, {block_size}")
        if not group_windows:
            raise ValueError("need at least one KV group")
        self.block_size = block_size
        self.num_total_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.group_windows = tuple(group_windows)
        self.num_groups = len(self.group_windows)
        self.ref_counts = [0] * num_blocks
        # a cached block is keyed by (group, chained hash): each group caches its own layers' K/V of a block
        self.block_hash: list[tuple[int, bytes] | None] = [None] * num_blocks
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks  # checked on every hit
        self.hash_to_block: dict[tuple[int, bytes], int] = {}
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._num_free_cached = 0
        # prefix-cache counters (in tokens), for metrics
        self.num_prefix_queried_tokens = 0
        self.num_prefix_hit_tokens = 0
        if num_state_slots and enable_prefix_caching:
            raise ValueError("a hybrid model's sequences cannot share prefix blocks (their recurrent state is not "
                             "kept at block boundaries): enable_prefix_caching must be False")
        self.num_state_slots = num_state_slots
        self.state_blocks_per_seq = state_blocks_per_seq if num_state_slots else 0
        self.free_state_slots = list(range(num_state_slots - 1, -1, -1))  # popped from the end: slot 0 first

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

    def window_blocks(self, window: int) -> int:
        """The most blocks a decoding sequence keeps in a group with this window: the window may straddle one
        more block than it fills."""
        return cdiv(window, self.block_size) + 1

    def blocks_held(self, num_tokens: int, max_chunk: int | None = None) -> int:
        """Blocks of the pool one sequence of num_tokens holds at most, over all groups. A sliding group keeps
        its window plus, while a prefill chunk of up to max_chunk tokens is computed, that chunk."""
        full = cdiv(num_tokens, self.block_size)
        total = 0
        for window in self.group_windows:
            if window is None:
                total += full
            else:
                total += min(full, cdiv(window - 1 + (max_chunk or 1), self.block_size) + 1)
        return total

    # ---- prefix cache ----
    def _compute_block_hashes(self, seq: BlockTableOwner, num_full_blocks: int) -> list[bytes]:
        hashes, bs = seq.block_hashes, self.block_size
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            hashes.append(hash_block(hashes[-1] if hashes else None, seq.token_ids[i * bs : (i + 1) * bs]))
        return hashes

    def empty_prefix(self) -> PrefixBlocks:
        return PrefixBlocks([[] for _ in self.group_windows], [0] * self.num_groups)

    def find_cached_prefix(self, seq: BlockTableOwner) -> PrefixBlocks:
        """The longest run of leading full blocks this sequence can take from the cache instead of computing.

        A full group needs every block of the run cached; a sliding group only the blocks the next query's
        window reaches (the ones before it become placeholders). At least one token is always left to compute,
        since the step that computes it yields the logits.
        """
        if not self.enable_prefix_caching:
            return self.empty_prefix()
        bs = self.block_size
        max_blocks = (len(seq.token_ids) - 1) // bs
        hashes = self._compute_block_hashes(seq, max_blocks)

        def cached(g: int, i: int) -> int | None:
            block_id = self.hash_to_block.get((g, hashes[i]))
            if block_id is None or self.block_tokens[block_id] != tuple(seq.token_ids[i * bs : (i + 1) * bs]):
                return None
            return block_id

        found = [[cached(g, i) for i in range(max_blocks)] for g in range(self.num_groups)]
        n = max_blocks
        for g, window in enumerate(self.group_windows):
            if window is None:  # the run of cached blocks from block 0
                n = next((i for i, b in enumerate(found[g][:n]) if b is None), n)
        # sliding groups: the run of cached blocks ending at block n-1 must reach back to the window's first block
        runs = []
        for g, window in enumerate(self.group_windows):
            run, r = [], 0
            for b in found[g]:
                r = r + 1 if b is not None else 0
                run.append(r)
            runs.append(run)
        while n > 0 and any(window is not None and runs[g][n - 1] < n - self.first_visible_block(n * bs, window)
                            for g, window in enumerate(self.group_windows)):
            n -= 1
        self.num_prefix_queried_tokens += len(seq.token_ids)
        self.num_prefix_hit_tokens += n * bs
        prefix = self.empty_prefix()
        for g, window in enumerate(self.group_windows):
            first = 0 if window is None else min(n, self.first_visible_block(n * bs, window))
            prefix.tables[g] = [0] * first + [b for b in found[g][first:n]]  # 0: a placeholder, never read
            prefix.num_released[g] = first
        return prefix

    def register_full_blocks(self, seq: BlockTableOwner) -> None:
        """Offer the sequence's newly full, computed blocks to the prefix cache."""
        if not self.enable_prefix_caching or not seq.block_tables:
            return
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_tables[0]))
        if num_full <= seq.num_registered_blocks:
            return
        hashes = self._compute_block_hashes(seq, num_full)
        bs = self.block_size
        for i in range(seq.num_registered_blocks, num_full):
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            for g, table in enumerate(seq.block_tables):
                key, block_id = (g, hashes[i]), table[i]
                if i < seq.num_released_blocks[g] or self.block_hash[block_id] is not None:
                    continue
                cached = self.hash_to_block.get(key)
                if cached is not None:
                    if self.ref_counts[cached] > 0:
                        continue  # a live copy is cached already
                    self._forget(cached)  # a free copy: cache this live one instead, which eviction cannot take
                self.block_hash[block_id] = key
                self.block_tokens[block_id] = tokens
                self.hash_to_block[key] = block_id
        seq.num_registered_blocks = num_full

    # ---- allocation ----
    def num_new_blocks_needed(self, seq: BlockTableOwner, num_new_tokens: int) -> int:
        """Fresh blocks (over all groups) for num_new_tokens more tokens of a sequence that holds blocks."""
        per_group = cdiv(seq.num_computed_tokens + num_new_tokens, self.block_size) - len(seq.block_tables[0])
        return max(0, per_group) * self.num_groups

    def admit(self, seq: BlockTableOwner, prefix: PrefixBlocks | None, num_new_tokens: int) -> bool:
        """Give a sequence with no blocks its shared prefix blocks (None: none) plus room for num_new_tokens.
        The prefix's placeholder entries are kept in the tables, not taken.

        All or nothing: returns False and changes nothing when the pool cannot cover it.
        """
        assert not seq.block_tables, "admit() is for sequences that hold no blocks"
        if self.num_state_slots and not self.free_state_slots:
            return False
        prefix = prefix or self.empty_prefix()
        if self.num_state_slots and prefix.num_blocks:
            raise ValueError("a hybrid model's sequence cannot start from shared prefix blocks")
        n = prefix.num_blocks
        num_prefix_tokens = n * self.block_size
        num_new_blocks = cdiv(num_prefix_tokens + num_new_tokens, self.block_size) - n
        taken = [b for table, rel in zip(prefix.tables, prefix.num_released) for b in table[rel:]]
        num_prefix_from_free = sum(1 for b in taken if self.ref_counts[b] == 0)
        if num_new_blocks * self.num_groups + num_prefix_from_free > len(self.free_block_ids):
            return False
        for block_id in taken:
            self._take(block_id)
        seq.block_tables = [list(table) for table in prefix.tables]
        seq.num_released_blocks = list(prefix.num_released)
        seq.num_computed_tokens = num_prefix_tokens
        seq.num_cached_tokens = num_prefix_tokens
        seq.num_registered_blocks = n if self.enable_prefix_caching else 0
        for table in seq.block_tables:
            for _ in range(num_new_blocks):
                table.append(self._pop_free())
        if self.num_state_slots:
            seq.state_slot = self.free_state_slots.pop()
        return True

    def allocate_slots(self, seq: BlockTableOwner, num_new_tokens: int) -> bool:
        """Grow a running sequence's tables to hold num_new_tokens more. All or nothing."""
        num_new_blocks = self.num_new_blocks_needed(seq, num_new_tokens)
        if num_new_blocks > len(self.free_block_ids):
            return False
        for table in seq.block_tables:
            for _ in range(num_new_blocks // self.num_groups):
                table.append(self._pop_free())
        return True

    def free(self, seq: BlockTableOwner) -> None:
        """Return all of a sequence's blocks. Tail blocks go first in line for eviction, the shared head last."""
        for table, rel in zip(seq.block_tables, seq.num_released_blocks):
            for block_id in reversed(table[rel:]):
                self._put(block_id)
        seq.block_tables = []
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0
        seq.num_released_blocks = []
        if getattr(seq, "state_slot", None) is not None:
            self.free_state_slots.append(seq.state_slot)
            seq.state_slot = None

    def first_visible_block(self, position: int, window: int) -> int:
        """The first block a query at `position` or later can see through a sliding window of `window` tokens
        (it sees keys from position - window + 1 on): every block before it is behind the window for good."""
        return max(0, position - window + 1) // self.block_size

    def release_out_of_window(self, seq: BlockTableOwner) -> int:
        """In every sliding group, give back the leading blocks no future query can see. The next query sits at
        position num_computed_tokens and sees keys from there - window + 1 on; blocks wholly before that go to
        the free list (a registered one stays in the prefix cache, as a free cached block), and their table
        entries stay as placeholders. Returns how many it released."""
        released = 0
        for g, window in enumerate(self.group_windows):
            if window is None or not seq.block_tables:
                continue
            table = seq.block_tables[g]
            first_needed = min(self.first_visible_block(seq.num_computed_tokens, window), len(table))
            while seq.num_released_blocks[g] < first_needed:
                self._put(table[seq.num_released_blocks[g]])
                seq.num_released_blocks[g] += 1
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
        live = list(live)
        slots = [seq.state_slot for seq in live if getattr(seq, "state_slot", None) is not None]
        if self.num_state_slots:
            if len(set(slots)) != len(slots) or set(slots) & set(self.free_state_slots):
                raise AssertionError(f"a state slot is held twice, or held and free: held {slots}, free "
                                     f"{self.free_state_slots}")
            if len(slots) + len(self.free_state_slots) != self.num_state_slots:
                raise AssertionError(f"state slots leaked: {len(slots)} held + {len(self.free_state_slots)} free of "
                                     f"{self.num_state_slots}")
            if any(seq.block_tables and seq.state_slot is None for seq in live):
                raise AssertionError("a sequence of a hybrid model holds blocks but no state slot")
        elif slots:
            raise AssertionError(f"state slots held without a state pool: {slots}")
        for seq in live:
            held = [b for table, rel in zip(seq.block_tables, seq.num_released_blocks) for b in table[rel:]]
            if seq.block_tables and len({len(t) for t in seq.block_tables}) != 1:
                raise AssertionError(f"a sequence's group tables differ in length: {seq.block_tables}")
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
        for key, block_id in self.hash_to_block.items():
            if self.block_hash[block_id] != key:
                raise AssertionError(f"hash map points at block {block_id}, which holds another hash")
