"""Triton kernels for the engine's hot path, each with the signature of its torch reference.

- write_kv: one program per (token, KV head); slot -1 (padding) stores nothing.
- paged_attention: one program per (query tile, KV head, context split). A tile is one decode token, or in
  prefill up to 64 // G consecutive tokens of one sequence; its rows are (token, query head of the KV head's
  group of G), so GQA/MQA reads each K/V tile once for all of them. Keys come 64 at a time, gathered across
  pages through the block table, into tl.dot on the matrix units with an online softmax; each row stops at
  its own position (causal within a chunk, full over the cached prefix), so decode, chunked prefill and
  prefix-cache hits are one kernel. Long contexts at small batch are split over several programs
  (flash-decoding); a second kernel merges their partial softmaxes.
- rms_norm: several rows a program where rows are short (one from 4096 elements up), fp32 statistics per row,
  optional fused residual add.
- rotary: one program per token (all its heads), rotate-half form, cos/sin from the engine's table.

Tested against the references under TRITON_INTERPRET=1 on CPU (tests/test_kernels.py); on CUDA they
are what `kernels.select_ops` picks.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.kv_cache import is_fp8
from kernels.metadata import AttentionMetadata

SPLIT_MIN_BLOCKS = 8  # contexts shorter than this many blocks per split are not split
# Triton's interpreter (CPU tests) computes tl.dot wrongly on bf16 operands (seen with triton 3.9), so there
# the attention kernel upcasts them and multiplies in fp32; compiled on a GPU, bf16 goes to the matrix units.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


# ---------------------------------------------------------------------------------------------- KV write
@triton.jit
def _write_kv_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_cb, stride_cs, stride_ch, block_size, head_dim, inv_k_scale, inv_v_scale, fp8_max,
                     BLOCK_D: tl.constexpr, FP8: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + t)
    d = tl.arange(0, BLOCK_D)
    mask = d < tl.where(slot >= 0, head_dim, 0)  # padding (slot -1): nothing is stored
    safe = tl.maximum(slot, 0)
    blk = safe // block_size
    off = safe % block_size
    k = tl.load(key_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(value_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    dst = blk * stride_cb + off * stride_cs + h * stride_ch + d
    if FP8:  # quantize: x / scale, clamped to the format's range, rounded to nearest
        k = tl.minimum(tl.maximum(k.to(tl.float32) * inv_k_scale, -fp8_max), fp8_max)
        v = tl.minimum(tl.maximum(v.to(tl.float32) * inv_v_scale, -fp8_max), fp8_max)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_triton(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1 and key.stride(-1) == 1
    fp8 = is_fp8(k_cache)
    _write_kv_kernel[(num_tokens, num_kv_heads)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.shape[1], head_dim,
        1.0 / k_scale, 1.0 / v_scale, torch.finfo(k_cache.dtype).max if fp8 else 0.0,
        BLOCK_D=triton.next_power_of_2(head_dim), FP8=fp8)


# ---------------------------------------------------------------------------------------------- attention
@triton.jit
def _paged_attention_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_ptr,
                            token_seq_ptr, token_pos_ptr, tile_seq_ptr, tile_tok_ptr, tile_len_ptr,
                            block_tables_ptr, key_ptr, value_ptr, qsl_ptr, seq_lens_ptr,
                            stride_kt, stride_kh, stride_vt, stride_vh, inv_k_scale, inv_v_scale,
                            stride_qt, stride_qh, stride_ot, stride_oh,
                            stride_cb, stride_cs, stride_ch, stride_bt,
                            scale, v_scale, window, block_size, head_dim, group, keys_per_split, num_heads,
                            NUM_SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_G: tl.constexpr,
                            BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                            HAS_WINDOW: tl.constexpr, IEEE_DOT: tl.constexpr, FP8: tl.constexpr,
                            FRESH: tl.constexpr):
    tile = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    if BLOCK_M == 1:  # decode: a tile is one token (the CUDA-graph path fills token_seq/token_pos only)
        b = tl.load(token_seq_ptr + tile)
        tok0 = tile
        n_tok = 1
    else:  # a tile is up to BLOCK_M consecutive tokens of one sequence
        b = tl.load(tile_seq_ptr + tile)
        tok0 = tl.load(tile_tok_ptr + tile)
        n_tok = tl.load(tile_len_ptr + tile)
    # rows: (token of the tile, query head of this KV head's group), padded to BLOCK_R >= 16 for tl.dot
    r = tl.arange(0, BLOCK_R)
    r_tok = r // BLOCK_G
    r_g = r % BLOCK_G
    r_valid = (r_tok < n_tok) & (r_g < group)
    t = tok0 + r_tok
    pos = tl.load(token_pos_ptr + t, mask=r_valid, other=-1)  # each query's own position: keys 0..pos
    head = h * group + r_g
    d = tl.arange(0, BLOCK_D)
    dmask = d < head_dim
    q = tl.load(q_ptr + t[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=r_valid[:, None] & dmask[None, :], other=0.0)

    # the keys this program reads: its split of the context, cut to what any of its rows can see
    k_hi = tl.minimum((split + 1) * keys_per_split, tl.max(pos, axis=0) + 1)
    k_lo = split * keys_per_split
    if HAS_WINDOW:
        lo_row = tl.maximum(pos - window + 1, 0)
        k_lo = tl.maximum(k_lo, tl.min(tl.where(r_valid, lo_row, 1 << 30), axis=0))
    else:
        lo_row = tl.zeros([BLOCK_R], tl.int32)

    if FRESH:  # fp8: this step's own tokens (positions own_pos.., tokens own_tok..) are read from key/value
        if BLOCK_M == 1:
            own_tok = tile
            own_pos = tl.load(token_pos_ptr + tile)
        else:
            own_tok = tl.load(qsl_ptr + b)
            own_pos = tl.load(seq_lens_ptr + b) - (tl.load(qsl_ptr + b + 1) - own_tok)

    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    n = tl.arange(0, BLOCK_N)
    for start in range(k_lo, k_hi, BLOCK_N):
        key_pos = start + n
        nmask = key_pos < k_hi
        block_id = tl.load(block_tables_ptr + b * stride_bt + key_pos // block_size, mask=nmask, other=0)
        row = block_id.to(tl.int64) * stride_cb + (key_pos % block_size) * stride_cs + h * stride_ch
        kv_mask = nmask[:, None] & dmask[None, :]
        k = tl.load(k_cache_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)  # (N, D)
        v = tl.load(v_cache_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if FP8:  # fp8 codes widened to q's dtype; k_scale is in `scale`, v_scale applied to the output
            k = k.to(tl.float32)
            v = v.to(tl.float32)
            if FRESH:  # in the cache's units: written / scale
                own = (key_pos >= own_pos) & nmask
                tok = own_tok + tl.maximum(key_pos - own_pos, 0)
                own_mask = own[:, None] & dmask[None, :]
                k_own = tl.load(key_ptr + tok[:, None] * stride_kt + h * stride_kh + d[None, :], mask=own_mask,
                                other=0.0)
                v_own = tl.load(value_ptr + tok[:, None] * stride_vt + h * stride_vh + d[None, :], mask=own_mask,
                                other=0.0)
                k = tl.where(own[:, None], k_own.to(tl.float32) * inv_k_scale, k)
                v = tl.where(own[:, None], v_own.to(tl.float32) * inv_v_scale, v)
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        if IEEE_DOT:  # fp32 activations (or Triton's interpreter): full fp32 products, as the reference
            scores = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:  # bf16/fp16 on the matrix units, fp32 accumulation
            scores = tl.dot(q, tl.trans(k))
        scores = scores * scale  # (R, N)
        visible = (key_pos[None, :] <= pos[:, None]) & (key_pos[None, :] >= lo_row[:, None]) & nmask[None, :]
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        p = tl.exp(scores - m_safe[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        if IEEE_DOT:  # p rounded to V's dtype first, as on the matrix units
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32),
                                                input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new

    omask = r_valid[:, None] & dmask[None, :]
    acc = acc * v_scale
    if NUM_SPLITS == 1:
        out = acc / tl.maximum(l, 1e-30)[:, None]
        tl.store(out_ptr + t[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=omask)
    else:
        # partials: (T, H, NUM_SPLITS, 2 + D) float32 = [max, sum, acc...]
        prow = ((t.to(tl.int64) * num_heads + head) * NUM_SPLITS + split) * (2 + head_dim)
        tl.store(part_ptr + prow, m, mask=r_valid)
        tl.store(part_ptr + prow + 1, l, mask=r_valid)
        tl.store(part_ptr + prow[:, None] + 2 + d[None, :], acc, mask=omask)


@triton.jit
def _merge_splits_kernel(part_ptr, out_ptr, stride_ot, stride_oh, num_heads, head_dim,
                         NUM_SPLITS: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0)
    hd = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    dmask = d < head_dim
    sp = tl.arange(0, NUM_SPLITS)
    rows = ((t * num_heads + hd) * NUM_SPLITS + sp) * (2 + head_dim)
    m = tl.load(part_ptr + rows)
    l = tl.load(part_ptr + rows + 1)
    acc = tl.load(part_ptr + rows[:, None] + 2 + d[None, :], mask=dmask[None, :], other=0.0)
    m_all = tl.max(m, axis=0)
    m_all = tl.where(m_all == float("-inf"), 0.0, m_all)
    w = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_all))
    total = tl.sum(l * w, axis=0)
    out = tl.sum(acc * w[:, None], axis=0) / tl.maximum(total, 1e-30)
    tl.store(out_ptr + t * stride_ot + hd * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=dmask)


def _token_tables(meta: AttentionMetadata, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """For every flattened query token: its sequence index and its position in that sequence."""
    if meta.token_seq is not None and meta.token_pos is not None:
        return meta.token_seq, meta.token_pos
    key = ("triton_token_tables", device)
    if key not in meta.plans:  # once a step, shared by every layer
        seqs, positions = [], []
        for b, (q_len, ctx) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host)):
            seqs.extend([b] * q_len)
            positions.extend(range(ctx - q_len, ctx))
        meta.plans[key] = (torch.tensor(seqs, dtype=torch.int32, device=device),
                           torch.tensor(positions, dtype=torch.int32, device=device))
    return meta.plans[key]


def _query_tiles(meta: AttentionMetadata, block_m: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Tiles of up to `block_m` consecutive query tokens of one sequence: (sequence, first token, length)."""
    key = ("triton_query_tiles", block_m, device)
    if key not in meta.plans:
        seqs, firsts, lens, tok = [], [], [], 0
        for b, q_len in enumerate(meta.query_lens_host):
            for i in range(0, q_len, block_m):
                seqs.append(b)
                firsts.append(tok + i)
                lens.append(min(block_m, q_len - i))
            tok += q_len
        meta.plans[key] = tuple(torch.tensor(x, dtype=torch.int32, device=device) for x in (seqs, firsts, lens))
    return meta.plans[key]


