"""Hybrid models (Qwen3.5: Gated DeltaNet linear attention beside gated full attention): greedy fp32 token for
token equal to HF transformers on tiny random configs of several layer patterns, head counts and conv kernels,
whole prompts and chunked prefill, preemption forced by a small pool, n > 1; every block and state slot free at
the end. And the engine's own accounting on the seed's Qwen3.6-27B-like config."""
from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.models import hf_greedy  # noqa: E402

MAX_NEW = 12
L, F = "linear_attention", "full_attention"
VARIANTS = {
    # the default tiny hybrid: 3 linear layers around one full (conftest), GQA 4/2, value heads 2x key heads
    "lin-lin-full-lin": {},
    # full layers first and last, one key head for two value heads, a 2-tap conv, MQA
    "full-lin-lin-full": dict(layer_types=[F, L, L, F], linear_num_key_heads=1, linear_num_value_heads=2,
                              linear_conv_kernel_dim=2, num_key_value_heads=1),
    # as many key as value heads, wider heads, a 3-tap conv, whole-head rotary
    "lin-full": dict(num_hidden_layers=2, layer_types=[L, F], linear_num_key_heads=2, linear_num_value_heads=2,
                     linear_key_head_dim=16, linear_value_head_dim=12, linear_conv_kernel_dim=3,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0}),
}


def _prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 40000) for _ in range(n)] for n in (1, 5, 17, 40, 33)]


@pytest.fixture(scope="module")
def hybrid(make_tiny_model):
    cache = {}

    def get(variant: str):
        if variant not in cache:
            path = make_tiny_model("qwen3_5", **VARIANTS[variant])
            cache[variant] = (path, hf_greedy(path, _prompts(), MAX_NEW))
        return cache[variant]

    return get


def _ours(path: str, n: int = 1, **kw):
    llm = LLM(model=path, dtype="float32", device="cpu", show_progress=False, **({"num_kv_blocks": 64} | kw))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, n=n)
    outs = llm.generate(_prompts(), params)
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_total_blocks
    assert sorted(bm.free_state_slots) == list(range(bm.num_state_slots)) and bm.num_state_slots > 0
    bm.check_invariants([])
    return outs, llm


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_hybrid_matches_hf_whole_and_chunked(hybrid, variant):
    path, want = hybrid(variant)
    outs, llm = _ours(path)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert not llm.engine.block_manager.enable_prefix_caching  # off for hybrids, with a log line
    outs, _ = _ours(path, max_num_batched_tokens=7)  # prompts cut into chunks: the state carries over
    assert [o.outputs[0].token_ids for o in outs] == want


def test_hybrid_matches_hf_under_preemption_and_with_n_samples(hybrid):
    path, want = hybrid("lin-lin-full-lin")
    outs, llm = _ours(path, num_kv_blocks=6, max_model_len=64)  # 6 blocks of 16 for 5 sequences: preemptions
    assert [o.outputs[0].token_ids for o in outs] == want
    assert llm.stats().num_preemptions_total > 0
    outs, _ = _ours(path, n=3, max_num_batched_tokens=16)  # every sample computes its prompt's state itself
    for o, w in zip(outs, want):
        assert [c.token_ids for c in o.outputs] == [w] * 3


def test_hybrid_on_the_triton_attention_path(hybrid):
    pytest.importorskip("triton", reason="triton is not installed")  # it is, in CI
    path, want = hybrid("full-lin-lin-full")
    outs, llm = _ours(path, attention_backend="triton", max_num_batched_tokens=9)
    assert llm.engine.runner.ops.name == "triton"
    assert [o.outputs[0].token_ids for o in outs] == want


def _seed_like_config():
    """The seed's example: Qwen3.6-27B-like, 64 layers of which 16 full attention (4 KV heads, head dim 256)."""
    import transformers

    return transformers.Qwen3_5TextConfig(
        num_hidden_layers=64, num_attention_heads=24, num_key_value_heads=4, head_dim=256, hidden_size=5120,
        intermediate_size=17408, vocab_size=248320, layer_types=([L] * 3 + [F]) * 16, linear_num_value_heads=48,
        linear_num_key_heads=16, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
        architectures=["Qwen3_5ForCausalLM"])


def test_engine_accounting_on_the_seeds_example():
    """The engine's own numbers (model built on the meta device, the runner's formulas) against the seed's
    M = 2 L H_kv d T b with L = 16, and the state against engine.capacity's count."""
    from engine.capacity import _linear_state_bytes
    from engine.kv_groups import KVGroups
    from engine.models import get_model_class
    from kernels import select_ops

    cfg = _seed_like_config()
    with torch.device("meta"):
        model = get_model_class("Qwen3_5ForCausalLM")(cfg, select_ops("reference", "cpu"), 4096)
    groups = KVGroups.from_layer_windows(model.spec.sliding_windows)  # as ModelRunner forms them
    bf16 = 2
    kv_per_token = groups.bytes_per_token(model.spec.num_kv_heads, model.spec.head_dim, bf16)
    assert kv_per_token == 2 * 16 * 4 * 256 * 2 == 64 * 1024
    assert groups.block_bytes(16, model.spec.num_kv_heads, model.spec.head_dim, bf16) == 16 * 64 * 1024
    assert groups.num_groups == 1 and groups.group_size == 16  # the 48 linear layers keep no KV
    state = model.state_bytes_per_seq()
    assert state == 48 * _linear_state_bytes(cfg.to_dict())
    assert state == 48 * 4 * (48 * 128 * 128 + 3 * (2 * 16 * 128 + 48 * 128))


