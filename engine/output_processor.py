"""OutputProcessor: sampled tokens -> RequestOutputs. The one place for detokenizing, stop strings and
logprob assembly (vLLM's OutputProcessor; the scheduler's update_from_output has already appended the
tokens and applied EOS, stop token ids and lengths).

It owns the per-request state the engine keeps beside the scheduler's sequences: what each request has
been sent so far, so a DELTA output carries only what is new and costs what is new, not the whole output.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from engine.detokenizer import IncrementalDetokenizer, find_stop_string, stream_safe_length
from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from engine.sampling_params import RequestOutputKind, SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Logprob, Sequence


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    last_token_time: float | None = None
    sent_chars: list[int] = field(init=False)  # per sample: text already handed out (DELTA)
    sent_tokens: list[int] = field(init=False)  # per sample: output tokens (and logprobs) already handed out
    sent_finish: list[bool] = field(init=False)  # per sample: its finish_reason already handed out
    model_versions: list[Any] = field(default_factory=list)  # policy versions whose weights made its tokens

    def __post_init__(self) -> None:
        n = len(self.seqs)
        self.sent_chars, self.sent_tokens, self.sent_finish = [0] * n, [0] * n, [False] * n

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)


class OutputProcessor:
    def __init__(self, tokenizer: Any, scheduler: Scheduler) -> None:
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.requests: dict[str, RequestState] = {}
        self.model_version: Any = 0  # the weights' version now (LLMEngine.update_weights moves it)

    def add(self, state: RequestState) -> None:
        for seq in state.seqs:
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, state.prompt_token_ids,
                                                     state.params.skip_special_tokens)
        self.requests[state.request_id] = state

    def process(self, sampled: list[Sequence], logprobs: Any | None) -> list[RequestOutput]:
        """After Scheduler.update_from_output: sampled[k] got a token this step (logprobs row k)."""
        touched: dict[str, RequestState] = {}
        now = time.monotonic()
        for k, seq in enumerate(sampled):
            token = seq.token_ids[-1]
            if logprobs is not None and seq.logprobs is not None:
                self._record_logprobs(seq, token, logprobs, k)
            self._detokenize(seq)
            state = self.requests[seq.request_id]
            state.first_token_time = state.first_token_time or now
            state.last_token_time = now
            if not state.model_versions or state.model_versions[-1] != self.model_version:
                state.model_versions.append(self.model_version)
            touched[seq.request_id] = state
        outputs = []
        for request_id, state in touched.items():
            out = self.make_output(state)
            if out is not None:
                outputs.append(out)
            if state.finished:
                del self.requests[request_id]
        return outputs

    def pop(self, request_id: str) -> RequestState | None:
        return self.requests.pop(request_id, None)

    # ---- text ----
    def _detokenize(self, seq: Sequence) -> None:
        """New text for the latest token; a stop string it completes ends the sequence (or, if the same token
        also reached max_tokens, turns its "length" into "stop"), cutting the text where the string starts."""
        p = seq.params
        new_text = seq.detokenizer.step(seq.token_ids)
        seq.output_text += new_text
        if (not p.stop_strings or not new_text or seq.num_output_tokens < p.min_tokens
                or seq.finish_reason == "stop"):
            return
        hit = find_stop_string(seq.output_text, len(new_text), p.stop_strings)
        if hit is None:
            return
        seq.stop_reason = hit[0]
        seq.output_text = seq.output_text[: hit[1] + (len(hit[0]) if p.include_stop_str_in_output else 0)]
        if seq.is_finished:
            seq.finish_reason = "stop"
        else:
            self.scheduler.finish(seq, "stop")

    def _record_logprobs(self, seq: Sequence, token: int, lp: Any, k: int) -> None:
        entry = {token: Logprob(lp.token_logprobs[k], lp.token_ranks[k], self.tokenizer.decode([token]))}
        for rank, (tid, val) in enumerate(zip(lp.top_ids[k], lp.top_logprobs[k]), start=1):
            if tid not in entry:
                entry[tid] = Logprob(val, rank, self.tokenizer.decode([tid]))
        seq.logprobs.append(entry)
        seq.cumulative_logprob += lp.token_logprobs[k]

    # ---- outputs ----
    def make_output(self, state: RequestState) -> RequestOutput | None:
        """The request's output by its output_kind; None when there is nothing to hand out (FINAL_ONLY before
        the end, or a DELTA with nothing new)."""
        kind = state.params.output_kind
        if kind is RequestOutputKind.FINAL_ONLY and not state.finished:
            return None
        completions = []
        for j, seq in enumerate(state.seqs):
            visible = stream_safe_length(seq.output_text, seq.params.stop_strings, seq.is_finished)
            num_out = seq.num_output_tokens
            if kind is RequestOutputKind.DELTA:
                start_tok = state.sent_tokens[j]
                text = seq.output_text[state.sent_chars[j]:visible]
                token_ids = seq.token_ids[seq.num_prompt_tokens + start_tok:]
                logprobs = seq.logprobs[start_tok:] if seq.logprobs is not None else None
                new_finish = seq.is_finished and not state.sent_finish[j]
                if not (text or token_ids or new_finish):
                    continue
                state.sent_chars[j] = max(state.sent_chars[j], visible)
            else:
                text = seq.output_text[:visible]
                token_ids = seq.output_token_ids
                logprobs = list(seq.logprobs) if seq.logprobs is not None else None
            state.sent_tokens[j] = num_out
            state.sent_finish[j] = seq.is_finished
            completions.append(CompletionOutput(
                index=j, text=text, token_ids=token_ids, finish_reason=seq.finish_reason, logprobs=logprobs,
                cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None,
                stop_reason=seq.stop_reason, num_output_tokens=num_out,
            ))
        if not completions and not state.finished:
            return None
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, completions,
                             finished=state.finished, num_cached_tokens=state.seqs[0].num_cached_tokens,
                             model_versions=list(state.model_versions),
                             metrics=_metrics(state) if state.finished else None)


def _metrics(state: RequestState) -> RequestMetrics | None:
    scheduled = [s.first_scheduled_time for s in state.seqs if s.first_scheduled_time is not None]
    if state.first_token_time is None or not scheduled:  # ended before its first token (abort, failure)
        return None
    return RequestMetrics(state.arrival_time, min(scheduled), state.first_token_time, state.last_token_time,
                          sum(s.num_output_tokens for s in state.seqs))
