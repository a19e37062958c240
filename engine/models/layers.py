"""The decoder-only transformer shared by the Llama, Mistral and Qwen families, written against our ops.

Differences between families are constructor flags (attention bias, q/k norm, sliding window); each
family's file says which it sets. Projections are merged (q|k|v, gate|up) so each is one matmul.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from engine.models.rope import build_rope_cache
from kernels import AttentionMetadata, Ops
from kernels.kv_cache import kv_scale


@dataclass(frozen=True)
class DecoderSpec:
    """Everything the forward pass needs to know about an architecture, read once from the HF config."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_windows: tuple[int | None, ...] = ()  # per layer

    @classmethod
    def from_hf(cls, cfg: Any, *, attention_bias: bool | None = None, qk_norm: bool = False,
                sliding_windows: Iterable[int | None] | None = None) -> DecoderSpec:
        num_heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
        num_layers = cfg.num_hidden_layers
        return cls(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.rms_norm_eps,
            max_position_embeddings=cfg.max_position_embeddings,
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            attention_bias=bool(getattr(cfg, "attention_bias", False)) if attention_bias is None else attention_bias,
            mlp_bias=bool(getattr(cfg, "mlp_bias", False)),
            qk_norm=qk_norm,
            sliding_windows=tuple(sliding_windows) if sliding_windows is not None else (None,) * num_layers,
        )


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, ops: Ops) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps, self.ops = eps, ops

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return self.ops.rms_norm(x, self.weight, self.eps, residual)


class Attention(nn.Module):
    def __init__(self, spec: DecoderSpec, layer_idx: int, ops: Ops) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.q_size = spec.num_heads * spec.head_dim
        self.kv_size = spec.num_kv_heads * spec.head_dim
        self.qkv_proj = nn.Linear(spec.hidden_size, self.q_size + 2 * self.kv_size, bias=spec.attention_bias)
        self.o_proj = nn.Linear(self.q_size, spec.hidden_size, bias=False)
        self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, ops) if spec.qk_norm else None
        self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, ops) if spec.qk_norm else None
        self.scale = spec.head_dim**-0.5
        self.sliding_window = spec.sliding_windows[layer_idx]
        self.layer_idx, self.ops = layer_idx, ops
        # fp8 KV cache: the cache holds K / k_scale and V / v_scale (kernels.kv_cache); set once at start-up by
        # the runner's calibration (calibrate_kv: this forward sets them from the K and V it is about to write)
        self.k_scale, self.v_scale = 1.0, 1.0
        self.calibrate_kv = False
        # fp8 KV cache: (D, D), the transpose of the orthogonal matrix q and k are multiplied by before they
        # meet the cache (kernels.kv_cache.kv_rotation; the runner sets it, as a weight for ops.linear)
        self.kv_rotation: torch.Tensor | None = None
        self.kv_group = 0  # which KV group's block tables it reads (engine.kv_groups; set by the runner)

    def forward(self, hidden, positions, rope, kv_cache, meta: AttentionMetadata):
        num_tokens = hidden.shape[0]
        qkv = self.ops.linear(hidden, self.qkv_proj.weight, self.qkv_proj.bias)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # (T, H, D)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # (T, Hkv, D)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, _ = self.q_norm(q)
            k, _ = self.k_norm(k)
        q, k = self.ops.rotary(q, k, positions, *rope)
        out = self.attend(q, k, v, kv_cache, meta)
        return self.ops.linear(out.reshape(num_tokens, self.q_size), self.o_proj.weight)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache, meta: AttentionMetadata
               ) -> torch.Tensor:
        """This step's K/V into the layer's pages (fp8: setting the scales first when calibrating), then q
        against the pages of its KV group. q (T, H, D), k and v (T, Hkv, D); returns (T, H, D)."""
        k_cache, v_cache = kv_cache
        meta = meta.for_group(self.kv_group)
        if self.kv_rotation is not None:  # scores unchanged, keys' quantization error spread over channels
            q, k = self._rotate(q), self._rotate(k)
        if self.calibrate_kv:
            self.k_scale, self.v_scale = kv_scale(k, k_cache.dtype), kv_scale(v, v_cache.dtype)
        self.ops.write_kv(k, v, k_cache, v_cache, meta.slot_mapping, self.k_scale, self.v_scale)
        return self.ops.paged_attention(q, k_cache, v_cache, meta, self.scale, self.sliding_window, self.k_scale,
                                        self.v_scale, k, v)

    def _rotate(self, x: torch.Tensor) -> torch.Tensor:
        tokens, heads, head_dim = x.shape
        return self.ops.linear(x.reshape(tokens * heads, head_dim), self.kv_rotation).view(tokens, heads, head_dim)


class MLP(nn.Module):
    def __init__(self, spec: DecoderSpec, ops: Ops) -> None:
        super().__init__()
        self.ops = ops
        self.intermediate_size = spec.intermediate_size
        self.gate_up_proj = nn.Linear(spec.hidden_size, 2 * spec.intermediate_size, bias=spec.mlp_bias)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=spec.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        linear = self.ops.linear
        gate_up = linear(x, self.gate_up_proj.weight, self.gate_up_proj.bias)
        return linear(self.ops.silu_mul(gate_up), self.down_proj.weight, self.down_proj.bias)


