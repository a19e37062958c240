"""What crosses the Ray handle between the ingress and an engine replica: small typed messages.

The ingress sends one GenerateRequest per prompt; the replica streams back OutputDelta messages that carry
only what is new (text, token ids, logprobs of the tokens since the previous message), or one ErrorMessage
for a request it refuses or fails. They are turned into OpenAI's JSON once, in the ingress.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from serve_app.protocol import APIError


@dataclass(slots=True, frozen=True)
class GenerateRequest:
    request_id: str
    kind: Literal["completion", "chat"]
    sampling: dict[str, Any]  # engine.sampling_params.SamplingParams fields
    prompt: str | list[int] | None = None  # completion
    messages: list[dict[str, Any]] | None = None  # chat: OpenAI messages, content flattened to text
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None  # chat: OpenAI tool definitions for the template
    chat_template_kwargs: dict[str, Any] | None = None  # chat: extra template variables (enable_thinking, ...)
    arrival_time: float | None = None  # time.time() when the ingress received the HTTP request


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    token: str | None
    logprob: float
    top: list[tuple[str | None, float]]  # the top-k alternatives, most likely first


@dataclass(slots=True)
class ChoiceDelta:
    index: int  # which of the request's n samples
    text: str  # new text since the previous message of this sample
    token_ids: list[int]  # new token ids since then
    finish_reason: str | None  # set once, on the sample's last message
    num_output_tokens: int  # tokens generated so far by this sample (for usage)
    logprobs: list[TokenLogprob] | None = None  # one per new token, when asked for


@dataclass(slots=True)
class OutputDelta:
    choices: list[ChoiceDelta]
    finished: bool  # the whole request (every sample) has ended
    prompt_tokens: int
    prompt_token_ids: list[int] | None = None  # on the request's first message only
    model_versions: list[Any] | None = None  # policy versions whose weights made its tokens so far


@dataclass(slots=True)
class ErrorMessage:
    status: int
    message: str
    param: str | None = None
    code: str | None = None
    retry_after: float | None = None

    @classmethod
    def of(cls, e: APIError) -> ErrorMessage:
        return cls(e.status, e.message, e.param, e.code, e.retry_after)

    def to_error(self) -> APIError:
        return APIError(self.status, self.message, self.param, self.code, self.retry_after)
