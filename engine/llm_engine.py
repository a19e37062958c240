"""LLMEngine: requests in, outputs out. A step reads as schedule -> run -> update -> outputs.

Owns the scheduler (with its block manager), the model runner, the tokenizer and the output processor.
Not thread-safe, and never read from another thread: the offline LLM drives it directly; AsyncLLM drives
it from one background thread and publishes the `stats()` snapshot it takes after each step.
"""
from __future__ import annotations

import bisect
import dataclasses
import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.loader import load_hf_config, load_tokenizer, resolve_model_path
from engine.output_processor import OutputProcessor, RequestState
from engine.outputs import RequestOutput
from engine.perf_model import StepTimeModel
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledBatch, Scheduler
from engine.sequence import Sequence
from engine.structured_output import StructuredOutputs

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineStats:
    """An immutable snapshot of the engine's counts, taken by the thread that owns the engine; what metrics,
    the autoscaler and the router read, from any thread."""

    num_total_blocks: int
    num_free_blocks: int  # cached-but-evictable blocks count as free
    num_cached_free_blocks: int
    num_used_blocks: int
    block_size: int
    num_running: int
    num_waiting: int
    num_waiting_for_kv: int  # of num_waiting, those the last step could not admit for lack of blocks
    num_preemptions_total: int
    num_generation_tokens_total: int
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int
    kv_demand_blocks: int  # blocks the live sequences will hold at their end (engine.kv_demand), state included
    # hybrid models: recurrent-state slots (one per running sequence), and one slot's bytes in blocks
    num_state_slots: int = 0
    num_free_state_slots: int = 0
    state_blocks_per_seq: int = 0
    # the engine's own counts (zero in the autoscaling simulator, which runs a scheduler without an engine)
    num_prompt_tokens_total: int = 0
    num_steps_total: int = 0
    step_seconds_total: float = 0.0  # time spent in steps (schedule, forward, sample, update)
    last_step_seconds: float = 0.0
    last_step_num_tokens: int = 0
    # tokens per step (vLLM's iteration_tokens_total): per bucket of ITERATION_TOKENS_BUCKETS (+ one for more),
    # how many steps and their tokens
    iteration_tokens_counts: tuple[int, ...] = ()
    iteration_tokens_sums: tuple[int, ...] = ()
    is_healthy: bool = True
    # arrivals (Scheduler.add) and the running batch's context: what the autoscaler forecasts and sizes from
    num_added_total: int = 0
    num_added_prompt_tokens_total: int = 0
    num_running_tokens: int = 0  # tokens of the running sequences (the KV a decode step reads)
    num_prefill_backlog_tokens: int = 0  # prompt tokens of live sequences not computed yet (queued prefill)
    max_num_batched_tokens: int = 0  # the scheduler's token budget per step (what caps a step's time)
    # the replica's measured compute (engine.perf_model.StepTimeModel): step s ~= c0 + c1 tokens + c2 KV tokens
    step_model: tuple[float, float, float] = (0.0, 0.0, 0.0)

    @classmethod
    def from_scheduler(cls, sch: Scheduler, **engine_counts: float) -> EngineStats:
        """The counts the scheduler and its block manager hold, plus the engine's own where given."""
        bm = sch.block_manager
        return cls(
            num_total_blocks=bm.num_total_blocks, num_free_blocks=bm.num_free_blocks,
            num_cached_free_blocks=bm.num_cached_free_blocks, num_used_blocks=bm.num_used_blocks,
            block_size=bm.block_size, num_running=sch.num_running, num_waiting=sch.num_waiting,
            num_waiting_for_kv=sch.num_waiting_for_kv, num_preemptions_total=sch.num_preemptions_total,
            num_generation_tokens_total=sch.num_generation_tokens_total,
            prefix_cache_queried_tokens=bm.num_prefix_queried_tokens, prefix_cache_hit_tokens=bm.num_prefix_hit_tokens,
            kv_demand_blocks=sch.projected_demand_blocks(), num_state_slots=bm.num_state_slots,
            num_free_state_slots=len(bm.free_state_slots), state_blocks_per_seq=bm.state_blocks_per_seq,
            num_added_total=sch.num_added_total, num_added_prompt_tokens_total=sch.num_added_prompt_tokens_total,
            num_running_tokens=sum(s.num_tokens for s in sch.running),
            num_prefill_backlog_tokens=sum(max(0, s.num_prompt_tokens - s.num_computed_tokens)
                                           for s in sch.live_sequences()),
            max_num_batched_tokens=sch.max_num_batched_tokens, **engine_counts,
        )

    @property
    def kv_capacity_blocks(self) -> int:
        """The replica's KV memory in blocks: the pool, plus the state slots (hybrid models) in blocks."""
        return self.num_total_blocks + self.num_state_slots * self.state_blocks_per_seq


