"""RL rollout serving: logprobs a trainer can use, weight updates without restart, policy versions."""
from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.sampling_params import RequestOutputKind


def _hf_token_logprobs(model, prompt: list[int], tokens: list[int], temperature: float) -> list[float]:
    """The trainer's view: HF's forward over prompt + tokens, log-softmax of logits / temperature at each
    sampled token."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
    lp = torch.log_softmax(logits / temperature, dim=-1)
    return lp.gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logprobs_match_hf_log_softmax(make_tiny_model, temperature):
    """64 rollouts sampled in mixed batches (prompts of many lengths, chunked prefill, n = 4 per prompt): the
    logprob reported for each sampled token is HF's log-softmax of logits / temperature within 1e-4 (fp32)."""
    path = make_tiny_model("llama")
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 49152) for _ in range(rng.randrange(3, 40))] for _ in range(16)]
    llm = LLM(path, dtype="float32", num_kv_blocks=128, max_num_batched_tokens=48, show_progress=False)
    params = SamplingParams(temperature=temperature, max_tokens=12, n=4, seed=11, ignore_eos=True, logprobs=0)
    outs = llm.generate(prompts, params)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    worst, count = 0.0, 0
    for prompt, out in zip(prompts, outs):
        for c in out.outputs:
            ours = [entry[t].logprob for t, entry in zip(c.token_ids, c.logprobs)]
            want = _hf_token_logprobs(hf, prompt, c.token_ids, temperature)
            worst = max(worst, max(abs(a - b) for a, b in zip(ours, want)))
            count += 1
    assert count == 64
    assert worst < 1e-4, worst


# ---- weight updates without restart ----
def _weights(path: str) -> dict[str, torch.Tensor]:
    from engine.loader import iter_weights

    return dict(iter_weights(path, show_progress=False))


def _hf_greedy(path, prompts, n):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench.models import hf_greedy

    return hf_greedy(path, prompts, n)


@pytest.fixture(scope="module")
def two_policies(make_tiny_model):
    """Two checkpoints of one shape with different weights: the policy before and after a training step."""
    return make_tiny_model("llama"), make_tiny_model("llama", initializer_range=0.3)


def test_update_weights_serves_the_new_policy_with_no_stale_prefix_kv(two_policies):
    old, new = two_policies
    prompt = list(range(100, 140))  # 2 full blocks: cached after the first request
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want_old, want_new = _hf_greedy(old, [prompt], 8)[0], _hf_greedy(new, [prompt], 8)[0]
    assert want_old != want_new
    llm = LLM(old, dtype="float32", num_kv_blocks=32, show_progress=False)
    out = llm.generate([prompt], greedy)[0]
    assert out.outputs[0].token_ids == want_old and out.model_versions == [0]
    engine = llm.engine
    assert engine.update_weights(_weights(new), version=7) > 0
    out = llm.generate([prompt], greedy)[0]
    assert out.outputs[0].token_ids == want_new and out.model_versions == [7]
    assert out.num_cached_tokens == 0  # the old weights' prefix KV was forgotten, not reused
    # from a safetensors folder, back to the old policy; then a partial update of one tensor
    engine.update_weights(old, version=8)
    assert llm.generate([prompt], greedy)[0].outputs[0].token_ids == want_old
    engine.update_weights({"lm_head.weight": -_weights(old)["lm_head.weight"]}, version=9, partial=True)
    assert llm.generate([prompt], greedy)[0].outputs[0].token_ids != want_old


@pytest.mark.parametrize("bad,names", [
    ({"model.layers.0.mlp.nope.weight": torch.zeros(3)}, "model.layers.0.mlp.nope.weight"),
    ({"model.layers.1.self_attn.k_proj.weight": torch.zeros(5, 64)}, "model.layers.1.self_attn.k_proj.weight"),
    ({"model.norm.weight": torch.zeros(64, dtype=torch.int32)}, "model.norm.weight"),
    ("drop:model.layers.1.mlp.down_proj.weight", "model.layers.1.mlp.down_proj.weight"),
])
def test_a_bad_payload_names_the_parameter_and_changes_nothing(two_policies, bad, names):
    old, new = two_policies
    llm = LLM(old, dtype="float32", num_kv_blocks=32, show_progress=False)
    prompt = list(range(100, 120))
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    before = llm.generate([prompt], greedy)[0].outputs[0].token_ids
    payload = _weights(new)
    if isinstance(bad, str):  # a full update with one tensor missing
        del payload[bad.split(":", 1)[1]]
    else:
        payload.update(bad)
    with pytest.raises(ValueError, match=names.replace(".", r"\.").replace("down_proj", "(down_proj)")):
        llm.engine.update_weights(payload, version=1)
    after = llm.generate([prompt], greedy)[0]
    assert after.outputs[0].token_ids == before and after.model_versions == [0]


