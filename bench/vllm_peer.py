"""vLLM's CPU build as the peer of bench/throughput.py, run with the peers' interpreter (.venv-peers, made by
scripts/peers_venv.sh), never imported by kvscale: it reads a workload as JSON and prints its timings as JSON.

    .venv-peers/bin/python bench/vllm_peer.py WORKLOAD.json   # {"model", "dtype", "prompts", "output_lens", "runs"}

Same requests as ours: token-id prompts, greedy, EOS ignored, each request its own max_tokens; warm-up
excluded; then decode at batch 1 (32-token prompt, 128 new tokens, the prefill timed apart and removed).
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

# this file's folder holds a module named `kernels` (bench/kernels.py) that would shadow the package vLLM imports
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]


def main() -> None:
    work = json.load(open(sys.argv[1]))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(work.get("kv_gib", 2)))
    # vLLM drops torch to one thread "for serving" unless OMP_NUM_THREADS is set: give it every core, as ours has
    os.environ.setdefault("OMP_NUM_THREADS", str(work.get("threads", os.cpu_count() or 1)))
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=work["model"], dtype=work["dtype"], max_model_len=work.get("max_model_len", 512),
              max_num_seqs=256, max_num_batched_tokens=2048, enable_prefix_caching=False, seed=0)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in work["prompts"]]
    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for o in work["output_lens"]]
    llm.generate(prompts[:4], params[:4], use_tqdm=False)
    times = []
    for _ in range(work["runs"]):
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        times.append(time.perf_counter() - t)
        got = [len(o.outputs[0].token_ids) for o in outs]
        assert got == work["output_lens"], "vLLM produced other lengths than asked for"
    one = [TokensPrompt(prompt_token_ids=work["prompts"][0][:32])]
    llm.generate(one, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    t = time.perf_counter()
    llm.generate(one, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), use_tqdm=False)
    prefill = time.perf_counter() - t
    b1 = []
    for _ in range(3):
        t = time.perf_counter()
        llm.generate(one, SamplingParams(temperature=0, max_tokens=129, ignore_eos=True), use_tqdm=False)
        b1.append((time.perf_counter() - t - prefill) / 128)
    b1.sort()
    print("VLLM_PEER_RESULT " + json.dumps({"times": times, "decode_b1_s_per_token": b1[1],
                                            "version": __import__("vllm").__version__}), flush=True)


if __name__ == "__main__":
    main()
