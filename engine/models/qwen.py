"""Qwen2 and Qwen3 (HF Qwen2ForCausalLM, Qwen3ForCausalLM).

Qwen2 has a bias on q, k and v; Qwen3 drops it and RMS-normalizes q and k per head before rope. Both may
use sliding-window attention on some layers, which HF's config states per layer in `layer_types`.
"""
from __future__ import annotations

from typing import Any

from engine.models.layers import DecoderForCausalLM, DecoderSpec
from kernels import Ops


def _layer_windows(hf_config: Any) -> list[int | None]:
    num_layers = hf_config.num_hidden_layers
    window = getattr(hf_config, "sliding_window", None)
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is None:
        use = getattr(hf_config, "use_sliding_window", False)
        first = getattr(hf_config, "max_window_layers", num_layers)
        layer_types = ["sliding_attention" if use and i >= first else "full_attention" for i in range(num_layers)]
    return [window if t == "sliding_attention" else None for t in layer_types]


class Qwen2ForCausalLM(DecoderForCausalLM):
    def __init__(self, hf_config: Any, ops: Ops, max_positions: int) -> None:
        spec = DecoderSpec.from_hf(hf_config, attention_bias=True, sliding_windows=_layer_windows(hf_config))
        super().__init__(hf_config, spec, ops, max_positions)


class Qwen3ForCausalLM(DecoderForCausalLM):
    def __init__(self, hf_config: Any, ops: Ops, max_positions: int) -> None:
        spec = DecoderSpec.from_hf(hf_config, qk_norm=True, sliding_windows=_layer_windows(hf_config))
        super().__init__(hf_config, spec, ops, max_positions)
