"""Greedy fp32 output must match HF transformers token for token, for every architecture variant we
support, across batch shapes: plain batches, chunked prefill, prefix-cache hits, and preemption."""
from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from kernels.cpu_native import native

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/ is a folder of scripts, not a package
from bench.models import hf_greedy  # noqa: E402

VARIANTS = {
    "llama-gqa": ("llama", {}),
    "llama-mqa-tied-headdim": ("llama", dict(num_key_value_heads=1, tie_word_embeddings=True, head_dim=32)),
    "llama-rope-linear": ("llama", dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})),
    "llama-rope-llama3": ("llama", dict(rope_parameters={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64, "rope_theta": 500000.0})),
    "llama-rope-yarn": ("llama", dict(rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "rope_theta": 10000.0})),
    "mistral-sliding-window": ("mistral", dict(sliding_window=12)),
    "qwen2-bias": ("qwen2", dict(tie_word_embeddings=True)),
    "qwen3-qknorm": ("qwen3", dict(head_dim=32)),
    # Gemma 3: (1 + w) norms around attention and MLP, q/k norm, gelu-tanh, scaled embeddings, 2 sliding
    # layers (window 12, their own rope base) to 1 full
    "gemma3-sliding-full": ("gemma3", {}),
    "gemma3-rope-linear-untied": ("gemma3", dict(tie_word_embeddings=False, rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}})),
}

MAX_NEW = 10


def _prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    # lengths around block boundaries (block_size 16) and a one-token prompt
    return [[rng.randrange(3, 49152) for _ in range(n)] for n in (1, 7, 16, 17, 33, 50)]


def _ours(path: str, prompts, **engine_kwargs) -> tuple[list[list[int]], LLM]:
    llm = LLM(model=path, dtype="float32", device="cpu", show_progress=False, **engine_kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)], llm


@pytest.fixture(scope="module")
def hf_reference(make_tiny_model):
    cache = {}

    def get(variant: str, prompts_seed: int = 0, prompts=None):
        arch, overrides = VARIANTS[variant]
        path = make_tiny_model(arch, **overrides)
        prompts = prompts if prompts is not None else _prompts(prompts_seed)
        key = (variant, repr(prompts))
        if key not in cache:
            cache[key] = hf_greedy(path, prompts, MAX_NEW)
        return path, prompts, cache[key]

    return get


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_batch_matches_hf(hf_reference, variant):
    path, prompts, expected = hf_reference(variant)
    ours, _ = _ours(path, prompts, num_kv_blocks=64)
    assert ours == expected


@pytest.mark.parametrize("variant", ["llama-gqa", "mistral-sliding-window", "qwen3-qknorm", "gemma3-sliding-full"])
def test_chunked_prefill_matches_hf(hf_reference, variant):
    path, prompts, expected = hf_reference(variant)
    # a 9-token budget splits every longer prompt into chunks and mixes chunks with decodes
    ours, llm = _ours(path, prompts, num_kv_blocks=64, max_num_batched_tokens=9)
    assert ours == expected


@pytest.mark.parametrize("variant", ["llama-gqa", "qwen2-bias", "gemma3-sliding-full", "mistral-sliding-window"])
def test_prefix_cache_hits_match_hf(hf_reference, variant):
    rng = random.Random(1)
    shared = [rng.randrange(3, 49152) for _ in range(40)]
    prompts = [shared + [rng.randrange(3, 49152) for _ in range(k)] for k in (1, 5, 16, 23)]
    path, prompts, expected = hf_reference(variant, prompts=prompts)
    llm = LLM(model=path, dtype="float32", device="cpu", num_kv_blocks=64, show_progress=False)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    first = [o.outputs[0].token_ids for o in llm.generate(prompts[:1], params)]
    rest = llm.generate(prompts[1:], params)  # each finds the shared 2 full blocks in the cache
    assert first + [o.outputs[0].token_ids for o in rest] == expected
    assert all(o.num_cached_tokens >= 32 for o in rest)
    assert llm.stats().prefix_cache_hit_tokens >= 3 * 32
    again = llm.generate(prompts, params)  # now everything but the last block of each is cached
    assert [o.outputs[0].token_ids for o in again] == expected


