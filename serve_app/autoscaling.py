"""The autoscaling rule: replicas for three resources (KV memory, compute, arrivals) against latency SLOs.

Every Ray control tick the policy works out how many replicas each resource needs and takes the largest:

- **KV memory**: ceil(projected KV demand / (target utilization x blocks per replica)); demand is what the live
  requests will hold at their end, a shared prompt block counted once (engine.kv_demand), plus requests the
  router holds back, at the mean projected size.
- **Compute**: each replica learns its own step time, c0 + c1 x tokens + c2 x KV tokens read
  (engine.perf_model, from its real steps), and reports it. With the fleet's running sequences, their context
  and the prompt tokens arriving per second spread over r replicas, a step takes
  t = (c0 + c1 b + c2 k) / (1 - c1 p) (b sequences and k KV tokens per replica, p prompt tokens/s per replica,
  prefill chunks sharing the steps), at most a full token budget's step. The fewest r with t within the ITL
  SLO, a mean prompt's service plus its p99 queueing wait (M/D/1) within the TTFT SLO, and the prompt tokens
  already queued computed within it too (what the replicas running now cannot compute before a new one is up:
  a replica asked for now helps only after its start-up).
- **Arrivals**: the fleet's arrival rate (requests and prompt tokens per second, measured at the replicas)
  is forecast over the replica start-up time (learned from this deployment's own scale-ups) by a linear
  trend over the last minute, when the trend stands out of the noise; KV and compute are sized for it.

Up at once (a replica more per `pressure_settle_s` when requests wait for KV, are preempted, the observed p99
ITL exceeds the SLO, or the observed p99 TTFT has exceeded it for a latency window); down only after
`downscale_quiet_s` without pressure, and never below the most the sustained load needed over the last
`downscale_window_s` (which also holds the fleet at start until that much history is seen). The sustained need:
KV now, compute at the last minute's mean arrival rate, and the bursts of the last two minutes replayed through
a fluid queue at r replicas' prefill rate, the fewest r whose worst queueing stays within the TTFT SLO (a loose
SLO lets a burst queue and costs fewer replicas than a tight one); not the forecast or the backlog of the moment,
which hold only until their replicas are up and a quiet period has passed. Every decision is logged in words
with the resource that bound it. A plain function of Ray Serve's AutoscalingContext (KVAutoscalingPolicy hands it
its settings); its memory lives in policy_state.

The SLO: a request meets it when its TTFT (from arrival at the ingress) is within ttft_slo_s and its mean
inter-token latency (first to last token) within itl_slo_s; bench/autoscale_sim.py scores the share that do.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("ray.serve")

POLICY = "serve_app.autoscaling:KVAutoscalingPolicy"
AUTOSCALER_REPORT_S = 5.0  # the policy's decision reaches /metrics on every change and at least this often
ITL_MARGIN = 1.0  # size compute so the modelled step is within this fraction of the ITL SLO
TTFT_MARGIN = 1.0  # ... and the prompt's p99 (TAIL_FACTOR) service and queueing within this fraction of the TTFT SLO
TAIL_FACTOR = 4.6  # p99 of an exponential-like wait is ~ln(100) x its mean
RHO_MAX = 0.9  # never plan a replica's prefill above this share of its steps
HISTORY_S = 120.0  # how much of the fleet's recent arrival rates the policy remembers
TREND_S = 60.0  # the arrival forecast's linear trend is fitted over this long
LEVEL_S = 10.0  # ... from this recent level
TREND_T = 3.0  # ... when its slope is this many standard errors above zero
MAX_GROWTH = 4.0  # a forecast never asks for more than this multiple of today's load
LATENCY_WINDOW_S = 15.0  # replicas report TTFT / ITL quantiles over this long
ARRIVAL_WINDOW_S = 5.0  # replicas report arrival rates over this long
SUSTAINED_WINDOW_S = 60.0  # the floor sizes for the fleet's mean arrival rate over this long (and its bursts)
BREACH_PERSIST_S = LATENCY_WINDOW_S  # an observed TTFT breach asks for a replica once it has lasted this long
MIN_LATENCY_SAMPLES = 8  # fewer observations than this in the window: no latency pressure from them


@dataclass(frozen=True)
class SLO:
    ttft_s: float
    itl_s: float


def default_slo(on_gpu: bool) -> SLO:
    """TTFT / ITL targets when the config names none: an interactive chat on a GPU (1 s to the first token,
    20 tokens/s per stream), and what a CPU replica of a small model can hold under load (5 s, 4 tokens/s)."""
    return SLO(1.0, 0.05) if on_gpu else SLO(5.0, 0.25)


class LatencyWindow:
    """Recent observations (TTFT, or a finished request's mean ITL) and their quantile, on a replica."""

    def __init__(self, window_s: float = LATENCY_WINDOW_S) -> None:
        self.window_s = window_s
        self.samples: deque[tuple[float, float]] = deque()

    def add(self, now: float, value: float) -> None:
        self.samples.append((now, value))

    def quantile(self, now: float, q: float) -> float:
        while self.samples and self.samples[0][0] < now - self.window_s:
            self.samples.popleft()
        if len(self.samples) < MIN_LATENCY_SAMPLES:
            return 0.0
        values = sorted(v for _, v in list(self.samples))  # list() in one step: the event loop may be adding
        return values[min(len(values) - 1, int(q * len(values)))]


class ArrivalMeter:
    """Requests and prompt tokens arriving per second at a replica, and tokens generated per second, from the
    scheduler's cumulative counts over the last `window_s`."""

    def __init__(self, window_s: float = ARRIVAL_WINDOW_S) -> None:
        self.window_s = window_s
        self.points: deque[tuple[float, int, int, int]] = deque()

    def rates(self, now: float, stats: Any) -> tuple[float, float, float]:
        counts = (stats.num_added_total, stats.num_added_prompt_tokens_total, stats.num_generation_tokens_total)
        self.points.append((now, *counts))
        while len(self.points) > 2 and self.points[1][0] <= now - self.window_s:
            self.points.popleft()
        t0, *first = self.points[0]
        span = max(now - t0, 1.0)
        return tuple((c - c0) / span for c, c0 in zip(counts, first))  # type: ignore[return-value]


def autoscaling_metrics(stats: Any, num_preempted: int, arrivals: tuple[float, float, float] = (0.0, 0.0, 0.0),
                        ttft_recent_s: float = 0.0, itl_recent_s: float = 0.0,
                        queue_recent_s: float = 0.0) -> dict[str, float]:
    """What a replica reports to the policy (record_autoscaling_stats), from an engine.llm_engine.EngineStats
    snapshot, its ArrivalMeter and its LatencyWindows; the simulator (bench/autoscale_sim.py) reports through
    this same function."""
    c0, c1, c2 = stats.step_model
    return {"kv_total_blocks": float(stats.kv_capacity_blocks), "kv_free_blocks": float(stats.num_free_blocks),
            "kv_used_blocks": float(stats.num_used_blocks), "kv_demand_blocks": float(stats.kv_demand_blocks),
            "num_waiting": float(stats.num_waiting), "num_waiting_for_kv": float(stats.num_waiting_for_kv),
            "num_requests": float(stats.num_running + stats.num_waiting), "preemptions": float(num_preempted),
            "num_running": float(stats.num_running), "running_tokens": float(stats.num_running_tokens),
            "prefill_backlog_tokens": float(stats.num_prefill_backlog_tokens),
            "step_token_budget": float(stats.max_num_batched_tokens),
            "step_c0": c0, "step_c1": c1, "step_c2": c2,
            "arrival_rps": arrivals[0], "arrival_prompt_tps": arrivals[1], "generation_tps": arrivals[2],

            "ttft_recent_s": ttft_recent_s, "itl_recent_s": itl_recent_s, "queue_recent_s": queue_recent_s}


@dataclass(frozen=True)
class FleetLoad:
    """What the fleet carries now, summed over reporting replicas."""

    running: float  # sequences in the running batches
    running_tokens: float  # their context (KV a decode step reads)
    prefill_tps: float  # prompt tokens arriving per second
    arrival_rps: float  # requests arriving per second
    backlog_tokens: float = 0.0  # prompt tokens admitted or queued but not computed yet
    token_budget: float = math.inf  # a replica's tokens per step (max_num_batched_tokens)

    def scaled(self, g: float) -> FleetLoad:
        return dataclasses.replace(self, running=self.running * g, running_tokens=self.running_tokens * g,
                                   prefill_tps=self.prefill_tps * g, arrival_rps=self.arrival_rps * g)


def modelled_latency(load: FleetLoad, coeffs: tuple[float, float, float], r: int) -> tuple[float, float, float, float]:
    """(prefill share rho, step s, a mean prompt's service s, its p99 queueing wait s) with the load spread over
    r replicas. Prefill chunks share the steps with the decodes: a step computes its b decodes and p x step
    prompt tokens, t = (c0 + c1 b + c2 k) / (1 - c1 p), but never more tokens than the token budget (chunked
    prefill caps it). The wait is infinite when prefill would take every step."""
    c0, c1, c2 = coeffs
    mean_prompt = load.prefill_tps / load.arrival_rps if load.arrival_rps > 0 else 0.0
    b, k, p = load.running / r, load.running_tokens / r, load.prefill_tps / r
    rho = c1 * p
    service = c0 + c1 * mean_prompt + c2 * k
    full_step = c0 + c1 * max(b, load.token_budget) + c2 * k
    if rho >= 1.0:
        return rho, full_step, service, math.inf
    step = min((c0 + c1 * b + c2 * k) / (1 - rho), full_step)
    return rho, step, service, TAIL_FACTOR * rho * service / (2 * (1 - rho))


def compute_replicas(load: FleetLoad, coeffs: tuple[float, float, float], slo: SLO, limit: int,
                     ready: int = 0, startup_s: float = 0.0) -> tuple[int, str]:
    """The fewest replicas whose modelled step time meets the ITL target, whose prompt service plus queueing
    tail meets the TTFT target, and that compute the prompt tokens already queued (backlog) within the TTFT
    target, for this load; with the reason in words for the decision log. A replica asked for now serves only
    after startup_s: the `ready` replicas compute the backlog until then, and only what they leave counts."""
    if all(c <= 0 for c in coeffs) or load.running <= 0 and load.prefill_tps <= 0 and load.backlog_tokens <= 0:
        return 0, "no load"
    itl_target, ttft_target = ITL_MARGIN * slo.itl_s, TTFT_MARGIN * slo.ttft_s
    backlog = load.backlog_tokens
    if ready > 0 and backlog > 0:
        rho_now = min(modelled_latency(load, coeffs, ready)[0], RHO_MAX)
        backlog -= ready * startup_s * (1 - rho_now) / max(coeffs[1], 1e-12)
    why = ""
    for r in range(1, limit + 1):
        rho, step, service, wait = modelled_latency(load, coeffs, r)
        drain = coeffs[1] * max(0.0, backlog) / r / max(1e-9, 1 - min(rho, RHO_MAX))
        if drain > ttft_target:
            why = (f"the {load.backlog_tokens:.0f} queued prompt tokens would take {drain:.2f} s to compute"
                   + (f" after the {startup_s:.0f} s a new replica takes to start" if ready > 0 else ""))
            continue
        if rho >= RHO_MAX:
            why = f"prefill would take {rho:.0%} of each replica's time"
            continue
        if step > itl_target:
            why = f"a step would take {step * 1e3:.0f} ms, over the ITL target {itl_target * 1e3:.0f} ms"
            continue
        # a prompt's own service (no replica count shortens it), then its queueing tail, which more replicas do
        if wait > max(ttft_target - service - step, 0.25 * ttft_target):
            why = (f"a prompt's p99 TTFT would be {service + step + wait:.2f} s, over the TTFT target "
                   f"{ttft_target:.2f} s")
            continue
        return r, (f"at {r - 1} replica(s) {why}" if r > 1 and why else "fits")
    return limit, f"at {limit} replicas {why}"


def burst_replicas(history: list[tuple[float, float, float]], load: FleetLoad, coeffs: tuple[float, float, float],
                   slo: SLO, limit: int) -> int:
    """The fewest replicas that would have computed every burst of the remembered prompt-token arrivals
    (history) within the TTFT target: a fluid queue replayed over the history, each replica computing prompt
    tokens at its full-step rate (a token budget a step, less the running decodes)."""
    c0, c1, c2 = coeffs
    if c1 <= 0 or len(history) < 2:
        return 0
    budget_tokens = min(load.token_budget, 8192.0)  # no budget reported: a large prefill chunk
    for r in range(1, limit + 1):
        b, k = load.running / r, load.running_tokens / r
        cap = r * max(budget_tokens - b, 1.0) / (c0 + c1 * budget_tokens + c2 * k)
        service = modelled_latency(load, coeffs, r)[2]  # a mean prompt's own compute
        allowed = max(TTFT_MARGIN * slo.ttft_s - service, 0.25 * TTFT_MARGIN * slo.ttft_s)
        queue = worst = 0.0
        for (t0, _, _), (t1, p, _) in zip(history, history[1:]):
            queue = max(0.0, queue + (p - cap) * (t1 - t0))
            worst = max(worst, queue / cap)
        if worst <= allowed:
            return r
    return limit


def forecast_growth(history: list[tuple[float, float, float]], now: float, horizon_s: float) -> float:
    """Growth of the load at now + horizon_s over its level now: a linear trend of the fleet's prompt-token
    arrival rate over TREND_S, from its level over LEVEL_S, when the trend stands out of the rate's noise (its
    slope over TREND_T standard errors); >= 1 (no forecast shrinks the fleet)."""
    recent = [(t, p) for t, p, _ in history if t >= now - TREND_S]
    level_pts = [p for t, p in recent if t >= now - LEVEL_S]
    if not history or now - history[0][0] < TREND_S or len(recent) < 5 or not level_pts:
        return 1.0  # less than a trend's worth of history (a fleet just started, or its rates still warming up)
    level = sum(level_pts) / len(level_pts)
    n = len(recent)
    mt = sum(t for t, _ in recent) / n
    mp = sum(p for _, p in recent) / n
    var = sum((t - mt) ** 2 for t, _ in recent)
    slope = sum((t - mt) * (p - mp) for t, p in recent) / var if var > 0 else 0.0
    residual = sum((p - mp - slope * (t - mt)) ** 2 for t, p in recent)
    if var <= 0 or slope <= TREND_T * math.sqrt(residual / max(1, n - 2) / var):
        return 1.0  # no trend beyond the noise
    ahead = max(level, level + slope * (horizon_s + LEVEL_S / 2))
    return min(MAX_GROWTH, ahead / level) if level > 0 else 1.0


def kvscale_policy(ctx: Any, target_utilization: float = 0.75, downscale_quiet_s: float = 30.0,
                   pressure_settle_s: float = 10.0, ttft_slo_s: float = 2.0, itl_slo_s: float = 0.1,
                   startup_s: float = 30.0, downscale_window_s: float | None = None,
                   forecast: bool = True) -> tuple[int, dict[str, Any]]:
    state = dict(ctx.policy_state or {})
    now = ctx.current_time or 0.0
    lo, hi = ctx.capacity_adjusted_min_replicas, ctx.capacity_adjusted_max_replicas
    current = ctx.current_num_replicas
    metrics = ctx.aggregated_metrics or {}
    slo = SLO(ttft_slo_s, itl_slo_s)
    window_s = downscale_quiet_s if downscale_window_s is None else downscale_window_s
    state.setdefault("started_at", now)
    startup = _learn_startup(ctx, state, now, startup_s)

    def clamp(n: int) -> int:
        return max(lo, min(hi, n))

    totals = metrics.get("kv_total_blocks") or {}
    if current == 0 or not totals:  # nobody reporting yet: wake from zero on traffic, else hold
        wake = 1 if _value(ctx.total_num_requests) > 0 else 0
        return clamp(max(current, wake)), state

    def total(name: str) -> float:
        return sum((metrics.get(name) or {}).values())

    blocks_per_replica = sum(totals.values()) / len(totals)
    demand = total("kv_demand_blocks")
    # Requests the router holds back (no replica has room) wait in the callers: count them at the mean
    # projected size of the requests the replicas hold. Where the replicas hold none, every one has room and the
    # router holds nothing back: the queued ones are in transit, and the replicas' next report counts them (a
    # guessed size here once scaled a fleet of 3-block chats on KV memory).
    queued = _value(ctx.total_queued_requests)
    held = total("num_requests")
    if queued > 0 and held > 0:
        demand += queued * demand / held
    arrivals = total("arrival_rps")
    mean_prompt = total("arrival_prompt_tps") / arrivals if arrivals > 0 else 0.0
    budgets = [v for v in (metrics.get("step_token_budget") or {}).values() if v > 0]
    load = FleetLoad(total("num_running"), total("running_tokens"), total("arrival_prompt_tps"), arrivals,
                     total("prefill_backlog_tokens") + queued * mean_prompt,  # the router's held ones too
                     min(budgets) if budgets else math.inf)
    history = state.setdefault("history", [])
    if not history or now - history[-1][0] >= 1.0:
        history.append((now, load.prefill_tps, load.arrival_rps))
        while history and history[0][0] < now - HISTORY_S:
            history.pop(0)
    growth = forecast_growth(history, now, startup) if forecast else 1.0
    ahead = load.scaled(growth)
    coeffs = _fleet_coefficients(metrics)
    ttft_seen, itl_seen = _max(metrics, "ttft_recent_s"), _max(metrics, "itl_recent_s")

    kv_need = math.ceil(growth * demand / (target_utilization * blocks_per_replica)) if demand > 0 else 0
    compute_need, compute_why = compute_replicas(ahead, coeffs, slo, max(hi, 1), current, startup)
    # the resource that binds; on a tie compute (KV alone would not have asked for more)
    needed, bound = (kv_need, "kv_memory") if kv_need > compute_need else (compute_need, "compute")
    # The floor remembers what the sustained load needed: arrivals at their mean rate of the last minute (random
    # queueing), and the bursts of the remembered history computed within the TTFT SLO (a fluid replay: a looser
    # SLO lets a burst queue, a tight one needs its peak); not the forecast or the backlog of the moment (a
    # forecast that did not come true, or a burst's queue, must not hold replicas for a whole window): those hold
    # only until their replicas are up and have had a quiet period to prove them wrong.
    kv_now = math.ceil(demand / (target_utilization * blocks_per_replica)) if demand > 0 else 0
    recent = [(p, r) for t, p, r in history if t >= now - SUSTAINED_WINDOW_S]
    sustained = dataclasses.replace(load, backlog_tokens=0.0, prefill_tps=sum(p for p, _ in recent) / len(recent),
                                    arrival_rps=sum(r for _, r in recent) / len(recent))
    needed_now = max(kv_now, compute_replicas(sustained, coeffs, slo, max(hi, 1))[0],
                     burst_replicas(history, load, coeffs, slo, max(hi, 1)))
    floor = max(_note_need(state, now, needed_now, window_s),
                _note_need(state, now, needed, startup + downscale_quiet_s, key="transient_needs"))
    look = {"demand": demand, "needed": needed, "kv_need": kv_need, "compute_need": compute_need,
            "growth": growth, "startup_s": startup, "bound": bound}
    state["last_look"] = look
    forecast_words = (f"; arrivals forecast {growth:.1f}x today's in {startup:.0f} s (replica start-up)"
                      if growth > 1.05 else "")
    need_words = (f"KV needs {kv_need} (projected demand {demand:.0f} blocks at {target_utilization:.0%} of "
                  f"{blocks_per_replica:.0f}), compute needs {compute_need} ({compute_why}){forecast_words}")

    waiting = total("num_waiting_for_kv")  # queued for memory, not for a step
    preempted = total("preemptions")
    pressure = []
    if waiting > 0 or preempted > 0:
        pressure.append("requests wait for KV blocks or were preempted")
    # An observed TTFT breach counts once it has lasted a latency window: a short burst's misses leave the window
    # within it, and a replica asked for then would serve only after the burst (a start-up later).
    if ttft_seen > slo.ttft_s:
        state.setdefault("breach_since", now)
    else:
        state.pop("breach_since", None)
    if ttft_seen > slo.ttft_s and now - state["breach_since"] >= BREACH_PERSIST_S:
        pressure.append(f"observed TTFT {ttft_seen:.2f} s (p99, from arrival at the ingress; queued before the first "
                        f"step up to {_max(metrics, 'queue_recent_s'):.2f} s) is over the {slo.ttft_s:g} s SLO")
    if itl_seen > slo.itl_s:
        pressure.append(f"observed ITL {itl_seen * 1e3:.0f} ms is over the {slo.itl_s * 1e3:.0f} ms SLO")
    if pressure:
        # One more replica per settle period: requests already queued on a full replica stay there, so
        # the pressure can outlast the replica added for it; the router sends new work to the new one.
        state["last_pressure_time"] = now
        target = max(ctx.target_num_replicas or current, current)
        settled = now - (ctx.last_scale_up_time or -math.inf) >= pressure_settle_s
        extra = current + 1 if settled and target == current else target
        desired = clamp(max(needed, extra))
        _note_need(state, now, desired, startup + downscale_quiet_s, key="transient_needs")
        reason = bound if desired <= needed else "kv_pressure" if waiting > 0 or preempted > 0 else "slo_pressure"
        return _decide(desired, current, reason, f"{reason}: {'; '.join(pressure)}; {need_words}", state)
    if needed >= current:  # the whole fleet is needed: not quiet
        state["last_pressure_time"] = now
    # replicas still starting stay asked for while the window's need covers them (answering `current` would
    # cancel them)
    keep = min(max(ctx.target_num_replicas or current, current), floor)
    if needed > current:
        return _decide(clamp(max(needed, keep)), current, bound, f"{bound} binds: {need_words}", state)
    # Down only after a quiet period since the last pressure and since the last step down, to the most any
    # resource needed over the window (and not before the policy has seen that much). The answer stays the
    # same on every call of that stretch: Ray applies it only once it has held for downscale_delay_s.
    quiet_since = max(state.get("last_pressure_time", -math.inf), ctx.last_scale_down_time or -math.inf,
                      state["started_at"] + window_s - downscale_quiet_s)
    if floor < current and now - quiet_since >= downscale_quiet_s:
        return _decide(clamp(floor), current, "quiet", f"quiet for {downscale_quiet_s:.0f} s and the most needed over "
                       f"the last {window_s:.0f} s is {floor}: {need_words}", state)
    holding = clamp(max(current, keep))
    if holding == current:  # nothing pending: a later change, even the same as an earlier one, is a new decision
        state["last_logged"] = None
    return holding, state


def _note_need(state: dict[str, Any], now: float, needed: int, window_s: float, key: str = "needs") -> int:
    """Remembers the replicas needed (per second, the most) and returns the most over the last window_s."""
    looks = state.setdefault(key, [])
    if looks and now - looks[-1][0] < 1.0:
        looks[-1] = (looks[-1][0], max(looks[-1][1], needed))
    else:
        looks.append((now, needed))
    while looks and looks[0][0] < now - window_s:
        looks.pop(0)
    return max(n for _, n in looks)


def _fleet_coefficients(metrics: dict[str, dict]) -> tuple[float, float, float]:
    """The replicas' step-time models, averaged over those that have measured something."""
    rows = [(metrics["step_c0"][r], metrics["step_c1"][r], metrics["step_c2"][r])
            for r in (metrics.get("step_c0") or {}) if r in (metrics.get("step_c1") or {})
            and r in (metrics.get("step_c2") or {})]
    rows = [row for row in rows if any(v > 0 for v in row)]
    if not rows:
        return (0.0, 0.0, 0.0)
    return tuple(sum(row[i] for row in rows) / len(rows) for i in range(3))  # type: ignore[return-value]


def _learn_startup(ctx: Any, state: dict[str, Any], now: float, default: float) -> float:
    """Replica start-up time, learned from this deployment's own scale-ups: from the first tick a replica was
    asked for (target above running) to the tick it runs; the mean of the last few, the setting until then."""
    current, target = ctx.current_num_replicas, ctx.target_num_replicas or ctx.current_num_replicas
    asked = state.setdefault("asked_at", [])  # when each replica still starting was first seen asked for
    seen_running = state.get("seen_running", current)
    if current > seen_running and asked:
        samples = state.setdefault("startup_samples", [])
        for _ in range(min(current - seen_running, len(asked))):
            samples.append(now - asked.pop(0))
        del samples[:-5]
    state["seen_running"] = current
    starting = max(0, target - current)
    del asked[starting:]
    asked.extend([now] * (starting - len(asked)))
    samples = state.get("startup_samples")
    return sum(samples) / len(samples) if samples else default


def _max(metrics: dict[str, dict], name: str) -> float:
    return max((metrics.get(name) or {}).values(), default=0.0)


def _decide(desired: int, current: int, reason: str, why: str, state: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """Returns the decision, logging it (once per change) in words for whoever reads the controller log and
    counting it by direction and reason (state["decisions"], which /metrics shows)."""
    change = f"{current}->{desired}"
    if desired != current and state.get("last_logged") != change:
        logger.info(f"kvscale autoscaling: {current} -> {desired} replicas: {why}")
        state["last_logged"] = change
        key = f"{'up' if desired > current else 'down'}:{reason}"
        state["decisions"] = {**state.get("decisions", {}), key: state.get("decisions", {}).get(key, 0) + 1}
    return desired, state


def _value(x: Any) -> float:
    """Ray passes some context fields as zero-argument callables (evaluated lazily)."""
    x = x() if callable(x) else x
    return float(x or 0.0)


class KVAutoscalingPolicy:
    """What Ray Serve is given: Ray 2.60 forwards `policy_kwargs` only to a policy that is a class (it
    instantiates it once and calls it every tick); a plain function would get Ray's context alone and
    run on its defaults. This holds the kwargs and calls kvscale_policy with them."""

    def __init__(self, **policy_kwargs: Any) -> None:
        self.policy_kwargs = policy_kwargs
        self._board = None
        self._reported: tuple[float, tuple] = (-math.inf, ())  # (when, what) the board last got

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        desired, state = kvscale_policy(ctx, **self.policy_kwargs)
        self._report(ctx, desired, state)
        return desired, state

    def _report(self, ctx: Any, desired: int, state: dict[str, Any]) -> None:
        """The decision to the app's stats board (for /metrics), on every change and every AUTOSCALER_REPORT_S;
        never in the way of the decision itself."""
        look = state.get("last_look", {})
        report = {"autoscaler_current_replicas": ctx.current_num_replicas, "autoscaler_desired_replicas": desired,
                  "autoscaler_demand_blocks": look.get("demand", 0.0),
                  "autoscaler_needed_replicas": look.get("needed", 0),
                  "autoscaler_kv_need_replicas": look.get("kv_need", 0),
                  "autoscaler_compute_need_replicas": look.get("compute_need", 0),
                  "autoscaler_forecast_growth": look.get("growth", 1.0),
                  "autoscaler_startup_seconds": look.get("startup_s", 0.0), "decisions": state.get("decisions", {})}
        what = (ctx.current_num_replicas, desired, round(report["autoscaler_demand_blocks"]),
                tuple(sorted(report["decisions"].items())))
        now = time.monotonic()
        if what == self._reported[1] and now - self._reported[0] < AUTOSCALER_REPORT_S:
            return
        import ray

        if not ray.is_initialized():  # outside a Ray process (the simulator, tests): no board, and no Ray
            return  # started by get_actor's auto-init
        try:
            from serve_app.metrics import BOARD_NAMESPACE, board_name

            if self._board is None:
                self._board = ray.get_actor(board_name(ctx.app_name), namespace=BOARD_NAMESPACE)
            self._board.put_autoscaler.remote(report)
            self._reported = (now, what)
        except Exception:  # no board yet (the ingress makes it), or it went with its owner: look again next time
            self._board = None
            self._reported = (now, ())


def autoscaling_config(config: Any) -> dict[str, Any]:
    return {
        "min_replicas": config.min_replicas, "max_replicas": config.max_replicas,
        "initial_replicas": max(config.min_replicas, 1),
        "metrics_interval_s": 1.0, "look_back_period_s": 5.0,
        "upscale_delay_s": 1.0, "downscale_delay_s": 1.0,
        "policy": {"policy_function": POLICY, "policy_kwargs": policy_kwargs(config)},
    }


def policy_kwargs(config: Any) -> dict[str, Any]:
    """The policy's settings from a ServeConfig (SLOs resolved for the replicas' device)."""
    slo = config.slo()
    return {"target_utilization": config.kv_target_utilization, "downscale_quiet_s": config.downscale_quiet_s,
            "downscale_window_s": config.downscale_window_s, "ttft_slo_s": slo.ttft_s, "itl_slo_s": slo.itl_s,
            "startup_s": config.replica_startup_s}
