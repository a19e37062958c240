"""Batch-invariant mode (EngineConfig.batch_invariant): a request's tokens and logprobs are bit-identical whether
it runs alone or among 31 others of other lengths, with its prompt chunked and its prefix found in the cache, on
the CPU path (our C kernels, fp32 and bf16) and on the Triton path (under the interpreter here)."""
from __future__ import annotations

import random

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import RequestOutputKind, SamplingParams
from kernels import select_ops
from kernels.cpu_native import native

VOCAB = 1024  # a small vocabulary keeps the interpreted Triton LM head quick; prompts are ids below it

needs_native = pytest.mark.skipif(native() is None, reason="the C kernels cannot be built on this machine")


def _params(kind: str, max_tokens: int) -> SamplingParams:
    if kind == "greedy":
        p = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=3)
    else:  # sampled at temperature 1 from its own seed: the noise is the request's, the logits must be too
        p = SamplingParams(temperature=1.0, seed=7, max_tokens=max_tokens, ignore_eos=True, logprobs=3)
    p.output_kind = RequestOutputKind.FINAL_ONLY
    return p


def _run(engine: LLMEngine, arrivals: list[tuple[int, str, list[int], SamplingParams]]) -> dict[str, tuple]:
    """Feed requests at their arrival steps, step until all end; per request: (token ids, logprobs, cached)."""
    pending = sorted(arrivals, key=lambda a: a[0])
    results, step = {}, 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            _, rid, prompt, params = pending.pop(0)
            engine.add_request(rid, prompt, params)
        for out in engine.step():
            if out.finished:
                assert out.error is None, out.error
                c = out.outputs[0]
                results[out.request_id] = (c.token_ids, [{t: (lp.logprob, lp.rank) for t, lp in d.items()}
                                                         for d in c.logprobs], out.num_cached_tokens)
        step += 1
    assert engine.scheduler.block_manager.num_free_blocks == engine.scheduler.block_manager.num_total_blocks
    return results


CASES = [pytest.param("llama", "cpu", "float32", marks=needs_native),
         pytest.param("llama", "cpu", "bfloat16", marks=needs_native),
         # sliding and full layers in two KV groups, q/k norms, MQA
         pytest.param("gemma3", "cpu", "bfloat16", marks=needs_native),
         # a hybrid: Gated DeltaNet layers carry a recurrent state across the chunks of a prompt
         pytest.param("qwen3_5", "cpu", "float32", marks=needs_native),
         pytest.param("llama", "triton", "float32")]


@pytest.mark.parametrize(("arch", "backend", "dtype"), CASES)
def test_request_alone_and_among_31_others_is_bit_identical(make_tiny_model, arch, backend, dtype):
    if backend == "triton":
        pytest.importorskip("triton", reason="triton is not installed")  # it is, in CI
    # the interpreted Triton kernels run a Python loop per program: shorter there, and one layer (every kernel
    # runs in each layer; a second adds time, not kernels)
    path = make_tiny_model(arch, vocab_size=VOCAB, **({} if backend == "cpu" else {"num_hidden_layers": 1}))
    rng = random.Random(0)
    shared = [rng.randrange(3, VOCAB) for _ in range(32)]  # two full blocks the target finds in the cache
    target = shared + [rng.randrange(3, VOCAB) for _ in range(21)]
    max_new, longest = (20, 120) if backend == "cpu" else (6, 12)
    base = dict(model=path, dtype=dtype, device="cpu", attention_backend=backend, batch_invariant=True,
                show_progress=False, num_kv_blocks=256)

    # alone: the whole prompt in one chunk, no cache, a batch of one every step
    alone_engine = LLMEngine(EngineConfig(enable_prefix_caching=False, max_num_batched_tokens=2048, **base))
    alone = {}
    for kind in ("greedy", "sampled"):
        alone.update(_run(alone_engine, [(0, kind, target, _params(kind, max_new))]))
    assert all(cached == 0 for _, _, cached in alone.values())

    # among 31 others: chunked prefill (a 16-token budget: the 21 tokens after its cached prefix take two steps
    # or more), decodes of other lengths beside it, and its first 32 tokens from the prefix cache, computed
    # there by another request
    engine = LLMEngine(EngineConfig(enable_prefix_caching=True, max_num_batched_tokens=16, **base))
    others = [(0, "sharer", shared + [5, 6, 7], _params("greedy", 6))]
    for i in range(29):
        n = rng.randrange(3, longest)
        others.append((rng.randrange(0, 6), f"other-{i}", [rng.randrange(3, VOCAB) for _ in range(n)],
                       _params(rng.choice(["greedy", "sampled"]), rng.randrange(2, max_new))))
    arrivals = others + [(3, "greedy", target, _params("greedy", max_new)),
                         (3, "sampled", target, _params("sampled", max_new))]
    assert len(arrivals) == 32
    batched = _run(engine, arrivals)
    if arch != "qwen3_5":  # hybrids keep prefix caching off (engine/models/qwen3_5.py)
        assert batched["greedy"][2] >= 32 and batched["sampled"][2] >= 32  # the prefix hit happened

    for kind in ("greedy", "sampled"):
        tokens, logprobs, _ = batched[kind]
        assert tokens == alone[kind][0], kind
        assert logprobs == alone[kind][1], kind  # floats compared exactly: bit-identical


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_invariant_cpu_linear_rows_do_not_depend_on_the_batch(dtype):
    ops = select_ops("cpu", "cpu", dtype, batch_invariant=True)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(77, 96, generator=g).to(dtype)
    w = torch.randn(130, 96, generator=g).to(dtype)
    b = torch.randn(130, generator=g).to(dtype)
    whole = ops.linear(x, w, b)
    torch.testing.assert_close(whole.float(), torch.nn.functional.linear(x, w, b).float(),
                               atol=1e-4 if dtype == torch.float32 else 0.1, rtol=1e-4 if dtype == torch.float32 else 2e-2)
    for lo, hi in ((0, 1), (5, 6), (3, 40), (31, 77), (64, 65)):
        assert torch.equal(ops.linear(x[lo:hi], w, b), whole[lo:hi]), (lo, hi)


def test_invariant_triton_linear_rows_do_not_depend_on_the_batch():
    pytest.importorskip("triton", reason="triton is not installed")
    ops = select_ops("triton", "cpu", torch.float32, batch_invariant=True)
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(70, 48, generator=g), torch.randn(80, 48, generator=g), torch.randn(80, generator=g)
    whole = ops.linear(x, w, b)
    torch.testing.assert_close(whole, torch.nn.functional.linear(x, w, b), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ops.linear(x, w), torch.nn.functional.linear(x, w), atol=1e-4, rtol=1e-4)
    for lo, hi in ((0, 1), (33, 34), (10, 45), (40, 70)):
        assert torch.equal(ops.linear(x[lo:hi], w, b), whole[lo:hi]), (lo, hi)


def test_batch_invariant_refuses_ops_that_cannot_keep_it():
    with pytest.raises(ValueError, match="batch_invariant runs on attention_backend 'cpu' or 'triton'"):
        select_ops("reference", "cpu", torch.float32, batch_invariant=True)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        select_ops("cpu", "cpu", torch.float16, batch_invariant=True)


def test_serve_config_carries_batch_invariant():
    from serve_app.config import ServeConfig

    assert ServeConfig(batch_invariant=True).to_engine_config().batch_invariant is True
    assert ServeConfig(engine={"batch_invariant": True}).to_engine_config().batch_invariant is True
    assert ServeConfig().to_engine_config().batch_invariant is False
