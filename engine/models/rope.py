"""RoPE tables for the scaling types Llama, Mistral and Qwen checkpoints use: default, linear, llama3, yarn.

Follows the published formulas (and HF's config fields) so positions map to the same angles HF computes.
"""
from __future__ import annotations

import math
from typing import Any

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_parameters(hf_config: Any) -> dict[str, Any]:
    """The rope settings as one dict, whether the config uses rope_parameters (new) or rope_scaling (old)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    scaling = getattr(hf_config, "rope_scaling", None) or {}
    params = {**scaling, **params}
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    params["rope_type"] = rope_type
    return params


def _inv_freq(params: dict[str, Any], dim: int, max_positions: int) -> tuple[torch.Tensor, float]:
    base = float(params["rope_theta"])
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    rope_type = params["rope_type"]
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / float(params["factor"]), 1.0
    if rope_type == "llama3":
        factor, low, high = float(params["factor"]), float(params["low_freq_factor"]), float(params["high_freq_factor"])
        old_len = float(params["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(is_medium, smoothed, scaled), 1.0
    if rope_type == "yarn":
        orig = params.get("original_max_position_embeddings") or max_positions
        factor = params.get("factor") or max_positions / orig

        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        attention_factor = params.get("attention_factor")
        if attention_factor is None:
            m, m_all = params.get("mscale"), params.get("mscale_all_dim")
            attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
        beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

        def correction_dim(num_rotations: float) -> float:
            return (dim * math.log(orig / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

        low, high = correction_dim(beta_fast), correction_dim(beta_slow)
        if params.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        extrapolation_weight = 1 - ramp
        pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
        inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_weight) + (1.0 / pos_freqs) * extrapolation_weight
        return inv, float(attention_factor)
    raise ValueError(
        f"rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
    )


def build_rope_cache(hf_config: Any, head_dim: int, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables, (max_positions, head_dim) float32 each."""
    params = rope_parameters(hf_config)
    inv_freq, attention_factor = _inv_freq(params, head_dim, getattr(hf_config, "max_position_embeddings", max_positions))
    positions = torch.arange(max_positions, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq[None, :]  # (P, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * attention_factor, emb.sin() * attention_factor
