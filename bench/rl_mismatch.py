"""Training-inference mismatch: rollouts from kvscale's engine, replayed through HF transformers' forward (what
a trainer computes its logprobs with), per dtype.

For each engine dtype, the engine samples `--rollouts` completions at temperature 1 (mixed batches: prompts of
different lengths, n = 4 per prompt, chunked prefill) with the logprob of every sampled token. HF's forward
over prompt + completion in the same dtype gives the trainer's logprob of each of those tokens. Reported: the
max and mean |engine - HF| over all sampled tokens, and the mean of exp(engine - HF) - 1 (how far an
importance ratio of 1 drifts). fp32 is the exact case (the test suite holds it to 1e-4); bf16 shows what
rounding in different kernels costs.

    python bench/rl_mismatch.py [--model default] [--rollouts 64] [--max-tokens 32]
"""
from __future__ import annotations

import argparse
import math
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def measure(model: str, dtype: str, rollouts: int, max_tokens: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from engine import LLM, SamplingParams
    from engine.loader import resolve_model_path

    rng = random.Random(0)
    llm = LLM(model, dtype=dtype, max_num_batched_tokens=256, show_progress=False)
    vocab = llm.engine.runner.vocab_size
    prompts = [[rng.randrange(100, vocab) for _ in range(rng.randrange(8, 96))] for _ in range(rollouts // 4)]
    params = SamplingParams(temperature=1.0, max_tokens=max_tokens, n=4, seed=1, ignore_eos=True, logprobs=0)
    outs = llm.generate(prompts, params)
    del llm
    hf = AutoModelForCausalLM.from_pretrained(resolve_model_path(model), dtype=getattr(torch, dtype)).eval()
    diffs = []
    with torch.no_grad():
        for prompt, out in zip(prompts, outs):
            for c in out.outputs:
                logits = hf(torch.tensor([prompt + c.token_ids])).logits[0, len(prompt) - 1 : -1].float()
                want = torch.log_softmax(logits, -1).gather(1, torch.tensor(c.token_ids)[:, None])[:, 0].tolist()
                ours = [entry[t].logprob for t, entry in zip(c.token_ids, c.logprobs)]
                diffs += [a - b for a, b in zip(ours, want)]
    return {"dtype": dtype, "tokens": len(diffs), "max_abs": max(abs(d) for d in diffs),
            "mean_abs": sum(abs(d) for d in diffs) / len(diffs),
            "mean_ratio_drift": sum(math.exp(d) - 1 for d in diffs) / len(diffs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--rollouts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    args = ap.parse_args()
    rows = [measure(args.model, d, args.rollouts, args.max_tokens) for d in args.dtypes]
    print(f"\n{args.rollouts} rollouts of {args.max_tokens} tokens at temperature 1, model {args.model}: engine "
          "logprobs vs HF transformers' forward in the same dtype\n")
    print("| dtype | sampled tokens | max abs diff | mean abs diff | mean exp(diff) - 1 |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['dtype']} | {r['tokens']} | {r['max_abs']:.2e} | {r['mean_abs']:.2e} | {r['mean_ratio_drift']:+.2e} |")


if __name__ == "__main__":
    main()
