"""RMSNorm, optionally fused with the residual add that precedes it in every decoder layer."""
from __future__ import annotations

import torch

from kernels.cpu_native import native, native_dtype


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


def rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The reference's arithmetic in one pass of our C kernel (fp32 or bf16, rounding where the reference's ops
    round; rows with a unit last stride), else the reference. One call instead of eight torch ops: at batch 1
    their dispatch costs more than the math."""
    lib, bf = native(), native_dtype(x, weight, residual)
    if (lib is None or bf is None or x.dim() != 2 or x.stride(-1) != 1
            or not weight.is_contiguous()
            or (residual is not None and (residual.shape != x.shape or residual.stride(-1) != 1))):
        return rms_norm_ref(x, weight, eps, residual)
    rows, hidden = x.shape
    out = torch.empty(rows, hidden, dtype=x.dtype)
    res_out = torch.empty_like(out) if residual is not None else None
    lib.kvs_rms_norm(x.data_ptr(), None if residual is None else residual.data_ptr(), out.data_ptr(),
                     None if res_out is None else res_out.data_ptr(), weight.data_ptr(), rows, hidden,
                     x.stride(0), 0 if residual is None else residual.stride(0), eps, bf, torch.get_num_threads())
    return out, res_out
