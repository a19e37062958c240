"""SwiGLU's gating, silu(gate) * up, on the MLP's fused gate|up output (one matmul makes both halves)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.cpu_native import native, native_dtype


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:  # (T, 2 * I) -> (T, I)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_mul_cpu(gate_up: torch.Tensor) -> torch.Tensor:
    """One pass of our C kernel in fp32 or bf16 (a vectorized exp within 2 ulp of torch's, bf16 rounded where
    torch's two ops round); else the reference."""
    lib, bf = native(), native_dtype(gate_up)
    if lib is None or bf is None or gate_up.dim() != 2 or gate_up.stride(-1) != 1:
        return silu_mul_ref(gate_up)
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, inter, dtype=gate_up.dtype)
    lib.kvs_silu_mul(gate_up.data_ptr(), out.data_ptr(), rows, inter, gate_up.stride(0), bf, torch.get_num_threads())
    return out
