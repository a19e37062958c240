"""Rotary position embedding (the rotate-half form of Llama, Mistral and Qwen) from a cos/sin table."""
from __future__ import annotations

import torch


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
