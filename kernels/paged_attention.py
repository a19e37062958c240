"""Paged attention: queries of a flattened batch against each sequence's blocks in the paged cache.

One function serves decode (one query token per sequence) and prefill/extend (a chunk of query tokens,
causal within the chunk, full over the already-cached prefix). The reference below is plain torch: the
engine's CPU path uses it and the Triton kernels are checked against it.
"""
from __future__ import annotations

import os
from typing import NamedTuple

import torch
import torch.nn.functional as F

from kernels.cpu_native import native, native_dtype
from kernels.kv_cache import dequantize, fp8_table, gather_blocks, is_fp8, write_kv_ref
from kernels.metadata import AttentionMetadata


def _attend(
    q: torch.Tensor,  # (B, Lq, Hkv, G, D)
    k: torch.Tensor,  # (B, Lk, Hkv, D)
    v: torch.Tensor,  # (B, Lk, Hkv, D)
    allowed: torch.Tensor,  # (B, Lq, Lk) bool
    scale: float,
) -> torch.Tensor:  # (B, Lq, Hkv, G, D)
    scores = torch.einsum("bqhgd,bkhd->bhgqk", q, k) * scale  # (B, Hkv, G, Lq, Lk)
    scores = scores.masked_fill(~allowed[:, None, None], float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)
    return torch.einsum("bhgqk,bkhd->bqhgd", probs, v)


def _gather_kv(cache: torch.Tensor, block_table: torch.Tensor, num_blocks: int) -> torch.Tensor:
    # cache (NB, bs, Hkv, D), block_table (B, >=num_blocks) -> (B, num_blocks * bs, Hkv, D)
    blocks = cache[block_table[:, :num_blocks].long()]  # (B, nb, bs, Hkv, D)
    b, nb, bs, h, d = blocks.shape
    return blocks.reshape(b, nb * bs, h, d)


