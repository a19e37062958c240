"""Qwen3.5 (HF Qwen3_5ForCausalLM, text config `qwen3_5_text`): a hybrid of gated full attention and Gated
DeltaNet linear attention, per `layer_types` (the seed's Qwen3.6-27B: 16 full-attention layers of 64).

- Full-attention layers: q_proj carries an output gate beside the query (per head: D query, D gate), q/k
  RMS-normalized per head, rotary on the first `partial_rotary_factor` of each head (text-only mrope is plain
  rope), the output multiplied by sigmoid(gate). They keep paged KV like every other model; only they count
  in the KV pool (L in M = 2 L H_kv d T b).
- Gated DeltaNet layers keep no KV but a fixed-size state per sequence: the last K-1 inputs of a causal
  depthwise conv1d and a (value heads, d_k, d_v) matrix updated by the gated delta rule,
  S <- exp(g) S + k (beta (v - S^T k))^T, out = S^T q / sqrt(d_k), with q and k L2-normalized. The runner
  holds the states of all sequences in a pool of slots (ModelRunner.state_pool); a sequence's slot comes and
  goes with its KV blocks (BlockManager), a chunk starts from the state its previous chunk left, and a
  sequence's first chunk from zeros.
- RMSNorms are zero-centred (x * (1 + w)): the shared norm op gets 1 + w at load time, as for Gemma.

The delta rule runs in fp32, as HF's references do: one recurrent step per decode token (gated_delta_rule),
and for prefill chunks the chunked form (gated_delta_rule_chunked: 64 tokens at a time through one triangular
solve and matrix products), tested equal to the recurrence. Plain torch: no fused kernel yet.
"""
from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.layers import Attention, DecoderForCausalLM, DecoderLayer, DecoderSpec, RMSNorm
from engine.models.rope import build_rope_cache
from kernels import AttentionMetadata, Ops

logger = logging.getLogger(__name__)

# HF's separate projections of a Gated DeltaNet layer -> our merged in_proj, and which shard
_LINEAR_MERGED = {"in_proj_qkv": 0, "in_proj_z": 1, "in_proj_b": 2, "in_proj_a": 3}


class GatedAttention(Attention):
    """Full attention with Qwen3.5's output gate and partial rotary; K/V paged as in every model."""

    def __init__(self, spec: DecoderSpec, kv_layer_idx: int, ops: Ops, rotary_dim: int) -> None:
        super().__init__(spec, kv_layer_idx, ops)
        self.qkv_proj = nn.Linear(spec.hidden_size, 2 * self.q_size + 2 * self.kv_size, bias=spec.attention_bias)
        self.rotary_dim = rotary_dim

    def forward(self, hidden, positions, rope, kv_cache, meta: AttentionMetadata):
        t = hidden.shape[0]
        qkv = self.ops.linear(hidden, self.qkv_proj.weight, self.qkv_proj.bias)
        qg, k, v = qkv.split([2 * self.q_size, self.kv_size, self.kv_size], dim=-1)
        qg = qg.view(t, self.num_heads, 2 * self.head_dim)
        q, gate = qg[..., : self.head_dim], qg[..., self.head_dim :].reshape(t, self.q_size)
        q, _ = self.q_norm(q.contiguous())
        k, _ = self.k_norm(k.reshape(t, self.num_kv_heads, self.head_dim))
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        r = self.rotary_dim
        q_rot, k_rot = self.ops.rotary(q[..., :r], k[..., :r], positions, *rope)
        q = torch.cat([q_rot, q[..., r:]], dim=-1) if r < self.head_dim else q_rot
        k = torch.cat([k_rot, k[..., r:]], dim=-1) if r < self.head_dim else k_rot
        out = self.attend(q.contiguous(), k, v, kv_cache, meta)
        sigmoid = torch.sigmoid(gate) if not self.ops.batch_invariant else ew_invariant(torch.sigmoid, gate)
        out = out.reshape(t, self.q_size) * sigmoid
        return self.ops.linear(out, self.o_proj.weight)


EW_BLOCK = 64  # elements: a multiple of twice the widest vector torch's CPU loops use (AVX-512 fp32: 16)


def ew_invariant(fn, x: torch.Tensor) -> torch.Tensor:
    """fn (an elementwise op) on x with every element taking the same code path whatever x's size: torch's CPU
    loops run whole vectors and leave the remainder to a scalar loop, whose exp/sigmoid/softplus round
    differently, so an element's bits would depend on how many others share the call. Padding the flat input
    to a multiple of EW_BLOCK sends every element through the vector loop. For batch-invariant mode."""
    flat = x.reshape(-1)
    pad = -flat.numel() % EW_BLOCK
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return fn(flat)[: x.numel()].view(x.shape)


