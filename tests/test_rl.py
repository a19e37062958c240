"""RL rollout serving: logprobs a trainer can use, weight updates without restart, policy versions."""
from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams


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
