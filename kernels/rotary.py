"""Rotary position embedding (the rotate-half form of Llama, Mistral and Qwen) from a cos/sin table."""
from __future__ import annotations

import torch

from kernels.cpu_native import native, native_dtype


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotary_ref(
    q: torch.Tensor,  # (T, H, D)
    k: torch.Tensor,  # (T, Hkv, D)
    positions: torch.Tensor,  # (T,) int64
    cos_cache: torch.Tensor,  # (max_pos, D) float32, attention scaling already applied
    sin_cache: torch.Tensor,  # (max_pos, D) float32
) -> tuple[torch.Tensor, torch.Tensor]:
    cos = cos_cache[positions].to(q.dtype)[:, None, :]  # (T, 1, D)
    sin = sin_cache[positions].to(q.dtype)[:, None, :]
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotary_one(lib, x: torch.Tensor, positions: torch.Tensor, cos_cache: torch.Tensor, sin_cache: torch.Tensor,
                bf: int):
    tokens, heads, head_dim = x.shape
    out = torch.empty(tokens, heads, head_dim, dtype=x.dtype)
    lib.kvs_rotary(x.data_ptr(), out.data_ptr(), positions.data_ptr(), cos_cache.data_ptr(), sin_cache.data_ptr(),
                   tokens, heads, head_dim, x.stride(0), x.stride(1), cos_cache.stride(0), bf, torch.get_num_threads())
    return out


def rotary_cpu(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_cache: torch.Tensor,
               sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's arithmetic (fp32 or bf16 q/k, rounding where the reference's ops round; fp32 tables) in
    our C kernel, reading q and k in place inside the fused qkv output; else the reference."""
    lib, bf = native(), native_dtype(q, k)
    if (lib is None or bf is None or native_dtype(cos_cache, sin_cache) != 0 or positions.device.type != "cpu"
            or q.stride(-1) != 1 or k.stride(-1) != 1 or positions.dtype != torch.int64
            or not positions.is_contiguous() or cos_cache.stride(-1) != 1 or sin_cache.stride() != cos_cache.stride()):
        return rotary_ref(q, k, positions, cos_cache, sin_cache)
    return (_rotary_one(lib, q, positions, cos_cache, sin_cache, bf),
            _rotary_one(lib, k, positions, cos_cache, sin_cache, bf))
