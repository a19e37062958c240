"""Sequence: one sample of one request, as the scheduler and block manager see it.

vLLM v1's view: there is no prefill or decode phase. A sequence has tokens (prompt, then output) and
a count of tokens whose KV is computed; each step the scheduler lets the count catch up by some tokens.
"""
from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

from engine.sampling_params import SamplingParams

_arrival_counter = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Logprob:
    logprob: float
    rank: int  # 1 = most likely token
    decoded_token: str | None = None


@dataclass(eq=False)
class Sequence:
    request_id: str
    index: int  # which of the request's n samples
    token_ids: list[int]
    params: SamplingParams
    num_prompt_tokens: int = field(init=False)
    num_computed_tokens: int = 0  # tokens whose K/V sit in the cache
    num_cached_tokens: int = 0  # of the prompt, how many came from the prefix cache / a sibling
    # one block table per KV group (engine.kv_groups; one group unless the model mixes window kinds), all of
    # the same length: block i of every table holds positions i * block_size on. [] while it holds no blocks
    block_tables: list[list[int]] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of full token blocks
    num_registered_blocks: int = 0  # leading blocks already offered to the prefix cache
    # per group with a sliding window: leading blocks given back to the pool because no future query can see
    # them; their table entries stay as placeholders (never read: outside every window), so positions keep
    # their index
    num_released_blocks: list[int] = field(default_factory=list)
    state_slot: int | None = None  # hybrid models: its slot of the recurrent-state pool (BlockManager)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    parent: Sequence | None = None  # n > 1: sample 0, whose computed prompt blocks this one shares
    num_preemptions: int = 0
    arrival: int = field(default_factory=lambda: next(_arrival_counter))
    first_scheduled_time: float | None = None  # monotonic; stamped by the engine at the first step it is in
    # output side, filled by the engine
    output_text: str = ""
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0
    detokenizer: object | None = None

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.token_ids)
        if self.params.logprobs is not None:
            self.logprobs = []

    @property
    def seq_id(self) -> str:
        return f"{self.request_id}:{self.index}"

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def is_prompt_computed(self) -> bool:
        return self.num_computed_tokens >= self.num_prompt_tokens
