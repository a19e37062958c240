"""bench/omp_pools.py: why AsyncLLM builds its engine in the thread that steps it (engine/async_llm.py).

libgomp keeps a pool of OpenMP workers for each thread that opens parallel regions. Once its threads outnumber
the CPUs, a worker spins only about 100 times at a barrier before it sleeps, so every region ends in a futex
sleep and a wake-up. This times small torch ops (a 16-row matmul and a SwiGLU-sized product, as in a decode
step) in a new thread, alone and after the main thread has opened a pool of its own, in separate processes.

  python bench/omp_pools.py
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time


def _run(main_opens_a_pool: bool, iterations: int = 3000) -> None:
    import torch

    a, w, b = torch.randn(16, 1024), torch.randn(1024, 1024), torch.randn(256, 4096)

    def work(n: int) -> float:
        start = time.perf_counter()
        for _ in range(n):
            a @ w
            torch.nn.functional.silu(b) * b
        return time.perf_counter() - start

    if main_opens_a_pool:
        work(10)  # the main thread's pool lives as long as the main thread
    result: dict = {}

    def in_thread() -> None:
        result["s"] = work(iterations)
        status = open(f"/proc/self/task/{threading.get_native_id()}/status").read()
        result["sleeps"] = int(status.split("\nvoluntary_ctxt_switches:")[1].split()[0])

    t = threading.Thread(target=in_thread)
    t.start()
    t.join()
    print(f"{result['s']:.3f} {result['sleeps']}")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in ("alone", "second-pool"):
        _run(sys.argv[1] == "second-pool")
        return
    print(f"{os.cpu_count()} CPUs, torch threads: default; 3000 x (16x1024 @ 1024x1024, silu(256x4096) * 256x4096)")
    for _ in range(2):
        for case in ("alone", "second-pool"):
            out = subprocess.run([sys.executable, __file__, case], capture_output=True, text=True, check=True)
            seconds, sleeps = out.stdout.split()
            print(f"  {case:12s} {float(seconds):7.3f} s, the thread's voluntary context switches: {sleeps}")


if __name__ == "__main__":
    main()
