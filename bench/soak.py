"""Engine soak: mixed traffic for a long while, memory watched. Nothing the engine keeps per request may outlive it.

    python bench/soak.py --minutes 10            # tiny random Llama (fast steps, many requests)
    python bench/soak.py --minutes 10 --model default

Traffic, from one seeded rng: requests of random prompt length, n and max_tokens arrive while others run; a
share is aborted after a random number of steps; the KV pool is sized so the batch outgrows it and the
scheduler preempts. Every `--every` seconds it prints RSS, KV blocks free/total, live requests, sampler
state and Python object count. After the run it drains, and checks free == total and that the
block-manager invariants hold. The verdict compares RSS late in the run with RSS after warm-up (the first
sample past 20% of the run), so one-off allocations (allocator pools, caches warming) are not counted as
a leak.
"""
from __future__ import annotations

import argparse
import gc
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--every", type=float, default=15.0, help="seconds between samples")
    ap.add_argument("--model", default="tiny", help="'tiny' (random Llama), 'default', or a local HF folder")
    ap.add_argument("--blocks", type=int, default=48, help="KV pool (blocks of 16); small on purpose")
    ap.add_argument("--concurrency", type=int, default=24, help="requests kept in flight")
    ap.add_argument("--abort-share", type=float, default=0.25)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    import torch

    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    from bench.models import tiny_llama

    model = tiny_llama(Path(os.environ.get("TMPDIR", "/tmp")) / "kvscale-tiny") if args.model == "tiny" \
        else args.model
    engine = LLMEngine(EngineConfig(model=model, dtype="float32", device="cpu", num_kv_blocks=args.blocks,
                                    max_model_len=min(512, args.blocks * 16), max_num_seqs=32,
                                    max_num_batched_tokens=256, show_progress=False))
    rng = random.Random(args.seed)
    vocab = engine.runner.vocab_size
    abort_at: dict[str, int] = {}  # request id -> step at which to abort it
    counts = {"added": 0, "finished": 0, "aborted": 0, "tokens": 0}
    step = 0

    def top_up() -> None:
        while len(engine.request_ids) < args.concurrency:
            rid = f"r{counts['added']}"
            counts["added"] += 1
            plen = rng.randint(4, 160)
            params = SamplingParams(n=rng.choice([1, 1, 1, 2]), temperature=rng.choice([0.0, 0.8]),
                                    max_tokens=rng.randint(4, 96), ignore_eos=rng.random() < 0.8,
                                    seed=rng.choice([None, rng.randrange(1 << 20)]),
                                    logprobs=rng.choice([None, None, 2]), stop=rng.choice([None, ["the"]]))
            engine.add_request(rid, [rng.randrange(3, vocab) for _ in range(plen)], params)
            if rng.random() < args.abort_share:
                abort_at[rid] = step + rng.randint(0, 40)

    start = time.monotonic()
    end = start + args.minutes * 60
    samples: list[tuple[float, float, int, int, int, int, int]] = []
    next_sample = start
    print(f"soak: {args.minutes:g} min, model {args.model}, {args.blocks} KV blocks, {args.concurrency} in flight, "
          f"{args.abort_share:.0%} aborted")
    print(f"{'t (s)':>7} {'RSS MiB':>8} {'KV free/total':>14} {'live':>5} {'sampler':>8} {'objects':>8} "
          f"{'done':>7} {'aborted':>8} {'preempt':>8}")
    while time.monotonic() < end:
        top_up()
        for rid in [r for r, s in abort_at.items() if s <= step]:
            if engine.abort_request(rid) is not None:
                counts["aborted"] += 1
            del abort_at[rid]
        for out in engine.step():
            assert out.error is None, out.error
            if out.finished:
                counts["finished"] += 1
                abort_at.pop(out.request_id, None)
                counts["tokens"] += sum(len(c.token_ids) for c in out.outputs)
        step += 1
        now = time.monotonic()
        if now >= next_sample:
            gc.collect()
            st = engine.stats()
            row = (now - start, rss_mib(), st.num_free_blocks, st.num_total_blocks, len(engine.request_ids),
                   len(engine.runner.sampler._seq_generators), len(gc.get_objects()))
            samples.append(row)
            print(f"{row[0]:7.0f} {row[1]:8.1f} {row[2]:>6}/{row[3]:<7} {row[4]:5} {row[5]:8} {row[6]:8} "
                  f"{counts['finished']:7} {counts['aborted']:8} {st.num_preemptions_total:8}")
            next_sample = now + args.every
    for rid in engine.request_ids:
        engine.abort_request(rid)
    gc.collect()
    st = engine.stats()
    engine.block_manager.check_invariants([])
    drained_ok = st.num_free_blocks == st.num_total_blocks and not engine.has_unfinished_requests()
    warm = next(s for s in samples if s[0] >= 0.2 * (samples[-1][0] or 1))
    late = samples[-1]
    growth = late[1] - warm[1]
    print(f"\n{counts['added']} requests ({counts['finished']} finished, {counts['aborted']} aborted), "
          f"{st.num_preemptions_total} preemptions, {counts['tokens']} tokens in {step} steps")
    print(f"RSS after warm-up {warm[1]:.1f} MiB at {warm[0]:.0f} s -> {late[1]:.1f} MiB at {late[0]:.0f} s "
          f"({growth:+.1f} MiB); Python objects {warm[6]} -> {late[6]}; sampler generators left "
          f"{len(engine.runner.sampler._seq_generators)}")
    print(f"after drain: KV free {st.num_free_blocks}/{st.num_total_blocks}, invariants hold: "
          f"{'yes' if drained_ok else 'NO'}")
    flat = growth < max(8.0, 0.02 * warm[1])
    print(f"verdict: {'flat' if flat and drained_ok else 'LEAK SUSPECTED'}")
    sys.exit(0 if flat and drained_ok else 1)


if __name__ == "__main__":
    main()
