"""Autoscaling simulator, the judge of autoscaling policies: a fleet of replicas, each running the engine's real
scheduler and block manager, replaying a slice of an Azure LLM trace under kvscale's policy and under the
policies a user would otherwise deploy, and scoring each by replica-seconds against latency-SLO attainment.

Every policy goes through the same interface Ray uses: a policy function of an `AutoscalingContext`, wrapped by
Ray's own `_apply_autoscaling_config` (upscale/downscale delays, bounds), called every 0.1 s as Ray's
controller does, seeing what replicas report every second averaged over a 5 s look-back, as in Ray. Replicas
report through the same function the real ones use (`serve_app.autoscaling.autoscaling_metrics`: KV counts,
projected demand, arrival rates, the step-time model each learns from its own steps, recent TTFT / ITL). The
policies, each with its settings swept:

- `kvscale`: `serve_app.autoscaling.kvscale_policy` (KV memory, compute, arrivals, against the SLOs), requests
  routed by `serve_app.router`'s rule; its default configuration is the row with setting `default`;
- `ray-default`: Ray Serve's `replica_queue_length_autoscaling_policy` at a swept `target_ongoing_requests`,
  power-of-two routing on ongoing requests, max_ongoing_requests = 2 x target;
- `kv-threshold` (AIBrix-style): replicas = ceil(KV blocks in use / (target utilization x blocks per replica));
- `queue-kv-threshold` (Dynamo's load planner, llm-d's saturation scaler): one replica more when KV utilization
  or the waiting queue per replica is over its threshold, one less when both are well under, at most once
  per adjustment interval;
- `sla-planner` (Dynamo's SLA planner): every adjustment interval, forecast the next interval's request rate,
  prompt and output lengths (linear trend), and size prefill and decode capacity from a performance model of
  the replica profiled offline (prefill throughput; the largest decode batch whose step meets the ITL SLO),
  times a headroom factor.
The peers are routed by power-of-two choices on ongoing requests (Ray's default router). A replica's step
time depends on the step's tokens and the KV it reads (ReplicaProfile), so compute saturation shows up as
ITL. A request meets the SLO when its TTFT (arrival to first token, time held before routing included) is
within the TTFT SLO and its mean inter-token latency within the ITL SLO; requests still unfinished at the end
miss. Starting replicas cost `startup_s` before they serve; a replica being removed stops taking requests and
finishes what it holds. Cost is replica-seconds, start-up and drain included.

    python bench/autoscale_sim.py --trace conv --start-minute 0 --minutes 60 --speedup 1 \\
        --ttft-slo 1 2 5 --itl-slo 0.05 --json OUT.json     # rows: policy, setting, replica_seconds, ...
    python bench/autoscale_sim.py --quick ...                 # fewer peer settings

Prints a table per trace and SLO, and writes per trace a Pareto PNG (replica-seconds against SLO attainment,
every policy's settings) and a timeline PNG (matplotlib, if installed).
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import functools
import heapq
import itertools
import json
import math
import random
import sys
import time
import types
from collections import deque
from datetime import datetime
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.block_manager import BlockManager  # noqa: E402
from engine.llm_engine import EngineStats  # noqa: E402
from engine.perf_model import StepTimeModel  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.scheduler import Scheduler  # noqa: E402
from engine.sequence import Sequence  # noqa: E402
from serve_app.autoscaling import ArrivalMeter, LatencyWindow, autoscaling_metrics  # noqa: E402
from serve_app.router import routing_stats  # noqa: E402

TRACE_DIR = Path(__file__).resolve().parents[2] / "shared" / "data" / "azure-llm-2023"
CONTROL_PERIOD_S = 0.1  # Ray's controller loop
METRICS_PERIOD_S = 1.0  # metrics_interval_s in serve_app.autoscaling.autoscaling_config
LOOK_BACK_S = 5.0
ROUTING_STATS_PERIOD_S = 1.0
POLICIES = ("kvscale", "ray-default", "kv-threshold", "queue-kv-threshold", "sla-planner")


# ---------------------------------------------------------------------------------------------- replicas
@dataclasses.dataclass(frozen=True)
class ReplicaProfile:
    """Step time = fixed overhead + max(memory time, compute time): weights and the KV the step reads
    over the bandwidth, against 2 x params FLOPs per token over the matmul rate."""

    name: str
    weight_bytes: float
    params: float
    kv_bytes_per_token: float
    bandwidth: float  # achievable bytes/s
    flops: float  # achievable FLOP/s
    t_fixed: float  # per-step overhead, s
    num_blocks: int  # KV pool per replica
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096
    max_model_len: int = 8192
    startup_s: float = 60.0

    def step_time(self, num_tokens: int, kv_tokens_read: int) -> float:
        memory = (self.weight_bytes + kv_tokens_read * self.kv_bytes_per_token) / self.bandwidth
        compute = 2.0 * self.params * num_tokens / self.flops
        return self.t_fixed + max(memory, compute)


def gpu_profile() -> ReplicaProfile:
    """Llama-3.1-8B in bf16 on one 24 GB GPU of the A10G class (600 GB/s, 125 TFLOP/s dense bf16), at
    80 % of bandwidth and 50 % of matmul peak. KV: 32 layers x 8 KV heads x 128 x (K, V) x 2 bytes per
    token; pool = 0.9 x 24 GB - 16 GB weights - 1.5 GB activations ~ 4.1 GB = 31k tokens."""
    kv_per_token = 32 * 8 * 128 * 2 * 2
    pool_tokens = int((0.9 * 24e9 - 16.06e9 - 1.5e9) / kv_per_token)
    return ReplicaProfile(name="Llama-3.1-8B bf16 on an A10G-class GPU (modelled)", weight_bytes=16.06e9,
                          params=8.03e9, kv_bytes_per_token=kv_per_token, bandwidth=0.8 * 600e9,
                          flops=0.5 * 125e12, t_fixed=0.004, num_blocks=pool_tokens // 16, startup_s=60.0)


def h100_profile() -> ReplicaProfile:
    """Llama-3.1-8B in bf16 on one H100 SXM 80 GB (3.35 TB/s, 989 TFLOP/s dense bf16), at 80 % of bandwidth and
    50 % of matmul peak; max_num_seqs 256, 1024 batched tokens a step (chunked prefill sized for a 50 ms ITL).
    KV: 32 layers x 8 KV heads x 128 x (K, V) x 2 bytes = 128 KiB per token; pool = 0.9 x 80 GB - 16 GB weights
    - 4 GB activations and graphs ~ 52 GB = 396k tokens. A new replica serves after 60 s (node already up:
    pull, load, warm-up)."""
    kv_per_token = 32 * 8 * 128 * 2 * 2
    pool_tokens = int((0.9 * 80e9 - 16.06e9 - 4e9) / kv_per_token)
    return ReplicaProfile(name="Llama-3.1-8B bf16 on an H100 SXM (modelled)", weight_bytes=16.06e9, params=8.03e9,
                          kv_bytes_per_token=kv_per_token, bandwidth=0.8 * 3.35e12, flops=0.5 * 989e12,
                          t_fixed=0.003, num_blocks=pool_tokens // 16, max_num_batched_tokens=1024,
                          max_model_len=16384, startup_s=60.0)


def measured_profile(num_blocks: int = 2048) -> ReplicaProfile:
    """Fit the step-time model to our engine on this machine (default model, CPU): time decode steps
    at a few batch sizes and one prefill, solve for overhead, bandwidth-like and compute-like terms."""
    import torch

    from engine import LLM, SamplingParams as SP

    llm = LLM(num_kv_blocks=num_blocks, show_progress=False)
    engine = llm.engine
    params = sum(p.numel() for p in engine.runner.model.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.runner.model.parameters())
    cfg = engine.hf_config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_per_token = cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 2 * torch.tensor(
        [], dtype=engine.runner.dtype).element_size()

    def timed_steps(batch: int, prompt: int, steps: int) -> float:
        for i in range(batch):
            engine.add_request(f"m{batch}-{prompt}-{i}", list(range(100, 100 + prompt)),
                               SP(max_tokens=steps + 2, ignore_eos=True, temperature=0))
        engine.step()  # prefill
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        dt = (time.perf_counter() - t0) / steps
        while engine.has_unfinished_requests():
            engine.step()
        return dt

    timed_steps(1, 8, 3)  # warm-up
    d1, d16 = timed_steps(1, 64, 8), timed_steps(16, 64, 8)
    t0 = time.perf_counter()
    engine.add_request("prefill", list(range(100, 612)), SP(max_tokens=1, temperature=0))
    engine.step()
    prefill = time.perf_counter() - t0
    flops = 2.0 * params * 512 / max(prefill, 1e-6)
    bandwidth = weight_bytes / max(d1, 1e-6)
    t_fixed = max(0.0, (d16 - 16 * 2.0 * params / flops) * 0.25)
    llm.shutdown() if hasattr(llm, "shutdown") else None
    return ReplicaProfile(name=f"{llm.model_name if hasattr(llm, 'model_name') else 'default model'} on this "
                          f"CPU (measured: decode b1 {d1 * 1e3:.0f} ms, b16 {d16 * 1e3:.0f} ms, prefill 512 "
                          f"{prefill * 1e3:.0f} ms)", weight_bytes=weight_bytes, params=params,
                          kv_bytes_per_token=kv_per_token, bandwidth=bandwidth, flops=flops, t_fixed=t_fixed,
                          num_blocks=num_blocks, max_num_batched_tokens=2048, max_model_len=2048, startup_s=15.0)


@dataclasses.dataclass(eq=False)
class Request:
    rid: int
    arrival: float
    prompt_len: int
    output_len: int
    scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None
    replica: Any = None
    seq: Sequence | None = None

    @property
    def itl(self) -> float:
        """Mean inter-token latency, first token to last (what the ITL SLO bounds)."""
        if self.finished is None or self.first_token is None:
            return math.inf
        return (self.finished - self.first_token) / (self.output_len - 1) if self.output_len > 1 else 0.0


class SimReplica:
    _ids = itertools.count()

    def __init__(self, profile: ReplicaProfile, now: float) -> None:
        self.id = next(SimReplica._ids)
        self.profile = profile
        self.bm = BlockManager(profile.num_blocks, profile.block_size, enable_prefix_caching=False)
        self.scheduler = Scheduler(self.bm, profile.max_num_seqs, profile.max_num_batched_tokens)
        self.started_at = now
        self.ready_at = now + profile.startup_s
        self.stopped_at: float | None = None
        self.draining = False
        self.busy_until: float | None = None  # a step is in flight until then
        self.requests: dict[str, Request] = {}
        self.preemptions_reported = 0
        self.reports: deque[tuple[float, dict[str, float]]] = deque()
        self.routing_stats: dict[str, float] | None = None
        # what a real replica measures and reports (serve_app/server.py): its own step times, arrivals, latencies
        self.step_model = StepTimeModel()
        self.arrivals = ArrivalMeter()
        self.ttft_window, self.itl_window, self.queue_window = LatencyWindow(), LatencyWindow(), LatencyWindow()
        self.step_started = 0.0

    @property
    def ready(self) -> bool:
        return self.stopped_at is None and not self.draining

    @property
    def ongoing(self) -> int:
        return len(self.requests)

    def add(self, req: Request) -> None:
        seq = Sequence(str(req.rid), 0, [0] * req.prompt_len, SamplingParams(max_tokens=req.output_len,
                                                                              ignore_eos=True))
        req.seq, req.replica = seq, self
        self.requests[seq.request_id] = req
        self.scheduler.add(seq)

    def start_step(self, now: float) -> float | None:
        """Schedule one step; returns when it ends (None: nothing to run)."""
        batch = self.scheduler.schedule()
        if batch.is_empty:
            self.busy_until = None
            return None
        self.batch, self.step_started = batch, now
        for seq in batch.seqs:
            req = self.requests[seq.request_id]
            if req.scheduled is None:  # its first step: the end of its queueing
                req.scheduled = now
                self.queue_window.add(now, now - req.arrival)
        self.busy_until = now + self.profile.step_time(batch.num_tokens, batch.num_kv_tokens_read)
        return self.busy_until

    def finish_step(self, now: float) -> list[Request]:
        """The engine's own update path (Scheduler.update_from_output) with a fake token for every sample;
        sequences end at the trace's output length (their max_tokens)."""
        batch, done = self.batch, []
        self.step_model.observe(batch.num_tokens, batch.num_kv_tokens_read, now - self.step_started)
        for seq in self.scheduler.update_from_output(batch, [1] * len(batch.sample_rows())):
            req = self.requests[seq.request_id]
            if req.first_token is None:
                req.first_token = now
                self.ttft_window.add(now, now - req.arrival)
            if seq.is_finished:
                req.finished = now
                if req.output_len > 1:
                    self.itl_window.add(now, req.itl)
                del self.requests[seq.request_id]
                done.append(req)
        self.busy_until = None
        return done

    def report(self, now: float) -> None:
        """What record_autoscaling_stats returns on a real replica (serve_app/server.py), through the same
        function, plus the ongoing count Ray's default policy reads."""
        preempted = self.scheduler.num_preemptions_total - self.preemptions_reported
        self.preemptions_reported = self.scheduler.num_preemptions_total
        stats = EngineStats.from_scheduler(self.scheduler, step_model=self.step_model.coefficients())
        metrics = autoscaling_metrics(stats, preempted, self.arrivals.rates(now, stats),
                                      self.ttft_window.quantile(now, 0.99), self.itl_window.quantile(now, 0.99),
                                      self.queue_window.quantile(now, 0.99))
        self.reports.append((now, {**metrics, "ongoing": float(self.ongoing)}))
        while self.reports and self.reports[0][0] < now - LOOK_BACK_S:
            self.reports.popleft()

    def refresh_routing_stats(self, now: float) -> None:
        """What record_routing_stats returns on a real replica, through the same function."""
        waiting = sum(1 for r in self.requests.values() if r.first_token is None)
        self.routing_stats = routing_stats(EngineStats.from_scheduler(self.scheduler), waiting, 512, (), now)

    def averaged(self, name: str) -> float:
        values = [m[name] for _, m in self.reports]
        return sum(values) / len(values) if values else 0.0


