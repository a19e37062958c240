"""KV write: store this step's keys and values into the paged cache at their slots."""
from __future__ import annotations

import torch

from kernels.cpu_native import native, native_dtype


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


def write_kv_cpu(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """One C call (fp32 or bf16: a row copy per token, padding skipped) instead of a mask, a check and two
    index_copy_; else the reference."""
    lib = native()
    tokens, num_kv_heads, head_dim = key.shape
    if (lib is None or native_dtype(key, value, k_cache, v_cache) is None or slot_mapping.device.type != "cpu"
            or not (k_cache.is_contiguous() and v_cache.is_contiguous() and slot_mapping.is_contiguous())
            or slot_mapping.dtype != torch.int64 or key.stride()[1:] != (head_dim, 1)
            or value.stride()[1:] != (head_dim, 1)):
        return write_kv_ref(key, value, k_cache, v_cache, slot_mapping)
    es = key.element_size()
    lib.kvs_write_kv(key.data_ptr(), value.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), slot_mapping.data_ptr(),
                     tokens, num_kv_heads * head_dim * es, key.stride(0) * es, value.stride(0) * es)
