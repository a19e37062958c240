"""Attention and fused ops behind one interface; `select_ops` is the one place a backend is chosen.

Every op has a plain torch reference (`*_ref`) with the signature its Triton kernel keeps. The CPU path
uses the references; CUDA uses the Triton kernels where they exist.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from kernels.kv_cache import write_kv_ref
from kernels.metadata import AttentionMetadata
from kernels.norm import rms_norm_ref
from kernels.paged_attention import paged_attention_ref
from kernels.rotary import rotary_ref

__all__ = ["AttentionMetadata", "Ops", "select_ops"]


@dataclass(frozen=True)
class Ops:
    name: str
    write_kv: Callable
    paged_attention: Callable
    rms_norm: Callable
    rotary: Callable


TORCH_OPS = Ops("torch", write_kv_ref, paged_attention_ref, rms_norm_ref, rotary_ref)


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
