"""bench/serve.py: replay a slice of the Azure LLM inference trace (Patel et al., Splitwise, ISCA 2024;
CC-BY 4.0) against OpenAI-compatible servers, open loop, and report throughput, TTFT and ITL.

Arrival times are the trace's, divided by --speedup; context and generated token counts are the trace's,
capped by --max-context / --max-output so the run fits a small machine. Prompts are random token ids of
the given length, decoded to text with the default model's tokenizer (the same prompts for every system).

  python bench/serve.py --url ours=http://127.0.0.1:8000          # one running server
  python bench/serve.py --compare                                  # ours offline, in-process and served; vLLM's server
  python bench/serve.py --compare kvscale,vllm,ray-serve-llm,transformers
  python bench/serve.py --compare kvscale-offline,kvscale --rounds 4   # A B, B A, A B, B A; medians

--compare starts each system in turn on this machine, the others stopped, and replays the same requests:
  - kvscale-offline: our engine in this process, every request at once (the ceiling the served path is held to);
  - kvscale-inprocess: our AsyncLLM in this process, each request sent at its arrival time and streamed as the
    app streams it (tokens merged every stream_interval_s), with no Ray and no HTTP: what the serving path costs
    is the gap from here to kvscale;
  - kvscale: `kvscale serve serve_app/config.yaml` (the app as users run it);
  - vllm: vLLM CPU's OpenAI server from .venv-peers (`bash scripts/peers_venv.sh`), bf16, every core;
  - ray-serve-llm: Ray Serve LLM around the same vLLM (`bash scripts/peers_venv.sh --ray-serve-llm`);
  - transformers: `transformers serve --continuous-batching` (needs `pip install accelerate==1.15.0`).
For each served system it prints the CPU-seconds every process on the machine used during the replay, and for
kvscale what that leaves possible: the served run needs the offline engine's CPU-seconds plus the other processes'
on the same cores, which bounds served / offline before the engine loses anything to sharing them.
Every system gets the same model (the default), dtype (what our dtype="auto" picks on this machine: bf16 where
the CPU has AVX512-BF16, else fp32), prompts, max_tokens and ignore_eos.
"""
from __future__ import annotations

import argparse
import asyncio
import csv
import json
import os
import random
import statistics
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the project's packages before this folder (bench/kernels.py would shadow `kernels`)
TRACE_DIR = ROOT.parent / "shared" / "data" / "azure-llm-2023"


def load_trace(kind: str, n: int, offset: int, speedup: float, max_context: int, max_output: int):
    path = TRACE_DIR / f"AzureLLMInferenceTrace_{kind}.csv"
    if not path.exists():
        sys.exit(f"trace not found at {path}: this benchmark reads ../shared/data/azure-llm-2023")
    rows = list(csv.DictReader(path.open()))[offset : offset + n]
    t0 = _ts(rows[0]["TIMESTAMP"])
    return [((_ts(r["TIMESTAMP"]) - t0) / speedup, min(int(r["ContextTokens"]), max_context),
             max(1, min(int(r["GeneratedTokens"]), max_output))) for r in rows]


def _ts(s: str) -> float:
    day, frac = s.split(".") if "." in s else (s, "0")
    return datetime.fromisoformat(day).timestamp() + float("0." + frac)


def make_prompts(trace, seed: int = 0) -> list[str]:
    from transformers import AutoTokenizer

    from engine.default_model import default_model_dir

    tok = AutoTokenizer.from_pretrained(default_model_dir())
    rng = random.Random(seed)
    return [tok.decode([rng.randrange(1000, 40000) for _ in range(ctx)]) for _, ctx, _ in trace]


