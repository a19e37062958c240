"""Stream capacity of the served path: how many tokens/s the Ray Serve app delivers to many concurrent streaming
clients, and the latency it adds per token, with the model taken out of the picture.

    python bench/stream_capacity.py                                  # 256 streams, 5 ms fake steps
    python bench/stream_capacity.py --streams 64 --step-ms 2 --stream-interval 0

The engine runs with `fake_step_s` (engine/config.py): each step sleeps --step-ms instead of running the model
and samples a fixed token, while the scheduler, block manager, detokenizer, output processor, the engine
replica, the ingress, Ray Serve's proxy and the HTTP/SSE path are all real. First the same engine runs offline
in this process (its own ceiling: how fast the fake engine produces tokens with no serving around it), then the
app is started on a local Ray cluster and --streams clients stream --tokens tokens each, all at once.

Reported: tokens/s delivered to the clients (from each stream's usage), SSE events/s and tokens per event, time
per output token per stream (TPOT, first token to last) against the engine's own, and the CPU seconds each
process spent (the clients run in this process and share the machine's cores with the servers: that is part
of the ceiling on a 2-core machine, and printed as such).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402

from bench.serve import one_request  # noqa: E402

PROMPT = [100] * 8  # token ids: every stream the same short prompt


def engine_kwargs(args) -> dict:
    return dict(model="default", fake_step_s=args.step_ms / 1000, max_num_seqs=max(256, args.streams),
                max_num_batched_tokens=max(2048, args.streams * 8), num_kv_blocks=args.streams * (-(-(
                    args.tokens + 16) // 16)) + 64, max_model_len=args.tokens + 64, enable_prefix_caching=False)


def offline(args) -> dict:
    from engine import LLM, SamplingParams

    llm = LLM(show_progress=False, **engine_kwargs(args))
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    llm.generate([[100 + i % 50] * 8 for i in range(4)], params)
    start = time.perf_counter()
    outs = llm.generate([[100 + i % 50] * 8 for i in range(args.streams)], params)
    wall = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    steps = llm.engine.num_steps_total
    del llm
    return {"tok_s": tokens / wall, "tpot_s": wall / args.tokens, "steps": steps}


async def load(url: str, streams: int, tokens: int) -> dict:
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=streams + 8)) as client:
        model = (await client.get(f"{url}/v1/models")).json()["data"][0]["id"]
        await asyncio.gather(*(one_request(client, url, model, PROMPT, 8, 0, [], False) for _ in range(4)))  # warm-up
        out: list[dict] = []
        cpu0 = resource.getrusage(resource.RUSAGE_SELF)
        start = time.perf_counter()
        await asyncio.gather(*(one_request(client, url, model, PROMPT, tokens, 0, out, False) for _ in range(streams)))
        wall = time.perf_counter() - start
        cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    ok = [r for r in out if r["ok"] and r["tokens"] == tokens]
    tokens_total = sum(r["tokens"] for r in ok)
    events = sum(len(r["times"]) for r in ok)
    tpot = [(r["times"][-1] - r["times"][0]) / (r["tokens"] - 1) for r in ok if r["tokens"] > 1 and len(r["times"]) > 1]
    ttft = [r["times"][0] - r["sent"] for r in ok]
    return {"streams": streams, "failed": len(out) - len(ok), "tokens": tokens_total, "wall_s": wall,
            "tok_s": tokens_total / wall, "events_per_s": events / wall, "tokens_per_event": tokens_total / max(events, 1),
            "tpot_p50_s": statistics.median(tpot) if tpot else float("nan"),
            "ttft_p50_s": statistics.median(ttft) if ttft else float("nan"),
            "client_cpu_s": (cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime)}


def served(args) -> dict:
    import ray
    from ray import serve

    from serve_app.app import build_app
    from serve_app.config import ServeConfig

    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    config = ServeConfig(engine=engine_kwargs(args), num_replicas=1, stream_interval_s=args.stream_interval,
                         stream_max_messages_per_s=args.max_messages,
                         max_ongoing_requests=max(1024, 2 * args.streams))
    serve.run(build_app(config), name="kvscale", route_prefix="/")
    try:
        return asyncio.run(load(f"http://127.0.0.1:{args.port}", args.streams, args.tokens))
    finally:
        serve.shutdown()
        ray.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=256, help="tokens per stream")
    ap.add_argument("--step-ms", type=float, default=5.0, help="the fake step's duration")
    ap.add_argument("--stream-interval", type=float, default=None,
                    help="ServeConfig.stream_interval_s (default: the config's default)")
    ap.add_argument("--max-messages", type=float, default=None,
                    help="ServeConfig.stream_max_messages_per_s (default: the config's default; 0: no budget)")
    ap.add_argument("--port", type=int, default=8010)
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from serve_app.config import ServeConfig

    defaults = ServeConfig()
    if args.stream_interval is None:
        args.stream_interval = defaults.stream_interval_s
    # the config's budget: the default's, or the option's (0: none)
    args.max_messages = defaults.stream_max_messages_per_s if args.max_messages is None else args.max_messages or None
    print(f"{args.streams} streams x {args.tokens} tokens, fake step {args.step_ms} ms, stream_interval_s "
          f"{args.stream_interval}, stream_max_messages_per_s {args.max_messages}, {os.cpu_count()} cores")
    alone = offline(args)
    print(f"engine alone (offline, no serving): {alone['tok_s']:.0f} tok/s, {alone['tpot_s'] * 1e3:.1f} ms per token "
          f"per stream")
    res = served(args)
    print(f"served: {res['tok_s']:.0f} tok/s delivered to {res['streams']} streams ({res['failed']} failed), "
          f"{res['events_per_s']:.0f} SSE events/s, {res['tokens_per_event']:.1f} tokens per event; TPOT p50 "
          f"{res['tpot_p50_s'] * 1e3:.1f} ms (engine alone {alone['tpot_s'] * 1e3:.1f} ms: the serving path adds "
          f"{(res['tpot_p50_s'] - alone['tpot_s']) * 1e3:.1f} ms per token); TTFT p50 {res['ttft_p50_s']:.2f} s; "
          f"clients' own CPU {res['client_cpu_s']:.1f} s of {res['wall_s']:.1f} s wall")
    print(f"served / engine alone: {res['tok_s'] / alone['tok_s']:.0%}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "engine_alone": alone, "served": res}, indent=1))


if __name__ == "__main__":
    main()
