"""Linear layers, y = x @ W.T + b. The reference is F.linear.

On CPU, F.linear goes to MKL, whose small-row GEMMs are slow on this class of machine (AVX2, AMD): at the
row counts decoding runs at (1-64) torch's oneDNN linear, `torch.ops.mkldnn._linear_pointwise` (the op
torch.compile's CPU backend emits), measured 1.1-2.4x faster on the default model's shapes and 2x on its LM
head (bench/throughput.py prints the step-time split it leads to). It is used when this torch build has it
and it agrees with F.linear on a probe for the dtype; otherwise F.linear.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


@functools.cache
def _onednn_works(dtype: torch.dtype) -> bool:
    op = getattr(getattr(torch.ops, "mkldnn", None), "_linear_pointwise", None)
    if op is None or not torch.backends.mkldnn.is_available():
        return False
    try:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(5, 48, generator=g).to(dtype)
        w = torch.randn(40, 48, generator=g).to(dtype)
        b = torch.randn(40, generator=g).to(dtype)
        tol = 1e-4 if dtype == torch.float32 else 5e-2
        return all(torch.allclose(op(x, w, bb, "none", [], "").float(), F.linear(x, w, bb).float(), atol=tol, rtol=tol)
                   for bb in (None, b))
    except (RuntimeError, NotImplementedError):
        return False


def linear_cpu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if x.dim() == 2 and x.device.type == "cpu" and x.dtype == weight.dtype and _onednn_works(x.dtype):
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)
