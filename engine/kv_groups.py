"""KV groups: how layers with different attention windows share one paged pool. Pure Python, no torch.

A model whose layers all attend the same way (every layer full, or every layer on one sliding window) is one
group: a block holds block_size tokens of K/V for every layer, and a sequence has one block table.

A model that mixes them (Gemma 3: five sliding layers to one full) cannot free a block behind the window while
its full layers still read it, unless the two kinds keep separate tables. The layout follows vLLM's hybrid KV
cache manager: layers of one kind are cut into groups of `group_size` layers (the gcd of the kinds' layer
counts, so no group is padded), every group has its own block table per sequence, and a block of the shared
pool holds block_size tokens of K/V for group_size layers: whichever group takes it. Layer i reads and writes
the pool through slot layer_slot[i] of the (group_size, 2, num_blocks, ...) cache, at its group's block ids.
Sliding groups give back blocks behind their window while the sequence runs; full groups keep every block.

Gemma 3 270M (15 sliding layers, window 512; 3 full): 6 groups of 3 layers. A 4096-token sequence holds 4096
tokens of one full group plus about 512 of each of five sliding groups: 2.9x less than 6 full groups.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from math import gcd


@dataclass(frozen=True)
class KVGroups:
    windows: tuple[int | None, ...]  # per group: its layers' sliding window, None for full attention
    layer_group: tuple[int, ...]  # per layer: which group's block table it reads
    layer_slot: tuple[int, ...]  # per layer: which of the group_size cache slots it owns
    group_size: int  # layers per group (every group has exactly this many)

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def num_layers(self) -> int:
        return len(self.layer_group)

    @classmethod
    def from_layer_windows(cls, layer_windows: Sequence[int | None], free_out_of_window: bool = True) -> KVGroups:
        """Group layers by window. free_out_of_window=False: one group of every layer that keeps all blocks
        (windows still mask attention; nothing is freed), the layout before per-group accounting."""
        n = len(layer_windows)
        if n == 0:
            raise ValueError("a model with no attention layers has no KV groups")
        kinds = list(dict.fromkeys(layer_windows))  # in order of first appearance
        if not free_out_of_window:
            kinds = [None]
            layer_windows = [None] * n
        if len(kinds) == 1:
            return cls((kinds[0],), (0,) * n, tuple(range(n)), n)
        layers_of = {k: [i for i, w in enumerate(layer_windows) if w == k] for k in kinds}
        size = 0
        for layers in layers_of.values():
            size = gcd(size, len(layers))
        windows: list[int | None] = []
        layer_group, layer_slot = [0] * n, [0] * n
        for kind in kinds:
            layers = layers_of[kind]
            for start in range(0, len(layers), size):
                for slot, layer in enumerate(layers[start : start + size]):
                    layer_group[layer], layer_slot[layer] = len(windows), slot
                windows.append(kind)
        return cls(tuple(windows), tuple(layer_group), tuple(layer_slot), size)

    def block_bytes(self, block_size: int, num_kv_heads: int, head_dim: int, elem_bytes: int) -> int:
        """The seed's M = 2 * L * H_kv * d_head * T * b for one block of T = block_size tokens, L the layers of
        one group (a block holds one group's layers): what the runner sizes its pool with."""
        return self.group_size * 2 * block_size * num_kv_heads * head_dim * elem_bytes

    def bytes_per_token(self, num_kv_heads: int, head_dim: int, elem_bytes: int) -> int:
        """KV bytes one token of a sequence adds over every group (full groups; a sliding group only while the
        token is inside its window): 2 * L * H_kv * d_head * b with L the layers that keep KV."""
        return self.num_groups * self.block_bytes(1, num_kv_heads, head_dim, elem_bytes)

    def describe(self) -> str:
        full = sum(1 for w in self.windows if w is None)
        parts = [f"{full} full"] if full else []
        for w in sorted({w for w in self.windows if w is not None}):
            parts.append(f"{sum(1 for x in self.windows if x == w)} on a {w}-token window")
        return f"{self.num_groups} KV group(s) of {self.group_size} layer(s): " + ", ".join(parts)