async def one_request(client, url, model, prompt, max_tokens, delay, result, strict_openai):
    await asyncio.sleep(delay)
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    if not strict_openai:  # transformers serve answers 422 to these; it then counts streamed chunks as tokens
        body.update(ignore_eos=True, stream_options={"include_usage": True})
    sent = time.perf_counter()
    times, usage = [], None
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                result.append({"ok": False, "status": r.status_code})
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if event.get("usage"):
                    usage = event["usage"]
                if any(c.get("text") for c in event.get("choices") or []):
                    times.append(time.perf_counter())
    except httpx.HTTPError as e:
        result.append({"ok": False, "status": repr(e)})
        return
    tokens = usage["completion_tokens"] if usage else len(times)
    result.append({"ok": bool(times), "sent": sent, "times": times, "tokens": tokens})


async def _model_id(client, url: str) -> str:
    r = await client.get(f"{url}/v1/models")
    if r.status_code == 200 and r.json().get("data"):
        return r.json()["data"][0]["id"]
    from engine.default_model import default_model_dir

    return default_model_dir()  # transformers serve: the preloaded model is named by its path


async def run_load(url: str, trace, prompts, strict_openai: bool = False) -> dict:
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=512)) as client:
        model = await _model_id(client, url)
        results: list[dict] = []
        start = time.perf_counter()
        await asyncio.gather(*(one_request(client, url, model, p, out, arrival, results, strict_openai)
                               for (arrival, _, out), p in zip(trace, prompts)))
        makespan = time.perf_counter() - start
    return summarize(results, makespan)


def summarize(results: list[dict], makespan: float) -> dict:
    """Throughput, TTFT and ITL of a replay: each result has ok, and when ok the send time, each chunk's
    arrival time and the tokens it got."""
    ok = [r for r in results if r["ok"]]
    ttft = [r["times"][0] - r["sent"] for r in ok]
    itl = [b - a for r in ok for a, b in zip(r["times"], r["times"][1:])]
    tokens = sum(r["tokens"] for r in ok)
    return {"requests": len(results), "failed": len(results) - len(ok), "tokens": tokens, "makespan_s": makespan,
            "tok_s": tokens / makespan, "ttft_p50": _pct(ttft, 50), "ttft_p99": _pct(ttft, 99),
            "itl_p50": _pct(itl, 50), "itl_p99": _pct(itl, 99)}


def _pct(xs, q):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def cpu_by_process() -> dict[int, tuple[float, str]]:
    """CPU-seconds (user + system) each process on this machine has used so far, with a short name for it, from
    Linux's /proc ({} elsewhere)."""
    if not os.path.isdir("/proc"):
        return {}
    hz = os.sysconf("SC_CLK_TCK")
    out = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").split()
        except OSError:  # it ended meanwhile
            continue
        comm, fields = stat.split("(", 1)[1].rsplit(")", 1)[0], stat.rsplit(")", 1)[1].split()
        out[int(pid)] = ((int(fields[11]) + int(fields[12])) / hz, _process_name(cmd) or comm)
    return out


def _process_name(cmd: list[str]) -> str:
    if not cmd:
        return ""
    if cmd[0].startswith("ray::"):  # a Ray actor: its class (and method)
        return cmd[0][5:]
    base = os.path.basename(cmd[0])
    if base.startswith("python") and len(cmd) > 1:
        script = next((a for a in cmd[1:] if not a.startswith("-")), cmd[1])
        return os.path.basename(script)
    return base


def cpu_used(before: dict, after: dict) -> dict[str, float]:
    """CPU-seconds used between two cpu_by_process() snapshots, summed by process name; this process (the load
    generator) as "load generator"."""
    used: dict[str, float] = {}
    for pid, (cpu, name) in after.items():
        delta = cpu - before.get(pid, (0.0, ""))[0]
        if delta > 0:
            name = "load generator" if pid == os.getpid() else name
            used[name] = used.get(name, 0.0) + delta
    return dict(sorted(used.items(), key=lambda kv: -kv[1]))


ENGINE_REPLICA = "ServeReplica:kvscale:KVEngine"


def engine_dtype() -> str:
    """What our dtype="auto" picks on this machine's CPU, the dtype every system is given: bf16 where the CPU has
    AVX512-BF16 or AMX, else fp32 (bf16 there has no fast matmul: vLLM CPU's server in bf16 ran this trace at a
    tenth of its fp32 speed on an AMD EPYC with AVX2 alone)."""
    import torch

    from engine.model_runner import resolve_dtype

    return str(resolve_dtype("auto", torch.device("cpu"))).removeprefix("torch.")