# ---------------------------------------------------------------------------------------------- peer policies
# Each is a policy function of Ray's AutoscalingContext, as a user would plug it into Ray Serve; they read the
# same replica reports kvscale's policy reads.
def _fleet(ctx: Any, name: str) -> float:
    return sum(((ctx.aggregated_metrics or {}).get(name) or {}).values())


def _no_reports(ctx: Any) -> bool:
    return not (ctx.aggregated_metrics or {}).get("kv_total_blocks")


def kv_threshold_policy(ctx: Any, target_utilization: float) -> tuple[int, dict]:
    """AIBrix-style: as many replicas as keep the KV cache in use at the target utilization."""
    if _no_reports(ctx):
        return ctx.current_num_replicas, ctx.policy_state or {}
    per_replica = _fleet(ctx, "kv_total_blocks") / max(1, len(ctx.aggregated_metrics["kv_total_blocks"]))
    used = _fleet(ctx, "kv_used_blocks")
    return max(1, math.ceil(used / (target_utilization * per_replica))), ctx.policy_state or {}


def queue_kv_threshold_policy(ctx: Any, kv_threshold: float, queue_threshold: float,
                              interval_s: float) -> tuple[int, dict]:
    """Dynamo load-planner / llm-d style: one replica more when the mean KV utilization or the waiting queue per
    replica is over its threshold, one less when both are under half of it, at most once per interval."""
    state = dict(ctx.policy_state or {})
    current, now = ctx.current_num_replicas, ctx.current_time or 0.0
    if _no_reports(ctx) or now - state.get("last", -math.inf) < interval_s:  # hold the last decision (Ray's
        return state.get("decision", current), state  # delays want the same answer on consecutive ticks)
    util = _fleet(ctx, "kv_used_blocks") / max(1.0, _fleet(ctx, "kv_total_blocks"))
    queue = (_fleet(ctx, "num_waiting") + (ctx.total_queued_requests or 0)) / max(1, current)
    state["last"] = now
    base = max(current, ctx.target_num_replicas or current)
    if util > kv_threshold or queue > queue_threshold:
        state["decision"] = base + 1
    elif util < kv_threshold / 2 and queue < queue_threshold / 2:
        state["decision"] = current - 1
    else:
        state["decision"] = base
    return state["decision"], state


