"""Gemma 3, text (HF Gemma3ForCausalLM: the 270M and 1B checkpoints).

What differs from the shared decoder (engine/models/layers.py):
- RMSNorm scales by (1 + w): the checkpoint's w is stored and 1 added once at load, so the shared norm op
  (w * normed) computes it; four norms a layer (input, post-attention, pre- and post-feed-forward) and q/k
  norms per head.
- The attention output and the MLP output are each normalized before they join the residual stream.
- Embeddings are scaled by sqrt(hidden_size) (in the model's dtype, as HF does); the MLP's gate is
  gelu-tanh instead of SiLU; attention scales by query_pre_attn_scalar**-0.5.
- Per layer type (`layer_types`): sliding layers attend over `sliding_window` tokens with their own rope base
  (rope_parameters["sliding_attention"]), full layers over everything with theirs.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.layers import Attention, DecoderForCausalLM, DecoderSpec, RMSNorm
from engine.models.rope import build_rope_cache
from kernels import Ops


def _check_supported(cfg: Any) -> None:
    for field in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(cfg, field, None) is not None:
            raise ValueError(f"Gemma 3 with {field}={getattr(cfg, field)} is not supported (Gemma 3 checkpoints have "
                             "none; Gemma 2 does)")
    if getattr(cfg, "use_bidirectional_attention", False):
        raise ValueError("Gemma 3 with use_bidirectional_attention (the embedding variant) is not supported: "
                         "kvscale serves causal language models")
    if getattr(cfg, "attention_bias", False):
        raise ValueError("Gemma 3 with attention_bias=True is not supported")
    if getattr(cfg, "hidden_activation", "gelu_pytorch_tanh") not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"Gemma 3 with hidden_activation={cfg.hidden_activation!r} is not supported")


class Gemma3MLP(nn.Module):
    def __init__(self, spec: DecoderSpec, ops: Ops) -> None:
        super().__init__()
        self.ops, self.intermediate_size = ops, spec.intermediate_size
        self.gate_up_proj = nn.Linear(spec.hidden_size, 2 * spec.intermediate_size, bias=False)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.ops.linear(x, self.gate_up_proj.weight).split(self.intermediate_size, dim=-1)
        return self.ops.linear(F.gelu(gate, approximate="tanh") * up, self.down_proj.weight)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, spec: DecoderSpec, layer_idx: int, ops: Ops, query_pre_attn_scalar: float) -> None:
        super().__init__()
        self.self_attn = Attention(spec, layer_idx, ops)
        self.self_attn.scale = query_pre_attn_scalar**-0.5
        self.mlp = Gemma3MLP(spec, ops)
        eps = spec.rms_norm_eps
        self.input_layernorm = RMSNorm(spec.hidden_size, eps, ops)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, eps, ops)
        self.pre_feedforward_layernorm = RMSNorm(spec.hidden_size, eps, ops)
        self.post_feedforward_layernorm = RMSNorm(spec.hidden_size, eps, ops)

    def forward(self, hidden, residual, positions, rope, kv_cache, meta):
        # residual: the stream so far; hidden: the previous layer's normalized MLP output, not yet added to it
        hidden, residual = self.input_layernorm(hidden, residual) if residual is not None else (
            self.input_layernorm(hidden)[0], hidden)
        hidden = self.self_attn(hidden, positions, rope, kv_cache, meta)
        hidden, _ = self.post_attention_layernorm(hidden)
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        hidden, _ = self.post_feedforward_layernorm(self.mlp(hidden))
        return hidden, residual


class Gemma3Model(nn.Module):
    def __init__(self, spec: DecoderSpec, ops: Ops, cfg: Any) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.embed_scale = spec.hidden_size**0.5
        self.layer_types = list(cfg.layer_types)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(spec, i, ops, cfg.query_pre_attn_scalar)
                                    for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, ops)

    def forward(self, input_ids, positions, ropes, kv_caches, meta):
        embeds = self.embed_tokens(input_ids)
        hidden, residual = embeds * torch.tensor(self.embed_scale, dtype=embeds.dtype), None
        for layer, layer_type, kv_cache in zip(self.layers, self.layer_types, kv_caches):
            hidden, residual = layer(hidden, residual, positions, ropes[layer_type], kv_cache, meta)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class Gemma3ForCausalLM(DecoderForCausalLM):
    def __init__(self, hf_config: Any, ops: Ops, max_positions: int) -> None:
        cfg = hf_config
        _check_supported(cfg)
        windows = [cfg.sliding_window if t == "sliding_attention" else None for t in cfg.layer_types]
        spec = DecoderSpec.from_hf(cfg, attention_bias=False, qk_norm=True, sliding_windows=windows)
        super().__init__(cfg, spec, ops, max_positions, Gemma3Model(spec, ops, cfg))
        self.ropes: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def init_rope(self, device: torch.device) -> None:
        """One cos/sin table per layer type, each from its own rope parameters."""
        params = getattr(self.hf_config, "rope_parameters", None) or {}
        for layer_type in set(self.model.layer_types):
            own = params.get(layer_type)
            if not isinstance(own, dict):
                raise ValueError(f"this Gemma 3 config has no rope_parameters for {layer_type!r} layers (transformers "
                                 ">= 5 writes one per layer type); got {params!r}")
            cfg = _RopeView(self.hf_config, own)
            cos, sin = build_rope_cache(cfg, self.spec.head_dim, self.max_positions)
            self.ropes[layer_type] = (cos.to(device), sin.to(device))

    def forward(self, input_ids, positions, kv_caches, meta) -> torch.Tensor:
        return self.model(input_ids, positions, self.ropes, kv_caches, meta)

    def adjust_weight(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Gemma's norms scale by (1 + w); the shared norm op by w, so it holds 1 + w."""
        return tensor.float() + 1.0 if name.endswith("norm.weight") else tensor


class _RopeView:
    """The config as build_rope_cache reads it, with one layer type's rope parameters."""

    def __init__(self, cfg: Any, params: dict[str, Any]) -> None:
        self._cfg, self.rope_parameters, self.rope_scaling = cfg, params, None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cfg, name)