def machine_ceilings() -> str:
    import torch

    a = torch.empty(64 << 20, dtype=torch.float32)  # 256 MiB
    b = torch.empty_like(a)
    b.copy_(a)
    t = time.perf_counter()
    for _ in range(5):
        b.copy_(a)
    bw = 5 * 2 * a.numel() * 4 / (time.perf_counter() - t) / 1e9
    name = engine_dtype()
    x, w = torch.randn(256, 576, dtype=getattr(torch, name)), torch.randn(1536, 576, dtype=getattr(torch, name))
    x @ w.T
    t = time.perf_counter()
    for _ in range(20):
        x @ w.T
    flops = 20 * 2 * 256 * 576 * 1536 / (time.perf_counter() - t) / 1e9
    return (f"machine: {os.cpu_count()} cores, copy bandwidth {bw:.1f} GB/s, "
            f"{name} matmul {flops:.0f} GFLOP/s at the default model's MLP shape (256x576x1536)")


def wait_up(url: str, proc=None, timeout: float = 300) -> None:
    """Until url/health answers 200; exits the benchmark if `proc` (the server, when we started it) dies first
    or the timeout passes."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            sys.exit(f"server for {url} exited early with code {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    sys.exit(f"server for {url} did not come up in {timeout:.0f} s")


PEERS_PY = ROOT / ".venv-peers" / "bin" / "python"
SYSTEMS = ("kvscale-offline", "kvscale-inprocess", "kvscale", "vllm", "ray-serve-llm", "transformers")


def start_server(name: str, log_dir: Path):
    from engine.default_model import default_model_dir

    hub_cache = log_dir / "hf-hub"  # transformers serve scans a hub cache even for a local model
    hub_cache.mkdir(exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_CACHE": str(hub_cache)}
    log = open(log_dir / f"{name}.log", "w")
    if name in ("vllm", "ray-serve-llm") and not PEERS_PY.exists():
        sys.exit(f"{name} runs from {PEERS_PY.parent.parent}: make it with `bash scripts/peers_venv.sh"
                 f"{' --ray-serve-llm' if name == 'ray-serve-llm' else ''}`")
    # vLLM: 2 GiB of KV (more than these requests can hold), and every core (it would drop to one "for serving")
    vllm_env = {"VLLM_CPU_KVCACHE_SPACE": "2", "OMP_NUM_THREADS": str(os.cpu_count() or 1)}
    dtype = engine_dtype()  # ours runs dtype auto (serve_app/config.yaml); the peers get what that picks
    if name == "kvscale":  # as users start it (scripts/serve.sh does too): Ray's actors at nice 0, not 15
        cmd = ["kvscale", "serve", str(ROOT / "serve_app" / "config.yaml")]
        url = "http://127.0.0.1:8000"
    elif name == "vllm":  # `python -m`: the `vllm` CLI looks for a distribution named vllm, this one is vllm-cpu
        cmd = [str(PEERS_PY), "-m", "vllm.entrypoints.openai.api_server", "--model", default_model_dir(),
               "--dtype", dtype, "--host", "127.0.0.1", "--port", "8002", "--max-model-len", "2048",
               "--max-num-seqs", "256", "--max-num-batched-tokens", "2048"]
        env.update(vllm_env)
        url = "http://127.0.0.1:8002"
    elif name == "ray-serve-llm":
        cmd = [str(PEERS_PY), str(ROOT / "bench" / "ray_serve_llm_peer.py"), default_model_dir(), "8003", dtype]
        env.update(vllm_env)
        url = "http://127.0.0.1:8003"
    else:
        cmd = ["transformers", "serve", default_model_dir(), "--continuous-batching", "--port", "8001",
               "--host", "127.0.0.1", "--dtype", dtype, "--device", "cpu"]
        url = "http://127.0.0.1:8001"
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
    wait_up(url, proc, timeout=600)
    return proc, url


# our engine in this process, as serve_app/config.yaml runs it
ENGINE_ARGS = dict(model="default", max_num_seqs=256, max_num_batched_tokens=2048, show_progress=False)


def offline_engine(trace, prompts, **overrides):
    """Our engine in this process as the served app's config runs it (overrides on top), warmed up, and the
    trace's sampling params."""
    from engine import LLM, SamplingParams

    llm = LLM(**ENGINE_ARGS, **overrides)
    params = [SamplingParams(temperature=0, max_tokens=out, ignore_eos=True) for _, _, out in trace]
    llm.generate(prompts[:4], params[:4])  # warm-up
    return llm, params


