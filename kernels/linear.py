"""Linear layers, y = x @ W.T + b. The reference is F.linear.

On CPU, up to NATIVE_MAX_ROWS rows in fp32 (decoding at small batch: a stream over the weights) go to our
own AVX2 kernel (kernels/cpu_native.py), where it can be built; from TILED_MIN_ROWS rows fp32 goes to
linear_tiled (the library's sgemm in tiles the threads take one at a time); everything else as below.

On CPU, F.linear goes to MKL, whose small-row GEMMs are slow on this class of machine (AVX2, AMD): at the
row counts decoding runs at (1-64) torch's oneDNN linear, `torch.ops.mkldnn._linear_pointwise` (the op
torch.compile's CPU backend emits), is faster at those row counts (bench/results/design_figures.md;
bench/throughput.py prints the step-time split it leads to). It is used when this torch build has it
and it agrees with F.linear on a probe for the dtype; otherwise F.linear.

oneDNN builds and caches one primitive per input shape. Batches of every row count from 1 to the token
budget would fill that cache with hundreds of primitives per weight (bench/soak.py saw RSS climb), so rows are padded up to bucket sizes (`row_bucket`): about 8 shapes per doubling
of the row count, at most 12.5 % extra rows. It gets each weight packed once in its own blocked layout
(packed_weight), not the plain one it would reorder inside every call.
"""
from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from kernels.cpu_native import NATIVE_MAX_ROWS, NATIVE_MAX_ROWS_BF16, native, native_dtype


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


PACK_ROWS_HINT = 256  # the row count oneDNN picks its weight layout for; one layout served 5-2048 rows as well


@functools.cache
def _onednn_mode(dtype: torch.dtype) -> str | None:
    """How linear_cpu calls torch's oneDNN linear in this dtype, from one probe against F.linear: "packed" (each
    weight in oneDNN's own layout, packed_weight), "plain" (this build cannot pack, or packed disagrees), or
    None (no oneDNN linear here, or it disagrees: F.linear)."""
    mkldnn = getattr(torch.ops, "mkldnn", None)
    op = getattr(mkldnn, "_linear_pointwise", None)
    if op is None or not torch.backends.mkldnn.is_available():
        return None
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 48, generator=g).to(dtype)
    w = torch.randn(40, 48, generator=g).to(dtype)
    b = torch.randn(40, generator=g).to(dtype)
    tol = 1e-4 if dtype == torch.float32 else 5e-2

    def agrees(weight: torch.Tensor) -> bool:
        return all(torch.allclose(op(x, weight, bb, "none", [], "").float(), F.linear(x, w, bb).float(), atol=tol,
                                  rtol=tol) for bb in (None, b))

    try:
        if not agrees(w):
            return None
    except (RuntimeError, NotImplementedError):
        return None
    reorder = getattr(mkldnn, "_reorder_linear_weight", None)
    try:
        return "packed" if reorder is not None and agrees(reorder(w, PACK_ROWS_HINT)) else "plain"
    except (RuntimeError, NotImplementedError):
        return "plain"


def row_bucket(rows: int) -> int:
    """The row count a batch of `rows` is padded to: exact up to 8, then 8 sizes per power of two (so at
    most 12.5 % extra rows, and about 8 distinct sizes per doubling of the token budget)."""
    if rows <= 8:
        return rows
    step = 1 << (rows.bit_length() - 4)  # 1/8 of the largest power of two <= rows
    return -(-rows // step) * step


_DERIVED = ("_kvscale_packed", "_kvscale_bf16")  # the attributes that hold a weight's derived copies


def _derived(weight: torch.Tensor, attr: str, make):
    """make(weight), made on first use and kept on the weight itself (as `attr`, one of _DERIVED), so it lives and
    dies with it; made again when the weight's storage or version counter moved, and forgotten by drop_packed."""
    cached = getattr(weight, attr, None)
    if cached is not None and cached[0] == weight.data_ptr() and cached[1] == weight._version:
        return cached[2]
    value = make(weight)
    setattr(weight, attr, (weight.data_ptr(), weight._version, value))
    return value


def packed_weight(weight: torch.Tensor) -> torch.Tensor:
    """`weight` in oneDNN's own blocked layout (_derived: made once, kept on the weight). Whoever changes weights
    drops it (drop_packed: the model runner, on every weight load and before a sleep frees them). Against the
    plain layout, which oneDNN reorders inside every call: 1.5-2x at 36 rows, 1.05-1.4x at 256-2048
    (bench/kernels.py). The cost: a second copy of the linear weights in memory."""
    return _derived(weight, "_kvscale_packed", lambda w: torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS_HINT))


def _exact_bf16(weight: torch.Tensor) -> torch.Tensor | None:
    half = weight.to(torch.bfloat16)
    return half if torch.equal(half.float(), weight) else None


def bf16_copy(weight: torch.Tensor) -> torch.Tensor | None:
    """An fp32 weight's values in bf16 when every one of them is a bf16 value (a bf16 checkpoint run in fp32, as
    CPUs without AVX512-BF16 run the default model), else None; checked and kept like packed_weight (_derived).
    Our fp32 GEMV reads it instead of the fp32 weight: the same results bit for bit (kvs_linear_f32_bf16w), half
    the bytes. Its cost: half the fp32 weight's memory."""
    return _derived(weight, "_kvscale_bf16", _exact_bf16)


def drop_packed(weights) -> None:
    """Forget the packed and bf16 copies of these weights (before their memory is freed, e.g. a level-2 sleep)."""
    for w in weights:
        for attr in _DERIVED:
            if hasattr(w, attr):
                delattr(w, attr)


