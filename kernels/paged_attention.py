"""Paged attention: queries of a flattened batch against each sequence's blocks in the paged cache.

One function serves decode (one query token per sequence) and prefill/extend (a chunk of query tokens,
causal within the chunk, full over the already-cached prefix). The reference below is plain torch: the
engine's CPU path uses it and the Triton kernels are checked against it.
"""
from __future__ import annotations

import torch

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
) -> torch.Tensor:  # (T, H, D)
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