def run_offline(trace, prompts) -> dict:
    """Our engine in this process on the same requests, all submitted at once: what the served path is held to."""
    llm, params = offline_engine(trace, prompts)
    start, cpu = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params)
    makespan, cpu = time.perf_counter() - start, time.process_time() - cpu
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    del llm
    nan = float("nan")
    return {"requests": len(outs), "failed": 0, "tokens": tokens, "makespan_s": makespan, "tok_s": tokens / makespan,
            "ttft_p50": nan, "ttft_p99": nan, "itl_p50": nan, "itl_p99": nan, "cpu_s": {"engine": cpu}}


def run_inprocess(trace, prompts) -> dict:
    """Our AsyncLLM in this process, open loop on the trace's arrivals, streaming as the served app does (deltas
    merged every stream_interval_s, within stream_max_messages_per_s): the served path without Ray's processes and
    HTTP."""
    from engine import SamplingParams
    from engine.async_llm import AsyncLLM
    from engine.sampling_params import RequestOutputKind
    from serve_app.config import ServeConfig

    defaults = ServeConfig()
    interval, budget = defaults.stream_interval_s, defaults.stream_max_messages_per_s
    llm = AsyncLLM(**ENGINE_ARGS)

    async def one(request_id, prompt, max_tokens, delay, result):
        await asyncio.sleep(delay)
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                                output_kind=RequestOutputKind.DELTA)
        sent, times, tokens = time.perf_counter(), [], 0
        async for out in llm.generate(prompt, params, request_id, min_interval_s=interval, max_outputs_per_s=budget):
            if out.outputs and out.outputs[0].token_ids:
                tokens += len(out.outputs[0].token_ids)
                times.append(time.perf_counter())
        result.append({"ok": bool(times), "sent": sent, "times": times, "tokens": tokens})

    async def replay(rows, tag):
        results: list[dict] = []
        start = time.perf_counter()
        await asyncio.gather(*(one(f"{tag}-{i}", p, out, arrival, results)
                               for i, ((arrival, _, out), p) in enumerate(rows)))
        return results, time.perf_counter() - start

    try:
        asyncio.run(replay(list(zip(trace[:4], prompts[:4])), "warm-up"))
        results, makespan = asyncio.run(replay(list(zip(trace, prompts)), "run"))
    finally:
        llm.shutdown()
    return summarize(results, makespan)


def stop(proc, url: str | None = None) -> None:
    """Stop a server we started, and wait until `url` no longer answers: Ray's processes outlive `serve run` by
    a few seconds, and the next system started on the same port must not find the last one's /health."""
    import signal

    try:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=60)
    except Exception:
        os.killpg(proc.pid, signal.SIGKILL)
    deadline = time.time() + 60
    while url and time.time() < deadline:
        try:
            httpx.get(f"{url}/health", timeout=2)
        except httpx.HTTPError:
            return
        time.sleep(1)