# What an fp8 KV cache's scales are calibrated on at start-up: prose, a chat turn, code and numbers, so every
# layer sees the kinds of K and V that serving will write.
KV_CALIBRATION_TEXT = """The river rose through the night, and by morning the lower fields were a grey lake. Farmers \
moved the animals to the ridge while the children carried sacks of grain up the stairs of the mill.
User: Can you explain why the sky looks blue during the day but red at sunset?
Assistant: Sunlight scatters off the molecules of the air, and short wavelengths scatter far more than long ones, so \
blue light reaches us from every direction. At sunset the light crosses much more air, the blue is scattered away \
before it arrives, and the reds and oranges remain.
def merge(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out
Quarterly revenue was 4,812,330 EUR (up 12.5 %), with 1,024 new accounts, 87 % retention and a churn of 3.1 %. \
SELECT id, name FROM users WHERE created_at > '2024-01-01' ORDER BY id LIMIT 50; {"ok": true, "items": [1, 2, 3]}
"""

ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        from engine.model_runner import ModelRunner  # torch stays out of the pure-Python imports above

        self.config = config
        self.model_path = resolve_model_path(config.model)
        self.hf_config = load_hf_config(self.model_path)
        self.tokenizer = load_tokenizer(self.model_path)
        self.eos_token_ids = self._eos_token_ids()
        self.generation_defaults = load_generation_defaults(self.model_path)
        self.runner = ModelRunner(config, self.model_path, self.hf_config, self.eos_token_ids)
        self.structured_outputs = StructuredOutputs(self.tokenizer, self.runner.vocab_size, self.eos_token_ids)
        self.runner.sampler.structured = self.structured_outputs

        groups = self.runner.kv_groups
        caching = config.enable_prefix_caching
        if self.runner.num_state_slots and caching:
            # a cached prefix's KV blocks would come without the linear layers' state at the prefix's end
            logger.info("prefix caching is off for this model: its linear-attention layers keep a recurrent state "
                        "per sequence that is not checkpointed at block boundaries, so a cached prefix could not be "
                        "resumed; every prompt is computed whole")
            caching = False
        state_blocks = -(-self.runner.state_bytes_per_seq // self.runner.bytes_per_block)
        self.block_manager = BlockManager(self.runner.num_kv_blocks, config.block_size, caching, groups.windows,
                                          self.runner.num_state_slots, state_blocks)
        max_positions = self.hf_config.max_position_embeddings
        pool_tokens = self._longest_fitting_sequence(max_positions)
        self.max_model_len = config.max_model_len or min(max_positions, pool_tokens)
        if self.max_model_len > pool_tokens:
            raise ValueError(
                f"max_model_len={self.max_model_len} needs {self.block_manager.blocks_held(self.max_model_len)} KV "
                f"blocks for one sequence, but the pool has {self.runner.num_kv_blocks} blocks of {config.block_size} "
                f"tokens ({groups.describe()}), enough for {pool_tokens} tokens; lower max_model_len or give the KV "
                "cache more memory (num_kv_blocks / kv_cache_bytes)"
            )
        if self.max_model_len > max_positions:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds the model's max_position_embeddings "
                             f"({max_positions})")
        self._calibration_ids = self.tokenizer.encode(KV_CALIBRATION_TEXT)[: self.max_model_len]
        self.runner.calibrate_kv_scales(self._calibration_ids)
        self.model_version: Any = 0  # the checkpoint's weights; update_weights sets what a trainer pushed
        self.sleep_level = 0  # 1: KV pool freed, 2: weights too (sleep / wake_up)
        self.runner.capture_decode_graphs(self.max_model_len)
        if any(w is not None for w in groups.windows):
            logger.info("%s: KV blocks behind a window go back to the pool as sequences advance", groups.describe())
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   self.eos_token_ids, self.max_model_len)
        self.output_processor = OutputProcessor(self.tokenizer, self.scheduler)
        self.num_prompt_tokens_total = 0
        self.num_steps_total = 0
        self.step_seconds_total = 0.0
        self.last_step_seconds = 0.0
        self.step_model = StepTimeModel()  # this replica's compute, learned from its own steps
        self.last_step_num_tokens = 0
        self.iteration_tokens_counts = [0] * (len(ITERATION_TOKENS_BUCKETS) + 1)
        self.iteration_tokens_sums = [0] * (len(ITERATION_TOKENS_BUCKETS) + 1)

    def _longest_fitting_sequence(self, limit: int) -> int:
        """The most tokens one sequence can reach with the whole pool to itself (at most limit): with sliding
        groups that give back blocks, more than the pool's blocks times block_size divided by the groups."""
        bm, chunk = self.block_manager, self.config.max_num_batched_tokens
        if bm.blocks_held(limit, chunk) <= bm.num_total_blocks:
            return limit
        lo, hi = 0, limit  # blocks_held grows with the tokens: the largest lo that fits
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if bm.blocks_held(mid, chunk) <= bm.num_total_blocks else (lo, mid - 1)
        return lo

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
        if self.has_request(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        vocab = self.runner.vocab_size
        if any(t >= vocab for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be token ids in [0, {vocab}); got "
                             f"{[t for t in params.stop_token_ids if t >= vocab][:5]}")
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise ValueError(f"logit_bias keys must be token ids in [0, {vocab}); got "
                             f"{[t for t in params.logit_bias if t >= vocab][:5]}")
        grammar = (self.structured_outputs.compile(params.structured_outputs)
                   if params.structured_outputs is not None else None)
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
        if grammar is not None:
            for seq in seqs:
                self.structured_outputs.add(seq.seq_id, grammar)
        self.output_processor.add(RequestState(request_id, text, list(token_ids), params, seqs))
        for seq in seqs:
            self.scheduler.add(seq)
        self.num_prompt_tokens_total += len(token_ids)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its blocks. Unknown or finished ids are ignored."""
        state = self.output_processor.pop(request_id)
        if state is None:
            return None
        self._end(state, "abort")
        return self.output_processor.make_output(state)

    def has_request(self, request_id: str) -> bool:
        return request_id in self.output_processor.requests

    @property
    def request_ids(self) -> list[str]:
        return list(self.output_processor.requests)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished

    # ---- the step ----
    def step(self) -> list[RequestOutput]:
        start = time.perf_counter()
        batch = self.scheduler.schedule()
        if batch.is_empty:
            return []
        now = time.monotonic()
        for seq in batch.seqs:
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
        try:
            sampled = self.runner.execute(batch)
        except Exception as e:  # a failed forward fails the requests in it, and only those
            logger.exception("engine step failed; failing the %d requests in it", len(batch.seqs))
            return self._fail_batch(batch, e)
        token_ids = sampled.token_ids if sampled is not None else []
        seqs = self.scheduler.update_from_output(batch, token_ids)
        outputs = self.output_processor.process(seqs, sampled.logprobs if sampled is not None else None)
        for seq in seqs:
            if seq.is_finished:
                self._forget(seq.seq_id)
        self.num_steps_total += 1
        self.last_step_seconds = time.perf_counter() - start
        self.step_model.observe(batch.num_tokens, batch.num_kv_tokens_read, self.last_step_seconds)
        self.step_seconds_total += self.last_step_seconds
        self.last_step_num_tokens = batch.num_tokens
        bucket = bisect.bisect_left(ITERATION_TOKENS_BUCKETS, batch.num_tokens)
        self.iteration_tokens_counts[bucket] += 1
        self.iteration_tokens_sums[bucket] += batch.num_tokens
        return outputs

    def _end(self, state: RequestState, reason: str) -> None:
        for seq in state.seqs:
            self.scheduler.finish(seq, reason)  # a no-op for samples that already ended
            self._forget(seq.seq_id)

    def _forget(self, seq_id: str) -> None:
        """Drop what the sampler and the grammars keep for an ended sample."""
        self.runner.sampler.forget(seq_id)
        self.structured_outputs.forget(seq_id)

    def _fail_batch(self, batch: ScheduledBatch, error: Exception) -> list[RequestOutput]:
        return self.fail_requests(dict.fromkeys(s.request_id for s in batch.seqs),
                                  f"the engine step failed: {type(error).__name__}: {error}")

    def fail_requests(self, request_ids: Iterable[str], error: str) -> list[RequestOutput]:
        """End these requests now (blocks freed) with an output that carries `error`."""
        outputs = []
        for request_id in request_ids:
            state = self.output_processor.pop(request_id)
            if state is None:
                continue
            self._end(state, "abort")
            out = self.output_processor.make_output(state)
            out.error = error
            outputs.append(out)
        return outputs

    # ---- policy weights and memory (RL rollouts; AsyncLLM pauses what runs first) ----
    def update_weights(self, weights: Mapping[str, Any] | Iterable[tuple[str, Any]] | str, version: Any,
                       partial: bool = False) -> int:
        """Load new weights in place: HF-named tensors (a dict, (name, tensor) pairs, or a safetensors file or
        folder). All or nothing: an unknown name, a wrong shape, a non-float dtype or (unless partial) a missing
        parameter raises ValueError naming it, with the old weights untouched. Then every cached prefix is
        forgotten (its KV came from the old weights), fp8 KV scales are calibrated again, and outputs from here
        on carry `version`. Only while no sequence holds KV blocks: abort, drain or preempt_all() first.
        Returns how many tensors it loaded."""
        self._require_no_kv("update weights")
        count = self.runner.load_weights(_weight_items(weights), partial)
        self.block_manager.reset_prefix_cache()
        self.runner.calibrate_kv_scales(self._calibration_ids)
        self.model_version = self.output_processor.model_version = version
        logger.info("weights updated in place: %d tensors, now serving version %r", count, version)
        return count

    def check_weights(self, weights: Mapping[str, Any] | Iterable[tuple[str, Any]] | str, partial: bool = False) -> int:
        """What update_weights checks, without loading anything (ValueError naming what is wrong)."""
        return self.runner.load_weights(_weight_items(weights), partial, check_only=True)

    def abort_all(self) -> list[RequestOutput]:
        """End every request now, with finish_reason abort, blocks freed."""
        return [out for rid in self.request_ids if (out := self.abort_request(rid)) is not None]

    def preempt_all(self) -> int:
        """Free every running sequence's KV; each recomputes its prompt and output so far when it runs again."""
        return self.scheduler.preempt_all()

    def sleep(self, level: int) -> None:
        """Free the KV pool (level 1) and the weights too (level 2), keeping the engine's state to wake up.
        Only while no request is live."""
        check_sleep_level(level)
        if self.has_unfinished_requests():
            raise RuntimeError("cannot sleep with requests live; abort or finish them first")
        self.block_manager.reset_prefix_cache()  # its blocks' contents go with the pool
        self.runner.release_memory(level)
        self.sleep_level = level
        logger.info("asleep at level %d: KV pool%s freed", level, " and weights" if level == 2 else "")

    def wake_up(self, weights: Mapping[str, Any] | Iterable[tuple[str, Any]] | str | None = None,
                version: Any = None) -> None:
        """A fresh KV pool; after level 2, the weights loaded again from `weights` (with its `version`), or from
        the checkpoint on disk (version 0) when None."""
        if not self.sleep_level:
            return
        if self.runner.restore_memory():
            if weights is None:
                weights, version = self.model_path, 0
            self.sleep_level = 0
            self.update_weights(weights, version)
        self.sleep_level = 0
        logger.info("awake, serving version %r", self.model_version)

    def _require_no_kv(self, what: str) -> None:
        if self.block_manager.num_used_blocks:
            raise RuntimeError(f"cannot {what} while sequences hold {self.block_manager.num_used_blocks} KV blocks; "
                               "abort, finish or preempt them first")

    # ---- introspection ----
    def kv_cache_config(self) -> dict[str, str]:
        """The KV cache's fixed facts, in vLLM's cache_config_info names (num_gpu_blocks: blocks of the pool,
        wherever it lives), plus ours: bytes of one block, and the KV groups that share the pool (a block holds
        one group's layers)."""
        return {"block_size": str(self.config.block_size), "num_gpu_blocks": str(self.runner.num_kv_blocks),
                "cache_dtype": str(self.runner.kv_dtype).removeprefix("torch."),
                "enable_prefix_caching": str(self.config.enable_prefix_caching),
                "kv_bytes_per_block": str(self.runner.bytes_per_block), "kv_groups": self.runner.kv_groups.describe()}

    def stats(self) -> EngineStats:
        """A snapshot; take it on the thread that drives the engine (AsyncLLM publishes one per step)."""
        return EngineStats.from_scheduler(
            self.scheduler, num_prompt_tokens_total=self.num_prompt_tokens_total,
            num_steps_total=self.num_steps_total, step_seconds_total=self.step_seconds_total,
            last_step_seconds=self.last_step_seconds, last_step_num_tokens=self.last_step_num_tokens,
            iteration_tokens_counts=tuple(self.iteration_tokens_counts),
            iteration_tokens_sums=tuple(self.iteration_tokens_sums), step_model=self.step_model.coefficients())


GENERATION_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def check_sleep_level(level: int) -> None:
    if level not in (1, 2):
        raise ValueError(f"sleep level must be 1 (free the KV pool) or 2 (the KV pool and the weights); got {level}")


def _weight_items(weights: Mapping[str, Any] | Iterable[tuple[str, Any]] | str) -> Iterable[tuple[str, Any]]:
    if isinstance(weights, str):
        from engine.loader import iter_weights

        return iter_weights(weights, show_progress=False)
    return weights.items() if isinstance(weights, Mapping) else weights


def load_generation_defaults(model_path: str) -> dict[str, float]:
    """The sampling settings the model's generation_config.json recommends (only those it sets), which servers
    apply to requests that leave them out (vLLM's `--generation-config auto`)."""
    import json
    import os

    path = os.path.join(model_path, "generation_config.json")
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, ValueError):
        return {}
    if raw.get("do_sample") is False:  # greedy by the model's own config: sampling settings do not apply
        return {"temperature": 0.0}
    return {k: raw[k] for k in GENERATION_DEFAULT_FIELDS if isinstance(raw.get(k), (int, float))
            and not isinstance(raw.get(k), bool)}


def _with_max_tokens(params: SamplingParams, max_tokens: int) -> SamplingParams:
    return dataclasses.replace(params, max_tokens=max_tokens)
