"""AttentionMetadata: what attention needs to know about one step's flattened batch.

Built once per step by the model runner and passed explicitly to every attention call (no module globals).
Tokens of all scheduled sequences are flattened into one axis T; sequence b owns tokens
query_start_loc[b]:query_start_loc[b+1], the last of which sits at position seq_lens[b] - 1.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # (T,) int64: cache slot (block_id * block_size + offset) of each new token
    query_start_loc: torch.Tensor  # (B + 1,) int32: prefix sums of query lengths
    seq_lens: torch.Tensor  # (B,) int32: context length of each sequence after this step
    block_tables: torch.Tensor  # (B, max_blocks) int32: block ids, padded with 0
    query_lens_host: list[int]  # the same facts on the host, so references need no device sync
    seq_lens_host: list[int]
    max_query_len: int
    max_seq_len: int
    # Optional device-side token tables (sequence index and position of every query token). A kernel that
    # needs them builds them from the host lists when absent; the CUDA-graph path fills them into static
    # buffers, because nothing may be built from host lists inside a captured graph.
    token_seq: torch.Tensor | None = None  # (T,) int32
    token_pos: torch.Tensor | None = None  # (T,) int32
    # Buffers an op may reuse across steps (the runner passes the same dict every step): on CPU a fresh
    # multi-MiB tensor per layer costs more in page faults than the copy that fills it.
    scratch: dict[Any, Any] = field(default_factory=dict, repr=False, compare=False)
    plans: dict[Any, Any] = field(default_factory=dict, repr=False, compare=False)  # per-step work an op
    # derives from the above and every layer would otherwise rebuild (index tensors, masks)
    # Models with several KV groups (engine.kv_groups): one metadata per group, the first being this one; the
    # others differ only in slot_mapping, block_tables and plans. None: one group
    group_metas: list[AttentionMetadata] | None = field(default=None, repr=False, compare=False)
    # Hybrid models (linear-attention layers with a recurrent state per sequence): per sequence of the batch its
    # slot of the state pool and whether this step starts it from zeros (its first chunk); per linear layer its
    # pool tensors (engine.models.qwen3_5). None: no such layers
    state_slots: list[int] | None = None
    state_fresh: list[bool] | None = None
    linear_states: list[Any] | None = field(default=None, repr=False, compare=False)

    def for_group(self, group: int) -> AttentionMetadata:
        """The metadata a layer of KV group `group` attends with."""
        return self if self.group_metas is None else self.group_metas[group]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1
