"""SamplingParams: how one request is decoded (vLLM's field names and meanings)."""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from engine.structured_output import StructuredOutputsParams

MAX_N = 1024  # a hard ceiling; servers set their own, lower one (ServeConfig.max_n)
GREEDY_BELOW = 1e-5  # temperatures below this sample greedily (SamplingParams.is_greedy)


class RequestOutputKind(enum.Enum):
    """What each RequestOutput of a request carries (vLLM's names and meanings)."""

    CUMULATIVE = 0  # everything so far: text, token ids and logprobs since the start
    DELTA = 1  # only what is new since the previous output of the request (streaming servers)
    FINAL_ONLY = 2  # one output, when the request ends (offline batches)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) = all tokens
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None  # top-k logprobs for each sampled token (plus the sampled one)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False  # keep the stop string that ended the output in its text
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before sampling, in [-100, 100]
    # a grammar the output must follow (JSON schema, any JSON object, regex, EBNF or a choice); a dict is
    # taken as StructuredOutputsParams' fields
    structured_outputs: StructuredOutputsParams | dict | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    _stop_list: list[str] = field(init=False, repr=False, default_factory=list)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None and not isinstance(self.stop, (list, tuple)):
            raise ValueError(f"stop must be a string or a list of strings; got {self.stop!r}")
        if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, (list, tuple)):
            raise ValueError(f"stop_token_ids must be a list of non-negative token ids; got {self.stop_token_ids!r}")
        self._stop_list = [s for s in (self.stop or []) if isinstance(s, str) and s]
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == 0:
            self.top_k = -1
        if isinstance(self.structured_outputs, dict):
            try:
                self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
            except TypeError as e:
                raise ValueError(f"structured_outputs: {e}") from None
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must be a map of token id to bias; got {self.logit_bias!r}")
            try:
                self.logit_bias = {int(t): b for t, b in self.logit_bias.items()}
            except (TypeError, ValueError):
                raise ValueError("logit_bias keys must be token ids (integers)") from None
        self._validate()

    def _validate(self) -> None:
        """ValueError naming the field for anything out of range, of the wrong type, NaN or infinite: whatever a
        client sends is refused here, before it can reach (and break) a step shared with other requests."""
        def bad(name: str, allowed: str) -> ValueError:
            return ValueError(f"{name} must be {allowed}; got {getattr(self, name)!r}")

        def is_int(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def real(name: str) -> float:
            """The field as a finite float, and kept so: an int past int64 (a JSON 2**63) would pass as a number
            here and fail the whole engine step when the sampler makes a tensor of it."""
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise bad(name, "a finite number")
            try:
                v = float(v)
            except OverflowError:  # an int beyond float's range
                raise bad(name, "a finite number") from None
            if not math.isfinite(v):
                raise bad(name, "a finite number")
            object.__setattr__(self, name, v)
            return v

        if not is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise bad("n", f"an integer in [1, {MAX_N}]")
        if real("temperature") < 0:
            raise bad("temperature", ">= 0 (0 means greedy)")
        if not 0.0 < real("top_p") <= 1.0:
            raise bad("top_p", "in (0, 1]")
        if not is_int(self.top_k) or self.top_k < -1:
            raise bad("top_k", "-1 (disabled) or an integer >= 1")
        if not 0.0 <= real("min_p") <= 1.0:
            raise bad("min_p", "in [0, 1]")
        if not 1e-30 <= real("repetition_penalty") <= 1e30:  # outside, float32 logits meet 0 or inf: 0 * inf = nan
            raise bad("repetition_penalty", "in [1e-30, 1e30] (1 disables it)")
        if not -2.0 <= real("presence_penalty") <= 2.0:
            raise bad("presence_penalty", "in [-2, 2]")
        if not -2.0 <= real("frequency_penalty") <= 2.0:
            raise bad("frequency_penalty", "in [-2, 2]")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad("max_tokens", "an integer >= 1 or None")
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad("min_tokens", "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if any(not is_int(t) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "a list of non-negative token ids")
        if any(not isinstance(s, str) for s in (self.stop or [])):
            raise bad("stop", "a string or a list of strings")
        if self.seed is not None and not is_int(self.seed):
            raise bad("seed", "an integer or None")
        if self.logprobs is not None and (not is_int(self.logprobs) or not 0 <= self.logprobs <= 20):
            raise bad("logprobs", "an integer in [0, 20] or None")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise bad("output_kind", "a RequestOutputKind")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise bad("structured_outputs", "a StructuredOutputsParams, a dict of its fields, or None")
        if self.structured_outputs is not None and self.ignore_eos:
            raise ValueError("ignore_eos cannot be combined with structured_outputs: the output ends where the "
                             "grammar is complete")
        for t, b in (self.logit_bias or {}).items():
            if t < 0:
                raise ValueError(f"logit_bias keys must be non-negative token ids; got {t}")
            if isinstance(b, bool) or not isinstance(b, (int, float)) or not -100 <= b <= 100:
                raise ValueError(f"logit_bias values must be numbers in [-100, 100]; got {b!r} for token {t}")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "true or false")

    @property
    def is_greedy(self) -> bool:
        # below 1e-5 (vLLM's threshold) sampling is argmax anyway, and logits / T would overflow float32
        return self.temperature < GREEDY_BELOW

    @property
    def stop_strings(self) -> list[str]:
        return self._stop_list

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
        )
