"""Llama and Mistral (HF LlamaForCausalLM, MistralForCausalLM): GQA, optional attention bias,
rope scaling (linear, llama3, yarn), tied embeddings (SmolLM, Llama 3.2), Mistral's sliding window."""
from __future__ import annotations

from typing import Any

from engine.models.layers import DecoderForCausalLM, DecoderSpec
from kernels import Ops


class LlamaForCausalLM(DecoderForCausalLM):
    def __init__(self, hf_config: Any, ops: Ops, max_positions: int) -> None:
        super().__init__(hf_config, DecoderSpec.from_hf(hf_config), ops, max_positions)


class MistralForCausalLM(DecoderForCausalLM):
    def __init__(self, hf_config: Any, ops: Ops, max_positions: int) -> None:
        window = getattr(hf_config, "sliding_window", None)
        spec = DecoderSpec.from_hf(hf_config, attention_bias=False,
                                   sliding_windows=[window] * hf_config.num_hidden_layers)
        super().__init__(hf_config, spec, ops, max_positions)
