"""Model registry: HF `architectures[0]` -> our class, imported lazily."""
from __future__ import annotations

import importlib

_REGISTRY = {
    "LlamaForCausalLM": "engine.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "engine.models.llama:MistralForCausalLM",
    "Qwen2ForCausalLM": "engine.models.qwen:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "engine.models.qwen:Qwen3ForCausalLM",
    "Gemma3ForCausalLM": "engine.models.gemma3:Gemma3ForCausalLM",
    "Qwen3_5ForCausalLM": "engine.models.qwen3_5:Qwen3_5ForCausalLM",
    "Qwen3_5ForConditionalGeneration": "engine.models.qwen3_5:Qwen3_5ForConditionalGeneration",
}

SUPPORTED_ARCHITECTURES = tuple(_REGISTRY)


def get_model_class(architecture: str) -> type:
    if architecture not in _REGISTRY:
        raise ValueError(
            f"architecture {architecture!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    module, name = _REGISTRY[architecture].split(":")
    return getattr(importlib.import_module(module), name)