def _hf_argmax(path, prompt, tokens):
    """Teacher-forced: HF's greedy choice after prompt + tokens[:i], for every i."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    return logits.argmax(-1).tolist()


def _stream_all(llm, prompts, params):
    """Start one stream per prompt on AsyncLLM; returns (task gathering [(outputs, versions)], loop)."""
    import asyncio

    async def one(i, p):
        texts, reason, versions = [], None, []
        async for out in llm.generate(p, params, f"s{i}"):
            texts.extend(out.outputs[0].token_ids)
            reason = out.outputs[0].finish_reason or reason
            versions = out.model_versions
        return texts, reason, versions

    return [one(i, p) for i, p in enumerate(prompts)]


@pytest.mark.parametrize("mode", ["abort", "wait", "keep"])
def test_each_pause_mode_under_concurrent_streams(two_policies, mode):
    """abort: the live streams end with finish_reason abort; wait: they finish on the old weights before the
    update; keep: they go on with the new weights (their KV recomputed), spanning both versions. Greedy tokens
    prove which weights made them; no KV block is left held."""
    import asyncio

    from engine.async_llm import AsyncLLM

    old, new = two_policies
    prompts = [list(range(100 + 7 * i, 130 + 7 * i)) for i in range(4)]
    n = 40
    want_old, want_new = _hf_greedy(old, prompts, n), _hf_greedy(new, prompts, n)
    llm = AsyncLLM(model=old, dtype="float32", num_kv_blocks=64, show_progress=False)
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, output_kind=RequestOutputKind.DELTA)

    async def run():
        tasks = [asyncio.create_task(c) for c in _stream_all(llm, prompts, params)]
        while llm.stats().num_generation_tokens_total < 4 * 5:  # every stream is a few tokens in
            await asyncio.sleep(0.005)
        await asyncio.wrap_future(llm.update_weights(_weights(new), version=1, pause=mode))
        after = await asyncio.gather(*tasks)
        # a request sent after the update runs on the new weights
        fresh = [o async for o in llm.generate(prompts[0], params, "fresh")]
        return after, sum((o.outputs[0].token_ids for o in fresh), [])

    try:
        results, fresh = asyncio.run(run())
        assert fresh == want_new[0]
        for (tokens, reason, versions), old_out, new_out in zip(results, want_old, want_new):
            if mode == "abort":
                assert reason == "abort" and 0 < len(tokens) < n and tokens == old_out[: len(tokens)]
                assert versions == [0]
            elif mode == "wait":
                assert reason == "length" and tokens == old_out and versions == [0]
            else:
                assert reason == "length" and len(tokens) == n and versions == [0, 1]
                prompt = prompts[[r[0] for r in results].index(tokens)]
                by_old, by_new = _hf_argmax(old, prompt, tokens), _hf_argmax(new, prompt, tokens)
                # some split j: the old weights made tokens[:j], the new ones (over recomputed KV) the rest
                assert any(tokens[:j] == by_old[:j] and tokens[j:] == by_new[j:] for j in range(1, n)), tokens
        stats = llm.stats()
        assert stats.num_free_blocks == stats.num_total_blocks
    finally:
        llm.shutdown()


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_frees_the_kv_pool_refuses_requests_and_wakes_up_the_same(two_policies, level):
    import asyncio

    from engine.async_llm import AsyncLLM, EnginePaused

    old, _ = two_policies
    llm = AsyncLLM(model=old, dtype="float32", kv_cache_bytes=256 << 20, show_progress=False)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = list(range(100, 130))

    async def greedy(rid):
        return [o async for o in llm.generate(prompt, params, rid)][-1].outputs[0].token_ids

    try:
        before = asyncio.run(greedy("a"))
        pool = llm._engine.runner.kv_cache.numel() * llm._engine.runner.kv_cache.element_size()
        awake = _rss_bytes()
        llm.sleep(level).result(timeout=30)
        asleep = _rss_bytes()
        assert awake - asleep >= 0.9 * pool, (awake, asleep, pool)
        with pytest.raises(EnginePaused, match="asleep"):
            asyncio.run(greedy("b"))
        llm.wake_up().result(timeout=60)  # level 2: the weights come back from the checkpoint
        assert asyncio.run(greedy("c")) == before
        assert llm.stats().num_free_blocks == llm.stats().num_total_blocks
    finally:
        llm.shutdown()
