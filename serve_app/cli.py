"""The `kvscale` command (installed by `pip install .`).

  kvscale serve [CONFIG.yaml] [serve run options]   the Ray Serve app (default: the packaged serve_app/config.yaml)
  kvscale chat [--model M] [--dtype D]              chat with a model in this terminal (the offline engine, no Ray)
  kvscale capacity [MODEL] [--kv-cache-dtype D] [--memory 16GiB] [--seq-len N]
                                                    KV bytes per token by layer group, and what fits in the memory
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

DEFAULT_CONFIG = Path(__file__).with_name("config.yaml")


def serve(argv: list[str]) -> int:
    """`serve run` on the config, so every `serve run` option works; returns its exit status."""
    # Ray starts actors at nice 15 unless told otherwise, so the engine replicas would yield the cores to every
    # other process on the machine (a client, the raylet); a Ray this command starts runs them at nice 0.
    os.environ.setdefault("RAY_worker_niceness", "0")
    # Serve's controller reconciles every 0.1 s by default, and with GCS that is most of what an idle app costs
    # (README: Performance); every 0.5 s it uses 1-1.5 CPU-seconds less a minute, which on a small machine the
    # engine gets back. The autoscaling policy reads the clock, not the tick count, so it decides the same.
    os.environ.setdefault("RAY_SERVE_CONTROL_LOOP_INTERVAL_S", "0.5")
    # Ray's log monitor globs the log folder for new files every 0.1 s while it holds under 1,000 of them, 0.8
    # CPU-seconds a minute on an idle app; every 2 s it uses 0.3. Lines of files it knows still reach the
    # terminal within 0.1 s; a new worker's first lines up to 2 s later, none lost (it reads new files from the start).
    os.environ.setdefault("RAY_LOG_MONITOR_MANY_FILES_THRESHOLD", "0")
    os.environ.setdefault("LOG_NAME_UPDATE_INTERVAL_S", "2")
    config = argv[0] if argv and not argv[0].startswith("-") else str(DEFAULT_CONFIG)
    rest = argv[1:] if argv and not argv[0].startswith("-") else argv
    if not Path(config).exists():
        print(f"kvscale serve: no config file {config!r}", file=sys.stderr)
        return 2
    _batch_scheduling()
    from ray.serve.scripts import cli

    # the app imports serve_app from wherever kvscale is installed, whatever the working directory
    sys.argv = ["serve", "run", config, *rest]
    try:
        cli.main(prog_name="serve")
    except SystemExit as e:
        return int(e.code or 0)
    return 0


def _batch_scheduling() -> None:
    """Start Ray under Linux's SCHED_BATCH, unless KVSCALE_SCHED_BATCH=0.

    Every process Ray starts inherits it: its daemons, Serve's controller and proxy, the ingress and the engine
    replicas, whose engine thread and OpenMP workers go back to the ordinary policy (serve_app/server.py). A
    SCHED_BATCH thread that wakes does not preempt the thread running on its core; it runs at the next tick or
    when that thread blocks. On a small machine the engine's two compute threads were preempted about 600 times
    a second each by gRPC and Ray threads waking, each stalling the other thread at the next barrier (README:
    Performance). Same nice value, so the CPU shares do not change; on a machine with idle cores nothing waits."""
    if os.environ.get("KVSCALE_SCHED_BATCH", "1") == "0" or not hasattr(os, "SCHED_BATCH"):
        return
    try:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    except OSError as e:  # a platform or sandbox that refuses it: Ray runs as it would anyway
        print(f"kvscale serve: could not start Ray under SCHED_BATCH ({e}); continuing with the ordinary policy",
              file=sys.stderr)


def chat(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="kvscale chat", description="Chat with a model in this terminal.")
    ap.add_argument("--model", default="default", help="local folder, Hugging Face repo id, or 'default'")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=0.7)
    args = ap.parse_args(argv)
    from engine import LLM, SamplingParams

    llm = LLM(model=args.model, dtype=args.dtype, show_progress=False)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    messages: list[dict] = []
    print("kvscale chat: type a message; an empty line or Ctrl-D ends.")
    while True:
        try:
            line = input("> ").strip()
        except EOFError:
            break
        if not line:
            break
        messages.append({"role": "user", "content": line})
        reply = llm.chat(messages, params)[0].outputs[0].text
        print(reply)
        messages.append({"role": "assistant", "content": reply})
    return 0


def capacity(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="kvscale capacity", description="KV bytes per token by layer group (M = 2 L "
                                 "H_kv d_head T b), and how many tokens and sequences fit in a memory size.")
    ap.add_argument("model", nargs="?", default="default",
                    help="a model folder, its config.json, a Hugging Face repo id, or 'default'")
    ap.add_argument("--kv-cache-dtype", default="auto", help="auto (the model's dtype), fp8_e4m3 or fp8_e5m2")
    ap.add_argument("--memory", default="16GiB", help="memory for KV, e.g. 16GiB, 512MiB, 80GB")
    ap.add_argument("--seq-len", type=int, default=8192, help="tokens per sequence")
    args = ap.parse_args(argv)
    from engine.capacity import kv_capacity, parse_size

    try:
        memory = parse_size(args.memory)
        source = Path(args.model)
        if not source.exists():
            from engine.loader import resolve_model_path

            source = Path(resolve_model_path(args.model))
        print(kv_capacity(source, args.kv_cache_dtype).render(memory, args.seq_len))
    except (ValueError, OSError, KeyError) as e:
        print(f"kvscale capacity: {e}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if command == "serve":
        return serve(rest)
    if command == "chat":
        return chat(rest)
    if command == "capacity":
        return capacity(rest)
    print(f"kvscale: unknown command {command!r}\n\n{__doc__.strip()}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
