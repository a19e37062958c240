"""KV capacity at the same memory: how many long sequences a replica runs at once, by KV dtype and window freeing.

Each row runs the real engine (scheduler, block manager, prefix cache, KV pool sized from `--kv-mib`) on a
long-context workload: `--requests` requests of `--prompt` + `--output` tokens (random ids, ignore_eos), all
sent at once. The model's forward is replaced by a fixed token (EngineConfig.fake_step_s = 0), since what is
measured is memory, not speed: the peak of sequences running together, the blocks the pool has, and steps.

    python bench/kv_capacity.py            # default model bf16 vs fp8; a model with 4k and 1k windows against
                                          # none; Gemma 3 270M bf16 vs fp8, each with and without freeing the
                                          # blocks behind its window (when its packages are installed)

Rows with a window use a random Mistral-shaped model (the default model's layer shapes, sliding_window
from `--windows`) against the same model without the window.
"""
from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def run(model: str, kv_cache_dtype: str, kv_mib: int, requests: int, prompt: int, output: int,
        free_windows: bool = True) -> dict:
    from engine import SamplingParams
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=model, kv_cache_dtype=kv_cache_dtype, kv_cache_bytes=kv_mib << 20,
                                    max_model_len=prompt + output, fake_step_s=0.0, max_num_seqs=256,
                                    free_out_of_window_blocks=free_windows, show_progress=False))
    rng = random.Random(0)
    params = SamplingParams(max_tokens=output, ignore_eos=True)
    for i in range(requests):
        engine.add_request(f"r{i}", [rng.randrange(100, 30000) for _ in range(prompt)], params)
    peak, steps = 0, 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        peak = max(peak, engine.scheduler.num_running)
    runner = engine.runner
    groups = runner.kv_groups
    return {"blocks": runner.num_kv_blocks, "block_bytes": runner.bytes_per_block, "groups": groups.num_groups,
            "bytes_per_token": runner.bytes_per_block * groups.num_groups // runner.block_size,
            "peak_running": peak, "steps": steps}


def mistral_like(folder: Path, window: int | None) -> str:
    """The default model's shapes as a random Mistral with (or without) a sliding window on every layer."""
    import json

    from transformers import MistralConfig

    from bench.models import random_model
    from engine.default_model import default_model_dir

    base = json.loads((Path(default_model_dir()) / "config.json").read_text())
    cfg = MistralConfig(vocab_size=base["vocab_size"], hidden_size=base["hidden_size"],
                        intermediate_size=base["intermediate_size"], num_hidden_layers=base["num_hidden_layers"],
                        num_attention_heads=base["num_attention_heads"], num_key_value_heads=base["num_key_value_heads"],
                        max_position_embeddings=32768, sliding_window=window, tie_word_embeddings=True)
    return random_model(folder / f"mistral-window-{window}", cfg, dtype="bfloat16")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kv-mib", type=int, default=512, help="KV pool memory per replica, MiB")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=6144)
    ap.add_argument("--output", type=int, default=1024)
    ap.add_argument("--windows", type=int, nargs="+", default=[4096, 1024])
    args = ap.parse_args()
    rows = []
    work = dict(kv_mib=args.kv_mib, requests=args.requests, prompt=args.prompt, output=args.output)
    for kv in ("auto", "fp8_e4m3"):
        rows.append(("default (SmolLM2-135M), all layers full", kv, run("default", kv, **work)))
    with tempfile.TemporaryDirectory() as tmp:
        for window in (None, *args.windows):
            label = f"Mistral-shaped, window {window} on every layer" if window else "Mistral-shaped, no window"
            rows.append((label, "auto", run(mistral_like(Path(tmp), window), "auto", **work)))
    try:
        from engine.default_model import gemma3_gguf_path

        gemma3_gguf_path()
    except FileNotFoundError as e:
        print(f"(Gemma 3 270M rows skipped: {e})")
    else:
        for kv in ("auto", "fp8_e4m3"):
            for free in (False, True):
                label = ("Gemma 3 270M (15 of 18 layers on a 512 window), "
                         + ("blocks behind the window freed (6 KV groups)" if free else "every block kept"))
                rows.append((label, kv, run("gemma-3-270m", kv, **work, free_windows=free)))
    print(f"\n{args.requests} requests of {args.prompt} + {args.output} tokens at once, KV pool {args.kv_mib} MiB "
          "per replica\n")
    print("| model | KV dtype | KV bytes/token, all layers | blocks (bytes each) | peak sequences running | steps |")
    print("|---|---|---:|---:|---:|---:|")
    for label, kv, r in rows:
        print(f"| {label} | {kv} | {r['bytes_per_token']} | {r['blocks']} ({r['block_bytes']}) | {r['peak_running']} "
              f"| {r['steps']} |")


if __name__ == "__main__":
    main()
