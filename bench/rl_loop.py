"""An RL loop on kvscale: a trainer Ray actor improves the default model with policy gradients on a toy
verifiable reward, pushing its weights to a 2-replica kvscale deployment after every step.

Each step: the trainer asks the app for rollouts token-in/token-out (/v1/completions with token-id prompts,
return_token_ids and logprobs, n samples per prompt), scores them (reward: the share of completion tokens that
are numbers, after a prompt that starts a list of numbers), takes one GRPO-style step (advantages normalized
within each prompt's group, REINFORCE on HF transformers' forward), and pushes the new weights to every replica
with serve_app.rl.update_weights (bf16 tensors through Ray's object store). It prints per step the mean reward,
the policy version the rollouts came from, rollout tokens/s, the weight sync (seconds until every replica serves
the new version, and bytes moved per second: bytes pushed x replicas / time), and the mean |logprob| gap
between the engine's rollout logprobs (bf16) and the trainer's (fp32) on the same tokens.

    python bench/rl_loop.py [--steps 8] [--prompts 4] [--group 8] [--max-tokens 24] [--lr 2e-5]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

APP = "kvscale"
PROMPTS = ["Some numbers: 4, 8, 15,", "Count with me: 1, 2, 3,", "Lottery numbers: 12, 31,", "Prices: $5, $9,",
           "Here is a list: 7, 19,", "Digits of pi: 3.14", "Years: 1999, 2004,", "Scores: 88, 92,"]


def reward(text_tokens: list[str]) -> float:
    """The share of completion tokens that are made of digits (a verifiable, dense toy reward)."""
    if not text_tokens:
        return 0.0
    return sum(1 for t in text_tokens if t.strip().strip(",.$").isdigit()) / len(text_tokens)


def trainer_class():
    import ray

    @ray.remote(num_cpus=1)
    class Trainer:
        def __init__(self, model_path: str, base_url: str, lr: float) -> None:
            import torch
            from transformers import AutoModelForCausalLM, AutoTokenizer

            torch.manual_seed(0)
            self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
            self.model.train()
            self.tokenizer = AutoTokenizer.from_pretrained(model_path)
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.0)
            self.base_url, self.model_name = base_url, None

        def step(self, version: int, prompts: list[str], group: int, max_tokens: int) -> dict:
            import httpx
            import torch

            from serve_app import rl

            if self.model_name is None:
                self.model_name = httpx.get(f"{self.base_url}/v1/models", timeout=60).json()["data"][0]["id"]
            ids = [self.tokenizer.encode(p) for p in prompts]
            start = time.monotonic()
            body = httpx.post(f"{self.base_url}/v1/completions", timeout=600, json={
                "model": self.model_name, "prompt": ids, "n": group, "max_tokens": max_tokens, "temperature": 1.0,
                "logprobs": 0, "return_token_ids": True, "seed": version}).json()
            rollout_s = time.monotonic() - start
            choices = body["choices"]
            samples = [(ids[c["index"] // group], c["token_ids"], c["logprobs"]) for c in choices]
            rewards = torch.tensor([reward(lps["tokens"]) for _, _, lps in samples])
            grouped = rewards.view(len(prompts), group)
            adv = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).view(-1)

            self.opt.zero_grad()
            mismatch = []
            for (prompt, completion, lps), a in zip(samples, adv):
                if not completion:
                    continue
                seq = torch.tensor([prompt + completion])
                logits = self.model(seq).logits[0, len(prompt) - 1 : -1].float()
                lp = torch.log_softmax(logits, -1).gather(1, torch.tensor(completion)[:, None])[:, 0]
                (-(a * lp.sum()) / len(samples)).backward()
                mismatch += (lp.detach() - torch.tensor(lps["token_logprobs"])).abs().tolist()
            self.opt.step()

            tied = self.model.config.tie_word_embeddings  # the head is the embedding: push it once
            weights = {k: v.detach().to(torch.bfloat16) for k, v in self.model.state_dict().items()
                       if not (tied and k == "lm_head.weight")}
            sync = rl.update_weights(weights, version=version + 1, app_name=APP)
            generated = sum(len(c) for _, c, _ in samples)
            return {"step": version, "reward": rewards.mean().item(), "served_version": body["model_version"],
                    "rollout_tok_s": generated / rollout_s, "sync_s": sync["seconds"], "bytes": sync["bytes"],
                    "replicas": sync["replicas"], "mismatch": sum(mismatch) / max(1, len(mismatch))}

    return Trainer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--port", type=int, default=8123)
    args = ap.parse_args()

    import ray
    from ray import serve

    from bench.serve import wait_up
    from engine.default_model import default_model_dir
    from serve_app import build_app, rl

    t0 = time.monotonic()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    serve.run(build_app({"model": "default", "num_replicas": 2, "torch_threads": 1, "max_num_seqs": 64}), name=APP,
              route_prefix="/", blocking=False)
    base = f"http://127.0.0.1:{args.port}"
    wait_up(base, timeout=600)
    trainer = trainer_class().remote(default_model_dir(), base, args.lr)
    print(f"app and trainer up in {time.monotonic() - t0:.0f} s; {args.prompts} prompts x {args.group} samples x "
          f"{args.max_tokens} tokens per step\n")
    print("| step | mean reward | rollouts from version | rollout tok/s | weight sync s | sync MB/s (bytes x replicas "
          "/ s) | mean abs logprob diff, engine (bf16) vs trainer (fp32) |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    rewards = []
    for step in range(args.steps):
        r = ray.get(trainer.step.remote(step, PROMPTS[: args.prompts], args.group, args.max_tokens))
        rewards.append(r["reward"])
        mbps = r["bytes"] * r["replicas"] / r["sync_s"] / 1e6
        print(f"| {step} | {r['reward']:.3f} | {r['served_version']} | {r['rollout_tok_s']:.0f} | {r['sync_s']:.2f} | "
              f"{mbps:.0f} ({r['bytes'] / 1e6:.0f} MB x {r['replicas']}) | {r['mismatch']:.3f} |", flush=True)
    print(f"\nreward {rewards[0]:.3f} -> {rewards[-1]:.3f} over {args.steps} steps; "
          f"total {time.monotonic() - t0:.0f} s")
    rl.reset(app_name=APP)
    serve.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
