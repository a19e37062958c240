"""Attention and fused ops behind one interface; `select_ops` is the one place a backend is chosen, once, for
the device and dtype: "reference" (plain torch), "cpu" (C kernels + oneDNN + SDPA) or "triton".

Every op has a plain torch reference (`*_ref`) with the signature its Triton kernel keeps. The CPU path
(`*_cpu`) runs our C kernels in fp32 and bf16 where they build (kernels/cpu_native.py: small-batch GEMV, RMSNorm,
rotary, KV write, decode attention reading pages in place, SwiGLU gating), oneDNN for larger matmuls and
torch's fused SDPA for prefill attention, and the references otherwise; each is checked against its
reference. CUDA uses the Triton kernels where they exist and cuBLAS for linear layers.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch

from kernels.activation import silu_mul_cpu, silu_mul_ref
from kernels.cpu_native import NATIVE_MAX_ROWS, NATIVE_MAX_ROWS_BF16, native
from kernels.kv_cache import write_kv_cpu, write_kv_ref
from kernels.linear import linear_cpu, linear_invariant_cpu, linear_ref
from kernels.metadata import AttentionMetadata
from kernels.norm import rms_norm_cpu, rms_norm_ref
from kernels.paged_attention import paged_attention_invariant_cpu, paged_attention_ref, paged_attention_sdpa
from kernels.rotary import rotary_cpu, rotary_ref

__all__ = ["AttentionMetadata", "BACKENDS", "Ops", "batch_invariant_ops", "select_ops"]


BACKENDS = ("auto", "reference", "cpu", "triton")


@dataclass(frozen=True)
class Ops:
    """One backend's ops, bound once at start-up for a device and dtype (select_ops); layers call these and
    nothing re-decides which kernel runs."""

    name: str  # "reference" | "cpu" | "triton": the backend
    write_kv: Callable
    paged_attention: Callable
    rms_norm: Callable
    rotary: Callable
    linear: Callable
    silu_mul: Callable
    description: str = ""  # what runs, in words, for the start-up log
    batch_invariant: bool = False  # every op sums in a fixed order per row (batch_invariant_ops)


# The plain torch form every other path is checked against.
REFERENCE_OPS = Ops("reference", write_kv_ref, paged_attention_ref, rms_norm_ref, rotary_ref, linear_ref,
                    silu_mul_ref, "plain torch reference ops")


def cpu_ops(dtype: torch.dtype) -> Ops:
    """The CPU path for this dtype, decided once: in fp32 and bf16 where our C kernels build, they run (GEMV for
    few rows, norm, rotary, KV write, SwiGLU, paged decode attention, bf16 prefill attention where the CPU has
    AVX512-BF16); linear layers otherwise go to oneDNN and other attention to torch's fused SDPA; in other dtypes
    or without the C kernels the elementwise ops are the references, bound directly."""
    lib = native()
    if dtype in (torch.float32, torch.bfloat16) and lib is not None:
        gemv = ("bf16 GEMV <= %d rows (%s)" % (NATIVE_MAX_ROWS_BF16, "AVX512-BF16" if lib.kvs_has_avx512bf16() else
                                               "AVX2, bf16 widened") if dtype == torch.bfloat16
                else f"fp32 GEMV <= {NATIVE_MAX_ROWS} rows")
        prefill = ("our C prefill attention in bf16 (AVX512-BF16), SDPA otherwise"
                   if dtype == torch.bfloat16 and lib.kvs_has_avx512bf16() else "SDPA prefill attention")
        return Ops("cpu", write_kv_cpu, paged_attention_sdpa, rms_norm_cpu, rotary_cpu, linear_cpu, silu_mul_cpu,
                   f"our C kernels ({gemv}, RMSNorm, rotary, KV write, SwiGLU, paged decode attention), "
                   f"oneDNN linear on packed weights, {prefill}")
    why = "no C kernels on this machine" if dtype in (torch.float32, torch.bfloat16) else f"no C kernels for {dtype}"
    return Ops("cpu", write_kv_ref, paged_attention_sdpa, rms_norm_ref, rotary_ref, linear_cpu, silu_mul_ref,
               f"oneDNN linear, SDPA attention, torch reference elementwise ops ({why})")


def select_ops(backend: str, device_type: str, dtype: torch.dtype = torch.float32,
               batch_invariant: bool = False) -> Ops:
    """The one place a backend is chosen. backend: "auto" (Triton on CUDA where it loads, else the CPU path on
    CPU and the references on CUDA) | "reference" | "cpu" (host memory only) | "triton". batch_invariant: that
    backend's batch-invariant ops (batch_invariant_ops)."""
    ops = _select_ops(backend, device_type, dtype)
    return batch_invariant_ops(ops, dtype) if batch_invariant else ops


def batch_invariant_ops(ops: Ops, dtype: torch.dtype) -> Ops:
    """The same backend with every op whose sums depend on the step's shape replaced by one with a fixed order
    (EngineConfig.batch_invariant): linear layers (the library GEMMs pick their blocking and split of K by the
    row count) and attention (prefill chunks go through flash attention, decode rows through another kernel,
    long contexts are split over programs). The rest already computes each row alone in a fixed order: RMSNorm,
    rotary, SwiGLU and KV write (one row a task), and the sampler's per-row softmax."""
    if ops.name == "cpu":
        if native() is None or dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(
                "batch_invariant on CPU runs on our C kernels in float32 or bfloat16; "
                + ("they cannot be built on this machine (see the log line of kernels/cpu_native.py)"
                   if native() is None else f"the model runs in {dtype}") + ". Set dtype to float32 or bfloat16, "
                "or turn batch_invariant off.")
        return replace(ops, linear=linear_invariant_cpu, paged_attention=paged_attention_invariant_cpu,
                       batch_invariant=True,
                       description="batch-invariant: our C GEMV for every linear layer and our C decode kernel for "
                                   "every query token; " + ops.description)
    if ops.name == "triton":
        from kernels.triton_ops import linear_invariant_triton, paged_attention_invariant_triton  # noqa: PLC0415

        return replace(ops, linear=linear_invariant_triton, paged_attention=paged_attention_invariant_triton,
                       batch_invariant=True,
                       description="batch-invariant: fixed-tile Triton linear, one program per query token and no "
                                   "context split in attention; " + ops.description)
    raise ValueError("batch_invariant runs on attention_backend 'cpu' or 'triton' (or 'auto', which picks one of "
                     f"them); the {ops.name!r} ops batch decode rows with padding. Change attention_backend, or "
                     "turn batch_invariant off.")


def _select_ops(backend: str, device_type: str, dtype: torch.dtype) -> Ops:
    if backend not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(BACKENDS)}; got {backend!r}"
                         + (" ('torch' is now 'cpu': C kernels + oneDNN + SDPA; or 'reference': plain torch)"
                            if backend == "torch" else ""))
    if backend == "reference":
        return REFERENCE_OPS
    if backend == "cpu" or (backend == "auto" and device_type != "cuda"):
        if device_type != "cpu":
            raise ValueError(f"attention_backend='cpu' runs on host memory, not on {device_type}; use 'triton' "
                             "or 'reference' there")
        return cpu_ops(dtype)
    try:
        from kernels.triton_ops import TRITON_OPS  # noqa: PLC0415 - triton is optional
    except ImportError as e:
        if backend == "triton":
            raise RuntimeError(
                f"attention_backend='triton' was asked for but the Triton kernels cannot load ({e}). "
                "Install triton, or use attention_backend='reference'."
            ) from e
        return REFERENCE_OPS  # auto on CUDA without Triton
    return TRITON_OPS
