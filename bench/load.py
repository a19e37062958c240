"""Load on a live app: many streaming clients for a fixed time, every stream checked (bench/loadgen.py).

    python bench/load.py --clients 300 --seconds 120                 # starts a local Ray Serve app itself
    python bench/load.py --url http://127.0.0.1:8000 --model SmolLM2-135M-Instruct   # or loads one running

The longer sibling of tests/test_reliability_e2e.py's load test. Prints requests, ok, well-formed errors
(503 + Retry-After refusals), malformed streams (must be 0), tokens/s and TTFT / latency percentiles,
then waits for every replica's KV blocks to be free again and prints them.
"""
from __future__ import annotations

import argparse
import asyncio
import socket
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.loadgen import replica_metrics, run_load  # noqa: E402


def kv_blocks(base: str) -> dict[str, tuple[float, float]]:
    free, total = replica_metrics(base, "num_free_blocks"), replica_metrics(base, "num_total_blocks")
    return {r: (free.get(r, -1), total[r]) for r in total}


def start_local_app(model: str, replicas: int, kv_blocks_per_replica: int) -> str:
    import ray
    from ray import serve

    from serve_app import build_app

    if model == "tiny":
        from bench.models import tiny_llama

        model = tiny_llama(Path("/tmp/kvscale-tiny"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ray.init(include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app({"model": model, "served_model_name": "bench", "num_kv_blocks": kv_blocks_per_replica,
                         "max_model_len": 512, "num_replicas": replicas, "torch_threads": 1}),
              name="bench", route_prefix="/", blocking=False)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 600
    while time.time() < deadline:
        try:
            if httpx.get(f"{base}/health", timeout=5).status_code == 200 and len(kv_blocks(base)) == replicas:
                return base
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise SystemExit("the app did not come up within 600 s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="an app already serving; default: start a local one")
    ap.add_argument("--model", default="tiny", help="local app: 'tiny', 'default' or a folder; --url: its name")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--kv-blocks", type=int, default=256, help="local app: KV blocks per replica")
    ap.add_argument("--clients", type=int, default=300)
    ap.add_argument("--seconds", type=float, default=120)
    ap.add_argument("--api-key")
    args = ap.parse_args()

    base = args.url or start_local_app(args.model, args.replicas, args.kv_blocks)
    model = args.model if args.url else "bench"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    result = asyncio.run(run_load(base, model, args.clients, args.seconds, headers=headers))
    print(result.summary())
    for reason in sorted(set(result.malformed))[:10]:
        print("  malformed:", reason)
    deadline = time.time() + 30
    while time.time() < deadline:
        blocks = kv_blocks(base)
        if blocks and all(f == t for f, t in blocks.values()):
            break
        time.sleep(0.5)
    print("KV blocks free/total per replica after the load:",
          ", ".join(f"{r}: {f:.0f}/{t:.0f}" for r, (f, t) in sorted(blocks.items())))
    leaked = any(f != t for f, t in blocks.values())
    sys.exit(1 if result.malformed or leaked else 0)


if __name__ == "__main__":
    main()