def attention_tiling(max_query_len: int, group: int, head_dim: int) -> dict[str, int]:
    """Tile sizes. Decode: one token a program (BLOCK_M 1), its G heads padded to 16 rows for the matrix
    units; 64 keys (4 pages of 16) per step of the loop keep enough loads in flight. Prefill: BLOCK_M tokens
    x G heads = 64 rows a program, so each K/V tile is read once for 64 query rows."""
    block_g = triton.next_power_of_2(group)
    block_m = 1 if max_query_len == 1 else max(1, 64 // block_g)
    block_n = 64 if head_dim <= 128 else 32
    return dict(BLOCK_M=block_m, BLOCK_G=block_g, BLOCK_R=max(16, block_m * block_g), BLOCK_N=block_n,
                BLOCK_D=triton.next_power_of_2(head_dim))


def choose_num_splits(num_programs: int, num_kv_heads: int, max_blocks: int, target_programs: int = 512) -> int:
    """Split the context when there are too few (query tile, KV head) programs to fill the device; the
    target and the cap come from bench/kernels.py --sweep on an H200 (bench/results/design_figures.md)."""
    if num_programs * num_kv_heads >= target_programs or max_blocks < 2 * SPLIT_MIN_BLOCKS:
        return 1
    want = -(-target_programs // (num_programs * num_kv_heads))
    return int(min(triton.next_power_of_2(want), triton.next_power_of_2(max_blocks // SPLIT_MIN_BLOCKS), 64))


def paged_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           meta: AttentionMetadata, scale: float, sliding_window: int | None = None,
                           k_scale: float = 1.0, v_scale: float = 1.0, key: torch.Tensor | None = None,
                           value: torch.Tensor | None = None, num_splits: int | None = None, num_warps: int = 4, num_stages: int = 2,
                           block_n: int | None = None, block_m: int | None = None) -> torch.Tensor:
    """Paged attention over the block tables; the keyword knobs after `sliding_window` are for tests and
    bench/kernels.py --sweep (defaults: `attention_tiling`, `choose_num_splits`)."""
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    if num_tokens == 0:
        return out
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1 and q.stride(-1) == 1
    tiling = attention_tiling(meta.max_query_len, group, head_dim)
    if block_n is not None:
        tiling["BLOCK_N"] = block_n
    if block_m is not None and tiling["BLOCK_M"] > 1:
        tiling["BLOCK_M"], tiling["BLOCK_R"] = block_m, max(16, block_m * tiling["BLOCK_G"])
    token_seq, token_pos = _token_tables(meta, q.device)
    if tiling["BLOCK_M"] == 1:
        num_tiles, tile_seq, tile_tok, tile_len = num_tokens, token_seq, token_seq, token_seq  # unused
    else:
        tile_seq, tile_tok, tile_len = _query_tiles(meta, tiling["BLOCK_M"], q.device)
        num_tiles = tile_seq.shape[0]
    max_blocks = -(-meta.max_seq_len // block_size)
    splits = num_splits or choose_num_splits(num_tiles, num_kv_heads, max_blocks)
    keys_per_split = -(-meta.max_seq_len // (splits * tiling["BLOCK_N"])) * tiling["BLOCK_N"]
    part = (torch.empty((num_tokens, num_heads, splits, 2 + head_dim), dtype=torch.float32, device=q.device)
            if splits > 1 else out)
    block_tables = meta.block_tables.to(device=q.device, dtype=torch.int32).contiguous()
    fp8 = is_fp8(k_cache)
    fresh = fp8 and key is not None  # fp8: this step's own tokens attended as written (the reference's rule)
    if not fresh:
        key = value = q  # unused
    _paged_attention_kernel[(num_tiles, num_kv_heads, splits)](
        q, k_cache, v_cache, out, part, token_seq, token_pos, tile_seq, tile_tok, tile_len, block_tables,
        key, value, meta.query_start_loc, meta.seq_lens, key.stride(0), key.stride(1), value.stride(0),
        value.stride(1), 1.0 / k_scale, 1.0 / v_scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        scale * k_scale, v_scale, sliding_window or 0, block_size, head_dim, group, keys_per_split, num_heads,
        NUM_SPLITS=splits, HAS_WINDOW=sliding_window is not None, IEEE_DOT=q.dtype == torch.float32 or _INTERPRETED,
        FP8=fp8, FRESH=fresh,
        num_warps=num_warps, num_stages=num_stages, **tiling)
    if splits > 1:
        _merge_splits_kernel[(num_tokens, num_heads)](part, out, out.stride(0), out.stride(1), num_heads,
                                                      head_dim, NUM_SPLITS=splits, BLOCK_D=tiling["BLOCK_D"])
    return out


# ---------------------------------------------------------------------------------------------- RMSNorm
@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, out_ptr, res_out_ptr, w_ptr, rows, stride_x, stride_r, stride_o, stride_ro,
                     hidden, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    # ROWS rows a program, each reduced on its own. Math in fp32, rounded to the activation dtype where the
    # reference rounds (after the residual add, after normalizing), so bf16 results match it to the last bit in
    # most elements.
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)[:, None]
    i = tl.arange(0, BLOCK)[None, :]
    mask = (r < rows) & (i < hidden)
    dtype = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + r * stride_x + i, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x = x + tl.load(res_ptr + r * stride_r + i, mask=mask, other=0.0).to(tl.float32)
        x = x.to(dtype).to(tl.float32)
        tl.store(res_out_ptr + r * stride_ro + i, x.to(dtype), mask=mask)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / hidden + eps)
    normed = (x * inv[:, None]).to(dtype).to(tl.float32)
    w = tl.load(w_ptr + i, mask=i < hidden, other=0.0).to(tl.float32)
    tl.store(out_ptr + r * stride_o + i, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


def _rows_per_program(block: int) -> int:
    """Rows one program takes: several where rows are short (a q/k norm's head_dim, a small model's hidden size),
    one from 4096 elements up; about as many elements a program either way."""
    return max(1, min(16, 4096 // block))


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float,
                    residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Over the last dim of x (any leading shape: (T, hidden), or (T, H, D) for Qwen3's q/k norm)."""
    shape, hidden = x.shape, x.shape[-1]
    x2 = x.reshape(-1, hidden)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    r2 = residual.reshape(-1, hidden).contiguous() if residual is not None else None
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(out) if residual is not None else None
    if x2.shape[0] > 0:
        r = r2 if r2 is not None else x2
        ro = res_out if res_out is not None else out
        block = triton.next_power_of_2(hidden)
        rows = _rows_per_program(block)
        _rms_norm_kernel[(triton.cdiv(x2.shape[0], rows),)](
            x2, r, out, ro, weight, x2.shape[0], x2.stride(0), r.stride(0), out.stride(0), ro.stride(0), hidden, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=block, ROWS=rows)
    return out.view(shape), (res_out.view(shape) if res_out is not None else None)


# ---------------------------------------------------------------------------------------------- rotary
@triton.jit
def _rotary_kernel(x_ptr, out_ptr, pos_ptr, cos_ptr, sin_ptr, stride_xt, stride_xh, stride_ot, stride_oh,
                   stride_c, heads, half, BLOCK_HEADS: tl.constexpr, BLOCK_H: tl.constexpr):
    # One token a program, all its heads. fp32 math, rounded where the reference (which works in the activation
    # dtype) rounds: the table on its cast, each product, the sum.
    t = tl.program_id(0)
    h = tl.arange(0, BLOCK_HEADS)[:, None]
    i = tl.arange(0, BLOCK_H)[None, :]
    mask = (h < heads) & (i < half)
    pos = tl.load(pos_ptr + t)
    dtype = x_ptr.dtype.element_ty
    base = x_ptr + t * stride_xt + h * stride_xh
    x1 = tl.load(base + i, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + half + i, mask=mask, other=0.0).to(tl.float32)
    row = pos * stride_c
    cos1 = tl.load(cos_ptr + row + i, mask=i < half, other=0.0).to(dtype).to(tl.float32)
    cos2 = tl.load(cos_ptr + row + half + i, mask=i < half, other=0.0).to(dtype).to(tl.float32)
    sin1 = tl.load(sin_ptr + row + i, mask=i < half, other=0.0).to(dtype).to(tl.float32)
    sin2 = tl.load(sin_ptr + row + half + i, mask=i < half, other=0.0).to(dtype).to(tl.float32)
    a1 = (x1 * cos1).to(dtype).to(tl.float32)
    b1 = (x2 * sin1).to(dtype).to(tl.float32)
    a2 = (x2 * cos2).to(dtype).to(tl.float32)
    b2 = (x1 * sin2).to(dtype).to(tl.float32)
    o = out_ptr + t * stride_ot + h * stride_oh
    tl.store(o + i, (a1 - b1).to(dtype), mask=mask)
    tl.store(o + half + i, (a2 + b2).to(dtype), mask=mask)


def rotary_triton(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_cache: torch.Tensor,
                  sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    num_tokens, _, head_dim = q.shape
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    if num_tokens == 0:
        return q_out, k_out
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and cos_cache.stride() == sin_cache.stride()
    half = head_dim // 2
    for x, out in ((q, q_out), (k, k_out)):
        _rotary_kernel[(num_tokens,)](x, out, positions, cos_cache, sin_cache, x.stride(0), x.stride(1),
                                      out.stride(0), out.stride(1), cos_cache.stride(0), x.shape[1], half,
                                      BLOCK_HEADS=triton.next_power_of_2(x.shape[1]),
                                      BLOCK_H=triton.next_power_of_2(half))
    return q_out, k_out


# ---------------------------------------------------------------------------------------------- linear
@triton.jit
def _linear_kernel(x_ptr, w_ptr, b_ptr, y_ptr, rows, n_out, n_in, stride_x, stride_w, stride_y,
                   HAS_BIAS: tl.constexpr, IEEE_DOT: tl.constexpr, ROW_EXACT_DOT: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """y = x @ w.T (+ b), one (BLOCK_M, BLOCK_N) tile a program, the whole of K in BLOCK_K steps in order: no
    split-K and no tile size that depends on the shape, so an output element's sum runs the same way for any
    row count (the batch-invariant linear; cuBLAS picks its algorithm, and its split of K, by shape).
    ROW_EXACT_DOT (under the interpreter): the interpreter runs tl.dot as numpy's matmul, and the BLAS behind it
    may round a row differently by its place in the tile (OpenBLAS's Haswell/Zen kernels do: seen on an AMD EPYC),
    where a GPU's matrix units give each output element the same result whatever the other rows hold; so there the
    tile's product is written out as the multiply and the sum over K it stands for."""
    pm = tl.program_id(0)
    pn = tl.program_id(1)
    rm = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, n_in, BLOCK_K):
        kk = k0 + rk
        x = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_x + kk[None, :],
                    mask=(rm[:, None] < rows) & (kk[None, :] < n_in), other=0.0)
        w = tl.load(w_ptr + rn[:, None].to(tl.int64) * stride_w + kk[None, :],
                    mask=(rn[:, None] < n_out) & (kk[None, :] < n_in), other=0.0)
        if ROW_EXACT_DOT:  # the interpreter: the tile product as the sum it stands for, element by element
            acc += tl.sum(x.to(tl.float32)[:, :, None] * tl.trans(w.to(tl.float32))[None, :, :], axis=1)
        elif IEEE_DOT:
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=rn < n_out, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm[:, None].to(tl.int64) * stride_y + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rm[:, None] < rows) & (rn[None, :] < n_out))


def linear_invariant_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Batch-invariant linear (EngineConfig.batch_invariant): fixed 32 x 64 x 32 tiles, products in fp32 (IEEE in
    fp32 and under the interpreter, the matrix units in bf16/fp16), one rounding at the end."""
    x = x.contiguous()
    weight = weight.contiguous()
    rows, n_in = x.shape
    n_out = weight.shape[0]
    y = torch.empty(rows, n_out, dtype=x.dtype, device=x.device)
    if rows == 0:
        return y
    block_m, block_n, block_k = 32, 64, 32
    _linear_kernel[(triton.cdiv(rows, block_m), triton.cdiv(n_out, block_n))](
        x, weight, bias if bias is not None else x, y, rows, n_out, n_in, x.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, IEEE_DOT=x.dtype == torch.float32 or _INTERPRETED, ROW_EXACT_DOT=_INTERPRETED,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return y


def paged_attention_invariant_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                     meta: AttentionMetadata, scale: float, sliding_window: int | None = None,
                                     k_scale: float = 1.0, v_scale: float = 1.0, key: torch.Tensor | None = None,
                                     value: torch.Tensor | None = None) -> torch.Tensor:
    """Batch-invariant attention: the paged kernel with every query token its own program (as decode runs,
    prefill chunks too) and no split of the context, so each token's keys are summed in one order, 64 at a time
    from position 0 (or its window's start), whatever the step holds."""
    return paged_attention_triton(q, k_cache, v_cache, meta, scale, sliding_window, k_scale, v_scale, key, value,
                                  num_splits=1, block_m=1)


def _make_ops():
    from kernels import Ops
    from kernels.activation import silu_mul_ref
    from kernels.linear import linear_ref

    return Ops("triton", write_kv_triton, paged_attention_triton, rms_norm_triton, rotary_triton, linear_ref,
               silu_mul_ref, "Triton KV write, paged attention, RMSNorm and rotary; cuBLAS linear")


TRITON_OPS = _make_ops()
