"""Scheduler: which sequences run this step, and with how many tokens. Pure Python, no torch.

The rules, all of them here:
1. Iteration-level continuous batching. Every step has a token budget (max_num_batched_tokens) and a
   sequence cap (max_num_seqs). A sequence's share of a step is how far its computed tokens lag its tokens:
   1 for a decode, up to the whole remaining prompt for a prefill. Prefills are chunked by the budget, so
   prefill chunks and decodes share one step.
2. Running sequences go first, in admission order. When the pool cannot give one the blocks it needs, the
   most recently admitted running sequence is preempted by recompute: its blocks are freed, its computed
   count reset, and it goes back to the front of the waiting queue (its generated tokens are kept and
   recomputed as if they were prompt). Preemptions are counted.
3. Waiting sequences are admitted strictly first-come-first-served, and not at all in a step that
   preempted. Admission takes any cached prefix (or, for samples 2..n of a request, the prompt blocks
   sample 1 has computed) before asking the pool for fresh blocks. When the pool is what stops admission
   (or forced a preemption), the waiting sequences are counted as waiting for KV: the autoscaler's
   signal that this replica is out of memory, not just busy.
4. A request that can never fit is refused when it is added (see LLMEngine), never queued forever.
5. After the model ran a batch, `update_from_output` is the one update path (the engine, the tests and the
   autoscaling simulator all call it): computed counts catch up, newly full blocks go to the prefix
   cache, sampled tokens are appended, and EOS / stop token ids / max_tokens / max_model_len end
   sequences and free their blocks. Stop strings need text, so the engine's output processor checks them
   and ends such a sequence through `finish`.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from engine.block_manager import BlockManager, PrefixBlocks
from engine.kv_demand import projected_demand_blocks
from engine.sequence import Sequence, SequenceStatus

RECENT_OUTPUT_LENS = 256  # finished sequences remembered for the demand estimate (engine.kv_demand)


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)  # per sequence, tokens computed this step
    num_preempted: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def num_kv_tokens_read(self) -> int:
        """KV tokens attention reads this step: each sequence's context up to its last new token."""
        return sum(s.num_computed_tokens + n for s, n in zip(self.seqs, self.num_new_tokens))

    def will_sample(self, i: int) -> bool:
        """After this step sequence i has computed all its tokens, so its last logits give a new token."""
        seq = self.seqs[i]
        return seq.num_computed_tokens + self.num_new_tokens[i] == seq.num_tokens

    def sample_rows(self) -> list[int]:
        """Rows that sample a token this step (valid until update_from_output moves the counts)."""
        return [i for i in range(len(self.seqs)) if self.will_sample(i)]


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 eos_token_ids: Iterable[int] = (), max_model_len: int | None = None) -> None:
        self.block_manager = block_manager  # knows the KV groups and their windows
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions_total = 0
        self.num_waiting_for_kv = 0  # waiting sequences the last step left out for lack of KV blocks
        self.num_generation_tokens_total = 0
        self.num_added_total = 0  # sequences that arrived (add), and their prompt tokens: the arrival rates
        self.num_added_prompt_tokens_total = 0  # the autoscaler forecasts from
        self.recent_output_lens: deque[int] = deque(maxlen=RECENT_OUTPUT_LENS)  # of sequences that ended

    # ---- queue ----
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)
        self.num_added_total += 1
        self.num_added_prompt_tokens_total += seq.num_prompt_tokens

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def live_sequences(self) -> Iterator[Sequence]:
        yield from self.running
        yield from self.waiting

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a sequence, wherever it is, and give its blocks back at once."""
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        if reason != "abort":
            self.recent_output_lens.append(seq.num_output_tokens)

    def projected_demand_blocks(self) -> int:
        """Blocks the live sequences will hold at their end, not just now (see engine.kv_demand)."""
        return projected_demand_blocks(self.live_sequences(), self.recent_output_lens, self.block_manager)

    # ---- after the model ran ----
    def update_from_output(self, batch: ScheduledBatch, sampled_token_ids: Iterable[int]) -> list[Sequence]:
        """Advance every sequence of `batch` past this step. sampled_token_ids holds one token for each
        sequence that sampled (batch.sample_rows, in that order). Returns those sequences, in that order;
        the ones that ended are finished (blocks freed) with finish_reason set."""
        rows = batch.sample_rows()  # before the counts move: which sequences had all their tokens computed
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n
            self.block_manager.register_full_blocks(seq)
            self.block_manager.release_out_of_window(seq)
        sampled = []
        for row, token in zip(rows, sampled_token_ids, strict=True):
            seq = batch.seqs[row]
            seq.token_ids.append(token)
            self.num_generation_tokens_total += 1
            reason = self._stop_reason(seq, token)
            if reason is not None:
                self.finish(seq, reason)
            sampled.append(seq)
        return sampled

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if seq.num_output_tokens >= p.min_tokens:
            if not p.ignore_eos and token in self.eos_token_ids:
                return "stop"
            if token in p.stop_token_ids:
                seq.stop_reason = token
                return "stop"
        if seq.num_output_tokens >= p.max_tokens or (self.max_model_len and seq.num_tokens >= self.max_model_len):
            return "length"
        return None

    # ---- the step ----
    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        bm = self.block_manager
        self.num_waiting_for_kv = 0

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_uncomputed_tokens, budget)
            while not bm.allocate_slots(seq, num_new):
                victim = self.running[-1]  # most recently admitted; never one already in this batch
                self._preempt(victim)
                batch.num_preempted += 1
                if victim is seq:
                    break
            else:
                batch.seqs.append(seq)
                batch.num_new_tokens.append(num_new)
                budget -= num_new
                i += 1
                continue
            break  # seq preempted itself: nothing after it is left running

        if batch.num_preempted:
            self.num_waiting_for_kv = len(self.waiting)
            return batch
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            prefix = self._admission_prefix(seq)
            if prefix is None:
                break  # sample 1 of its request has not computed the shared prompt yet
            num_new = min(seq.num_tokens - prefix.num_blocks * bm.block_size, budget)
            if not bm.admit(seq, prefix, num_new):
                self.num_waiting_for_kv = len(self.waiting)
                break  # FCFS: nobody overtakes the head of the queue
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(num_new)
            budget -= num_new
        return batch

    def _admission_prefix(self, seq: Sequence) -> PrefixBlocks | None:
        """The leading blocks to share (from the prefix cache, or sample 1's computed prompt), or None to wait."""
        bm = self.block_manager
        if bm.num_state_slots:  # hybrid: a shared prefix would come without the recurrent state at its end
            return bm.empty_prefix()
        parent = seq.parent
        if parent is None or parent.is_finished:
            return bm.find_cached_prefix(seq)
        if parent.status is not SequenceStatus.RUNNING or not parent.is_prompt_computed:
            return None
        bs = bm.block_size
        num_shared = min(parent.num_computed_tokens // bs, (seq.num_prompt_tokens - 1) // bs)
        released = [min(r, num_shared) for r in parent.num_released_blocks]
        for g, window in enumerate(bm.group_windows):
            # the sibling starts at num_shared * bs: what the parent released must be behind its window too
            if window is not None and released[g] > bm.first_visible_block(num_shared * bs, window):
                num_shared = 0
        shared = PrefixBlocks([t[:num_shared] for t in parent.block_tables],
                              [min(r, num_shared) for r in released])
        cached = bm.find_cached_prefix(seq)
        return cached if cached.num_blocks > shared.num_blocks else shared

    def preempt_all(self) -> int:
        """Every running sequence back to the front of the waiting queue, in order, its blocks freed: it
        recomputes its KV when it runs again (after a weight update, KV computed with the old weights must
        not be read). Returns how many it preempted."""
        count = len(self.running)
        while self.running:
            self._preempt(self.running[-1])
        return count

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.appendleft(seq)
