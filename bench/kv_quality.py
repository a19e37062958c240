"""What an fp8 KV cache costs in quality on the default model, against the model's own dtype (bf16 here).

For each KV cache dtype: the mean and largest KL divergence (nats) of the next-token distributions over a
fixed text (1,500 tokens of prose, a chat turn, code and this project's README), read token by token from the
cache as decoding reads it; how often the top token agrees; and, over 14 short chat questions answered greedily
(48 tokens), how many answers keep every token of the bf16-KV answer and, where one leaves it, how far apart
bf16's own top two tokens were at that step (a near-tie flips under any change of the arithmetic).
`fp8_e4m3 (keys not rotated)` turns off the keys' rotation (kernels.kv_cache.kv_rotation) to show what it buys.

    python bench/kv_quality.py
"""
from __future__ import annotations

import argparse
import pathlib
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from engine import LLM, SamplingParams  # noqa: E402
from test_kv_memory import QUESTIONS, TEXT  # noqa: E402

MORE_QUESTIONS = [
    "What is 12 times 7?", "Write a haiku about the sea.", "Who wrote Romeo and Juliet?",
    "Explain photosynthesis in one sentence.", "Give me a tip for learning Python.",
    "What is the boiling point of water?", "List three fruits that are red.", "How many days are in a leap year?",
    "Translate 'good morning' into Spanish.", "What does a CPU do?", "Suggest a name for a pet cat.",
    "Why is the sky blue?"]


def build(kv: str, rotate: bool, memory: int) -> LLM:
    llm = LLM(kv_cache_dtype=kv, kv_cache_bytes=memory, max_model_len=2048, show_progress=False)
    if not rotate:
        runner = llm.engine.runner
        for layer in runner.attention_layers():
            layer.kv_rotation = None
        runner.calibrate_kv_scales(llm.engine._calibration_ids)  # the scales of unrotated keys
    return llm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=1500, help="length of the fixed text")
    ap.add_argument("--max-tokens", type=int, default=48, help="tokens per greedy answer")
    args = ap.parse_args()
    memory = 128 << 20
    questions = QUESTIONS + MORE_QUESTIONS
    messages = [[{"role": "user", "content": q}] for q in questions]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, logprobs=2)

    ref = LLM(kv_cache_bytes=memory, max_model_len=2048, show_progress=False)
    text = TEXT + (ROOT / "README.md").read_text()[3000:12000]
    ids = ref.get_tokenizer().encode(text)[: args.tokens]
    base = torch.log_softmax(ref.engine.runner.prompt_logits(ids, chunk=1), -1)
    want = [o.outputs[0] for o in ref.chat(messages, params)]
    print(f"default model, weights in {ref.engine.runner.dtype}; fixed text {len(ids)} tokens; "
          f"{len(questions)} questions, {args.max_tokens} greedy tokens each")
    print(f"{'KV cache':<30} {'mean KL':>8} {'max KL':>7} {'top-1':>6} {'answers kept':>13}  "
          f"bf16's top-two gap where an answer left it (nats)")
    for kv, rotate in (("fp8_e4m3", True), ("fp8_e4m3", False), ("fp8_e5m2", True)):
        llm = build(kv, rotate, memory)
        logp = torch.log_softmax(llm.engine.runner.prompt_logits(ids, chunk=1), -1)
        kl = (base.exp() * (base - logp)).sum(-1)
        top1 = float((base.argmax(-1) == logp.argmax(-1)).float().mean())
        got = [o.outputs[0] for o in llm.chat(messages, params)]
        gaps = []
        for w, g in zip(want, got):
            i = next((i for i, (a, b) in enumerate(zip(w.token_ids, g.token_ids)) if a != b), None)
            if i is not None:
                top = sorted(w.logprobs[i].values(), key=lambda lp: -lp.logprob)
                gaps.append(top[0].logprob - top[1].logprob)
        name = kv + ("" if rotate else " (keys not rotated)")
        print(f"{name:<30} {kl.mean():8.4f} {kl.max():7.3f} {top1:6.3f} {len(questions) - len(gaps):>6}/"
              f"{len(questions):<6}  {' '.join(f'{g:.2f}' for g in sorted(gaps))}", flush=True)
        del llm


if __name__ == "__main__":
    main()
