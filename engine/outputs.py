"""What the engine hands back: vLLM-shaped RequestOutput / CompletionOutput."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.sequence import Logprob


@dataclass
class CompletionOutput:
    index: int
    text: str  # all text so far (stop strings cut off; in streams a possible stop prefix held back)
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    stop_reason: str | int | None = None  # which stop string / token id ended it
    text_delta: str = ""  # new since the previous output of this request (streaming)
    token_ids_delta: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    error: str | None = None  # set when the engine failed this request