def sla_planner_policy(ctx: Any, profile: ReplicaProfile, ttft_slo_s: float, itl_slo_s: float, interval_s: float,
                       headroom: float) -> tuple[int, dict]:
    """Dynamo SLA-planner style: every interval, forecast the next interval's request rate, prompt and output
    lengths by a linear trend over the last intervals, and size the fleet from a performance model profiled
    offline: prefill capacity (tokens/s a replica computes with its TTFT within the SLO) and decode capacity
    (tokens/s at the largest batch whose step meets the ITL SLO, at the forecast context)."""
    state = dict(ctx.policy_state or {})
    current, now = ctx.current_num_replicas, ctx.current_time or 0.0
    if _no_reports(ctx) or now - state.get("last", -math.inf) < interval_s:  # hold the last decision
        return state.get("decision", max(current, ctx.target_num_replicas or current)), state
    state["last"] = now
    rps, ptps, gtps = _fleet(ctx, "arrival_rps"), _fleet(ctx, "arrival_prompt_tps"), _fleet(ctx, "generation_tps")
    hist = state.setdefault("hist", [])
    hist.append((rps, ptps / rps if rps > 0 else 0.0, gtps / rps if rps > 0 else 0.0))
    del hist[:-4]

    def trend(i: int) -> float:
        xs = [h[i] for h in hist]
        return max(0.0, xs[-1] + (xs[-1] - xs[0]) / (len(xs) - 1)) if len(xs) > 1 else xs[-1]

    rate, isl, osl = trend(0), trend(1), trend(2)
    if rate <= 0:
        state["decision"] = 1
        return 1, state
    # prefill: a replica computing prompts back to back, each within the TTFT SLO
    chunk = min(profile.max_num_batched_tokens, max(1, int(isl)))
    prefill_tps = chunk / profile.step_time(chunk, chunk)
    if profile.step_time(chunk, chunk) > ttft_slo_s:  # one prompt alone misses: plan at half load
        prefill_tps /= 2
    # decode: the largest batch whose step meets the ITL SLO at the mean context
    ctx_len = isl + osl / 2
    best = 1
    for b in range(1, profile.max_num_seqs + 1):
        if profile.step_time(b, int(b * ctx_len)) > itl_slo_s or b * ctx_len > profile.num_blocks * profile.block_size:
            break
        best = b
    decode_tps = best / profile.step_time(best, int(best * ctx_len))
    need = rate * isl / prefill_tps + rate * osl / decode_tps
    state["decision"] = max(1, math.ceil(headroom * need))
    return state["decision"], state


