"""Our own CPU kernels in C (kernels/cpu_native.c), compiled on first use with the system C compiler.

Why: batch-1 and small-batch decoding streams every weight matrix once per step, so its speed is the GEMV's
memory bandwidth, and at batch 1 the dispatch of many small torch ops costs more than their math. The GEMV
serves up to NATIVE_MAX_ROWS rows, where oneDNN's blocked GEMM takes over; bench/kernels.py prints both at
1, 5 and 6 rows (the figures that set it: bench/results/design_figures.md). The other kernels fuse what took
torch 2 to 8 ops: RMSNorm + residual, rotary, KV write, SwiGLU gating, and decode attention reading the
pages in place.

The shared library is built once per (source, compiler flags, CPU model) into the kvscale cache dir
(atomic rename, so concurrent first calls from several replicas are safe) and loaded with ctypes. Where it
cannot be had (no C compiler, a CPU without AVX2/FMA, not x86-64), or KVSCALE_NATIVE_CPU=0, `native()`
returns None once, says why in the log, and callers use the library kernels.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_native.c")
# -ffp-contract=off: no fused multiply-adds the source does not ask for, so the elementwise kernels round
# exactly as torch's separate multiply and add do
FLAGS = ["-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC"]
# on CPUs with AVX512-BF16: the bf16 GEMV and prefill attention multiply bf16 pairs with vdpbf16ps, and RMSNorm,
# rotary and SwiGLU run 16 lanes at a time (the rest stays AVX2). `python bench/kernels.py --dtype bfloat16`,
# 2048 rows of the default model, against the loops before (8 lanes, RMSNorm's sum of squares and residual add
# one element at a time, rotary's tables rounded per head): RMSNorm 747 -> 222 us, with the residual add
# 851 -> 342, rotary 708 -> 288, SwiGLU 2308 -> 1048
BF16_FLAGS = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16"]
NATIVE_MAX_ROWS = 5  # up to here our fp32 GEMV beats oneDNN on 2 AVX2 cores (bench/kernels.py)
NATIVE_MAX_ROWS_BF16 = 5  # and our bf16 GEMV beats oneDNN's bf16 linear (bench/kernels.py --dtype bfloat16)


def _cpu_flags() -> tuple[str, set[str]]:
    model, flags = platform.processor() or "unknown", set()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    return model, flags


def _flags(cpu_flags: set[str]) -> list[str]:
    return FLAGS + (BF16_FLAGS if {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"} <= cpu_flags else [])


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _build(target: Path, compiler: str, flags: list[str]) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, *flags, str(SOURCE), "-o", tmp, "-lm"], check=True, capture_output=True, text=True,
                       timeout=120)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def native_dtype(*tensors) -> int | None:
    """The dtype flag the dtype-generic kernels take (0: fp32, 1: bf16) when every tensor given (None entries
    pass) is in host memory and all share one of those dtypes; else None. Called for every op, so a plain loop
    (0.5 us, where sets and generators took 1.8)."""
    dtype = None
    for t in tensors:
        if t is None:
            continue
        if not t.is_cpu or (dtype is not None and t.dtype != dtype):
            return None
        dtype = t.dtype
    return _dtype_flags().get(dtype)


@functools.cache
def _dtype_flags() -> dict:
    import torch

    return {torch.float32: 0, torch.bfloat16: 1}


@functools.cache
def native() -> ctypes.CDLL | None:
    """The loaded kernels, or None (logged once) when they cannot be used here."""
    if os.environ.get("KVSCALE_NATIVE_CPU", "1") == "0":
        logger.info("native CPU kernels off (KVSCALE_NATIVE_CPU=0): using torch's library kernels")
        return None
    model, flags = _cpu_flags()
    if platform.machine() not in ("x86_64", "AMD64") or not {"avx2", "fma"} <= flags:
        logger.info("native CPU kernels need x86-64 with AVX2 and FMA (this CPU: %s); using torch's library "
                    "kernels", model)
        return None
    compiler = _compiler()
    if compiler is None:
        logger.warning("no C compiler found (set CC or install gcc) to build kvscale's CPU kernels; small-batch "
                       "decoding falls back to torch's library kernels, which are slower at few rows")
        return None
    build_flags = _flags(flags)
    try:
        source = SOURCE.read_bytes()
    except OSError as e:
        logger.warning("kvscale's CPU kernel source %s is missing (%s): the install lacks its package data; "
                       "reinstall kvscale (pip install .). Falling back to torch's library kernels", SOURCE, e)
        return None
    key = hashlib.sha256(source + " ".join(build_flags).encode() + model.encode()).hexdigest()[:16]
    cache = os.environ.get("KVSCALE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kvscale")  # as the default model's
    target = Path(cache) / "cpu_kernels" / f"cpu_native-{key}.so"
    try:
        if not target.exists():
            logger.info("building kvscale's CPU kernels once: %s -> %s", SOURCE.name, target)
            _build(target, compiler, build_flags)
        lib = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        logger.warning("could not build or load kvscale's CPU kernels with %s (%s); falling back to torch's "
                       "library kernels", compiler, detail.strip()[:500])
        return None
    return _declare(lib)


@functools.cache
def _library_sgemm() -> int | None:
    """The address of the BLAS sgemm torch itself calls (MKL's, in torch's CPU wheels; Fortran interface), or None
    where this torch build exports none."""
    import torch

    lib_dir = Path(torch.__file__).parent / "lib"
    for name in ("libtorch_cpu.so", "libtorch_cpu.dylib"):
        if (lib_dir / name).exists():
            try:
                torch_cpu = ctypes.CDLL(str(lib_dir / name))
            except OSError:
                return None
            for symbol in ("sgemm_", "sgemm"):
                fn = getattr(torch_cpu, symbol, None)
                if fn is not None:
                    return ctypes.cast(fn, ctypes.c_void_p).value
    return None


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Every kernel's argument types on a loaded build, and the library sgemm kvs_linear_tiled_f32 calls."""
    P, L, I = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
    signatures = {  # the trailing int of the generic kernels: bf16 flag, then threads
        "kvs_linear_f32": [P] * 4 + [L] * 3 + [I],
        "kvs_linear_bf16": [P] * 4 + [L] * 3 + [I],
        "kvs_linear_f32_bf16w": [P] * 4 + [L] * 3 + [I],
        "kvs_rms_norm": [P] * 5 + [L] * 4 + [ctypes.c_float, I, I],
        "kvs_rotary": [P] * 5 + [L] * 6 + [I, I],
        "kvs_paged_decode": [P] * 5 + [L] + [P] * 3 + [L] * 6 + [ctypes.c_float, ctypes.c_float] + [P] * 3 + [L] * 2
                            + [ctypes.c_float, ctypes.c_float, I, I],
        "kvs_write_kv": [P] * 5 + [L] * 4,
        "kvs_silu_mul": [P] * 2 + [L] * 3 + [I, I],
        "kvs_prefill_attention_bf16": [P] * 4 + [L] * 11 + [ctypes.c_float, I],
        "kvs_prefill_attention_f32": [P] * 4 + [L] * 11 + [ctypes.c_float, I],
        "kvs_linear_tiled_f32": [P] * 4 + [L] * 5 + [I],
        "kvs_set_sgemm": [P],
    }
    for name, argtypes in signatures.items():
        getattr(lib, name).argtypes = argtypes
        getattr(lib, name).restype = None
    lib.kvs_has_avx512bf16.restype = I
    lib.kvs_prefill_attention_bf16.restype = I
    lib.kvs_prefill_attention_f32.restype = I
    lib.kvs_linear_tiled_f32.restype = I
    lib.kvs_set_sgemm(_library_sgemm())
    return lib


def build_avx2_only(directory: Path) -> ctypes.CDLL | None:
    """A build without the AVX-512 flags, as CPUs with AVX2 alone get it (into `directory`), or None where no build
    is possible; for tests, which run every kernel through it as well on a CPU that has AVX-512."""
    compiler = _compiler()
    if compiler is None or platform.machine() not in ("x86_64", "AMD64") or not {"avx2", "fma"} <= _cpu_flags()[1]:
        return None
    target = Path(directory) / "cpu_native-avx2.so"
    _build(target, compiler, FLAGS)
    return _declare(ctypes.CDLL(str(target)))