@pytest.mark.parametrize("variant,blocks,budget", [("llama-gqa", 8, 2048), ("qwen3-qknorm", 8, 2048),
                                                   ("gemma3-sliding-full", 24, 2048), ("mistral-sliding-window", 4, 9)])
def test_preemption_matches_hf(hf_reference, variant, blocks, budget):
    path, prompts, expected = hf_reference(variant)
    # 8 blocks of 16 = 128 slots for six requests needing ~190: some must be preempted and recomputed. With a
    # 12-token window on every layer a sequence holds at most 2 blocks once decoding, so 8 would be plenty:
    # 4 blocks and 9-token prefill chunks (many sequences prefilling at once) force preemptions there. Gemma 3
    # (2 sliding layers, 1 full) has 3 KV groups, each with its own table: 24 blocks are 8 per group.
    ours, llm = _ours(path, prompts, num_kv_blocks=blocks, max_model_len=128, max_num_batched_tokens=budget)
    assert ours == expected
    assert llm.stats().num_preemptions_total > 0
    assert llm.stats().num_free_blocks == blocks


def test_block_size_32_matches_hf(hf_reference):
    path, prompts, expected = hf_reference("llama-gqa")
    ours, llm = _ours(path, prompts, block_size=32, num_kv_blocks=16, max_num_batched_tokens=20)
    assert ours == expected  # 32-token blocks, prefills chunked across block boundaries


def test_bf16_next_token_distribution_matches_hf_bf16(make_tiny_model):
    """bf16 cannot be token-exact across kernels, so hold it to HF's bf16 forward where it can be held: our
    greedy first token is HF's argmax up to bf16 noise, and its logprob agrees."""
    from transformers import AutoModelForCausalLM

    path = make_tiny_model("llama")
    llm = LLM(model=path, dtype="bfloat16", device="cpu", block_size=32, num_kv_blocks=16, show_progress=False)
    outs = llm.generate(_prompts(), SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=0))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    for prompt, out in zip(_prompts(), outs):
        c = out.outputs[0]
        assert len(c.token_ids) == 5
        with torch.no_grad():
            want = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, -1].float(), -1)
        token, ours_lp = c.token_ids[0], c.logprobs[0][c.token_ids[0]].logprob
        assert want[token] >= want.max() - 0.1, (token, want[token].item(), want.max().item())
        assert abs(ours_lp - want[token].item()) < 0.1


@pytest.mark.parametrize("variant", ["llama-gqa", "qwen3-qknorm", "gemma3-sliding-full"])
def test_batch_invariant_mode_matches_hf(hf_reference, variant):
    """batch_invariant=True swaps linear layers and attention for fixed-order kernels: still HF's greedy tokens,
    under chunked prefill too."""
    if native() is None:
        pytest.skip("batch_invariant on CPU needs the C kernels, which cannot be built on this machine")
    path, prompts, expected = hf_reference(variant)
    ours, llm = _ours(path, prompts, num_kv_blocks=64, max_num_batched_tokens=9, batch_invariant=True)
    assert "batch-invariant" in llm.engine.runner.ops.description
    assert ours == expected


# ---- the Triton kernels, end to end (Triton's interpreter on CPU; see tests/test_kernels.py) ----
@pytest.mark.parametrize("variant", ["llama-gqa", "llama-mqa-tied-headdim", "mistral-sliding-window",
                                     "qwen3-qknorm", "gemma3-sliding-full"])
def test_triton_kernels_match_hf(hf_reference, variant):
    pytest.importorskip("triton", reason="triton is not installed")  # it is, in CI
    path, prompts, expected = hf_reference(variant)
    ours, llm = _ours(path, prompts, num_kv_blocks=64, attention_backend="triton")
    assert llm.engine.runner.ops.name == "triton"
    assert ours == expected


def test_triton_kernels_match_hf_under_chunked_prefill_and_preemption(hf_reference):
    pytest.importorskip("triton", reason="triton is not installed")
    path, prompts, expected = hf_reference("llama-gqa")
    ours, _ = _ours(path, prompts, num_kv_blocks=64, max_num_batched_tokens=9, attention_backend="triton")
    assert ours == expected
    ours, llm = _ours(path, prompts, num_kv_blocks=8, max_model_len=128, attention_backend="triton")
    assert ours == expected and llm.stats().num_preemptions_total > 0
