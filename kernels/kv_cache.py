"""KV write: store this step's keys and values into the paged cache at their slots."""
from __future__ import annotations

import torch


def write_kv_ref(
    key: torch.Tensor,  # (T, Hkv, D)
    value: torch.Tensor,  # (T, Hkv, D)
    k_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
    v_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
    slot_mapping: torch.Tensor,  # (T,) int64; -1 = padding, skip
) -> None:
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    k_cache.view(num_blocks * block_size, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    v_cache.view(num_blocks * block_size, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)
