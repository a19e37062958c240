"""bench/idle_cpu.py: what `kvscale serve` costs the machine with nothing to serve.

Starts the app as users do (bench/serve.py's `kvscale` system), sends it four requests of the Azure conv trace
as a warm-up, then reads every process's CPU-seconds from /proc over a quiet window and prints them by process.
Each restart is one sample; the spread between restarts is the noise any knob must beat.

  python bench/idle_cpu.py                        # one restart, 60 s quiet
  python bench/idle_cpu.py --restarts 3 --seconds 60
  RAY_SERVE_METRICS_EXPORT_INTERVAL_MS=1000 python bench/idle_cpu.py   # a Ray or Serve knob, inherited by Ray
"""
from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

from serve import cpu_by_process, cpu_used, load_trace, make_prompts, run_load, start_server, stop


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--restarts", type=int, default=1)
    ap.add_argument("--seconds", type=float, default=60.0, help="the quiet window measured")
    args = ap.parse_args()
    trace = load_trace("conv", 4, 3000, 2.0, 512, 64)
    prompts = make_prompts(trace)
    log_dir = Path("/tmp/kvscale-bench")
    log_dir.mkdir(exist_ok=True)
    for i in range(args.restarts):
        proc, url = start_server("kvscale", log_dir)
        try:
            asyncio.run(run_load(url, trace, prompts))  # warm-up: every path has run once
            time.sleep(5)
            before = cpu_by_process()
            time.sleep(args.seconds)
            used = cpu_used(before, cpu_by_process())
        finally:
            stop(proc, url)
        per_minute = 60 / args.seconds
        top = ", ".join(f"{k} {v * per_minute:.2f}" for k, v in list(used.items())[:14])
        print(f"restart {i + 1}: {sum(used.values()) * per_minute:.1f} CPU-s a minute in all: {top}", flush=True)


if __name__ == "__main__":
    main()