def run_system(name: str, trace, prompts, log_dir: Path) -> dict:
    """One replay of the trace on one system: ours offline / in-process in this process, else against the
    system's server, started for this run, warmed up with four requests and stopped after, with the CPU-seconds
    every process on the machine used during the replay."""
    if name in ("kvscale-offline", "kvscale-inprocess"):
        row = (run_offline if name == "kvscale-offline" else run_inprocess)(trace, prompts)
        print(name, json.dumps(row), flush=True)
        return row
    proc, url = start_server(name, log_dir)
    try:
        strict = name == "transformers"
        asyncio.run(run_load(url, trace[:4], prompts[:4], strict))  # warm-up, not counted
        before = cpu_by_process()
        row = asyncio.run(run_load(url, trace, prompts, strict))
        row["cpu_s"] = cpu_used(before, cpu_by_process())
        print(name, json.dumps(row), flush=True)
        return row
    finally:
        stop(proc, url)


def report(rows: list[tuple[str, dict]]) -> None:
    """One round: the table, kvscale's ratios to the others, and the bound the other processes' CPU sets."""
    print(f"\n| system | requests (failed) | output tok/s | TTFT p50 / p99 s | ITL p50 / p99 s |")
    print("|---|---|---|---|---|")
    for name, r in rows:
        print(f"| {name} | {r['requests']} ({r['failed']}) | {r['tok_s']:.1f} | {r['ttft_p50']:.2f} / "
              f"{r['ttft_p99']:.2f} | {r['itl_p50']:.3f} / {r['itl_p99']:.3f} |")
    for name, r in rows:
        if r.get("cpu_s") and name != "kvscale-offline":
            top = ", ".join(f"{k} {v:.1f}" for k, v in list(r["cpu_s"].items())[:8])
            print(f"{name}: CPU-seconds by process during the replay, {sum(r['cpu_s'].values()):.1f} in all: {top}")
    by_name = dict(rows)
    ours = by_name.get("kvscale")
    if ours:
        for name, r in rows:
            if name == "kvscale-offline":
                print(f"\nkvscale served / kvscale offline on the same requests: {ours['tok_s'] / r['tok_s']:.0%} "
                      "(target >= 90 %)")
            elif name == "kvscale-inprocess":
                print(f"kvscale served / kvscale in-process (no Ray, no HTTP): {ours['tok_s'] / r['tok_s']:.0%}")
            elif name != "kvscale" and r["tok_s"] > 0:
                print(f"kvscale / {name}: throughput x{ours['tok_s'] / r['tok_s']:.2f} (target >= 1.2), p99 TTFT "
                      f"x{ours['ttft_p99'] / r['ttft_p99']:.2f} (target <= 1), ITL p50 x{ours['itl_p50'] / r['itl_p50']:.2f}")
    offline = by_name.get("kvscale-offline")
    if ours and offline and ours.get("cpu_s") and ENGINE_REPLICA in ours["cpu_s"]:
        # What the machine allows: the served run needs the offline engine's CPU-seconds plus what every other
        # process used meanwhile, on the same cores.
        others = sum(v for k, v in ours["cpu_s"].items() if k != ENGINE_REPLICA)
        cores = len(os.sched_getaffinity(0))
        floor = max(offline["makespan_s"], (offline["cpu_s"]["engine"] + others) / cores)
        print(f"the served run's other processes used {others:.1f} CPU-s, the offline engine {offline['cpu_s']['engine']:.1f}"
              f" (the served replica {ours['cpu_s'][ENGINE_REPLICA]:.1f}): on {cores} cores the served run could not end "
              f"before {floor:.1f} s, so served / offline <= {offline['makespan_s'] / floor:.0%} here")


