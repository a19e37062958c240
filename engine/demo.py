"""`python -m engine.demo`: chat with the default model through the offline engine, batched."""
from __future__ import annotations

import argparse
import time

from engine import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="default")
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    llm = LLM(model=args.model)
    questions = ["What is the capital of France?", "Name three primary colors.",
                 "Write a haiku about autumn.", "What is 12 times 12?"]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    start = time.perf_counter()
    outs = llm.chat([[{"role": "user", "content": q}] for q in questions], params)
    elapsed = time.perf_counter() - start
    for q, o in zip(questions, outs):
        print(f"\n>>> {q}\n{o.outputs[0].text.strip()}   [{o.outputs[0].finish_reason}]")
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"\n{len(outs)} requests, {n} tokens in {elapsed:.2f}s ({n / elapsed:.1f} tok/s) "
          f"on {llm.engine.runner.device} in {llm.engine.runner.dtype}")


if __name__ == "__main__":
    main()
