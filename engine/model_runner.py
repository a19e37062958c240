"""ModelRunner: the only part of the engine that touches a device.

It owns the weights and the KV pool (allocated once), turns a ScheduledBatch into one flattened forward
pass (tokens of all sequences on one axis, K/V written through a slot mapping, attention through block
tables), and samples the sequences that reached the end of their known tokens.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable
from typing import Any

import torch

from engine.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig
from engine.kv_groups import KVGroups
from engine.loader import iter_weights
from engine.models import get_model_class
from engine.sampler import Sampler, SamplerOutput
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledBatch
from engine.sequence import Sequence
from kernels import AttentionMetadata, select_ops
from kernels.kv_cache import KV_CACHE_DTYPES, kv_rotation
from kernels.linear import drop_packed

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"device={device!r} was asked for but torch sees no CUDA device; use device='cpu'")
    return torch.device(device)


def cpu_has_native_bf16() -> bool:
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype != "auto":
        return _DTYPES[dtype]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


class ModelRunner:
    def __init__(self, config: EngineConfig, model_path: str, hf_config: Any, eos_token_ids: list[int]) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.ops = select_ops(config.attention_backend, self.device.type, self.dtype, config.batch_invariant)
        self.block_size = config.block_size

        model_cls = get_model_class(hf_config.architectures[0])
        with torch.device("meta"):
            model = model_cls(hf_config, self.ops, hf_config.max_position_embeddings)
        model = model.to(self.dtype).to_empty(device=self.device)
        model.load_weights(iter_weights(model_path, config.show_progress))
        model.init_rope(self.device)
        self.model = model.eval().requires_grad_(False)
        spec = model.spec
        self.vocab_size = spec.vocab_size
        self.num_layers, self.num_kv_heads, self.head_dim = spec.num_layers, spec.num_kv_heads, spec.head_dim
        # which layers share a block table (one group unless sliding and full layers mix: engine/kv_groups.py)
        self.kv_groups = KVGroups.from_layer_windows(spec.sliding_windows, config.free_out_of_window_blocks)
        for layer in self.attention_layers():
            layer.kv_group = self.kv_groups.layer_group[layer.layer_idx]

        # hybrid models (linear-attention layers): a recurrent state per running sequence, in a pool of slots
        self.state_bytes_per_seq = model.state_bytes_per_seq() if hasattr(model, "new_state_pool") else 0
        self.num_state_slots = config.max_num_seqs if self.state_bytes_per_seq else 0
        self.state_pool = self._new_state_pool()

        self.sampler = Sampler(self.vocab_size, eos_token_ids, config.seed, self.device)
        # what a fake step (config.fake_step_s) samples: an ordinary token, never an end of sequence
        self.fake_token = next(t for t in range(100, self.vocab_size) if t not in eos_token_ids)
        self.attention_scratch: dict = {}  # reused gather buffers of the CPU attention (AttentionMetadata.scratch)
        # what the KV pool stores: the model's dtype, or fp8 (kernels.kv_cache: quantized with per-layer scales)
        self.kv_dtype = KV_CACHE_DTYPES.get(config.kv_cache_dtype, self.dtype)
        if self.kv_dtype != self.dtype:  # fp8: keys rotated before they are quantized (kernels.kv_cache)
            for layer in self.attention_layers():
                layer.kv_rotation = kv_rotation(layer.head_dim, layer.layer_idx).T.contiguous().to(
                    self.dtype).to(self.device)
        self.num_kv_blocks = config.num_kv_blocks or self._blocks_from_budget()
        # (layers of a group, K/V, blocks, block_size, kv_heads, head_dim): the one large allocation besides
        # weights. A block holds K/V of one group's layers; layer i uses slot layer_slot[i] at its group's ids
        self.kv_cache = self._new_kv_pool(self.num_kv_blocks)
        self.kv_caches = self._layer_views(self.kv_cache)
        self.graphs = None  # DecodeGraphs once capture_decode_graphs has run (CUDA + Triton, not enforce_eager)
        logger.info("ops: %s backend: %s", self.ops.name, self.ops.description)
        logger.info("model on %s in %s; KV cache in %s: %d bytes per token in each of %d KV group(s), pool %d blocks "
                    "x %d tokens (%.1f MiB)", self.device, self.dtype, str(self.kv_dtype).removeprefix("torch."),
                    self.bytes_per_block // self.block_size, self.kv_groups.num_groups, self.num_kv_blocks,
                    self.block_size, self.kv_cache.numel() * self.kv_cache.element_size() / 2**20)
        logger.info("%s", self.kv_groups.describe())
        if self.num_state_slots:
            logger.info("recurrent state of the linear-attention layers: %d bytes per sequence, %d slots (%.1f MiB)",
                        self.state_bytes_per_seq, self.num_state_slots,
                        self.state_bytes_per_seq * self.num_state_slots / 2**20)

    def _new_state_pool(self) -> list:
        return (self.model.new_state_pool(self.num_state_slots, self.device) if self.num_state_slots
                else [])

    # ---- weights and memory, for RL rollouts (LLMEngine.update_weights / sleep / wake_up) ----
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], partial: bool = False,
                     check_only: bool = False) -> int:
        """HF-named tensors into the model in place, all or nothing (DecoderForCausalLM.load_weights checks them
        all before copying any). In place, so CUDA graphs stay valid; oneDNN's packed copies of the weights
        (kernels.linear.packed_weight) are dropped, to be packed again from the new values on first use."""
        copied = self.model.load_weights(weights, partial, check_only)
        if not check_only:
            drop_packed(self.model.parameters())
        return copied

    def release_memory(self, level: int) -> None:
        """Sleep: level 1 frees the KV pool, level 2 the weights too. Only while no sequence holds blocks."""
        self.kv_cache, self.kv_caches, self.state_pool = None, [], []
        self.attention_scratch.clear()
        if level >= 2:
            drop_packed(self.model.parameters())  # oneDNN's packed copies (kernels.linear.packed_weight) too
            self._weight_shapes = {n: (p.shape, p.dtype) for n, p in self.model.named_parameters()}
            for p in self.model.parameters():
                p.data = torch.empty(0, dtype=p.dtype, device=self.device)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        else:
            _trim_heap()

    def restore_memory(self) -> bool:
        """Wake up: a fresh (zeroed) KV pool, and room for the weights if they were freed. Returns whether the
        weights were freed, i.e. must be loaded again before the next step."""
        self.kv_cache = self._new_kv_pool(self.num_kv_blocks)
        self.kv_caches = self._layer_views(self.kv_cache)
        self.state_pool = self._new_state_pool()
        shapes = getattr(self, "_weight_shapes", None)
        if shapes is None:
            return False
        params = dict(self.model.named_parameters())
        for name, (shape, dtype) in shapes.items():
            params[name].data = torch.empty(shape, dtype=dtype, device=self.device)
        self._weight_shapes = None
        return True

    @property
    def bytes_per_block(self) -> int:
        """The seed's M = 2 * L * H_kv * d_head * T * b for one block of T tokens, b the KV dtype's bytes and L
        the layers of one KV group (every layer when the model has one group)."""
        elem = torch.empty(0, dtype=self.kv_dtype).element_size()
        return self.kv_groups.block_bytes(self.block_size, self.num_kv_heads, self.head_dim, elem)

    def _new_kv_pool(self, num_blocks: int) -> torch.Tensor:
        return torch.zeros(self.kv_groups.group_size, 2, num_blocks, self.block_size, self.num_kv_heads,
                           self.head_dim, dtype=self.kv_dtype, device=self.device)

    def _layer_views(self, pool: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's (K, V) pages: its slot of the pool."""
        return [(pool[slot, 0], pool[slot, 1]) for slot in self.kv_groups.layer_slot]

    def attention_layers(self) -> list[Any]:
        from engine.models.layers import Attention

        return [m for m in self.model.modules() if isinstance(m, Attention)]

    @torch.inference_mode()
    def prompt_logits(self, token_ids: list[int], chunk: int | None = None) -> torch.Tensor:
        """(T, vocab) float32: the next-token logits after every prefix of token_ids, through the KV pool's first
        blocks, in forwards of `chunk` tokens (None: one; 1: as decoding reads them, every earlier token from the
        cache). Only while no request holds blocks (start-up, tests, benchmarks)."""
        num_blocks = -(-len(token_ids) // self.block_size)
        num_groups = self.kv_groups.num_groups
        if num_blocks * num_groups > self.num_kv_blocks:
            raise ValueError(f"{len(token_ids)} tokens need {num_blocks * num_groups} KV blocks; the pool has "
                             f"{self.num_kv_blocks}")
        seq = Sequence("prompt-logits", 0, list(token_ids), SamplingParams(max_tokens=1))
        seq.block_tables = [list(range(g * num_blocks, (g + 1) * num_blocks)) for g in range(num_groups)]
        seq.state_slot = 0 if self.num_state_slots else None
        logits = []
        for start in range(0, len(token_ids), chunk or len(token_ids)):
            seq.num_computed_tokens = start
            batch = ScheduledBatch()
            batch.seqs.append(seq)
            batch.num_new_tokens.append(min(chunk or len(token_ids), len(token_ids) - start))
            input_ids, positions, meta, _, _ = self.prepare(batch)
            logits.append(self.model.compute_logits(self.model(input_ids, positions, self.kv_caches, meta)))
        return torch.cat(logits)

    def calibrate_kv_scales(self, token_ids: list[int]) -> None:
        """fp8 KV: each attention layer's per-tensor K and V scales from one forward over token_ids (each layer
        sets its own from the K and V it writes, so later layers see a well-scaled cache), fixed from then on."""
        if self.kv_dtype == self.dtype:
            return
        layers = self.attention_layers()
        for layer in layers:
            layer.calibrate_kv = True
        try:
            self.prompt_logits(token_ids[: self.num_kv_blocks // self.kv_groups.num_groups * self.block_size])
        finally:
            for layer in layers:
                layer.calibrate_kv = False
        k, v = [lay.k_scale for lay in layers], [lay.v_scale for lay in layers]
        logger.info("fp8 KV scales from %d calibration tokens: k %.3g..%.3g, v %.3g..%.3g", len(token_ids),
                    min(k), max(k), min(v), max(v))

    def _blocks_from_budget(self) -> int:
        if self.device.type == "cuda":
            free, _total = torch.cuda.mem_get_info(self.device)
            budget = int(free * self.config.gpu_memory_utilization) - self._activation_bytes()
        else:
            budget = self.config.kv_cache_bytes or DEFAULT_CPU_KV_CACHE_BYTES
        budget -= self.num_state_slots * self.state_bytes_per_seq  # hybrid models: the state pool comes first
        num_blocks = budget // self.bytes_per_block
        if num_blocks < 1:
            raise RuntimeError(
                f"no memory left for the KV cache (budget {budget} bytes, one block needs {self.bytes_per_block}); "
                "raise kv_cache_bytes / gpu_memory_utilization or lower max_num_batched_tokens"
            )
        return int(num_blocks)

    def _activation_bytes(self) -> int:
        """Peak memory of one whole warm-up step at the largest batch the scheduler can form (CUDA only):
        every layer, the logits and sampling, over a scratch KV pool just large enough for it."""
        batch, num_blocks = warmup_batch(self.config.max_num_seqs, self.config.max_num_batched_tokens,
                                         self.block_size, self.kv_groups.num_groups)
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        self.run_warmup(batch, num_blocks)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        scratch_pool = num_blocks * self.bytes_per_block  # counted in peak, but it is not activations
        return int(max(0, peak - scratch_pool) * 1.1)  # 10 % for allocator fragmentation

    def run_warmup(self, batch: ScheduledBatch, num_blocks: int) -> None:
        """Run `batch` (from warmup_batch) against a scratch KV pool of num_blocks blocks, then drop the pool."""
        scratch = self._new_kv_pool(num_blocks)
        saved = getattr(self, "kv_caches", None)
        self.kv_caches = self._layer_views(scratch)
        for i, seq in enumerate(batch.seqs):
            seq.state_slot = i if self.num_state_slots else None
        try:
            self.execute(batch)
        finally:
            self.kv_caches = saved
            for seq in batch.seqs:
                self.sampler.forget(seq.seq_id)
            del scratch

    def capture_decode_graphs(self, max_model_len: int) -> None:
        """On CUDA with the Triton ops, capture decode steps as CUDA graphs (engine/cuda_graphs.py). Called by
        the engine once max_model_len is known, since attention is captured for the longest context."""
        if self.device.type != "cuda" or self.config.enforce_eager or self.ops.name != "triton":
            return
        if self.kv_groups.num_groups > 1 or self.num_state_slots:
            logger.info("decode steps run eagerly: CUDA graphs are captured for one block table per sequence and no "
                        "recurrent state, and this model has %d KV groups%s", self.kv_groups.num_groups,
                        " and linear-attention layers" if self.num_state_slots else "")
            return
        from engine.cuda_graphs import DecodeGraphs, capture_sizes

        self.graphs = DecodeGraphs(self.model, self.kv_caches, sizes=capture_sizes(self.config.max_num_seqs),
                                   max_model_len=max_model_len, block_size=self.block_size, device=self.device)
        self.graphs.capture()

    # ---- one step ----
    def prepare(self, batch: ScheduledBatch
                ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int], torch.Tensor]:
        seqs, query_lens = batch.seqs, batch.num_new_tokens
        starts = [s.num_computed_tokens for s in seqs]
        input_ids: list[int] = []
        for seq, start, n in zip(seqs, starts, query_lens):
            input_ids.extend(seq.token_ids[start : start + n])
        seq_lens = [st + n for st, n in zip(starts, query_lens)]
        max_blocks = max(len(s.block_tables[0]) for s in seqs)
        group_tables = [torch.tensor([s.block_tables[g] + [0] * (max_blocks - len(s.block_tables[g])) for s in seqs],
                                     dtype=torch.int32) for g in range(self.kv_groups.num_groups)]

        qlens_t = torch.tensor(query_lens)
        cu = torch.zeros(len(seqs) + 1, dtype=torch.int32)
        torch.cumsum(qlens_t, 0, out=cu[1:])
        seq_idx = torch.repeat_interleave(torch.arange(len(seqs)), qlens_t)  # (T,)
        positions = torch.arange(len(input_ids)) - cu[:-1].long()[seq_idx] + torch.tensor(starts)[seq_idx]
        bs = self.block_size
        block_index, offset = positions // bs, positions % bs
        slot_mappings = [t[seq_idx, block_index].long() * bs + offset for t in group_tables]
        sample_rows = batch.sample_rows()
        logits_idx = (cu[1:] - 1).long()[sample_rows]

        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=slot_mappings[0].to(dev), query_start_loc=cu.to(dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(dev), block_tables=group_tables[0].to(dev),
            query_lens_host=list(query_lens), seq_lens_host=seq_lens,
            max_query_len=max(query_lens), max_seq_len=max(seq_lens), scratch=self.attention_scratch,
        )
        if self.num_state_slots:
            meta.state_slots = [s.state_slot for s in seqs]
            meta.state_fresh = [st == 0 for st in starts]
            meta.linear_states = self.state_pool
        if len(group_tables) > 1:
            meta.group_metas = [meta] + [
                dataclasses.replace(meta, slot_mapping=m.to(dev), block_tables=t.to(dev), plans={})
                for m, t in zip(slot_mappings[1:], group_tables[1:])
            ]
        return torch.tensor(input_ids, device=dev), positions.to(dev), meta, sample_rows, logits_idx.to(dev)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> SamplerOutput | None:
        """Run one step. Returns what the rows of batch.sample_rows() sampled, in that order (None: none did)."""
        input_ids, positions, meta, sample_rows, logits_idx = self.prepare(batch)
        if self.config.fake_step_s is not None:  # benchmarks of the serving path: a step of known cost
            time.sleep(self.config.fake_step_s + self.config.fake_step_s_per_token * batch.num_tokens)
            return SamplerOutput([self.fake_token] * len(sample_rows), None) if sample_rows else None
        if self.graphs is not None and self.graphs.can_run(meta):
            hidden = self.graphs.run(input_ids, positions, meta)
        else:
            hidden = self.model(input_ids, positions, self.kv_caches, meta)
        if not sample_rows:
            return None
        logits = self.model.compute_logits(hidden[logits_idx])
        return self.sampler(logits, [batch.seqs[i] for i in sample_rows])


def _trim_heap() -> None:
    """Hand freed heap memory back to the OS. A large tensor carved out of glibc's heap (not its own mmap, as
    happens once earlier allocations left big free chunks there) otherwise stays resident after it is freed."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: its allocator returns memory its own way
        pass


def warmup_batch(max_num_seqs: int, max_num_batched_tokens: int, block_size: int,
                 num_groups: int = 1) -> tuple[ScheduledBatch, int]:
    """The largest step the scheduler can form: the whole token budget as prefills spread over as many
    sequences as may run, every one of them sampling (so the logits and the sampler are at their largest too).
    Returns the batch and the KV blocks it needs (in every one of num_groups KV groups), numbered from 0."""
    num_seqs = max(1, min(max_num_seqs, max_num_batched_tokens))
    base, extra = divmod(max_num_batched_tokens, num_seqs)
    batch, next_block = ScheduledBatch(), 0
    for i in range(num_seqs):
        n = base + (1 if i < extra else 0)
        seq = Sequence(f"warmup-{i}", 0, [0] * n, SamplingParams(max_tokens=1))
        num_blocks = -(-n // block_size)
        seq.block_tables = []
        for _ in range(num_groups):
            seq.block_tables.append(list(range(next_block, next_block + num_blocks)))
            next_block += num_blocks
        batch.seqs.append(seq)
        batch.num_new_tokens.append(n)
    return batch, next_block
