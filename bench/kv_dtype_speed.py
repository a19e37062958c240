"""Offline throughput of the default model with bf16 and fp8 KV, back to back in one process each.

    for kv in auto fp8_e4m3 auto fp8_e4m3; do python bench/kv_dtype_speed.py $kv; done

32 requests of 32-256 random prompt tokens, 64 generated each (ignore_eos), 256 MiB of KV, 2 threads; the
best of two timed runs after a warm-up.
"""
from __future__ import annotations

import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(kv: str) -> None:
    import torch

    from engine import LLM, SamplingParams

    torch.set_num_threads(2)
    llm = LLM(kv_cache_bytes=256 << 20, kv_cache_dtype=kv, show_progress=False)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randint(32, 256))] for _ in range(32)]
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    llm.generate(prompts[:2], params)
    best = min(_timed(llm, prompts, params) for _ in range(2))
    print(f"{kv}: {32 * 64 / best:.1f} tok/s")


def _timed(llm, prompts, params) -> float:
    t = time.perf_counter()
    llm.generate(prompts, params)
    return time.perf_counter() - t


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "auto")