def paged_attention_ref(
    q: torch.Tensor,  # (T, H, D)
    k_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
    v_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    k_scale: float = 1.0,  # fp8 caches: what they hold is dequantized (fp8 * scale, kernels.kv_cache) first
    v_scale: float = 1.0,
    key: torch.Tensor | None = None,  # (T, Hkv, D): this step's own K/V, which an fp8 cache's readers attend to
    value: torch.Tensor | None = None,  # exactly (as written, not as stored); other tokens come from the cache
) -> torch.Tensor:  # (T, H, D)
    if is_fp8(k_cache):
        k_cache, v_cache = dequantize(k_cache, k_scale, q.dtype), dequantize(v_cache, v_scale, q.dtype)
        if key is not None:
            write_kv_ref(key, value, k_cache, v_cache, meta.slot_mapping)
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    starts = [0]
    for n in meta.query_lens_host:
        starts.append(starts[-1] + n)

    decode_ids = [b for b, n in enumerate(meta.query_lens_host) if n == 1]
    if decode_ids:
        # All one-token queries in one batched call: pad every context to the longest, mask the rest.
        idx = torch.tensor(decode_ids, device=q.device)
        token_idx = torch.tensor([starts[b] for b in decode_ids], device=q.device)
        max_len = max(meta.seq_lens_host[b] for b in decode_ids)
        nb = -(-max_len // block_size)
        bt = meta.block_tables[idx]
        k = _gather_kv(k_cache, bt, nb)
        v = _gather_kv(v_cache, bt, nb)
        seq_lens = meta.seq_lens[idx].to(q.device).long()  # (Bd,)
        key_pos = torch.arange(nb * block_size, device=q.device)
        allowed = key_pos[None, :] < seq_lens[:, None]  # (Bd, Lk)
        if sliding_window is not None:
            allowed &= key_pos[None, :] > (seq_lens[:, None] - 1 - sliding_window)
        qd = q[token_idx].view(len(decode_ids), 1, num_kv_heads, group, head_dim)
        out[token_idx] = _attend(qd, k, v, allowed[:, None, :], scale).reshape(-1, num_heads, head_dim)

    for b, q_len in enumerate(meta.query_lens_host):
        if q_len == 1:
            continue
        ctx = meta.seq_lens_host[b]
        nb = -(-ctx // block_size)
        k = _gather_kv(k_cache, meta.block_tables[b : b + 1], nb)[:, :ctx]
        v = _gather_kv(v_cache, meta.block_tables[b : b + 1], nb)[:, :ctx]
        q_pos = torch.arange(ctx - q_len, ctx, device=q.device)[:, None]
        key_pos = torch.arange(ctx, device=q.device)[None, :]
        allowed = key_pos <= q_pos
        if sliding_window is not None:
            allowed &= key_pos > q_pos - sliding_window
        qb = q[starts[b] : starts[b] + q_len].view(1, q_len, num_kv_heads, group, head_dim)
        out[starts[b] : starts[b] + q_len] = _attend(qb, k, v, allowed[None], scale).reshape(
            q_len, num_heads, head_dim
        )
    return out


def _decode_buckets(lengths: list[int], max_waste: float = 0.25) -> list[list[int]]:
    """Indices of decode rows grouped by context length, longest first, so each group pads to its own
    longest: a group closes when the next row is more than `max_waste` shorter than the group's first."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and lengths[i] >= (1 - max_waste) * lengths[groups[-1][0]]:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


class NativeDecode(NamedTuple):
    """Every decode row in one call of our C kernel, reading the pages in place."""
    block_tables: torch.Tensor  # (B, max_blocks) int32
    rows: torch.Tensor  # (Bd,) int64: which sequences
    tokens: torch.Tensor  # (Bd,) int64: their query token
    ctx_lens: torch.Tensor  # (Bd,) int64


class DecodeGroup(NamedTuple):
    """Decode rows of similar context length, their blocks gathered for one SDPA call."""
    token_idx: torch.Tensor  # (Bg,)
    block_ids: torch.Tensor  # (Bg * num_blocks,) int64
    num_blocks: int
    mask: torch.Tensor | None  # (Bg, 1, 1, Lk) bool; None: every key counts
    own_positions: torch.Tensor  # (Bg,) int64: each row's own token's position (its context length - 1)


class PrefillChunk(NamedTuple):
    """One sequence's query chunk against its cached prefix and itself."""
    start: int
    q_len: int
    ctx: int
    block_ids: torch.Tensor  # (num_blocks,) int64
    num_blocks: int
    mask: torch.Tensor | None  # (q_len, ctx) bool; None: plain causal


def _sdpa_plan(meta: AttentionMetadata, block_size: int, sliding_window: int | None, device,
               native_decode: bool) -> list[NativeDecode | DecodeGroup | PrefillChunk]:
    """What paged_attention_sdpa does for this step, as index tensors and masks. Every layer of a step
    asks the same, so it is built once per step and kept on the metadata."""
    key = ("sdpa", block_size, sliding_window, native_decode)
    if key in meta.plans:
        return meta.plans[key]
    starts = [0]
    for n in meta.query_lens_host:
        starts.append(starts[-1] + n)
    plan: list[NativeDecode | DecodeGroup | PrefillChunk] = []
    decode = [b for b, n in enumerate(meta.query_lens_host) if n == 1]
    if native_decode and decode:  # every decode row in one call of our C kernel, reading the pages in place
        tables = meta.block_tables.to(torch.int32).contiguous()  # no copy when the runner's already are
        plan.append(NativeDecode(tables, *(torch.tensor(x, dtype=torch.int64) for x in (
            decode, [starts[b] for b in decode], [meta.seq_lens_host[b] for b in decode]))))
        decode = []
    for group in _decode_buckets([meta.seq_lens_host[b] for b in decode]):
        rows = [decode[i] for i in group]
        lens = [meta.seq_lens_host[b] for b in rows]
        nb = -(-lens[0] // block_size)
        ids = meta.block_tables[torch.tensor(rows, device=meta.block_tables.device), :nb].reshape(-1).long()
        mask = None
        if sliding_window is not None or any(n != nb * block_size for n in lens):
            seq_lens = torch.tensor(lens, device=device)
            key_pos = torch.arange(nb * block_size, device=device)
            allowed = key_pos[None, :] < seq_lens[:, None]
            if sliding_window is not None:
                allowed &= key_pos[None, :] > (seq_lens[:, None] - 1 - sliding_window)
            mask = allowed[:, None, None, :]  # (B, 1, 1, Lk)
        plan.append(DecodeGroup(torch.tensor([starts[b] for b in rows], device=device), ids.to(device), nb, mask,
                                torch.tensor([n - 1 for n in lens], device=device)))
    for b, q_len in enumerate(meta.query_lens_host):
        if q_len == 1:
            continue
        ctx = meta.seq_lens_host[b]
        nb = -(-ctx // block_size)
        ids = meta.block_tables[b, :nb].long().to(device)
        mask = None  # None: plain causal (a whole prompt, no cached prefix)
        if ctx != q_len or sliding_window is not None:
            q_pos = torch.arange(ctx - q_len, ctx, device=device)[:, None]
            key_pos = torch.arange(ctx, device=device)[None, :]
            mask = key_pos <= q_pos
            if sliding_window is not None:
                mask &= key_pos > q_pos - sliding_window
        plan.append(PrefillChunk(starts[b], q_len, ctx, ids, nb, mask))
    meta.plans[key] = plan
    return plan


def _scratch(meta: AttentionMetadata, name: str, num_blocks: int, cache: torch.Tensor,
             dtype: torch.dtype | None = None) -> torch.Tensor:
    """A (num_blocks, block_size, Hkv, D) buffer for gathered blocks, reused by every layer and, through the
    runner's meta.scratch, every step. Past glibc's mmap threshold (32 MiB) a fresh tensor each layer is
    mapped anew and costs more in page faults than the gather's copy itself. It grows with a quarter of headroom
    and stays as large as the largest step's longest group: at most a layer's share of the KV pool."""
    dtype = dtype or cache.dtype
    key = ("paged_attention_gather", name, dtype, cache.device)
    buf = meta.scratch.get(key)
    if buf is None or buf.shape[0] < num_blocks or buf.shape[1:] != cache.shape[1:]:
        buf = torch.empty((num_blocks + num_blocks // 4,) + tuple(cache.shape[1:]), dtype=dtype,
                          device=cache.device)
        meta.scratch[key] = buf
    return buf[:num_blocks]


def paged_attention_sdpa(
    q: torch.Tensor,  # (T, H, D)
    k_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    key: torch.Tensor | None = None,
    value: torch.Tensor | None = None,
) -> torch.Tensor:  # (T, H, D)
    """The CPU path: the reference's semantics through torch's fused scaled_dot_product_attention, which on
    CPU runs a flash-attention kernel (no (Lq, Lk) score tensor per head in memory, GQA without repeating
    K/V). Decode rows go in groups of similar context length, so little time is spent on padding; each
    group's blocks are gathered with one index_select. In fp32 and bf16, where our C kernels build
    (kernels/cpu_native.py), decode rows instead go to a paged decode kernel that reads K/V in place, fp8
    pages too (through a 256-entry table, the scales folded into the softmax scale and the output). Prompts and
    chunks, sliding windows too, go to our C flash attention: bf16 where the CPU has AVX512-BF16 (about 3x torch's
    SDPA at 512 tokens on 2 cores: bench/kernels.py), fp32 on any AVX2 CPU; its tasks are handed out dynamically,
    where SDPA splits its loop statically and a core taken for a moment stalls the other. With an fp8 cache, this step's own tokens are attended
    through `key`/`value` as written, as in the reference. Checked against paged_attention_ref in tests."""
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)
    gqa = num_heads != num_kv_heads
    fp8 = is_fp8(k_cache)

    def gather(cache: torch.Tensor, ids: torch.Tensor, rows: int, nb: int, name: str,
               own: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        # (B, Hkv, L, D), copied into a buffer kept across layers and steps (see _scratch); fp8 pages are
        # dequantized to q's dtype on the way, and this step's own tokens (own: their positions in each row,
        # (B, n), and their rows of key/value, (B, n)) put in as written
        if fp8:
            buf = _scratch(meta, name, ids.numel(), cache, q.dtype)
            buf.copy_(dequantize(gather_blocks(cache, ids), k_scale if name == "k" else v_scale, q.dtype))
        else:
            buf = _scratch(meta, name, ids.numel(), cache)
            torch.index_select(cache, 0, ids, out=buf)
        buf = buf.view(rows, nb * block_size, num_kv_heads, head_dim)
        if own is not None:
            positions, tokens = own
            buf[torch.arange(rows, device=buf.device)[:, None], positions] = (key if name == "k" else value)[tokens]
        return buf.transpose(1, 2)

    lib, bf = native(), native_dtype(q)
    native_decode = (lib is not None and bf is not None and meta.block_tables.device.type == "cpu"
                     and (fp8 or k_cache.dtype == q.dtype) and v_cache.dtype == k_cache.dtype
                     and q.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous()
                     and (key is None or not fp8 or (key.dtype == q.dtype and value.dtype == q.dtype
                                                     and key.stride()[1:] == (head_dim, 1)
                                                     and value.stride()[1:] == (head_dim, 1))))
    # fp32 and bf16 prompts and chunks through our C flash attention, which answers 0 where it cannot take them
    # (bf16 without AVX512-BF16, head_dim): SDPA then. KVSCALE_NATIVE_PREFILL=0 keeps SDPA, for A/B runs.
    prefill_kernel = None
    if (lib is not None and bf is not None and q.stride()[1:] == (head_dim, 1) and out.is_contiguous()
            and os.environ.get("KVSCALE_NATIVE_PREFILL", "1") != "0"):
        prefill_kernel = lib.kvs_prefill_attention_bf16 if bf == 1 else lib.kvs_prefill_attention_f32
    fresh = fp8 and key is not None  # the C kernel reads each row's own token from key/value
    for step in _sdpa_plan(meta, block_size, sliding_window, q.device, native_decode):
        if isinstance(step, NativeDecode):
            _native_decode(lib, step, q, k_cache, v_cache, out, meta, scale, sliding_window, k_scale, v_scale,
                           key if fresh else None, value if fresh else None)
        elif isinstance(step, DecodeGroup):
            token_idx, ids, nb, mask, own_positions = step
            rows = len(token_idx)
            own = (own_positions[:, None], token_idx[:, None]) if fresh else None
            k, v = gather(k_cache, ids, rows, nb, "k", own), gather(v_cache, ids, rows, nb, "v", own)
            res = F.scaled_dot_product_attention(q[token_idx].unsqueeze(2), k, v, attn_mask=mask, scale=scale,
                                                 enable_gqa=gqa)  # (B, H, 1, D)
            out[token_idx] = res.squeeze(2)
        else:
            start, q_len, ctx, ids, nb, mask = step
            own = ((torch.arange(ctx - q_len, ctx, device=q.device)[None],
                    torch.arange(start, start + q_len, device=q.device)[None]) if fresh else None)
            k = gather(k_cache, ids, 1, nb, "k", own)[:, :, :ctx]
            v = gather(v_cache, ids, 1, nb, "v", own)[:, :, :ctx]
            if prefill_kernel is not None and k.stride(3) == 1 and v.stride(3) == 1 and prefill_kernel(
                    q[start].data_ptr(), k.data_ptr(), v.data_ptr(), out[start].data_ptr(), q_len, ctx, num_heads,
                    num_kv_heads, head_dim, q.stride(0), k.stride(2), k.stride(1), v.stride(2), v.stride(1),
                    sliding_window or 0, scale, torch.get_num_threads()):
                continue
            qb = q[start : start + q_len].transpose(0, 1).unsqueeze(0)  # (1, H, Lq, D)
            res = F.scaled_dot_product_attention(qb, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                                 enable_gqa=gqa)
            out[start : start + q_len] = res[0].transpose(0, 1)
    return out


def _native_decode(lib, step: NativeDecode, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   out: torch.Tensor, meta: AttentionMetadata, scale: float, sliding_window: int | None,
                   k_scale: float, v_scale: float, key: torch.Tensor | None, value: torch.Tensor | None) -> None:
    """Rows of `step` through our C decode kernel, which reads the pages in place. Each (row, query head) is
    one task in a fixed order over its keys, whatever else the call holds. key/value: an fp8 cache's own
    tokens as written (None: every key from the pages)."""
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    fp8 = is_fp8(k_cache)
    table = None
    if fp8:
        table = meta.scratch.get(("fp8_table", k_cache.dtype))
        if table is None:
            table = meta.scratch[("fp8_table", k_cache.dtype)] = fp8_table(k_cache.dtype)
    tables, rows, tokens, ctx = step
    fresh = key is not None
    lib.kvs_paged_decode(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
                         tables.data_ptr(), tables.stride(0), rows.data_ptr(), tokens.data_ptr(),
                         ctx.data_ptr(), len(rows), num_heads, num_kv_heads, head_dim, block_size,
                         sliding_window or 0, scale * k_scale, v_scale,
                         table.data_ptr() if fp8 else None, key.data_ptr() if fresh else None,
                         value.data_ptr() if fresh else None, key.stride(0) if fresh else 0,
                         value.stride(0) if fresh else 0, 1.0 / k_scale, 1.0 / v_scale, native_dtype(q),
                         torch.get_num_threads())


def paged_attention_invariant_cpu(
    q: torch.Tensor,  # (T, H, D)
    k_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    key: torch.Tensor | None = None,
    value: torch.Tensor | None = None,
) -> torch.Tensor:  # (T, H, D)
    """Batch-invariant attention (EngineConfig.batch_invariant): every query token, decode or prefill, is one
    row of the C decode kernel against its own context 0..pos (its sequence's pages, this step's K/V already
    written), so what a token gets does not depend on how its prompt was chunked, whether its prefix came
    from the cache, or what else the step holds. A prefill chunk costs q_len decode rows instead of one
    flash-attention call. With an fp8 cache each token's own K/V is attended as written and every other key
    from the pages, alike in every step shape. Same semantics as paged_attention_ref (tested against it)."""
    lib = native()
    plan = meta.plans.get("invariant_decode_rows")
    if plan is None:  # once a step per KV group, shared by the group's layers
        rows: list[int] = []
        ctx: list[int] = []
        for b, (q_len, seq_len) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host)):
            rows.extend([b] * q_len)
            ctx.extend(range(seq_len - q_len + 1, seq_len + 1))
        plan = meta.plans["invariant_decode_rows"] = NativeDecode(
            meta.block_tables.to(torch.int32).contiguous(), torch.tensor(rows, dtype=torch.int64),
            torch.arange(len(rows), dtype=torch.int64), torch.tensor(ctx, dtype=torch.int64))
    q = q.contiguous()
    out = torch.empty_like(q)
    if is_fp8(k_cache) and key is not None:
        key, value = key.to(q.dtype).contiguous(), value.to(q.dtype).contiguous()
    else:
        key = value = None
    _native_decode(lib, plan, q, k_cache.contiguous(), v_cache.contiguous(), out, meta, scale, sliding_window,
                   k_scale, v_scale, key, value)
    return out
