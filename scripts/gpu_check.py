"""On a CUDA machine: the engine end to end through the Triton kernels, eager against CUDA graphs.

Greedy tokens from a random Llama must be the same with `enforce_eager=True` and with decode steps
replayed from CUDA graphs, for batches that hit a captured size exactly, need padding, and exceed the
most sequences a step may hold, and (fp32) the same as HF transformers on CPU. Run by scripts/gpu_check.sh.
"""
from __future__ import annotations

import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.models import hf_greedy, random_llama  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402


def main() -> None:
    assert torch.cuda.is_available(), "this check needs a CUDA device"
    path = random_llama(Path(tempfile.gettempdir()) / "kvscale-gpu-check-llama", hidden_size=256,
                        intermediate_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                        max_position_embeddings=1024, initializer_range=0.1)
    rng = random.Random(0)
    max_new = 24
    failures = 0
    for dtype in ("float32", "bfloat16"):
        # 8: a captured size; 3, 13: padded to 4, 16; 40 > max_num_seqs (32): requests wait and join as others
        # finish, so prefill steps (eager) interleave with graph-replayed decode steps
        for batch in (1, 3, 8, 13, 40):
            prompts = [[rng.randrange(3, 49152) for _ in range(rng.randrange(1, 70))] for _ in range(batch)]
            lens = [rng.randrange(1, max_new + 1) for _ in range(batch)]
            params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lens]
            got = {}
            for eager in (True, False):
                llm = LLM(model=path, dtype=dtype, device="cuda", num_kv_blocks=512, max_num_seqs=32,
                          max_model_len=512, enforce_eager=eager, show_progress=False)
                assert (llm.engine.runner.graphs is None) == eager
                t = time.perf_counter()
                got[eager] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
                secs = time.perf_counter() - t
                replays = 0 if eager else llm.engine.runner.graphs.replays
                assert llm.stats().num_free_blocks == 512
                print(f"{dtype} batch {batch:3d} {'eager ' if eager else 'graphs'}: {secs:.2f} s, "
                      f"{replays} graph replays", flush=True)
                del llm
            same = got[True] == got[False]
            if dtype == "float32":
                want = hf_greedy(path, prompts, max_new)
                hf_ok = all(g == w[:n] for g, w, n in zip(got[False], want, lens))
            else:
                hf_ok = True  # bf16: eager vs graphs only
            print(f"  eager == graphs: {same}; matches HF (fp32 only): {hf_ok}", flush=True)
            failures += (not same) + (not hf_ok)
    print("GPU CHECK", "PASSED" if not failures else f"FAILED ({failures})")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