def _same(fn, x: torch.Tensor) -> torch.Tensor:
    return fn(x)


def _queries_keys(q: torch.Tensor, k: torch.Tensor, num_v_heads: int, ew=_same) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k (..., Hk, dk) as the rule reads them: float32, each key head repeated for the Hv / Hk consecutive
    value heads it serves, L2-normalized, and q scaled by 1 / sqrt(dk)."""
    num_k_heads, head_k = k.shape[-2:]
    if num_k_heads != num_v_heads:
        q = q.repeat_interleave(num_v_heads // num_k_heads, dim=-2)
        k = k.repeat_interleave(num_v_heads // num_k_heads, dim=-2)
    q, k = q.float(), k.float()
    q = q * ew(torch.rsqrt, (q * q).sum(-1, keepdim=True) + 1e-6) / (head_k**0.5)
    k = k * ew(torch.rsqrt, (k * k).sum(-1, keepdim=True) + 1e-6)
    return q, k


def _delta_step(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor,
                beta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the rule, over any leading batch dims: state (..., Hv, dk, dv); q, k (..., Hv, dk) from
    _queries_keys; v (..., Hv, dv); decay = exp(g) and beta (..., Hv). Returns the new state and the output
    (..., Hv, dv)."""
    state = state * decay[..., None, None]
    delta = (v - (state * k[..., None]).sum(dim=-2)) * beta[..., None]
    state = state + k[..., None] * delta[..., None, :]
    return state, (state * q[..., None]).sum(dim=-2)


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor, ew=_same) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's tokens through the gated delta rule, in order, from `state`. q, k (n, Hk, dk); v (n, Hv,
    dv); g, beta (n, Hv); state (Hv, dk, dv) float32. Returns the outputs (n, Hv, dv) float32 and the new
    state. Each query/key head serves Hv / Hk consecutive value heads."""
    n, num_v_heads, head_v = v.shape
    q, k = _queries_keys(q, k, num_v_heads, ew)
    v, beta = v.float(), beta.float()
    decay = ew(torch.exp, g.float())
    out = torch.empty(n, num_v_heads, head_v, dtype=torch.float32, device=v.device)
    for i in range(n):
        state, out[i] = _delta_step(state, q[i], k[i], v[i], decay[i], beta[i])
    return out, state


def gated_delta_rule_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                             beta: torch.Tensor, state: torch.Tensor, chunk: int = 64, ew=_same
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """gated_delta_rule, `chunk` tokens at a time in matrix products (the prefill form). Within a chunk, with
    G_t the cumulative log decay from the chunk's start and S0 the state before it, the values the rule
    writes are d = (I + A)^-1 (beta v) - (I + A)^-1 (beta exp(G) k) S0, where A[t, s] = beta_t exp(G_t - G_s)
    k_t.k_s for s < t (one unit lower-triangular solve); then o_t = exp(G_t) S0^T q_t + sum_{s<=t}
    exp(G_t - G_s) (q_t.k_s) d_s, and the state leaves as exp(G_C) S0 + sum_s exp(G_C - G_s) k_s d_s^T.
    Same arguments and results as gated_delta_rule, equal to rounding (tested)."""
    n = v.shape[0]
    q, k = _queries_keys(q, k, v.shape[1], ew)
    # heads first: (H, n, d)
    q, k, v = (x.transpose(0, 1) for x in (q, k, v.float()))
    g, beta = g.float().t(), beta.float().t()  # (H, n)
    out = torch.empty_like(v)
    for c0 in range(0, n, chunk):
        c1 = min(n, c0 + chunk)
        qc, kc, vc, bc = q[:, c0:c1], k[:, c0:c1], v[:, c0:c1], beta[:, c0:c1]
        cum = g[:, c0:c1].cumsum(-1)  # (H, C)
        causal = torch.ones(c1 - c0, c1 - c0, dtype=torch.bool, device=q.device).tril()
        decay = (cum[:, :, None] - cum[:, None, :]).masked_fill(~causal, float("-inf")).exp()  # (H, C, C), t >= s
        system = (bc[:, :, None] * (kc @ kc.transpose(-1, -2)) * decay).tril(-1)
        system = system + torch.eye(c1 - c0, dtype=system.dtype, device=system.device)
        written = torch.linalg.solve_triangular(system, bc[:, :, None] * vc, upper=False, unitriangular=True)
        reads = torch.linalg.solve_triangular(system, (bc * cum.exp())[:, :, None] * kc, upper=False,
                                              unitriangular=True)
        d = written - reads @ state  # (H, C, dv)
        out[:, c0:c1] = (qc * cum.exp()[:, :, None]) @ state + ((qc @ kc.transpose(-1, -2)) * decay) @ d
        last = cum[:, -1:]  # (H, 1)
        state = state * last.exp()[:, :, None] + (kc * (last - cum).exp()[:, :, None]).transpose(-1, -2) @ d
    return out.transpose(0, 1), state


def _causal_conv(window: torch.Tensor, weight: torch.Tensor, n: int) -> torch.Tensor:
    """Depthwise causal conv: out[c, t] = sum_j weight[c, j] * window[c, t + j], for the last n positions of
    window (..., conv_dim, K - 1 + n), the taps summed in order j = 0..K-1 (F.conv1d picks its algorithm by length,
    so a token's result would depend on how long its chunk is; this does not)."""
    out = window[..., :n] * weight[:, :1]
    for j in range(1, weight.shape[1]):
        out = out + window[..., j : j + n] * weight[:, j : j + 1]
    return out


class GatedDeltaNet(nn.Module):
    """A linear-attention layer: merged input projection (q|k|v, z, b, a), causal depthwise conv1d with its
    state, the gated delta rule with its state, gated RMSNorm, output projection."""

    def __init__(self, cfg: Any, linear_idx: int, ops: Ops) -> None:
        super().__init__()
        self.num_k_heads, self.num_v_heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.head_k, self.head_v = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim, self.value_dim = self.num_k_heads * self.head_k, self.num_v_heads * self.head_v
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel = cfg.linear_conv_kernel_dim
        self.eps = cfg.rms_norm_eps
        self.linear_idx, self.ops = linear_idx, ops
        self.in_proj = nn.Linear(cfg.hidden_size, self.conv_dim + self.value_dim + 2 * self.num_v_heads, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel, groups=self.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(self.head_v))
        self.out_proj = nn.Linear(self.value_dim, cfg.hidden_size, bias=False)

    def shard_sizes(self) -> list[int]:
        return [self.conv_dim, self.value_dim, self.num_v_heads, self.num_v_heads]

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Per sequence: the conv state (conv_dim, K - 1) and the delta state (Hv, dk, dv)."""
        return (self.conv_dim, self.kernel - 1), (self.num_v_heads, self.head_k, self.head_v)

    def _decode_rows(self, rows: list[int], starts: list[int], mixed, b, a, conv_pool, delta_pool, core,
                     meta: AttentionMetadata, neg_a: torch.Tensor) -> None:
        """One token each for several sequences, at once: their states gathered from the pool by slot, one conv
        step and one delta-rule step over the batch, the states scattered back (the same arithmetic as the
        per-sequence path: tested against HF through it)."""
        dev = mixed.device
        tok = torch.tensor([starts[i] for i in rows], device=dev)
        slots = torch.tensor([meta.state_slots[i] for i in rows], device=dev)
        fresh = torch.tensor([meta.state_fresh[i] for i in rows], device=dev)
        window = torch.cat([conv_pool[slots], mixed[tok][:, :, None].to(conv_pool.dtype)], dim=-1)  # (B, C, K)
        window[fresh, :, :-1] = 0  # a one-token prompt starts from zeros
        conv_pool[slots] = window[:, :, 1:]
        weight = self.conv1d.weight[:, 0]  # (C, K)
        y = F.silu(_causal_conv(window.to(weight.dtype), weight, 1)[..., 0])  # (B, C)
        q, k, v = y.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        nb = len(rows)
        q, k = _queries_keys(q.reshape(nb, self.num_k_heads, self.head_k), k.reshape(nb, self.num_k_heads, self.head_k),
                             self.num_v_heads)
        beta = torch.sigmoid(b[tok]).float()  # (B, Hv)
        g = neg_a * F.softplus(a[tok].float() + self.dt_bias)
        state = delta_pool[slots]  # (B, Hv, dk, dv)
        state[fresh] = 0
        state, out = _delta_step(state, q, k, v.reshape(nb, self.num_v_heads, self.head_v).float(), g.exp(), beta)
        delta_pool[slots] = state
        core[tok] = out.to(core.dtype)

    def forward(self, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        t = hidden.shape[0]
        proj = self.ops.linear(hidden, self.in_proj.weight)
        mixed, z, b, a = proj.split(self.shard_sizes(), dim=-1)
        conv_pool, delta_pool = meta.linear_states[self.linear_idx]
        core = torch.empty(t, self.num_v_heads, self.head_v, dtype=hidden.dtype, device=hidden.device)
        weight = self.conv1d.weight  # (conv_dim, 1, K)
        ew = ew_invariant if self.ops.batch_invariant else _same
        neg_a = -self.A_log.float().exp()
        starts = [0]
        for n in meta.query_lens_host:
            starts.append(starts[-1] + n)
        batched = [] if self.ops.batch_invariant else [i for i, n in enumerate(meta.query_lens_host) if n == 1]
        if batched:  # every one-token row (decode) in one batched step: no Python loop over sequences
            self._decode_rows(batched, starts, mixed, b, a, conv_pool, delta_pool, core, meta, neg_a)
        for i, (n, slot, fresh) in enumerate(zip(meta.query_lens_host, meta.state_slots, meta.state_fresh)):
            if batched and n == 1:
                continue
            start = starts[i]
            x = mixed[start : start + n].t()  # (conv_dim, n)
            prev = conv_pool.new_zeros(self.conv_dim, self.kernel - 1) if fresh else conv_pool[slot]
            window = torch.cat([prev, x.to(prev.dtype)], dim=-1)
            conv_pool[slot] = window[:, window.shape[1] - (self.kernel - 1) :]
            y = ew(F.silu, _causal_conv(window.to(weight.dtype), weight[:, 0], n)).t()  # (n, conv_dim)
            q, k, v = y.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
            beta = ew(torch.sigmoid, b[start : start + n])
            g = neg_a * ew(F.softplus, a[start : start + n].float() + self.dt_bias)
            state = delta_pool.new_zeros(delta_pool.shape[1:]) if fresh else delta_pool[slot]
            # decode: one step; prefill: chunks, unless batch-invariant, where a token's result may not depend on
            # where the scheduler cut its prompt: the recurrence, token by token, whatever the chunk
            rule = gated_delta_rule if n == 1 or self.ops.batch_invariant else gated_delta_rule_chunked
            out, state = rule(q.reshape(n, self.num_k_heads, self.head_k),
                              k.reshape(n, self.num_k_heads, self.head_k),
                              v.reshape(n, self.num_v_heads, self.head_v), g, beta, state, ew=ew)
            delta_pool[slot] = state
            core[start : start + n] = out.to(hidden.dtype)
        # gated RMSNorm per value head: w * norm(x) in the model's dtype, times silu(z) in fp32
        xf = core.float()
        xf = xf * ew(torch.rsqrt, xf.pow(2).mean(-1, keepdim=True) + self.eps)
        normed = self.norm.weight * xf.to(hidden.dtype)
        gated = (normed * ew(F.silu, z.reshape(t, self.num_v_heads, self.head_v).float())).to(hidden.dtype)
        return self.ops.linear(gated.reshape(t, self.value_dim), self.out_proj.weight)


class HybridDecoderLayer(DecoderLayer):
    """A decoder layer whose token mixer is gated full attention or a Gated DeltaNet, per layer_types."""

    def __init__(self, spec: DecoderSpec, cfg: Any, kind: str, index: int, ops: Ops, rotary_dim: int) -> None:
        self.is_attention = kind == "full_attention"
        if self.is_attention:
            super().__init__(spec, index, ops, GatedAttention(spec, index, ops, rotary_dim), "self_attn")
        else:
            super().__init__(spec, index, ops, GatedDeltaNet(cfg, index, ops), "linear_attn")

    def mix(self, hidden, positions, rope, kv_cache, meta):
        if self.is_attention:
            return self.self_attn(hidden, positions, rope, kv_cache, meta)
        return self.linear_attn(hidden, meta)


class HybridModel(nn.Module):
    def __init__(self, spec: DecoderSpec, cfg: Any, ops: Ops, rotary_dim: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        layers, counts = [], {"full_attention": 0, "linear_attention": 0}
        for kind in cfg.layer_types:
            layers.append(HybridDecoderLayer(spec, cfg, kind, counts[kind], ops, rotary_dim))
            counts[kind] += 1
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, ops)

    def forward(self, input_ids, positions, rope, kv_caches, meta):
        hidden, residual = self.embed_tokens(input_ids), None
        kv = iter(kv_caches)
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, positions, rope, next(kv) if layer.is_attention else None,
                                     meta)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class Qwen3_5ForCausalLM(DecoderForCausalLM):
    merged_modules = ("qkv_proj", "gate_up_proj", "in_proj")

    def __init__(self, hf_config: Any, ops: Ops, max_positions: int) -> None:
        kinds = list(hf_config.layer_types)
        unknown = sorted(set(kinds) - {"full_attention", "linear_attention"})
        if unknown:
            raise ValueError(f"Qwen3.5 layer_types holds {unknown}; supported: full_attention, linear_attention")
        num_full = kinds.count("full_attention")
        if num_full == 0:
            raise ValueError("this Qwen3.5 config has no full-attention layer; the engine needs at least one")
        spec = DecoderSpec.from_hf(hf_config, qk_norm=True, sliding_windows=[None] * num_full)
        params = dict(getattr(hf_config, "rope_parameters", None) or {})
        rotary_dim = int(spec.head_dim * params.get("partial_rotary_factor", 1.0))
        super().__init__(hf_config, spec, ops, max_positions, model=HybridModel(spec, hf_config, ops, rotary_dim))
        self.rotary_dim = rotary_dim

    def init_rope(self, device: torch.device) -> None:
        cos, sin = build_rope_cache(self.hf_config, self.rotary_dim, self.max_positions)
        self.rope_cos, self.rope_sin = cos.to(device), sin.to(device)

    # ---- the recurrent state (ModelRunner.state_pool) ----
    def linear_layers(self) -> list[GatedDeltaNet]:
        return [layer.linear_attn for layer in self.model.layers if not layer.is_attention]

    def state_bytes_per_seq(self) -> int:
        """Bytes of recurrent state one sequence holds over all linear layers, whatever the model's dtype: both
        states are kept in fp32 (the conv state holds the model dtype's values exactly; the delta state is
        accumulated in fp32, as HF's reference does). engine.capacity counts the same."""
        total = 0
        for layer in self.linear_layers():
            conv, delta = layer.state_shapes()
            total += 4 * (conv[0] * conv[1] + delta[0] * delta[1] * delta[2])
        return total

    def new_state_pool(self, num_slots: int, device: torch.device) -> list[tuple[torch.Tensor, ...]]:
        """Per linear layer: (conv states (slots, conv_dim, K - 1), delta states (slots, Hv, dk, dv)), fp32."""
        return [tuple(torch.zeros((num_slots, *shape), dtype=torch.float32, device=device)
                      for shape in layer.state_shapes()) for layer in self.linear_layers()]

    # ---- weights ----
    def _shard_sizes(self, merged: str) -> list[int]:
        s = self.spec
        if merged == "qkv_proj":  # q_proj holds query and gate
            return [2 * s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim, s.num_kv_heads * s.head_dim]
        if merged == "in_proj":
            return self.linear_layers()[0].shard_sizes()
        return super()._shard_sizes(merged)

    def _destination(self, name: str, params: dict[str, torch.nn.Parameter]) -> tuple[str, torch.Tensor] | None:
        if name.startswith("mtp."):  # the multi-token-prediction head: speculative decoding, not run here
            return None
        parts = name.split(".")
        for i, part in enumerate(parts):
            if part in _LINEAR_MERGED:
                target = ".".join(parts[:i] + ["in_proj"] + parts[i + 1 :])
                if target not in params:
                    raise ValueError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
                sizes = self._shard_sizes("in_proj")
                shard = _LINEAR_MERGED[part]
                return target, params[target].data.narrow(0, sum(sizes[:shard]), sizes[shard])
        return super()._destination(name, params)

    def adjust_weight(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Zero-centred RMSNorms scale by (1 + w); the shared norm op by w, so it holds 1 + w. The gated norm
        of the linear-attention layers scales by w itself."""
        if name.endswith("norm.weight") and ".linear_attn.norm." not in name:
            return tensor.float() + 1.0
        return tensor


class Qwen3_5ForConditionalGeneration(Qwen3_5ForCausalLM):
    """The language model of a Qwen3.5 vision-language checkpoint (how Qwen3.5 / 3.6 ship), text in, text out.
    engine.loader hands over its text_config; the checkpoint's `model.language_model.*` tensors load as
    `model.*`, and the vision tower (`model.visual.*`) is skipped, said once in the log."""

    def __init__(self, hf_config: Any, ops: Ops, max_positions: int) -> None:
        super().__init__(hf_config, ops, max_positions)
        self._skipped_vision = 0

    def _destination(self, name: str, params: dict[str, torch.nn.Parameter]) -> tuple[str, torch.Tensor] | None:
        if name.startswith("model.visual."):
            if self._skipped_vision == 0:
                logger.info("vision-language checkpoint: its vision tower (model.visual.*) is not loaded; the engine "
                            "serves the language model, text only")
            self._skipped_vision += 1
            return None
        if name.startswith("model.language_model."):
            name = "model." + name.removeprefix("model.language_model.")
        return super()._destination(name, params)
