"""RMSNorm, optionally fused with the residual add that precedes it in every decoder layer."""
from __future__ import annotations

import torch


def rms_norm_ref(
    x: torch.Tensor,  # (T, hidden)
    weight: torch.Tensor,  # (hidden,)
    eps: float,
    residual: torch.Tensor | None = None,  # (T, hidden): if given, x + residual is normalized and returned
) -> tuple[torch.Tensor, torch.Tensor | None]:
    if residual is not None:
        x = x + residual
        residual = x
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype), residual
