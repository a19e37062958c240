"""bench/contention.py: what a little CPU taken by another process costs the engine on a small machine.

Runs our engine offline on bench/serve.py's replay requests (the same 48 Azure conv requests its --compare
uses), alternately alone and beside a neighbour process that busy-waits `--busy-ms` every `--period-ms` (by
default 1 ms in 5: a fifth of one core, about what Ray's idle processes plus the ingress, proxy and load
generator take during a served run). Torch's and oneDNN's OpenMP loops split each op statically over the
cores, so a core taken for a moment stalls the other at the loop's end: the engine loses more than the
neighbour uses. fp32 linear layers of 64 rows and more run as dynamically scheduled tiles (kernels/linear.py:
linear_tiled), where the other core takes the next tiles meanwhile; KVSCALE_TILED_LINEAR=0 gives them back to
oneDNN's statically split GEMM, for an A/B.

  python bench/contention.py                          # alone, beside, alone, beside (one process, back to back)
  KVSCALE_TILED_LINEAR=0 python bench/contention.py   # the same with oneDNN's GEMM for fp32's many-row linears
  python bench/contention.py --thread                 # the neighbour a Python thread in the engine's process
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve as replay  # noqa: E402  (bench/serve.py: trace, prompts, ceilings)


def neighbour(busy_s: float, period_s: float, stop) -> None:
    while not stop.is_set():
        t = time.perf_counter()
        while time.perf_counter() - t < busy_s:
            pass
        time.sleep(period_s)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--busy-ms", type=float, default=1.0)
    ap.add_argument("--period-ms", type=float, default=4.0, help="sleep between busy-waits")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--thread", action="store_true",
                    help="the neighbour is a thread of the engine's process, busy in Python (holding the GIL), as "
                         "Ray's and the serving path's threads are in a replica")
    ap.add_argument("--offset", type=int, default=3000)
    args = ap.parse_args()
    trace = replay.load_trace("conv", 48, args.offset, 2.0, 512, 64)
    prompts = replay.make_prompts(trace)
    print(replay.machine_ceilings())
    share = args.busy_ms / (args.busy_ms + args.period_ms)
    # no prefix caching: every round computes the same prompts from scratch
    llm, params = replay.offline_engine(trace, prompts, enable_prefix_caching=False)
    for _ in range(args.rounds):
        for beside in (False, True):
            stop = threading.Event() if args.thread else mp.Event()
            if beside:
                kind = threading.Thread if args.thread else mp.Process
                proc = kind(target=neighbour, args=(args.busy_ms / 1e3, args.period_ms / 1e3, stop))
                proc.start()
            cpu0 = time.process_time()
            start = time.perf_counter()
            outs = llm.generate(prompts, params)
            wall = time.perf_counter() - start
            cpu = time.process_time() - cpu0
            if beside:
                stop.set()
                proc.join()
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            what = f"beside a neighbour {'thread' if args.thread else 'process'} at {share:.0%} of a core"
            print(f"{what if beside else 'alone':<32} "
                  f"{tokens / wall:6.1f} tok/s  wall {wall:5.1f} s  engine CPU {cpu:5.1f} s "
                  f"({cpu / wall / (os.cpu_count() or 1):.0%} of the cores)", flush=True)


if __name__ == "__main__":
    main()
