"""What the engine hands back: vLLM-shaped RequestOutput / CompletionOutput.

What a CompletionOutput's text, token_ids and logprobs hold depends on the request's
SamplingParams.output_kind: everything so far (CUMULATIVE, the default; FINAL_ONLY, once at the end), or
only what is new since the request's previous output (DELTA, what streaming servers ask for).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.sequence import Logprob


@dataclass
class CompletionOutput:
    index: int
    text: str  # stop strings cut off; in streams a tail that may begin a stop string is held back
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    logprobs: list[dict[int, Logprob]] | None = None  # one entry per token of token_ids
    cumulative_logprob: float | None = None
    stop_reason: str | int | None = None  # which stop string / token id ended it
    num_output_tokens: int = 0  # tokens generated so far, whatever the output kind

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """When a request passed each stage, by the engine's monotonic clock (vLLM's RequestStateStats): added,
    first scheduled (queue time ends), first token (prefill ends), last token. Set on its final output."""

    arrival_time: float
    first_scheduled_time: float
    first_token_time: float
    last_token_time: float
    num_generation_tokens: int  # over all n samples

    @property
    def queue_time(self) -> float:
        return self.first_scheduled_time - self.arrival_time

    @property
    def prefill_time(self) -> float:
        return self.first_token_time - self.first_scheduled_time

    @property
    def decode_time(self) -> float:
        return self.last_token_time - self.first_token_time

    @property
    def inference_time(self) -> float:
        return self.last_token_time - self.first_scheduled_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    error: str | None = None  # set when the engine failed this request
    metrics: RequestMetrics | None = None  # on the final output of a request that got at least one token
    # policy versions whose weights produced its tokens so far, in order (more than one only when a weight
    # update with pause="keep" came while it ran); empty before its first token
    model_versions: list[Any] = field(default_factory=list)


def merge_delta(older: RequestOutput, newer: RequestOutput) -> RequestOutput:
    """One DELTA output standing for two consecutive ones of a request: the newer state, both deltas."""
    if newer.error:
        return newer
    merged = {c.index: c for c in older.outputs}
    for c in newer.outputs:
        prev = merged.get(c.index)
        if prev is not None:
            c.text = prev.text + c.text
            c.token_ids = prev.token_ids + c.token_ids
            if c.logprobs is not None and prev.logprobs is not None:
                c.logprobs = prev.logprobs + c.logprobs
        merged[c.index] = c
    newer.outputs = [merged[i] for i in sorted(merged)]
    return newer