# ---------------------------------------------------------------------------------------------- systems
@dataclasses.dataclass
class System:
    policy: str  # one of POLICIES
    setting: str
    fn: Callable  # (AutoscalingContext) -> (replicas, state), wrapped by Ray's own config wrapper
    config: Any  # ray.serve.config.AutoscalingConfig
    route: Callable[[list[SimReplica], Request, random.Random], SimReplica | None]


class KVRoute:
    """serve_app.router's rule as KVAwareRouter applies it (KVRouting): stale stats plus what it sent since."""

    def __init__(self) -> None:
        from serve_app.router import KVRouting

        self.routing = KVRouting(seed=0)

    def __call__(self, replicas: list[SimReplica], req: Request, rng: random.Random) -> SimReplica | None:
        bs = replicas[0].profile.block_size if replicas else 16
        need = -(-(req.prompt_len + req.output_len) // bs)  # from the prompt and max_tokens, as the router does
        ranks = self.routing.choose([(r, r.routing_stats) for r in replicas], need, None)
        return ranks[0][0] if ranks else None


def make_request_count_route(max_ongoing: int):
    def route(replicas: list[SimReplica], req: Request, rng: random.Random) -> SimReplica | None:
        open_ = [r for r in replicas if r.ongoing < max_ongoing]
        if not open_:
            return None
        pair = rng.sample(open_, 2) if len(open_) >= 2 else open_
        return min(pair, key=lambda r: r.ongoing)

    return route


def settings(policy: str, quick: bool) -> list[dict[str, Any]]:
    """The swept settings of each policy (kvscale: its default configuration only, plus two variants)."""
    delays = [30.0] if quick else [30.0, 300.0, 600.0]
    if policy == "kvscale":
        return [{}] if quick else [{}, {"target_utilization": 0.9}, {"downscale_window_s": 60.0}]
    if policy == "ray-default":
        return [{"target": t, "delay": d} for t in ([16, 64] if quick else [8, 16, 32, 64, 128]) for d in delays]
    if policy == "kv-threshold":
        return [{"target_utilization": u, "delay": d} for u in ([0.3, 0.7] if quick else [0.2, 0.3, 0.5, 0.7])
                for d in delays]
    if policy == "queue-kv-threshold":
        return [{"kv_threshold": k, "queue_threshold": q, "interval_s": i} for k in ([0.5] if quick else [0.3, 0.6])
                for q in ([2] if quick else [1, 4]) for i in ([10.0] if quick else [10.0, 60.0])]
    if policy == "sla-planner":
        return [{"interval_s": i, "headroom": h} for i in ([60.0] if quick else [30.0, 60.0, 180.0])
                for h in ([1.5] if quick else [1.0, 1.5, 2.0, 3.0])]
    raise ValueError(policy)


def setting_name(policy: str, setting: dict[str, Any]) -> str:
    if policy == "kvscale" and not setting:
        return "default"
    return ", ".join(f"{k}={v:g}" for k, v in setting.items())


def build_system(policy: str, setting: dict[str, Any], profile: ReplicaProfile, slo: tuple[float, float],
                 min_replicas: int, max_replicas: int, initial_replicas: int) -> System:
    from ray.serve.autoscaling_policy import _apply_autoscaling_config, replica_queue_length_autoscaling_policy
    from ray.serve.config import AutoscalingConfig

    from serve_app.autoscaling import kvscale_policy
    from serve_app.config import ServeConfig

    common = dict(min_replicas=min_replicas, max_replicas=max_replicas, initial_replicas=initial_replicas,
                  metrics_interval_s=METRICS_PERIOD_S, look_back_period_s=LOOK_BACK_S, upscale_delay_s=1.0)
    name = setting_name(policy, setting)
    setting = dict(setting)
    delay = setting.pop("delay", 1.0)
    if policy == "kvscale":  # the app's own defaults (ServeConfig), the SLO and the replica's start-up given
        from serve_app.autoscaling import policy_kwargs

        kwargs = policy_kwargs(ServeConfig(num_replicas=None, ttft_slo_s=slo[0], itl_slo_s=slo[1],
                                           replica_startup_s=profile.startup_s))
        fn = functools.partial(kvscale_policy, **{**kwargs, **setting})
        return System(policy, name, _apply_autoscaling_config(fn), AutoscalingConfig(**common, downscale_delay_s=1.0),
                      KVRoute())
    if policy == "ray-default":
        return System(policy, name, _apply_autoscaling_config(replica_queue_length_autoscaling_policy),
                      AutoscalingConfig(**common, target_ongoing_requests=setting["target"], downscale_delay_s=delay),
                      make_request_count_route(2 * setting["target"]))
    if policy == "kv-threshold":
        fn = functools.partial(kv_threshold_policy, **setting)
    elif policy == "queue-kv-threshold":
        fn = functools.partial(queue_kv_threshold_policy, **setting)
    else:
        fn = functools.partial(sla_planner_policy, profile=profile, ttft_slo_s=slo[0], itl_slo_s=slo[1], **setting)
    return System(policy, name, _apply_autoscaling_config(fn), AutoscalingConfig(**common, downscale_delay_s=delay),
                  make_request_count_route(4 * profile.max_num_seqs))


# ---------------------------------------------------------------------------------------------- the run
def load_trace(name: str, start_minute: float, minutes: float, speedup: float, max_context: int,
               max_output: int) -> list[Request]:
    """Trace minutes [start_minute, start_minute + minutes), arrival times divided by speedup."""
    path = TRACE_DIR / f"AzureLLMInferenceTrace_{name}.csv"
    if not path.exists():
        raise SystemExit(f"trace not found: {path} (expected ../shared/data/azure-llm-2023 beside the project)")
    rows, t0 = [], None
    with path.open() as f:
        for row in csv.DictReader(f):
            ts = datetime.fromisoformat(row["TIMESTAMP"][:26]).timestamp()
            t0 = ts if t0 is None else t0
            offset = ts - t0 - start_minute * 60
            if offset < 0:
                continue
            if offset >= minutes * 60:
                break
            ctx = min(int(row["ContextTokens"]), max_context)
            out = max(1, min(int(row["GeneratedTokens"]), max_output, max_context + max_output - ctx))
            rows.append(Request(rid=len(rows), arrival=offset / speedup, prompt_len=max(1, ctx), output_len=out))
    return rows


class FakeClock:
    """Ray's delay logic reads time.time(); the simulation's clock stands in for it."""

    def __init__(self) -> None:
        self.now = 0.0

    def time(self) -> float:
        return self.now


def simulate(system: System, requests: list[Request], profile: ReplicaProfile, seed: int = 0) -> dict[str, Any]:
    import ray.serve.autoscaling_policy as ray_policy
    from ray.serve._private.common import DeploymentID, ReplicaID
    from ray.serve.config import AutoscalingContext

    clock = FakeClock()
    saved_time, ray_policy.time = ray_policy.time, types.SimpleNamespace(time=clock.time)
    try:
        return _simulate(system, [dataclasses.replace(r) for r in requests], profile, seed, clock,
                         DeploymentID(name="KVEngine", app_name="sim"), ReplicaID, AutoscalingContext)
    finally:
        ray_policy.time = saved_time


def _simulate(system, requests, profile, seed, clock, dep, ReplicaID, AutoscalingContext):
    rng = random.Random(seed)
    cfg = system.config
    replicas: list[SimReplica] = [SimReplica(profile, 0.0) for _ in range(cfg.initial_replicas)]
    for r in replicas:
        r.ready_at = 0.0  # the initial fleet is up when the trace starts
    events: list[tuple[float, int, str, Any]] = []
    seq_no = itertools.count()

    def push(t: float, kind: str, payload: Any = None) -> None:
        heapq.heappush(events, (t, next(seq_no), kind, payload))

    for req in requests:
        push(req.arrival, "arrive", req)
    end_of_trace = requests[-1].arrival if requests else 0.0
    push(0.0, "control")
    push(0.0, "metrics")
    push(0.0, "routing_stats")
    handle_queue: deque[Request] = deque()
    policy_state: dict[str, Any] = {}
    last_up = last_down = None
    done: list[Request] = []
    timeline: list[tuple[float, int, int, list[float]]] = []  # t, replicas, ongoing, KV use per replica

    def serving() -> list[SimReplica]:
        return [r for r in replicas if r.ready and r.ready_at <= clock.now]

    def kick(r: SimReplica) -> None:
        if r.busy_until is None and r.stopped_at is None:
            t = r.start_step(clock.now)
            if t is not None:
                push(t, "step_done", r)

    def route_queue() -> None:
        live = serving()
        while handle_queue and live:
            target = system.route(live, handle_queue[0], rng)
            if target is None:
                break
            req = handle_queue.popleft()
            target.add(req)
            kick(target)

    def maybe_stop(r: SimReplica) -> None:
        if r.draining and r.stopped_at is None and not r.requests:
            r.stopped_at = clock.now

    def more() -> bool:
        return clock.now <= end_of_trace or bool(handle_queue) or any(r.requests for r in replicas)

    while events:
        t, _, kind, payload = heapq.heappop(events)
        clock.now = t
        if kind == "arrive":
            handle_queue.append(payload)
            route_queue()
        elif kind == "step_done":
            r = payload
            done.extend(r.finish_step(t))
            maybe_stop(r)
            kick(r)
            if handle_queue:
                route_queue()
        elif kind == "metrics":
            for r in replicas:
                if r.stopped_at is None and r.ready_at <= t:
                    r.report(t)
            live = [r for r in replicas if r.stopped_at is None]
            timeline.append((t, len(live), len(handle_queue) + sum(r.ongoing for r in live),
                             [r.bm.num_used_blocks / r.bm.num_total_blocks for r in live if r.ready_at <= t]))
            if more():
                push(t + METRICS_PERIOD_S, "metrics")
        elif kind == "routing_stats":
            for r in serving():
                r.refresh_routing_stats(t)
            if more():
                push(t + ROUTING_STATS_PERIOD_S, "routing_stats")
        elif kind == "control":
            running = [r for r in replicas if r.ready and r.ready_at <= t]
            starting = [r for r in replicas if r.ready and r.ready_at > t]
            ids = {r: ReplicaID(unique_id=str(r.id), deployment_id=dep) for r in running}
            names = running[0].reports[-1][1].keys() if running and running[0].reports else ()
            aggregated = {m: {ids[r]: r.averaged(m) for r in running if r.reports} for m in names}
            total_requests = sum(r.averaged("ongoing") for r in running if r.reports) + len(handle_queue)
            ctx = AutoscalingContext(
                deployment_id=dep, deployment_name=dep.name, app_name=dep.app_name,
                current_num_replicas=len(running), target_num_replicas=len(running) + len(starting),
                running_replicas=list(ids.values()), total_num_requests=total_requests,
                total_queued_requests=float(len(handle_queue)), aggregated_metrics=aggregated, raw_metrics={},
                capacity_adjusted_min_replicas=cfg.min_replicas, capacity_adjusted_max_replicas=cfg.max_replicas,
                policy_state=dict(policy_state), last_scale_up_time=last_up, last_scale_down_time=last_down,
                current_time=t, config=cfg)
            desired, policy_state = system.fn(ctx)
            desired = max(cfg.min_replicas, min(cfg.max_replicas, math.ceil(desired)))
            have = len(running) + len(starting)
            if desired > have:
                for _ in range(desired - have):
                    replicas.append(SimReplica(profile, t))
                    push(t + profile.startup_s, "ready", replicas[-1])
                last_up = t
            elif desired < have:
                for _ in range(have - desired):  # starting ones first, then the least loaded
                    victim = starting.pop() if starting else min(
                        (r for r in running if r.ready), key=lambda r: (r.ongoing, -r.id))
                    victim.draining = True
                    if victim.ready_at > t:
                        victim.stopped_at = t
                    maybe_stop(victim)
                last_down = t
            if more():
                push(t + CONTROL_PERIOD_S, "control")
        elif kind == "ready":
            route_queue()

    horizon = max((r.finished for r in done), default=0.0)
    for r in replicas:
        if r.stopped_at is None:
            r.stopped_at = horizon
    return {
        "policy": system.policy, "setting": system.setting, "requests": len(requests), "completed": len(done),
        "replica_seconds": sum(max(0.0, r.stopped_at - r.started_at) for r in replicas),
        "preemptions": sum(r.scheduler.num_preemptions_total for r in replicas),
        "max_replicas": max((n for _, n, _, _ in timeline), default=0),
        "ttfts": [r.first_token - r.arrival for r in done], "itls": [r.itl for r in done],
        "timeline": timeline, "horizon": horizon,
    }


def score(result: dict[str, Any], ttft_slo: float, itl_slo: float) -> dict[str, Any]:
    """The row of OUT.json: cost, SLO attainment (unfinished requests miss) and tails."""
    met = sum(1 for a, b in zip(result["ttfts"], result["itls"]) if a <= ttft_slo and b <= itl_slo)

    def p99(xs: list[float]) -> float:
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(0.99 * len(xs)))] if xs else float("nan")

    return {"policy": result["policy"], "setting": result["setting"],
            "replica_seconds": round(result["replica_seconds"], 1),
            "slo_attainment": met / result["requests"] if result["requests"] else 1.0,
            "ttft_p99": round(p99(result["ttfts"]), 4), "itl_p99": round(p99(result["itls"]), 5),
            "preemptions": result["preemptions"], "completed": result["completed"], "requests": result["requests"]}


