"""Attention and fused ops behind one interface; `select_ops` is the one place a backend is chosen.

Every op has a plain torch reference (`*_ref`) with the signature its Triton kernel keeps. The CPU path
(`*_cpu`) runs our C kernels in fp32 where they build (kernels/cpu_native.py: small-batch GEMV, RMSNorm,
rotary, KV write, decode attention reading pages in place, SwiGLU gating), oneDNN for larger matmuls and
torch's fused SDPA for prefill attention, and the references otherwise; each is checked against its
reference. CUDA uses the Triton kernels where they exist and cuBLAS for linear layers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from kernels.activation import silu_mul_cpu, silu_mul_ref
from kernels.kv_cache import write_kv_cpu, write_kv_ref
from kernels.linear import linear_cpu, linear_ref
from kernels.metadata import AttentionMetadata
from kernels.norm import rms_norm_cpu, rms_norm_ref
from kernels.paged_attention import paged_attention_ref, paged_attention_sdpa
from kernels.rotary import rotary_cpu, rotary_ref

__all__ = ["AttentionMetadata", "Ops", "select_ops"]


@dataclass(frozen=True)
class Ops:
    name: str
    write_kv: Callable
    paged_attention: Callable
    rms_norm: Callable
    rotary: Callable
    linear: Callable
    silu_mul: Callable


# The CPU path. Attention is the reference's semantics through torch's fused SDPA (paged_attention_sdpa,
# checked against paged_attention_ref); REFERENCE_OPS is the plain form every other path is checked against.
TORCH_OPS = Ops("torch", write_kv_cpu, paged_attention_sdpa, rms_norm_cpu, rotary_cpu, linear_cpu, silu_mul_cpu)
REFERENCE_OPS = Ops("reference", write_kv_ref, paged_attention_ref, rms_norm_ref, rotary_ref, linear_ref,
                    silu_mul_ref)


def select_ops(backend: str, device_type: str) -> Ops:
    """backend: "auto" | "torch" | "triton". auto = torch references on CPU, Triton on CUDA when available."""
    if backend == "torch" or (backend == "auto" and device_type != "cuda"):
        return TORCH_OPS
    try:
        from kernels.triton_ops import TRITON_OPS  # noqa: PLC0415 - triton is optional
    except ImportError as e:
        if backend == "triton":
            raise RuntimeError(
                f"attention_backend='triton' was asked for but the Triton kernels cannot load ({e}). "
                "Install triton, or use attention_backend='torch'."
            ) from e
        return TORCH_OPS
    return TRITON_OPS