class DecoderLayer(nn.Module):
    """norm -> token mixer -> norm -> MLP, residuals fused into the norms. The mixer is attention unless a
    family gives its own (a hybrid's linear-attention layers), under the name its checkpoints use."""

    def __init__(self, spec: DecoderSpec, layer_idx: int, ops: Ops, mixer: nn.Module | None = None,
                 mixer_name: str = "self_attn") -> None:
        super().__init__()
        self.mixer_name = mixer_name
        setattr(self, mixer_name, mixer if mixer is not None else Attention(spec, layer_idx, ops))
        self.mlp = MLP(spec, ops)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, ops)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, ops)

    def mix(self, hidden, positions, rope, kv_cache, meta):
        return self.self_attn(hidden, positions, rope, kv_cache, meta)

    def forward(self, hidden, residual, positions, rope, kv_cache, meta):
        hidden, residual = self.input_layernorm(hidden, residual) if residual is not None else (
            self.input_layernorm(hidden)[0], hidden)
        hidden = self.mix(hidden, positions, rope, kv_cache, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class DecoderModel(nn.Module):
    def __init__(self, spec: DecoderSpec, ops: Ops) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec, i, ops) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, ops)

    def forward(self, input_ids, positions, rope, kv_caches, meta):
        hidden, residual = self.embed_tokens(input_ids), None  # (T, hidden)
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden, residual = layer(hidden, residual, positions, rope, kv_cache, meta)
        hidden, _ = self.norm(hidden, residual)
        return hidden


# HF checkpoint name -> (our parameter, which shard of a merged weight)
_MERGED = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}


class DecoderForCausalLM(nn.Module):
    """Base of every family: forward to hidden states, logits for the rows asked for, weight loading."""

    merged_modules: tuple[str, ...] = ("qkv_proj", "gate_up_proj")  # parameters several HF tensors fill

    def __init__(self, hf_config: Any, spec: DecoderSpec, ops: Ops, max_positions: int,
                 model: nn.Module | None = None) -> None:
        super().__init__()
        self.spec, self.ops = spec, ops
        self.model = model if model is not None else DecoderModel(spec, ops)  # a family's own stack, or ours
        self.lm_head = None if spec.tie_word_embeddings else nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        self.hf_config, self.max_positions = hf_config, max_positions
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)

    def init_rope(self, device: torch.device) -> None:
        """(Re)build the float32 cos/sin tables; called once the model sits on its device."""
        cos, sin = build_rope_cache(self.hf_config, self.spec.head_dim, self.max_positions)
        self.rope_cos, self.rope_sin = cos.to(device), sin.to(device)

    def forward(self, input_ids, positions, kv_caches, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, (self.rope_cos, self.rope_sin), kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # (N, hidden) -> (N, vocab) float32
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return self.ops.linear(hidden, weight).float()

    def _shard_sizes(self, merged: str) -> list[int]:
        s = self.spec
        if merged == "qkv_proj":
            return [s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim, s.num_kv_heads * s.head_dim]
        return [s.intermediate_size, s.intermediate_size]

    def adjust_weight(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A checkpoint tensor as our parameter holds it (a family whose layout differs overrides this)."""
        return tensor

    def _destination(self, name: str, params: dict[str, torch.nn.Parameter]) -> tuple[str, torch.Tensor] | None:
        """(our parameter's name, the view of it an HF-named tensor fills), or None for a tensor we do not keep
        (rotary caches, a tied head). Raises ValueError for a name with no place in this model."""
        if "rotary_emb.inv_freq" in name:
            return None
        if name == "lm_head.weight" and self.lm_head is None:
            return None  # tied: the embedding serves as the head
        parts = name.split(".")
        target, shard = name, None
        for i, part in enumerate(parts):
            if part in _MERGED:
                merged, shard = _MERGED[part]
                target = ".".join(parts[:i] + [merged] + parts[i + 1 :])
                break
        if target not in params:
            raise ValueError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
        if shard is None:
            return target, params[target].data
        sizes = self._shard_sizes(target.split(".")[-2])
        return target, params[target].data.narrow(0, sum(sizes[:shard]), sizes[shard])

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], partial: bool = False,
                     check_only: bool = False) -> int:
        """Copy HF-named tensors into our (partly merged) parameters. All or nothing: every tensor is checked
        (a name with a place here, its shape, a floating-point dtype) and, unless partial, every parameter must
        be covered, before anything is copied; a ValueError names the first tensor or parameter at fault.
        check_only: only check. Returns how many tensors it copied (or would copy)."""
        params = dict(self.named_parameters())
        plan: list[tuple[torch.Tensor, str, torch.Tensor]] = []
        filled: dict[str, int] = {}
        for name, tensor in weights:
            dest = self._destination(name, params)
            if dest is None:
                continue
            target, view = dest
            if view.shape != tensor.shape:
                raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(view.shape)}")
            if not tensor.is_floating_point():
                raise ValueError(f"tensor {name!r} has dtype {tensor.dtype}; weights must be floating point (the "
                                 f"model runs in {view.dtype})")
            plan.append((view, name, tensor))
            filled[target] = filled.get(target, 0) + 1
        if not partial:
            missing = []
            for target in params:
                module = target.split(".")[-2]
                expected = len(self._shard_sizes(module)) if module in self.merged_modules else 1
                if filled.get(target, 0) != expected:
                    missing.append(target)
            if missing:
                raise ValueError(f"checkpoint is missing tensors for: {', '.join(missing[:8])}"
                                 + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))
        if check_only:
            return len(plan)
        with torch.no_grad():
            for view, name, tensor in plan:
                view.copy_(self.adjust_weight(name, tensor.to(view.device)))
        return len(plan)
