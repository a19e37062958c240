"""Whole-model throughput on a GPU: our engine against HF transformers on a random-init, Llama-3-8B-shaped bf16
checkpoint, and decode at batch 1 against the device's memory-bandwidth roofline.

    python bench/gpu_model.py --json out.json                          # Llama-3-8B shape, bf16, CUDA
    python bench/gpu_model.py --shape tiny --device cpu --requests 8   # the same code on a 2-layer model: a dry run

scripts/gpu_check.sh runs it (its last stage) when a session is lent a GPU; no test needs it. Every system runs
in its own process, one after another (so each finds the device's memory free), on the same checkpoint and the
same requests: `--requests` prompts of random token ids with seeded random lengths in --prompt-len, each with
its own output length in --output-len, EOS ignored, greedy. Only the tokens each request asked for are counted.
  - ours: engine.LLM.generate on every request at once (paged KV, continuous batching, CUDA graphs for decode);
  - hf-static: HF `generate` in static batches of --hf-batch, left-padded (a batch runs to its longest output);
  - hf-cb: HF's continuous batching (the manager behind `generate_batch`), each request its own max_new_tokens.
Decode at batch 1 (one 32-token prompt, 128 new tokens, its prefill timed apart and taken out) for ours and
HF's `generate`, beside the roofline: the weights' bytes read once per token at the device's copy bandwidth.
The checkpoint (16 GB for the 8B shape) is drawn on the device once and kept in --dir.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.throughput import (DTYPES, _best_time, _hf_model, _sync, batch1_decode, make_workload,  # noqa: E402
                              run_hf_cb, run_hf_static)

LLAMA3 = dict(vocab_size=128256, bos_token_id=128000, eos_token_id=128001, rope_theta=500000.0,
              tie_word_embeddings=False, max_position_embeddings=8192, rms_norm_eps=1e-5)
SHAPES = {
    "llama3-8b": dict(LLAMA3, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8),
    "tiny": dict(LLAMA3, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2),  # the 8B's vocabulary, so a dry run decodes the same ids
}
RESULT = "GPU_MODEL_RESULT "


def checkpoint(shape: str, dtype: str, device: str, root: Path) -> str:
    from transformers import LlamaConfig

    from bench.models import random_model

    return random_model(root / f"kvscale-{shape}-{dtype}", LlamaConfig(**SHAPES[shape]), dtype=dtype,
                        init_device=device)


def run_ours(path: str, dtype: str, device: str, work, runs: int) -> dict:
    from engine import LLM, SamplingParams

    longest = max(len(p) + o for p, o in zip(work.prompts, work.output_lens))
    llm = LLM(model=path, dtype=dtype, device=device, max_num_seqs=256, max_num_batched_tokens=8192,
              max_model_len=max(longest, 512), enable_prefix_caching=False, show_progress=False)
    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for o in work.output_lens]
    llm.generate(work.prompts[:8], params[:8])  # warm-up
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        outs = llm.generate(work.prompts, params)
        times.append(time.perf_counter() - t)
        assert [len(o.outputs[0].token_ids) for o in outs] == work.output_lens, "other lengths than asked for"
    b1 = batch1_decode(lambda p, n: llm.generate([p], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)),
                       work.prompts[0][:32], device)
    runner = llm.engine.runner
    return {"times": times, "decode_b1_s_per_token": b1, "graphs": runner.graphs is not None,
            "weight_bytes": sum(p.numel() * p.element_size() for p in runner.model.parameters()),
            "kv_blocks": llm.stats().num_total_blocks}


def run_hf(path: str, dtype: str, device: str, work, runs: int, batch: int) -> dict:
    """HF `generate` in static batches, then at batch 1, on one load of the model."""
    from transformers import GenerationConfig

    model = _hf_model(path, dtype, device)
    static = run_hf_static(path, dtype, work, runs, batch, device, model=model)

    def generate(prompt: list[int], n: int) -> None:
        ids = torch.tensor([prompt], device=device)
        cfg = GenerationConfig(max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=None)
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=cfg)

    return {**static, "decode_b1_s_per_token": batch1_decode(generate, work.prompts[0][:32], device)}


def run_one(system: str, args) -> dict:
    path = checkpoint(args.shape, args.dtype, args.device, Path(args.dir))
    work = make_workload(args.requests, SHAPES[args.shape]["vocab_size"], args.seed, tuple(args.prompt_len),
                         tuple(args.output_len))
    if system == "ours":
        return run_ours(path, args.dtype, args.device, work, args.runs)
    if system == "hf-static":
        return run_hf(path, args.dtype, args.device, work, args.hf_runs, args.hf_batch)
    if system == "hf-cb":
        return run_hf_cb(path, args.dtype, work, args.hf_runs, args.device)
    raise SystemExit(f"unknown system {system!r}; choose from ours, hf-static, hf-cb")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=(128, 1024), metavar=("MIN", "MAX"))
    ap.add_argument("--output-len", type=int, nargs=2, default=(64, 256), metavar=("MIN", "MAX"))
    ap.add_argument("--runs", type=int, default=2, help="timed runs of ours (median reported)")
    ap.add_argument("--hf-runs", type=int, default=1)
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--systems", default="ours,hf-static,hf-cb")
    ap.add_argument("--timeout", type=float, default=300, help="seconds each system may take")
    ap.add_argument("--dir", default=os.environ.get("TMPDIR", tempfile.gettempdir()), help="where the checkpoint goes")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="also write the figures here")
    ap.add_argument("--only", help=argparse.SUPPRESS)  # one system, in this process (what main runs per system)
    args = ap.parse_args()
    if args.only:
        print(RESULT + json.dumps(run_one(args.only, args)), flush=True)
        return
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("bench/gpu_model.py: no CUDA device here; for a dry run on the CPU pass --shape tiny --device cpu")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    t = time.perf_counter()
    path = checkpoint(args.shape, args.dtype, args.device, Path(args.dir))
    work = make_workload(args.requests, SHAPES[args.shape]["vocab_size"], args.seed, tuple(args.prompt_len),
                         tuple(args.output_len))
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else f"CPU, {torch.get_num_threads()} threads"
    bw = copy_bandwidth(args.device)
    print(f"{args.shape} ({path}, made or found in {time.perf_counter() - t:.0f} s), {args.dtype} on {name}; copy "
          f"bandwidth {bw / 1e9:.0f} GB/s; {args.requests} requests, {work.prompt_tokens} prompt tokens, "
          f"{work.output_tokens} output tokens (seed {args.seed})", flush=True)
    results: dict[str, dict] = {}
    for system in args.systems.split(","):
        t = time.perf_counter()
        try:
            proc = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--only", system], capture_output=True, text=True,
                                  timeout=args.timeout)
        except subprocess.TimeoutExpired:
            print(f"{system}: did not finish within {args.timeout:.0f} s (--timeout); not counted", flush=True)
            continue
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT)), None)
        if line is None:
            print(f"{system}: failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}", flush=True)
            continue
        results[system] = json.loads(line[len(RESULT):])
        print(f"{system}: done in {time.perf_counter() - t:.0f} s", flush=True)

    tput = {s: work.output_tokens / statistics.median(r["times"]) for s, r in results.items() if "times" in r}
    b1 = {s: 1 / r["decode_b1_s_per_token"] for s, r in results.items() if "decode_b1_s_per_token" in r}
    print("\n| system | output tok/s | ours / it | batch-1 decode tok/s | ours / it |")
    print("|---|---:|---:|---:|---:|")
    for s in results:
        ratio = f"{tput['ours'] / tput[s]:.2f}x" if "ours" in tput and s in tput and s != "ours" else "-"
        b1_ratio = f"{b1['ours'] / b1[s]:.2f}x" if "ours" in b1 and s in b1 and s != "ours" else "-"
        print(f"| {s} | {tput.get(s, float('nan')):.1f} | {ratio} | {b1.get(s, float('nan')):.1f} | {b1_ratio} |")
    figures = {"shape": args.shape, "dtype": args.dtype, "device": name, "copy_bandwidth_GBps": bw / 1e9,
               "throughput_tok_s": tput, "decode_b1_tok_s": b1, "results": results}
    if "ours" in results:
        weights = results["ours"]["weight_bytes"]
        roof = bw / weights
        figures["decode_b1_roofline_tok_s"] = roof
        print(f"\nbatch-1 decode roofline: {weights / 1e9:.2f} GB of weights per token at {bw / 1e9:.0f} GB/s = "
              f"{roof:.1f} tok/s; ours {b1['ours']:.1f} = {b1['ours'] / roof:.0%} of it"
              f" (CUDA graphs: {results['ours']['graphs']}; KV pool {results['ours']['kv_blocks']} blocks)")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), **figures}, indent=1))


def copy_bandwidth(device: str) -> float:
    """Bytes/s of a large copy on the device (read + write): what one token's pass over the weights can reach."""
    from bench.kernels import copy_bandwidth as measure

    def timed(fn) -> float:
        return _best_time(lambda: (fn(), _sync(device)), 5)

    bw = measure(torch.device(device), timed)
    if device.startswith("cuda"):
        torch.cuda.empty_cache()  # each system sizes its KV pool from the device's free memory
    return bw


if __name__ == "__main__":
    main()
