"""What batch-invariant mode (EngineConfig.batch_invariant) costs, and that it holds on the default model.

    python bench/batch_invariant.py [--dtype auto|float32|bfloat16] [--requests 32] [--rounds 2]

One process, two engines on the same weights (default mode and batch_invariant=True), timed alternately so
the machine's bandwidth drift hits both alike; each figure the best of `rounds`:
- offline throughput: `requests` prompts of 32-256 random token ids, 64 generated each (ignore_eos);
- batch-1 decode: one 16-token prompt, 128 generated.
Then the check the mode exists for: one greedy request with logprobs run alone and among the others (its
prompt chunked by a 64-token budget, 32 of its tokens from the prefix cache), in both modes; it prints whether
tokens and logprobs came out bit-identical and the largest logprob difference.
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()

    import torch

    from bench.serve import machine_ceilings
    from engine import LLM, SamplingParams
    from engine.llm_engine import LLMEngine

    torch.set_num_threads(2)
    print(machine_ceilings())
    engines = {mode: LLM(dtype=args.dtype, kv_cache_bytes=256 << 20, show_progress=False,
                         batch_invariant=mode == "batch_invariant") for mode in ("default", "batch_invariant")}
    print(f"model: default, dtype {engines['default'].engine.runner.dtype}, 2 threads")
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randint(32, 256))] for _ in range(args.requests)]
    many = SamplingParams(max_tokens=64, ignore_eos=True)
    one = SamplingParams(max_tokens=128, ignore_eos=True)
    for llm in engines.values():  # warm-up
        llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True))

    best = {(m, k): float("inf") for m in engines for k in ("offline", "decode")}
    for _ in range(args.rounds):
        for mode, llm in engines.items():
            best[mode, "offline"] = min(best[mode, "offline"], _timed(llm, prompts, many))
            best[mode, "decode"] = min(best[mode, "decode"], _timed(llm, [prompts[0][:16]], one))
    rows = [("offline, output tok/s", "offline", args.requests * 64), ("batch-1 decode, tok/s", "decode", 128)]
    print(f"\n| | default | batch_invariant | batch_invariant / default |\n|---|---:|---:|---:|")
    for label, key, tokens in rows:
        d, b = tokens / best["default", key], tokens / best["batch_invariant", key]
        print(f"| {label} | {d:.1f} | {b:.1f} | {b / d:.2f}x |")

    # the property itself, on the real model: alone vs among the others
    target = prompts[1][:32] + [rng.randrange(100, 40000) for _ in range(40)]
    print()
    for mode in engines:
        cfg = dict(dtype=args.dtype, kv_cache_bytes=256 << 20, show_progress=False,
                   batch_invariant=mode == "batch_invariant")
        alone = _final(LLMEngine(_config(enable_prefix_caching=False, **cfg)), [("t", target)])["t"]
        batch = [(f"o{i}", p) for i, p in enumerate(prompts)] + [("t", target)]
        among = _final(LLMEngine(_config(max_num_batched_tokens=64, **cfg)), batch)["t"]
        same = alone[0] == among[0] and alone[1] == among[1]
        diff = max((abs(a - b) for a, b in zip(alone[1], among[1])), default=0.0)
        print(f"{mode}: alone vs among {len(prompts)} others (chunked, {among[2]} prefix tokens cached): "
              f"{'bit-identical' if same else 'DIFFERENT'} tokens and logprobs "
              f"(tokens equal: {alone[0] == among[0]}, max |logprob diff| {diff:.3g})")


def _config(**kw):
    from engine.config import EngineConfig

    return EngineConfig(**kw)


def _final(engine, requests) -> dict:
    """Greedy, 32 tokens, logprobs: per request id (tokens, sampled-token logprobs, cached prompt tokens)."""
    from engine import SamplingParams
    from engine.sampling_params import RequestOutputKind

    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=0,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    for rid, prompt in requests:
        engine.add_request(rid, prompt, params)
    out = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                c = o.outputs[0]
                out[o.request_id] = (c.token_ids, [d[t].logprob for t, d in zip(c.token_ids, c.logprobs)],
                                     o.num_cached_tokens)
    return out


def _timed(llm, prompts, params) -> float:
    t = time.perf_counter()
    llm.generate(prompts, params)
    return time.perf_counter() - t


if __name__ == "__main__":
    main()