def report_rounds(rounds: list[list[tuple[str, dict]]]) -> None:
    """Every system's throughput round by round and its median; kvscale's ratios round by round (each from
    runs of the same round, minutes apart) and their median, which is the figure: this machine's speed drifts
    between runs minutes apart by more than the margins being measured."""
    print(f"\nover {len(rounds)} rounds, the order reversed every other round:")
    by_system: dict[str, list[dict]] = {}
    for rows in rounds:
        for name, r in rows:
            by_system.setdefault(name, []).append(r)
    for name, rs in by_system.items():
        tok_s = [r["tok_s"] for r in rs]
        print(f"  {name}: output tok/s {' / '.join(f'{x:.1f}' for x in tok_s)}, median {statistics.median(tok_s):.1f}")
    if "kvscale" not in by_system:
        return
    for name in by_system:
        if name == "kvscale":
            continue
        pairs = [(dict(rows)["kvscale"], dict(rows)[name]) for rows in rounds]
        ratios = [ours["tok_s"] / peer["tok_s"] for ours, peer in pairs if peer["tok_s"] > 0]
        if not ratios:
            continue
        if name == "kvscale-offline":
            print(f"  kvscale served / kvscale offline: {' / '.join(f'{x:.0%}' for x in ratios)}, median "
                  f"{statistics.median(ratios):.0%} (target >= 90 %)")
        elif name == "kvscale-inprocess":
            print(f"  kvscale served / kvscale in-process: {' / '.join(f'{x:.0%}' for x in ratios)}, median "
                  f"{statistics.median(ratios):.0%}")
        else:
            ttft = [ours["ttft_p99"] / peer["ttft_p99"] for ours, peer in pairs]
            print(f"  kvscale / {name}: throughput {' / '.join(f'x{x:.2f}' for x in ratios)}, median "
                  f"x{statistics.median(ratios):.2f} (target >= 1.2); p99 TTFT {' / '.join(f'x{x:.2f}' for x in ttft)}, "
                  f"median x{statistics.median(ttft):.2f} (target <= 1)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", action="append", default=[], help="name=http://host:port (repeatable)")
    ap.add_argument("--compare", nargs="?", const="kvscale-offline,kvscale-inprocess,kvscale,vllm", default=None,
                    help=f"systems to start one by one, comma-separated, of {', '.join(SYSTEMS)} "
                         "(no value: kvscale-offline,kvscale-inprocess,kvscale,vllm)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="replay on every --compare system this many times, the order reversed every other round "
                         "(A B, B A, A B, ...), and print each figure round by round with its median")
    ap.add_argument("--json", help="also write the figures here")
    ap.add_argument("--trace", default="conv", choices=["conv", "code"])
    ap.add_argument("--num-requests", type=int, default=48)
    ap.add_argument("--offset", type=int, default=0)
    ap.add_argument("--speedup", type=float, default=2.0)
    ap.add_argument("--max-context", type=int, default=512)
    ap.add_argument("--max-output", type=int, default=64)
    args = ap.parse_args()
    names = args.compare.split(",") if args.compare else []
    for name in names:
        if name not in SYSTEMS:
            sys.exit(f"unknown system {name!r}; choose from {', '.join(SYSTEMS)}")
    if args.rounds < 1:
        sys.exit(f"--rounds must be at least 1, not {args.rounds}")
    trace = load_trace(args.trace, args.num_requests, args.offset, args.speedup, args.max_context, args.max_output)
    prompts = make_prompts(trace)
    print(f"trace: {args.trace}, {len(trace)} requests from row {args.offset}, arrivals / {args.speedup} over "
          f"{trace[-1][0]:.1f} s, context capped at {args.max_context}, output at {args.max_output} tokens")
    ceilings = machine_ceilings()
    print(ceilings)
    log_dir = Path("/tmp/kvscale-bench")
    log_dir.mkdir(exist_ok=True)
    rounds = []
    for r in range(args.rounds):
        # a machine that gets faster or slower over the rounds favours no system: A B, B A, A B, ...
        order = names if r % 2 == 0 else names[::-1]
        if args.rounds > 1:
            print(f"\nround {r + 1} of {args.rounds}: {', '.join(order)}", flush=True)
        rows = [(name, run_system(name, trace, prompts, log_dir)) for name in order]
        for spec in args.url:
            name, url = spec.split("=", 1)
            rows.append((name, asyncio.run(run_load(url, trace, prompts))))
        report(rows)
        rounds.append(rows)
    if len(rounds) > 1:
        report_rounds(rounds)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "machine": ceilings, "rows": rounds[0],
                                               "rounds": rounds}, indent=1))


if __name__ == "__main__":
    main()
