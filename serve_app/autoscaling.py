"""The autoscaling rule: replicas from projected KV demand, not from request counts.

desired = ceil(total projected KV demand / (target_utilization x blocks per replica)), within min/max.
Up at once when requests wait for KV or preemptions happen (at least one more replica); down only after
`downscale_quiet_s` with no pressure and demand below target on the smaller fleet, one replica at a time.
A plain function of Ray Serve's AutoscalingContext; its memory lives in policy_state.
"""
from __future__ import annotations

import math
from typing import Any

POLICY = "serve_app.autoscaling:kv_autoscaling_policy"


def kv_autoscaling_policy(ctx: Any, target_utilization: float = 0.75,
                          downscale_quiet_s: float = 30.0) -> tuple[int, dict[str, Any]]:
    state = dict(ctx.policy_state or {})
    now = ctx.current_time or 0.0
    lo, hi = ctx.capacity_adjusted_min_replicas, ctx.capacity_adjusted_max_replicas
    current = ctx.current_num_replicas
    metrics = ctx.aggregated_metrics or {}

    def clamp(n: int) -> int:
        return max(lo, min(hi, n))

    totals = metrics.get("kv_total_blocks") or {}
    if current == 0 or not totals:  # nobody reporting yet: wake from zero on traffic, else hold
        wake = 1 if (ctx.total_num_requests or 0) > 0 else 0
        return clamp(max(current, wake)), state
    blocks_per_replica = sum(totals.values()) / len(totals)
    demand = sum((metrics.get("kv_demand_blocks") or {}).values())
    waiting = sum((metrics.get("num_waiting_for_kv") or {}).values())  # queued for memory, not for a step
    preempted = sum((metrics.get("preemptions") or {}).values())
    needed = math.ceil(demand / (target_utilization * blocks_per_replica)) if demand > 0 else 0

    if waiting > 0 or preempted > 0:
        state["last_pressure_time"] = now
        return clamp(max(needed, current + 1)), state
    if needed > current:
        state["last_pressure_time"] = now
        return clamp(needed), state
    quiet_for = now - state.get("last_pressure_time", -math.inf)
    if needed < current and quiet_for >= downscale_quiet_s:
        state["last_pressure_time"] = now  # one step down per quiet period: no flapping
        return clamp(current - 1), state
    return clamp(current), state


def autoscaling_config(config: Any) -> dict[str, Any]:
    return {
        "min_replicas": config.min_replicas, "max_replicas": config.max_replicas,
        "initial_replicas": max(config.min_replicas, 1),
        "metrics_interval_s": 1.0, "look_back_period_s": 5.0,
        "upscale_delay_s": 1.0, "downscale_delay_s": 1.0,
        "policy": {"policy_function": POLICY,
                   "policy_kwargs": {"target_utilization": config.kv_target_utilization,
                                     "downscale_quiet_s": config.downscale_quiet_s}},
    }