def test_hybrid_pool_sizing_counts_the_state(hybrid):
    """The KV pool is what the budget leaves after one state slot per sequence the engine may run."""
    path, _ = hybrid("lin-lin-full-lin")
    budget = 4 << 20
    llm = LLM(model=path, dtype="float32", device="cpu", show_progress=False, kv_cache_bytes=budget, max_num_seqs=8)
    runner = llm.engine.runner
    assert runner.num_state_slots == 8 and runner.state_bytes_per_seq > 0
    assert runner.num_kv_blocks == (budget - 8 * runner.state_bytes_per_seq) // runner.bytes_per_block
    # a running sequence holds a slot; demand counts its blocks plus its state, in blocks of the same bytes
    bm = llm.engine.block_manager
    assert bm.state_blocks_per_seq == -(-runner.state_bytes_per_seq // runner.bytes_per_block)
    llm.engine.add_request("a", list(range(100, 140)), SamplingParams(max_tokens=8, ignore_eos=True))
    llm.engine.step()
    stats = llm.stats()
    assert stats.num_state_slots == 8 and stats.num_free_state_slots == 7
    assert stats.kv_demand_blocks == -(-48 // 16) + bm.state_blocks_per_seq
    assert stats.kv_capacity_blocks == runner.num_kv_blocks + 8 * bm.state_blocks_per_seq
    llm.engine.abort_request("a")
    assert llm.stats().num_free_state_slots == 8


@pytest.fixture(scope="module")
def vision_language_checkpoint(tmp_path_factory, default_model_path):
    """A tiny random Qwen3_5ForConditionalGeneration (how Qwen3.5 / 3.6 ship: a vision tower beside the
    hybrid language model), saved with the default model's tokenizer."""
    import shutil

    import transformers
    from conftest import TOKENIZER_FILES, _hf_config

    cfg = transformers.Qwen3_5Config(
        text_config=_hf_config("qwen3_5").to_dict(),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           patch_size=4, num_position_embeddings=16))
    torch.manual_seed(0)
    model = transformers.Qwen3_5ForConditionalGeneration(cfg).float()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and "visual" not in name:
                param.normal_(0.0, 0.3)
    out = tmp_path_factory.mktemp("tiny-qwen3_5-vl")
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (Path(default_model_path) / name).exists():
            shutil.copy(Path(default_model_path) / name, out / name)
    return str(out), model.eval()


def test_the_language_model_of_a_vision_language_checkpoint(vision_language_checkpoint, caplog):
    """Qwen3_5ForConditionalGeneration: the text_config drives the engine, model.language_model.* loads as the
    language model, the vision tower is skipped with a log line; greedy text equals HF's own model's."""
    import logging

    from transformers import GenerationConfig

    path, hf = vision_language_checkpoint
    gen = GenerationConfig(max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
    want = []
    with torch.no_grad():
        for p in _prompts():
            ids = torch.tensor([p])
            want.append(hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                    generation_config=gen)[0, len(p):].tolist())
    with caplog.at_level(logging.INFO):
        outs, llm = _ours(path, max_num_batched_tokens=9)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert type(llm.engine.runner.model).__name__ == "Qwen3_5ForConditionalGeneration"
    assert "vision tower (model.visual.*) is not loaded" in caplog.text


@pytest.mark.parametrize("n,k_heads,v_heads,dk,dv", [(1, 2, 4, 8, 8), (5, 2, 4, 8, 8), (64, 1, 2, 16, 12),
                                                    (130, 2, 2, 8, 8), (200, 4, 8, 16, 16)])
def test_chunked_delta_rule_equals_the_recurrence(n, k_heads, v_heads, dk, dv):
    """The prefill form (64-token chunks, triangular solve) against the token-by-token recurrence, from a
    non-zero state, across chunk boundaries and value-head groups: outputs and final state."""
    from engine.models.qwen3_5 import gated_delta_rule, gated_delta_rule_chunked

    g0 = torch.Generator().manual_seed(n)
    q, k = torch.randn(n, k_heads, dk, generator=g0), torch.randn(n, k_heads, dk, generator=g0)
    v = torch.randn(n, v_heads, dv, generator=g0)
    g, beta = -2 * torch.rand(n, v_heads, generator=g0), torch.rand(n, v_heads, generator=g0)
    state = 0.5 * torch.randn(v_heads, dk, dv, generator=g0)
    want_out, want_state = gated_delta_rule(q, k, v, g, beta, state.clone())
    got_out, got_state = gated_delta_rule_chunked(q, k, v, g, beta, state.clone())
    torch.testing.assert_close(got_out, want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_state, want_state, atol=1e-5, rtol=1e-5)


def test_hybrid_fp8_kv_calibrates_its_attention_layers(hybrid):
    """fp8 KV on a hybrid: the full-attention layers set their K/V scales from the calibration text at start-up
    (they share Attention's write path; a copy of it had left them at 1.0, clipping K/V at fp8's range)."""
    path, _ = hybrid("lin-lin-full-lin")
    llm = LLM(model=path, dtype="float32", device="cpu", show_progress=False, num_kv_blocks=64,
              kv_cache_dtype="fp8_e4m3")
    layers = llm.engine.runner.attention_layers()
    assert layers and all(layer.k_scale != 1.0 and layer.v_scale != 1.0 for layer in layers)
