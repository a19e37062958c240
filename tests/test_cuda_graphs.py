"""The CUDA-graph decode path's padding and static-buffer logic, on CPU.

CPU has no CUDA graphs, so DecodeGraphs runs here with use_cuda_graphs=False: every decode step goes
through the same padded static buffers and metadata a captured graph would read (attention sized for
max_model_len, token tables on the device, padded rows at slot -1), executed eagerly by the Triton
kernels under Triton's interpreter. What only a GPU can check (the capture itself) is in
scripts/gpu_check.py.
"""
from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from test_hf_exactness import hf_reference  # noqa: F401 - the fixture: tiny checkpoints and HF's greedy tokens

pytest.importorskip("triton", reason="triton is not installed")  # it is, in CI


def test_capture_sizes_cover_every_batch_with_bounded_padding():
    from engine.cuda_graphs import capture_sizes

    assert capture_sizes(256) == [1, 2, 4, *range(8, 257, 8)]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(1) == [1]
    assert capture_sizes(1000)[-1] == 256
    for max_seqs in (1, 3, 6, 8, 13, 64, 300):
        sizes = capture_sizes(max_seqs)
        for n in range(1, min(max_seqs, 256) + 1):
            padded = min(s for s in sizes if s >= n)
            assert padded - n < 8 and padded < 2 * n + 1


def _attach_graphs(llm, max_num_seqs):
    from engine.cuda_graphs import DecodeGraphs, capture_sizes

    runner = llm.engine.runner
    runner.graphs = DecodeGraphs(runner.model, runner.kv_caches, sizes=capture_sizes(max_num_seqs),
                                 max_model_len=llm.engine.max_model_len, block_size=runner.block_size,
                                 device=runner.device, use_cuda_graphs=False)
    return runner.graphs


def test_padded_static_decode_matches_hf(hf_reference):
    # Mistral with a 12-token sliding window and GQA (4 query heads on 2 KV heads): the window bound and
    # the head grouping both come from the captured metadata. (Triton's interpreter is slow: one variant.)
    path, prompts, expected = hf_reference("mistral-sliding-window")
    llm = LLM(model=path, dtype="float32", device="cpu", num_kv_blocks=64, max_num_seqs=8, max_model_len=256,
              attention_backend="triton", show_progress=False)
    assert llm.engine.runner.graphs is None, "no CUDA: decode graphs are never captured on CPU"
    graphs = _attach_graphs(llm, 4)  # sizes 1, 2, 4
    # Six requests of different output lengths: decode steps run 6, 5 rows (past the largest size: eager),
    # then 4, 4, 3 (padded to 4), 2, 2, 1, 1 through the static buffers. Prompts of 1-50 tokens cross block
    # boundaries while decoding; attention is sized for max_model_len (16 blocks, two context splits), so
    # the second split of every row is empty.
    lengths = [2, 3, 5, 6, 8, 10]
    outs = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths])
    assert [o.outputs[0].token_ids for o in outs] == [e[:n] for e, n in zip(expected, lengths)]
    assert graphs.replays == 7, "exactly the decode steps of at most 4 rows go through the static buffers"
    assert llm.stats().num_free_blocks == 64


def test_graphs_refuse_ops_that_read_host_lists(make_tiny_model):
    from engine.cuda_graphs import DecodeGraphs

    llm = LLM(model=make_tiny_model("llama"), dtype="float32", device="cpu", num_kv_blocks=16,
              attention_backend="cpu", show_progress=False)
    runner = llm.engine.runner
    with pytest.raises(ValueError, match="Triton"):
        DecodeGraphs(runner.model, runner.kv_caches, sizes=[1, 2], max_model_len=64, block_size=16,
                     device=runner.device, use_cuda_graphs=False)


def test_enforce_eager_is_a_config_switch_and_reaches_the_engine():
    from engine.config import EngineConfig
    from serve_app.config import ServeConfig

    assert EngineConfig().enforce_eager is False
    assert ServeConfig(enforce_eager=True).to_engine_config().enforce_eager is True
