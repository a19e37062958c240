"""OpenAI request bodies (plus vLLM's extras) and OpenAI-shaped errors."""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

INT64_MAX = 2**63 - 1  # integers past int64 are nobody's real value; refuse them before they reach the engine
TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]


class APIError(Exception):
    """An error with its HTTP status, rendered as {"error": {"message", "type", "param", "code"}}."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             413: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable", 500: "internal_error"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.retry_after = status, message, param, code, retry_after

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """What every 4xx/5xx body looks like (OpenAI's shape)."""

    error: ErrorInfo


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = False
    include_obfuscation: bool = False  # accepted: this server never pads chunks, so there is nothing to turn off


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    name: str = Field(max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: text (no constraint), json_object (any JSON object) or json_schema."""

    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["function"]
    function: NamedFunction


class StructuredOutputsField(BaseModel):
    """vLLM's extra `structured_outputs`: exactly one of these constrains the output."""

    model_config = ConfigDict(extra="forbid", strict=True)

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    grammar: str | None = None
    choice: list[str] | None = None

    def to_params(self) -> dict[str, Any]:
        out = {"json": self.json_, "json_object": bool(self.json_object), "regex": self.regex,
               "grammar": self.grammar, "choice": self.choice}
        return {k: v for k, v in out.items() if v not in (None, False)}


# Fields OpenAI defines that change nothing this server does; accepted and documented as such. Every other
# field not declared below is refused with a 400 that names it (extra="forbid"), as OpenAI's API does.
NO_EFFECT_FIELDS = ("user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier")


class _SamplingFields(BaseModel):
    """strict: "5" is not a number and "yes" is not a boolean here (ints still pass as floats).

    A field the client leaves out is left out of the sampling settings too (None here), so the model's own
    defaults (its generation_config.json) apply before the engine's."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    max_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=INT64_MAX)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), le=INT64_MAX)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    # accepted, no effect (NO_EFFECT_FIELDS)
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # vLLM's extras
    top_k: int | None = Field(None, ge=-1, le=INT64_MAX)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=INT64_MAX)
    stop_token_ids: list[TokenId] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsField | None = None
    return_token_ids: bool = False  # each choice also carries prompt_token_ids and token_ids (token-in/out)

    def sampling_kwargs(self) -> dict[str, Any]:
        """SamplingParams fields; those the client did not set are left out (the replica fills in defaults)."""
        out = dict(n=self.n, presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                   max_tokens=self.max_tokens, min_tokens=self.min_tokens, stop=self.stop,
                   stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos, seed=self.seed,
                   skip_special_tokens=self.skip_special_tokens,
                   include_stop_str_in_output=self.include_stop_str_in_output)
        for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        if self.logit_bias:
            try:
                out["logit_bias"] = {int(k): v for k, v in self.logit_bias.items()}
            except ValueError:
                raise APIError(400, "logit_bias keys must be token ids (integers as strings)",
                               param="logit_bias") from None
        constraint = self.constraint()
        if constraint is not None:
            out["structured_outputs"] = constraint
        return out

    def constraint(self) -> dict[str, Any] | None:
        """The grammar asked for by response_format or structured_outputs (not both)."""
        rf = self.response_format
        fmt = None
        if rf is not None and rf.type == "json_object":
            fmt = {"json_object": True}
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise APIError(400, "response_format of type json_schema needs json_schema.schema",
                               param="response_format.json_schema")
            fmt = {"json": rf.json_schema.schema_}
        if self.structured_outputs is not None:
            if fmt is not None:
                raise APIError(400, "send response_format or structured_outputs, not both",
                               param="structured_outputs")
            fmt = self.structured_outputs.to_params()
        return fmt

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    max_tokens: int | None = Field(16, ge=1, le=INT64_MAX)  # OpenAI's default for completions
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: str
    arguments: str


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant turns that called tools
    tool_call_id: str | None = None  # tool results
    reasoning_content: str | None = None  # accepted back; templates that show past reasoning use it
    refusal: str | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # vLLM's extras
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt, or chat messages rendered by the chat template."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    tokens: list[TokenId]


# ---- RL admin routes (serve_app/rl.py; only with admin_api: true) ----
class AdminUpdateWeightsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    path: str = Field(min_length=1)  # safetensors file or folder every replica can read
    version: int | str
    pause: Literal["abort", "wait", "keep"] = "abort"
    partial: bool = False


class AdminPauseRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    mode: Literal["abort", "wait", "keep"] = "abort"


class AdminSleepRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    level: Literal[1, 2] = 1
