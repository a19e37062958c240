"""kvscale's inference engine: paged KV cache, continuous batching, vLLM-compatible API.

Imports are lazy so that `engine.block_manager` and `engine.scheduler` load without torch.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from engine.config import EngineConfig
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.async_llm import AsyncLLM
    from engine.llm import LLM
    from engine.outputs import CompletionOutput, RequestOutput

__all__ = ["LLM", "AsyncLLM", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput"]


def __getattr__(name: str):
    if name == "LLM":
        from engine.llm import LLM

        return LLM
    if name == "AsyncLLM":
        from engine.async_llm import AsyncLLM

        return AsyncLLM
    if name in ("RequestOutput", "CompletionOutput"):
        from engine import outputs

        return getattr(outputs, name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
