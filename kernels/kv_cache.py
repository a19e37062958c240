"""KV write: store this step's keys and values into the paged cache at their slots; and the fp8 KV cache.

An fp8 cache (torch.float8_e4m3fn or float8_e5m2, 1 byte an element: half of bf16) holds K / k_scale and
V / v_scale, rounded to the nearest fp8 value and clamped to the format's largest finite value; a reader
dequantizes with the same per-layer, per-tensor scales (fp8 * scale). Every backend writes and reads it that
way; kernels/paged_attention.py's reference attends over `dequantize(cache)`.

Keys go into an fp8 cache rotated (`kv_rotation`): the attention layer multiplies q and k by one fixed
orthogonal matrix per layer before the cache and the kernels see them, which leaves every score q.k as it was
and spreads the few large channels that keys and queries share over all of them. An fp8 value's error is
relative to its own size, so a score's error is dominated by the channels where both q and k are large; spread
out, those errors average instead (FlashAttention-3's "incoherent processing" for fp8). The backends need no
change: they store and read the rotated keys like any others.
"""
from __future__ import annotations

import torch

from kernels.cpu_native import native, native_dtype

KV_CACHE_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
FP8_DTYPES = frozenset(KV_CACHE_DTYPES.values())
KV_SCALE_HEADROOM = 2.0  # calibrated scales map twice the largest |K| or |V| seen to the format's largest value


def kv_scale(x: torch.Tensor, dtype: torch.dtype) -> float:
    """The per-tensor scale for storing x in a cache of `dtype`: KV_SCALE_HEADROOM x max|x| lands on the fp8
    format's largest finite value, so later values up to twice the calibration's largest still fit; 1.0 for a
    cache that is not fp8."""
    if dtype not in FP8_DTYPES:
        return 1.0
    return max(float(x.detach().abs().max()) * KV_SCALE_HEADROOM / torch.finfo(dtype).max, 1e-12)


def kv_rotation(head_dim: int, seed: int) -> torch.Tensor:
    """A fixed orthogonal (head_dim, head_dim) fp32 matrix: a normalized Hadamard matrix with its rows' signs
    drawn from `seed` where head_dim is a power of two, else the Q of a seeded Gaussian's QR. The same seed
    (the layer index) gives the same matrix in every process, so cached keys stay valid across restarts."""
    gen = torch.Generator().manual_seed(seed)
    if head_dim & (head_dim - 1) == 0:
        h = torch.ones(1, 1)
        while h.shape[0] < head_dim:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        signs = torch.randint(0, 2, (head_dim,), generator=gen).float() * 2 - 1
        return signs[:, None] * h / head_dim**0.5
    q, r = torch.linalg.qr(torch.randn(head_dim, head_dim, generator=gen))
    return q * torch.sign(torch.diagonal(r))[None, :]


def is_fp8(cache: torch.Tensor) -> bool:
    return cache.dtype in FP8_DTYPES


def quantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """x / scale in fp8, nearest value, clamped to the format's range (e4m3 has no infinity: past it, NaN)."""
    limit = torch.finfo(dtype).max
    return (x.float() / scale).clamp_(-limit, limit).to(dtype)


def dequantize(cache: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """fp8 * scale, computed in fp32 and rounded once to dtype."""
    return (cache.float() * scale).to(dtype)


def gather_blocks(cache: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """cache[ids] for any cache dtype (torch's CPU index ops do not take fp8: the codes go as bytes)."""
    if is_fp8(cache):
        return cache.view(torch.uint8)[ids].view(cache.dtype)
    return cache[ids]


def fp8_table(dtype: torch.dtype) -> torch.Tensor:
    """The fp32 value of each of the 256 fp8 codes, as torch converts them (what the C kernels read through)."""
    return torch.arange(256, dtype=torch.uint8).view(dtype).float().contiguous()


def write_kv_ref(
    key: torch.Tensor,  # (T, Hkv, D)
    value: torch.Tensor,  # (T, Hkv, D)
    k_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
    v_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
    slot_mapping: torch.Tensor,  # (T,) int64; -1 = padding, skip
    k_scale: float = 1.0,  # fp8 caches only: stored = K / k_scale
    v_scale: float = 1.0,
) -> None:
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    if is_fp8(k_cache):  # torch's CPU index ops do not take fp8: copy the codes as bytes
        key = quantize(key, k_scale, k_cache.dtype).view(torch.uint8)
        value = quantize(value, v_scale, v_cache.dtype).view(torch.uint8)
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    k_cache.view(num_blocks * block_size, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    v_cache.view(num_blocks * block_size, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)


def write_kv_cpu(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """One C call (fp32 or bf16: a row copy per token, padding skipped) instead of a mask, a check and two
    index_copy_; else (fp8 caches too: the quantizing copy is a step's few rows) the reference."""
    lib = native()
    tokens, num_kv_heads, head_dim = key.shape
    if (lib is None or native_dtype(key, value, k_cache, v_cache) is None or slot_mapping.device.type != "cpu"
            or not (k_cache.is_contiguous() and v_cache.is_contiguous() and slot_mapping.is_contiguous())
            or slot_mapping.dtype != torch.int64 or key.stride()[1:] != (head_dim, 1)
            or value.stride()[1:] != (head_dim, 1)):
        return write_kv_ref(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    es = key.element_size()
    lib.kvs_write_kv(key.data_ptr(), value.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), slot_mapping.data_ptr(),
                     tokens, num_kv_heads * head_dim * es, key.stride(0) * es, value.stride(0) * es)