# ---------------------------------------------------------------------------------------------- sweeps and report
@functools.lru_cache(maxsize=4)
def _trace(name: str, start_minute: float, minutes: float, speedup: float, max_context: int,
           max_output: int) -> list[Request]:
    return load_trace(name, start_minute, minutes, speedup, max_context, max_output)


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    """One policy setting on one trace slice (a worker process runs many)."""
    import logging

    logging.getLogger("ray.serve").setLevel(logging.WARNING)  # the policy explains each decision; not here
    a = job["args"]
    requests = _trace(job["trace"], a["start_minute"], a["minutes"], a["speedup"], a["max_context"], a["max_output"])
    slo = (job["ttft_slo"] or max(a["ttft_slo"]), a["itl_slo"])
    system = build_system(job["policy"], job["setting"], job["profile"], slo, a["min_replicas"], a["max_replicas"],
                          a["initial_replicas"])
    t0 = time.perf_counter()
    result = simulate(system, requests, job["profile"])
    result["timeline"] = result["timeline"][::5]
    print(f"  {job['trace']} {system.policy} {system.setting}"
          f"{'' if job['ttft_slo'] is None else ' (TTFT SLO %g s)' % job['ttft_slo']}"
          f": {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return {**job, "result": result}


def pareto(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The points no other point beats on both cost (lower) and attainment (higher), by cost."""
    front, best = [], -1.0
    for cost, att in sorted(points, key=lambda p: (p[0], -p[1])):
        if att > best:
            front.append((cost, att))
            best = att
    return front


def summarize(trace: str, ttft_slo: float, rows: list[dict[str, Any]], target: float = 0.99) -> list[str]:
    """kvscale's default against the cheapest setting of each peer that reaches the target attainment."""
    ours = next(r for r in rows if r["policy"] == "kvscale" and r["setting"] == "default")
    lines = [f"kvscale default: {ours['slo_attainment']:.2%} of requests within the SLO at "
             f"{ours['replica_seconds']:.0f} replica-s" + ("" if ours["slo_attainment"] >= target else
                                                            f" (**below {target:.0%}**)")]
    for policy in POLICIES[1:]:
        ok = [r for r in rows if r["policy"] == policy and r["slo_attainment"] >= target]
        if not ok:
            best = max((r for r in rows if r["policy"] == policy), key=lambda r: r["slo_attainment"], default=None)
            lines.append(f"{policy}: no setting reaches {target:.0%}" + (
                f" (best {best['slo_attainment']:.2%} at {best['replica_seconds']:.0f} replica-s, {best['setting']})"
                if best else ""))
            continue
        cheapest = min(ok, key=lambda r: r["replica_seconds"])
        margin = 1 - ours["replica_seconds"] / cheapest["replica_seconds"]
        verdict = ("the same cost" if round(ours["replica_seconds"]) == round(cheapest["replica_seconds"]) else
                   f"{abs(margin):.1%} {'cheaper' if margin > 0 else 'dearer'}")
        lines.append(f"{policy}: cheapest setting at >= {target:.0%} is {cheapest['setting']} with "
                     f"{cheapest['replica_seconds']:.0f} replica-s ({cheapest['slo_attainment']:.2%}): kvscale "
                     f"{verdict}")
    return lines


def print_tables(trace: str, ttft_slo: float, rows: list[dict[str, Any]], header: str) -> None:
    print(f"\n### {trace}, TTFT SLO {ttft_slo:g} s, {header}\n")
    print("| policy | setting | replica-s | SLO attainment | TTFT p99 s | ITL p99 s | preemptions | done |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for r in sorted(rows, key=lambda r: (POLICIES.index(r["policy"]), r["replica_seconds"])):
        print(f"| {r['policy']} | {r['setting']} | {r['replica_seconds']:.0f} | {r['slo_attainment']:.2%} | "
              f"{r['ttft_p99']:.2f} | {r['itl_p99']:.3f} | {r['preemptions']} | {r['completed']}/{r['requests']} |")
    print()
    for line in summarize(trace, ttft_slo, rows):
        print(f"- {line}")


def plot_pareto(trace: str, by_slo: dict[float, list[dict[str, Any]]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(by_slo), figsize=(5.2 * len(by_slo), 4.4), squeeze=False)
    colors = dict(zip(POLICIES, ("tab:red", "tab:blue", "tab:green", "tab:orange", "tab:purple")))
    for ax, (slo, rows) in zip(axes[0], sorted(by_slo.items())):
        for policy in POLICIES:
            pts = [(r["replica_seconds"], r["slo_attainment"]) for r in rows if r["policy"] == policy]
            if not pts:
                continue
            ax.scatter(*zip(*pts), s=16, color=colors[policy], alpha=0.6)
            front = pareto(pts)
            ax.plot(*zip(*front), color=colors[policy], label=policy, lw=1.2, drawstyle="steps-post")
        ours = next(r for r in rows if r["policy"] == "kvscale" and r["setting"] == "default")
        ax.scatter([ours["replica_seconds"]], [ours["slo_attainment"]], marker="*", s=180, color="tab:red",
                   edgecolor="black", zorder=5, label="kvscale default")
        ax.axhline(0.99, color="gray", ls="--", lw=0.8)
        ax.set_ylim(max(0.0, min(r["slo_attainment"] for r in rows) - 0.02), 1.005)
        ax.set_xlabel("replica-seconds")
        ax.set_ylabel("SLO attainment")
        ax.set_title(f"{trace}: TTFT SLO {slo:g} s", fontsize=10)
        ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)
    print(f"Pareto fronts: {out}")


def plot_timeline(trace: str, shown: list[tuple[dict[str, Any], dict[str, Any]]], requests: list[Request],
                  out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1 + len(shown), 1, figsize=(11, 2.4 * (1 + len(shown))), sharex=True)
    horizon = max(res["horizon"] for res, _ in shown)
    bins = max(1, int(horizon // 10) + 1)
    load = [0.0] * bins
    for q in requests:
        load[min(bins - 1, int(q.arrival // 10))] += q.prompt_len / 10.0
    axes[0].plot([i * 10 for i in range(bins)], load, color="gray")
    axes[0].set_ylabel("prompt tokens/s")
    axes[0].set_title(f"Azure {trace} trace: offered load, replicas and KV use per replica")
    for ax, (res, row) in zip(axes[1:], shown):
        ts = [p[0] for p in res["timeline"]]
        ax.step(ts, [p[1] for p in res["timeline"]], where="post", color="black")
        ax.set_ylabel("replicas")
        ax2 = ax.twinx()
        for t, _, _, use in res["timeline"]:
            ax2.scatter([t] * len(use), use, s=2, color="tab:blue", alpha=0.4)
        ax2.set_ylim(0, 1.05)
        ax2.set_ylabel("KV used")
        ax.set_title(f"{row['policy']} {row['setting']}: {row['replica_seconds']:.0f} replica-s, "
                     f"SLO attainment {row['slo_attainment']:.2%}", fontsize=9)
    axes[-1].set_xlabel("simulated seconds")
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)
    print(f"timeline: {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", choices=["conv", "code", "both"], default="both")
    ap.add_argument("--start-minute", type=float, default=0.0, help="first minute of the trace to replay")
    ap.add_argument("--minutes", type=float, default=60.0, help="minutes of the trace to replay (before speed-up)")
    ap.add_argument("--speedup", type=float, default=1.0, help="divide the trace's arrival times by this")
    ap.add_argument("--ttft-slo", type=float, nargs="+", default=[1.0, 2.0, 5.0], help="TTFT SLOs, seconds")
    ap.add_argument("--itl-slo", type=float, default=0.05, help="SLO on each request's mean inter-token latency, s")
    ap.add_argument("--max-context", type=int, default=8192)
    ap.add_argument("--max-output", type=int, default=2048)
    ap.add_argument("--min-replicas", type=int, default=1)
    ap.add_argument("--max-replicas", type=int, default=32)
    ap.add_argument("--initial-replicas", type=int, default=2, help="the fleet when the slice starts (all policies)")
    ap.add_argument("--profile", choices=["h100", "a10g", "measured"], default="h100")
    ap.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    ap.add_argument("--quick", action="store_true", help="fewer settings per policy")
    ap.add_argument("--jobs", type=int, default=2, help="worker processes")
    ap.add_argument("--json", help="write every row (policy, setting, replica_seconds, slo_attainment, ...) here")
    ap.add_argument("--png-dir", default=None, help="write the Pareto and timeline PNGs here")
    args = ap.parse_args()
    if "kvscale" not in args.policies:
        args.policies.insert(0, "kvscale")
    profile = {"h100": h100_profile, "a10g": gpu_profile, "measured": measured_profile}[args.profile]()
    shared = {k: getattr(args, k) for k in ("start_minute", "minutes", "speedup", "max_context", "max_output",
                                             "min_replicas", "max_replicas", "initial_replicas", "itl_slo",
                                             "ttft_slo")}
    traces = ["conv", "code"] if args.trace == "both" else [args.trace]
    jobs = []
    for trace in traces:
        for policy in args.policies:
            slo_bound = policy in ("kvscale", "sla-planner")  # the others do not read the SLO: one run serves all
            for setting in settings(policy, args.quick):
                for slo in (args.ttft_slo if slo_bound else [None]):
                    jobs.append({"trace": trace, "policy": policy, "setting": setting, "ttft_slo": slo,
                                 "profile": profile, "args": shared})
    print(f"{len(jobs)} simulations on {args.jobs} processes", file=sys.stderr)
    if args.jobs > 1:
        import multiprocessing

        with multiprocessing.get_context("fork").Pool(args.jobs) as pool:
            done = pool.map(run_job, jobs, chunksize=1)
    else:
        done = [run_job(j) for j in jobs]
    header = (f"minutes {args.start_minute:g}-{args.start_minute + args.minutes:g} of the trace at {args.speedup:g}x, "
              f"context <= {args.max_context}, output <= {args.max_output}, ITL SLO {args.itl_slo:g} s; replica: "
              f"{profile.name}, {profile.num_blocks} KV blocks of {profile.block_size}, start-up "
              f"{profile.startup_s:.0f} s; replicas {args.min_replicas}..{args.max_replicas}, "
              f"{args.initial_replicas} at the start")
    out_rows = []
    for trace in traces:
        by_slo: dict[float, list[dict[str, Any]]] = {}
        for slo in args.ttft_slo:
            rows = []
            for job in done:
                if job["trace"] == trace and job["ttft_slo"] in (None, slo):
                    rows.append({**score(job["result"], slo, args.itl_slo), "trace": trace, "ttft_slo": slo,
                                 "itl_slo": args.itl_slo, "_result": job["result"]})
            by_slo[slo] = rows
            print_tables(trace, slo, rows, header)
            out_rows += [{k: v for k, v in r.items() if k != "_result"} for r in rows]
        if args.png_dir:
            try:
                import matplotlib  # noqa: F401
            except ImportError:
                print("(matplotlib not installed: no PNGs; pip install matplotlib)")
                continue
            Path(args.png_dir).mkdir(parents=True, exist_ok=True)
            plot_pareto(trace, by_slo, Path(args.png_dir) / f"autoscale_{trace}_pareto.png")
            mid = sorted(by_slo)[len(by_slo) // 2]
            rows = by_slo[mid]
            ours = next(r for r in rows if r["policy"] == "kvscale" and r["setting"] == "default")
            peers = [r for r in rows if r["policy"] != "kvscale" and r["slo_attainment"] >= 0.99]
            shown = [ours] + ([min(peers, key=lambda r: r["replica_seconds"])] if peers else [])
            requests = _trace(trace, args.start_minute, args.minutes, args.speedup, args.max_context, args.max_output)
            plot_timeline(trace, [(r["_result"], r) for r in shown], requests,
                          Path(args.png_dir) / f"autoscale_{trace}.png")
    if args.json:
        Path(args.json).write_text(json.dumps(out_rows, indent=1))
        print(f"rows: {args.json}")


if __name__ == "__main__":
    main()
