"""The autoscaling rule: replicas from projected KV demand, not from request counts.

desired = ceil(total projected KV demand / (target_utilization x blocks per replica)), within min/max.
Up at once when requests wait for KV or preemptions happen (at least one more replica); down only after
`downscale_quiet_s` without pressure (nothing waiting for KV, no preemption, the fleet not fully needed),
straight to the replicas the demand needs; a further step down waits another quiet period. Pressure adds
at most one replica per `pressure_settle_s`, and none while one is still starting.
A plain function of Ray Serve's AutoscalingContext (KVAutoscalingPolicy hands it its settings); its memory
lives in policy_state.
"""
from __future__ import annotations

import logging
import math
import time
from typing import Any

logger = logging.getLogger("ray.serve")

POLICY = "serve_app.autoscaling:KVAutoscalingPolicy"
AUTOSCALER_REPORT_S = 5.0  # the policy's decision reaches /metrics on every change and at least this often


def autoscaling_metrics(stats: Any, num_preempted: int) -> dict[str, float]:
    """What a replica reports to the policy (record_autoscaling_stats), from an engine.llm_engine.EngineStats
    snapshot; the simulator (bench/autoscale_sim.py) reports through this same function."""
    return {"kv_total_blocks": float(stats.kv_capacity_blocks), "kv_free_blocks": float(stats.num_free_blocks),
            "kv_used_blocks": float(stats.num_used_blocks), "kv_demand_blocks": float(stats.kv_demand_blocks),
            "num_waiting": float(stats.num_waiting), "num_waiting_for_kv": float(stats.num_waiting_for_kv),
            "num_requests": float(stats.num_running + stats.num_waiting), "preemptions": float(num_preempted)}


def kv_autoscaling_policy(ctx: Any, target_utilization: float = 0.75, downscale_quiet_s: float = 30.0,
                          pressure_settle_s: float = 10.0) -> tuple[int, dict[str, Any]]:
    state = dict(ctx.policy_state or {})
    now = ctx.current_time or 0.0
    lo, hi = ctx.capacity_adjusted_min_replicas, ctx.capacity_adjusted_max_replicas
    current = ctx.current_num_replicas
    metrics = ctx.aggregated_metrics or {}

    def clamp(n: int) -> int:
        return max(lo, min(hi, n))

    totals = metrics.get("kv_total_blocks") or {}
    if current == 0 or not totals:  # nobody reporting yet: wake from zero on traffic, else hold
        wake = 1 if _value(ctx.total_num_requests) > 0 else 0
        return clamp(max(current, wake)), state
    blocks_per_replica = sum(totals.values()) / len(totals)
    demand = sum((metrics.get("kv_demand_blocks") or {}).values())
    # Requests the router holds back (no replica has room) wait in the callers: count them at the mean
    # projected size of the requests the replicas hold.
    queued = _value(ctx.total_queued_requests)
    if queued > 0:
        held = sum((metrics.get("num_requests") or {}).values())
        demand += queued * (demand / held if held > 0 and demand > 0 else blocks_per_replica / 4)
    waiting = sum((metrics.get("num_waiting_for_kv") or {}).values())  # queued for memory, not for a step
    preempted = sum((metrics.get("preemptions") or {}).values())
    needed = math.ceil(demand / (target_utilization * blocks_per_replica)) if demand > 0 else 0

    if waiting > 0 or preempted > 0:
        # One more replica per settle period: requests already queued on a full replica stay there, so
        # the pressure can outlast the replica added for it; the router sends new work to the new one.
        state["last_pressure_time"] = now
        target = max(ctx.target_num_replicas or current, current)
        settled = now - (ctx.last_scale_up_time or -math.inf) >= pressure_settle_s
        extra = current + 1 if settled and target == current else target
        return _decide(clamp(max(needed, extra)), current, "kv_pressure",
                       "requests wait for KV blocks or were preempted", state, demand, needed)
    if needed >= current:  # the whole fleet is needed: not quiet
        state["last_pressure_time"] = now
    if needed > current:
        return _decide(clamp(needed), current, "kv_demand", "projected KV demand is over target", state, demand,
                       needed)
    # Down only after a quiet period since the last pressure and since the last step down, and then to
    # what the demand needs at target utilization (not below it). The answer stays the same on every call
    # of that stretch: Ray applies it only once it has held for downscale_delay_s.
    quiet_since = max(state.get("last_pressure_time", -math.inf), ctx.last_scale_down_time or -math.inf)
    if needed < current and now - quiet_since >= downscale_quiet_s:
        return _decide(clamp(needed), current, "quiet", f"quiet for {downscale_quiet_s:.0f} s and demand fits "
                       "fewer", state, demand, needed)
    state["last_look"] = {"demand": demand, "needed": needed}
    state["last_logged"] = None  # a later change, even the same as an earlier one, is a new decision
    return clamp(current), state


def _decide(desired: int, current: int, reason: str, why: str, state: dict[str, Any], demand: float,
            needed: int) -> tuple[int, dict[str, Any]]:
    """Returns the decision, logging it (once per change) in words for whoever reads the controller log and
    counting it by direction and reason (state["decisions"], which /metrics shows)."""
    change = f"{current}->{desired}"
    state["last_look"] = {"demand": demand, "needed": needed}
    if desired != current and state.get("last_logged") != change:
        logger.info(f"kvscale autoscaling: {current} -> {desired} replicas: {why} "
                    f"(projected demand {demand:.0f} blocks = {needed} replicas at target utilization)")
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
    run on its defaults. This holds the kwargs and calls kv_autoscaling_policy with them."""

    def __init__(self, **policy_kwargs: Any) -> None:
        self.policy_kwargs = policy_kwargs
        self._board = None
        self._reported: tuple[float, tuple] = (-math.inf, ())  # (when, what) the board last got

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        desired, state = kv_autoscaling_policy(ctx, **self.policy_kwargs)
        self._report(ctx, desired, state)
        return desired, state

    def _report(self, ctx: Any, desired: int, state: dict[str, Any]) -> None:
        """The decision to the app's stats board (for /metrics), on every change and every AUTOSCALER_REPORT_S;
        never in the way of the decision itself."""
        look = state.get("last_look", {})
        report = {"autoscaler_current_replicas": ctx.current_num_replicas, "autoscaler_desired_replicas": desired,
                  "autoscaler_demand_blocks": look.get("demand", 0.0),
                  "autoscaler_needed_replicas": look.get("needed", 0), "decisions": state.get("decisions", {})}
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
        "policy": {"policy_function": POLICY,
                   "policy_kwargs": {"target_utilization": config.kv_target_utilization,
                                     "downscale_quiet_s": config.downscale_quiet_s}},
    }