def library_linear(dtype: torch.dtype):
    """The library's linear that the benches time our GEMV against, as it is (plain weights, no row padding):
    oneDNN's where this torch takes the dtype, else F.linear (bf16 on a CPU without AVX512-BF16 or AMX)."""
    return linear_onednn if _onednn_mode(dtype) else F.linear


def linear_onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """torch's oneDNN linear on a 2-D input as it is (no row padding): the library path, and the peer the
    benches time our GEMV against."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def linear_native(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  max_rows: int | None = None) -> torch.Tensor | None:
    """Our C kernel (kernels/cpu_native.c) for the bandwidth-bound few-row case; None where it does not apply.
    max_rows: the most rows it takes (None: NATIVE_MAX_ROWS, where oneDNN starts to win)."""
    bf = native_dtype(x, weight, bias)
    if max_rows is None and bf is not None:
        max_rows = NATIVE_MAX_ROWS_BF16 if bf else NATIVE_MAX_ROWS
    if (x.dim() != 2 or bf is None or x.shape[0] > max_rows
            or not weight.is_contiguous() or (bias is not None and not bias.is_contiguous())):
        return None
    lib = native()
    if lib is None:
        return None
    x = x.contiguous()
    y = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype)
    half = None if bf else bf16_copy(weight)
    if half is not None:  # an fp32 weight holding bf16 values: the same sums from half the bytes
        kernel, weight = lib.kvs_linear_f32_bf16w, half
    else:
        kernel = lib.kvs_linear_bf16 if bf else lib.kvs_linear_f32
    kernel(x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr(),
           x.shape[0], x.shape[1], weight.shape[0], torch.get_num_threads())
    return y


INVARIANT_ROWS = 32  # rows per call of the GEMV in batch-invariant mode: x's rows stay in L1/L2 while w streams


def linear_invariant_cpu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Batch-invariant linear: every row through our C GEMV, whose output element (r, o) is one dot product of
    x[r] and w[o] in a fixed order whatever the row count, thread count or neighbours (oneDNN's blocking, and
    with it the order of its sums, changes with the row count). Rows go INVARIANT_ROWS at a time."""
    parts = [linear_native(x[i : i + INVARIANT_ROWS], weight, bias, max_rows=INVARIANT_ROWS)
             for i in range(0, max(x.shape[0], 1), INVARIANT_ROWS)]
    if any(p is None for p in parts):  # the dtype and kernels were checked at start-up (kernels.select_ops)
        raise RuntimeError(f"batch-invariant linear: the C GEMV cannot take x {tuple(x.shape)} {x.dtype} with "
                           f"weight {tuple(weight.shape)} {weight.dtype}")
    return parts[0] if len(parts) == 1 else torch.cat(parts)


TILE_ROWS, TILE_COLS = 128, 512  # kvs_linear_tiled_f32's tiles (columns evened out): bench/kernels.py
# Below this many rows oneDNN on the packed weight keeps the fp32 linear: each tile's sgemm packs its share of the
# weight again, which fewer rows amortize less (the LM head at 6-48 rows: 10-40 % slower tiled)
TILED_MIN_ROWS = 64


def _tile_cols(out: int) -> int:
    """Columns per tile: out cut into ceil(out / TILE_COLS) even parts, rounded up to 16."""
    cols = -(-out // -(-out // TILE_COLS))
    return -(-cols // 16) * 16


def _run_tiled(lib, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """kvs_linear_tiled_f32 on contiguous fp32 tensors; None when the build has no sgemm to call."""
    rows, out = x.shape[0], weight.shape[0]
    y = torch.empty(rows, out)
    done = lib.kvs_linear_tiled_f32(x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(),
                                    y.data_ptr(), rows, x.shape[1], out, TILE_ROWS, _tile_cols(out),
                                    torch.get_num_threads())
    return y if done else None


@functools.cache
def _tiled_available() -> bool:
    """Whether linear_tiled runs here: the C kernels built, the library's sgemm found, and a probe agreeing with
    F.linear (KVSCALE_TILED_LINEAR=0 turns it off, for A/B runs)."""
    if os.environ.get("KVSCALE_TILED_LINEAR", "1") == "0" or native() is None:
        return False
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(300, 72, generator=g), torch.randn(530, 72, generator=g), torch.randn(530, generator=g)
    y = _run_tiled(native(), x, w, b)
    return y is not None and torch.allclose(y, F.linear(x, w, b), atol=1e-4, rtol=1e-4)


def linear_tiled(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """fp32 x @ W.T (+ b) for many rows as tiles of single-threaded library GEMMs that the threads take one at a
    time (kvs_linear_tiled_f32): as fast as oneDNN on packed weights alone, and where another process takes a core
    for a moment, the other core goes on with the next tiles instead of waiting at the end of a statically split
    GEMM (bench/contention.py). None where it does not apply."""
    if (x.dtype != torch.float32 or weight.dtype != torch.float32 or x.dim() != 2 or x.shape[0] < TILED_MIN_ROWS
            or not x.is_cpu or not weight.is_cpu or not weight.is_contiguous()
            or (bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()))):
        return None
    lib = native()
    if lib is None or not _tiled_available():
        return None
    return _run_tiled(lib, x.contiguous(), weight, bias)


def linear_cpu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    y = linear_native(x, weight, bias)
    if y is None:
        y = linear_tiled(x, weight, bias)
    if y is not None:
        return y
    mode = _onednn_mode(x.dtype) if x.dim() == 2 and x.device.type == "cpu" and x.dtype == weight.dtype else None
    if mode is not None:
        rows = x.shape[0]
        padded = row_bucket(rows)
        if padded != rows:
            x = torch.cat([x, x.new_zeros(padded - rows, x.shape[1])])
        y = linear_onednn(x, packed_weight(weight) if mode == "packed" else weight, bias)
        return y[:rows] if padded != rows else y
    return F.linear(x, weight, bias)
