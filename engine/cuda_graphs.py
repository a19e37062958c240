"""CUDA graphs for decode steps: the model's forward captured once per padded batch size, then replayed.

A decode step at small batch on a GPU is launch-bound: about ten kernels a layer, each a few microseconds
of work behind a few microseconds of CPU launch. Replaying a captured graph issues the whole forward at
once. What makes the forward capturable:
- every input lives in a static buffer, because a graph reads the addresses it was captured with;
- nothing is built from host lists inside the forward: the Triton attention reads device-side token tables
  (AttentionMetadata.token_seq / token_pos) filled here;
- the launch grid does not depend on this step's lengths: attention is captured for max_model_len, and a
  context split past a sequence's end is empty (the merge gives it zero weight).
A batch is padded up to the next captured size. Padded rows write nowhere (slot -1), attend to one key,
and their outputs are dropped. Only the forward is captured; logits and sampling run eagerly on real rows.
Prefill and mixed steps, and batches past the largest size, run eagerly. `enforce_eager=True` turns
graphs off.
"""
from __future__ import annotations

import logging
import time
from typing import Any

import torch

from kernels import AttentionMetadata

logger = logging.getLogger(__name__)

LARGEST_CAPTURED_BATCH = 256


def capture_sizes(max_num_seqs: int, largest: int = LARGEST_CAPTURED_BATCH) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, then every multiple of 8, up to min(max_num_seqs, largest). A batch
    runs in the smallest captured size that holds it, so padding stays under 8 rows (and 2x below 8)."""
    cap = min(max_num_seqs, largest)
    sizes = [s for s in [1, 2, 4, *range(8, largest + 1, 8)] if s < cap]
    return sizes + [cap]


class DecodeGraphs:
    """Static input buffers, one captured graph per batch size, and the copy-in / replay / slice-out.

    `use_cuda_graphs=False` runs the same padded, static-buffer forward eagerly instead of replaying; that
    is how the CPU tests check the padding and buffer logic (Triton's interpreter) without a GPU.
    """

    def __init__(self, model: torch.nn.Module, kv_caches: list, *, sizes: list[int], max_model_len: int,
                 block_size: int, device: torch.device, use_cuda_graphs: bool = True) -> None:
        if model.ops.name != "triton":
            raise ValueError(f"decode graphs need attention that reads device-side tables (the Triton ops); "
                             f"this model uses the {model.ops.name!r} ops")
        self.model, self.kv_caches = model, kv_caches
        self.sizes = sorted(set(sizes))
        self.max_batch = self.sizes[-1]
        self.max_model_len = max_model_len
        self.use_cuda_graphs = use_cuda_graphs
        n, max_blocks = self.max_batch, -(-max_model_len // block_size)

        def zeros(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, device=device)

        self.input_ids = zeros(n)
        self.positions = zeros(n)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.block_tables = zeros(n, max_blocks, dtype=torch.int32)
        self.token_seq = torch.arange(n, dtype=torch.int32, device=device)  # decode: token i is row i
        self.token_pos = zeros(n, dtype=torch.int32)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, Any] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.replays = 0  # steps served from the static buffers (for tests and logs)

    def _meta(self, bs: int) -> AttentionMetadata:
        # The host lists say "every row may be max_model_len long": they size the attention grid, and the
        # kernel stops each row at its own position, read from token_pos.
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs], query_start_loc=self.query_start_loc[: bs + 1],
            seq_lens=self.seq_lens[:bs], block_tables=self.block_tables[:bs],
            query_lens_host=[1] * bs, seq_lens_host=[self.max_model_len] * bs,
            max_query_len=1, max_seq_len=self.max_model_len,
            token_seq=self.token_seq[:bs], token_pos=self.token_pos[:bs])

    def _forward(self, bs: int) -> torch.Tensor:
        return self.model(self.input_ids[:bs], self.positions[:bs], self.kv_caches, self._meta(bs))

    @torch.inference_mode()
    def capture(self) -> None:
        if not self.use_cuda_graphs:
            return
        t0, pool = time.perf_counter(), None
        for bs in reversed(self.sizes):  # largest first, so the smaller graphs fit in its memory pool
            self._forward(bs)  # warm-up outside the capture: Triton compiles, cuBLAS picks its kernels
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[bs] = self._forward(bs)
            pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize()
        logger.info("captured CUDA graphs for decode batch sizes %s in %.1f s (enforce_eager=True turns them off)",
                    self.sizes, time.perf_counter() - t0)

    def padded_size(self, num_seqs: int) -> int | None:
        return next((s for s in self.sizes if s >= num_seqs), None)

    def can_run(self, meta: AttentionMetadata) -> bool:
        return (meta.is_decode_only and meta.num_seqs <= self.max_batch and meta.max_seq_len <= self.max_model_len
                and meta.block_tables.shape[1] <= self.block_tables.shape[1])

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The decode step's hidden states (num_seqs, hidden), from the graph for the padded batch size."""
        n = input_ids.shape[0]
        bs = self.padded_size(n)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.token_pos[:n].copy_(positions)  # a decode token's own position bounds what it attends to
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.block_tables[:n, : meta.block_tables.shape[1]].copy_(meta.block_tables)
        if bs > n:  # padded rows: store nothing, attend to key 0 of whatever block their row names
            self.slot_mapping[n:bs].fill_(-1)
            self.positions[n:bs].zero_()
            self.token_pos[n:bs].zero_()
        self.replays += 1
        if not self.use_cuda_graphs:
            return self._forward(bs)[:n]
        self.graphs[bs].replay()
        return self.outputs[bs][:n]
