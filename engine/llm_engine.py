"""LLMEngine: requests in, outputs out. A step reads as schedule -> run -> update.

Owns the scheduler (with its block manager), the model runner and the tokenizer. Not thread-safe: the
offline LLM drives it directly, AsyncLLM drives it from one background thread.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer, find_stop_string, stream_safe_length
from engine.kv_demand import projected_demand_blocks
from engine.loader import load_hf_config, load_tokenizer, resolve_model_path
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledBatch, Scheduler
from engine.sequence import Logprob, Sequence

logger = logging.getLogger(__name__)


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    emitted_chars: list[int] = field(default_factory=list)
    emitted_tokens: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)


@dataclass
class EngineStats:
    """Exact counts, cheap to read; what metrics and the autoscaler see."""

    num_total_blocks: int
    num_free_blocks: int  # cached-but-evictable blocks count as free
    num_cached_free_blocks: int
    num_used_blocks: int
    block_size: int
    num_running: int
    num_waiting: int
    num_waiting_for_kv: int  # of num_waiting, those the last step could not admit for lack of blocks
    num_preemptions_total: int
    num_prompt_tokens_total: int
    num_generation_tokens_total: int
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        from engine.model_runner import ModelRunner  # torch stays out of the pure-Python imports above

        self.config = config
        self.model_path = resolve_model_path(config.model)
        self.hf_config = load_hf_config(self.model_path)
        self.tokenizer = load_tokenizer(self.model_path)
        self.eos_token_ids = self._eos_token_ids()
        self.runner = ModelRunner(config, self.model_path, self.hf_config, self.eos_token_ids)

        pool_tokens = self.runner.num_kv_blocks * config.block_size
        max_positions = self.hf_config.max_position_embeddings
        self.max_model_len = config.max_model_len or min(max_positions, pool_tokens)
        if self.max_model_len > pool_tokens:
            raise ValueError(
                f"max_model_len={self.max_model_len} needs {self.max_model_len} KV slots, but the pool holds "
                f"{pool_tokens} ({self.runner.num_kv_blocks} blocks of {config.block_size}); lower max_model_len "
                "or give the KV cache more memory (num_kv_blocks / kv_cache_bytes)"
            )
        if self.max_model_len > max_positions:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds the model's max_position_embeddings "
                             f"({max_positions})")
        self.runner.capture_decode_graphs(self.max_model_len)
        self.block_manager = BlockManager(self.runner.num_kv_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.requests: dict[str, RequestState] = {}
        self.num_prompt_tokens_total = 0
        self.num_generation_tokens_total = 0
        self.recent_output_lens: deque[int] = deque(maxlen=256)  # of finished sequences, for demand estimates

    def _eos_token_ids(self) -> list[int]:
        ids: set[int] = set()
        for source in (getattr(self.hf_config, "eos_token_id", None), self.tokenizer.eos_token_id):
            if isinstance(source, int):
                ids.add(source)
            elif isinstance(source, (list, tuple)):
                ids.update(source)
        try:
            from transformers import GenerationConfig

            gen = GenerationConfig.from_pretrained(self.model_path).eos_token_id
            ids.update([gen] if isinstance(gen, int) else (gen or []))
        except OSError:
            pass
        return sorted(ids)

    # ---- requests ----
    def tokenize(self, prompt: str | list[int] | dict) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
                raise ValueError("a prompt dict needs exactly one of 'prompt' or 'prompt_token_ids'")
            prompt = prompt.get("prompt", prompt.get("prompt_token_ids"))
        if isinstance(prompt, str):
            try:
                return prompt, self.tokenizer.encode(prompt)
            except Exception as e:  # e.g. a lone UTF-16 surrogate, which JSON can carry but text cannot hold
                raise ValueError(f"the prompt is not valid text ({type(e).__name__}); send well-formed Unicode "
                                 "or token ids") from None
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            vocab = self.runner.vocab_size
            bad = [t for t in prompt if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt token ids must be in [0, {vocab}); got {bad[:5]}")
            return None, list(prompt)
        raise ValueError(f"a prompt must be a string, a list of token ids or a dict; got {type(prompt).__name__}")

    def add_request(self, request_id: str, prompt: str | list[int] | dict, params: SamplingParams) -> None:
        """Validate and queue. Raises ValueError for a request that can never run; nothing is queued then."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        vocab = self.runner.vocab_size
        if any(t >= vocab for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be token ids in [0, {vocab}); got "
                             f"{[t for t in params.stop_token_ids if t >= vocab][:5]}")
        text, token_ids = self.tokenize(prompt)
        if not token_ids:
            raise ValueError("the prompt is empty: it needs at least one token")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens, but max_model_len is {self.max_model_len}, which must also "
                "leave room for at least one generated token; shorten the prompt"
            )
        room = self.max_model_len - len(token_ids)
        if params.max_tokens is None:
            params = _with_max_tokens(params, room)
        elif params.max_tokens > room:
            raise ValueError(
                f"max_tokens={params.max_tokens} plus the prompt's {len(token_ids)} tokens exceeds max_model_len="
                f"{self.max_model_len}; ask for at most {room} tokens"
            )
        seqs = [Sequence(request_id, j, list(token_ids), params) for j in range(params.n)]
        for seq in seqs[1:]:
            seq.parent = seqs[0]  # samples 2..n share sample 1's computed prompt blocks
        for seq in seqs:
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, token_ids, params.skip_special_tokens)
            self.scheduler.add(seq)
        self.requests[request_id] = RequestState(request_id, text, list(token_ids), params, seqs,
                                                 emitted_chars=[0] * params.n, emitted_tokens=[0] * params.n)
        self.num_prompt_tokens_total += len(token_ids)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its blocks. Unknown or finished ids are ignored."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return None
        for seq in state.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")
            self.runner.sampler.forget(seq.seq_id)
        return self._make_output(state)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished

    # ---- the step ----
    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        if batch.is_empty:
            return []
        try:
            sample_rows, sampled = self.runner.execute(batch)
        except Exception as e:  # a failed step fails the requests in it, and only those
            logger.exception("engine step failed; failing the %d requests in it", len(batch.seqs))
            return self._fail_batch(batch, e)
        return self._update(batch, sample_rows, sampled)

    def _update(self, batch: ScheduledBatch, sample_rows: list[int], sampled) -> list[RequestOutput]:
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n
            self.block_manager.register_full_blocks(seq)
        touched: dict[str, RequestState] = {}
        now = time.monotonic()
        for k, row in enumerate(sample_rows):
            seq = batch.seqs[row]
            token = sampled.token_ids[k]
            seq.token_ids.append(token)
            self.num_generation_tokens_total += 1
            if sampled.logprobs is not None and seq.logprobs is not None:
                self._record_logprobs(seq, token, sampled.logprobs, k)
            reason = self._check_stop(seq, token)
            if reason is not None:
                self.recent_output_lens.append(seq.num_output_tokens)
                self.scheduler.finish(seq, reason)
                self.runner.sampler.forget(seq.seq_id)
            state = self.requests[seq.request_id]
            state.first_token_time = state.first_token_time or now
            touched[seq.request_id] = state
        outputs = []
        for request_id, state in touched.items():
            outputs.append(self._make_output(state))
            if state.finished:
                del self.requests[request_id]
        return outputs

    def _check_stop(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        new_text = seq.detokenizer.step(seq.token_ids)
        seq.output_text += new_text
        if seq.num_output_tokens >= p.min_tokens:
            if not p.ignore_eos and token in self.eos_token_ids:
                return "stop"
            if token in p.stop_token_ids:
                seq.stop_reason = token
                return "stop"
            if p.stop_strings and new_text:
                hit = find_stop_string(seq.output_text, len(new_text), p.stop_strings)
                if hit is not None:
                    seq.stop_reason = hit[0]
                    seq.output_text = seq.output_text[: hit[1]]
                    return "stop"
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _record_logprobs(self, seq: Sequence, token: int, lp, k: int) -> None:
        entry = {token: Logprob(lp.token_logprobs[k], lp.token_ranks[k], self.tokenizer.decode([token]))}
        for rank, (tid, val) in enumerate(zip(lp.top_ids[k], lp.top_logprobs[k]), start=1):
            if tid not in entry:
                entry[tid] = Logprob(val, rank, self.tokenizer.decode([tid]))
        seq.logprobs.append(entry)
        seq.cumulative_logprob += lp.token_logprobs[k]

    def _fail_batch(self, batch: ScheduledBatch, error: Exception) -> list[RequestOutput]:
        outputs = []
        for request_id in dict.fromkeys(s.request_id for s in batch.seqs):
            state = self.requests.pop(request_id, None)
            if state is None:
                continue
            for seq in state.seqs:
                self.scheduler.finish(seq, "abort")
                self.runner.sampler.forget(seq.seq_id)
            out = self._make_output(state)
            out.error = f"the engine step failed: {type(error).__name__}: {error}"
            outputs.append(out)
        return outputs

    def _make_output(self, state: RequestState) -> RequestOutput:
        completions = []
        for j, seq in enumerate(state.seqs):
            visible = stream_safe_length(seq.output_text, seq.params.stop_strings, seq.is_finished)
            text = seq.output_text[:visible]
            tokens = seq.output_token_ids
            completions.append(CompletionOutput(
                index=j, text=text, token_ids=tokens, finish_reason=seq.finish_reason,
                logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
                cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None,
                stop_reason=seq.stop_reason,
                text_delta=text[state.emitted_chars[j]:], token_ids_delta=tokens[state.emitted_tokens[j]:],
            ))
            state.emitted_chars[j], state.emitted_tokens[j] = len(text), len(tokens)
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, completions,
                             finished=state.finished, num_cached_tokens=state.seqs[0].num_cached_tokens)

    # ---- introspection ----
    def stats(self) -> EngineStats:
        bm, sch = self.block_manager, self.scheduler
        return EngineStats(
            num_total_blocks=bm.num_total_blocks, num_free_blocks=bm.num_free_blocks,
            num_cached_free_blocks=bm.num_cached_free_blocks, num_used_blocks=bm.num_used_blocks,
            block_size=bm.block_size, num_running=sch.num_running, num_waiting=sch.num_waiting,
            num_waiting_for_kv=sch.num_waiting_for_kv,
            num_preemptions_total=sch.num_preemptions_total,
            num_prompt_tokens_total=self.num_prompt_tokens_total,
            num_generation_tokens_total=self.num_generation_tokens_total,
            prefix_cache_queried_tokens=bm.num_prefix_queried_tokens, prefix_cache_hit_tokens=bm.num_prefix_hit_tokens,
        )

    def projected_demand_blocks(self) -> int:
        """Blocks the live sequences will hold at their end, not just now (see engine.kv_demand)."""
        return projected_demand_blocks(self.scheduler.live_sequences(), self.recent_output_lens,
                                       self.config.block_size)

    def live_sequences(self) -> Iterable[Sequence]:
        return self.scheduler.live_sequences()


def _with_max_tokens(params: SamplingParams, max_tokens: int) -> SamplingParams:
    import dataclasses

    return dataclasses.replace(params, max_tokens=max_tokens)
