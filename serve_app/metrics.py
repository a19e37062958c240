"""Metrics with vLLM's names and meanings under the `kvscale:` prefix, served as Prometheus text by /metrics.

Each engine replica keeps its own counters and histograms (ReplicaMetrics) and pushes a snapshot every
REPORT_INTERVAL_S to one small named Ray actor per app (the board, removed with the app); the autoscaling
policy, in Serve's controller, pushes its latest decision there too. The ingress renders what the board holds
with prometheus_client: every series carries `model_name`, per-replica series also `replica`. A replica that
stops reporting drops out after STALE_AFTER_S.

The tables below are the one list of what is exported; deploy/grafana/kvscale-dashboard.json reads from it,
and tests/test_metrics.py checks that every series the dashboard queries is one of these.
"""
from __future__ import annotations

import bisect
import time
from typing import Any

import ray

REPORT_INTERVAL_S = 0.5
STALE_AFTER_S = 10.0
ALIVE_WITHIN_S = 3.0  # /health counts a replica as alive while it reported this recently
AUTOSCALER_STALE_AFTER_S = 60.0  # the policy reports on every change and at least every 5 s
BOARD_NAMESPACE = "kvscale"

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
PHASE_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
N_BUCKETS = (1, 2, 5, 10, 20)

# per replica, name -> help
GAUGES = {
    "kv_cache_usage_perc": "KV-cache usage: blocks held by running requests over all blocks (1 = full); "
                           "cached-but-evictable blocks count as free.",
    "num_total_blocks": "KV blocks in this replica's pool.",
    "num_free_blocks": "KV blocks free now, evictable cached ones included.",
    "num_cached_blocks": "Free KV blocks that still hold a reusable cached prefix.",
    "kv_demand_blocks": "KV blocks the live requests will hold at their end (what the autoscaler scales on); for "
                        "hybrid models each request's recurrent state counts too, in blocks of the same bytes.",
    "num_state_slots": "Recurrent-state slots of a hybrid model's linear-attention layers (one per running "
                       "sequence; 0 for models without such layers).",
    "num_free_state_slots": "Recurrent-state slots free now.",
    "state_blocks_per_seq": "One sequence's recurrent state, in KV blocks of the same bytes (0 without linear "
                            "attention layers).",
    "num_requests_running": "Sequences in the running batch.",
    "num_requests_waiting": "Sequences waiting for KV blocks or a batch slot.",
}
COUNTERS = {  # rendered with prometheus' _total suffix
    "num_preemptions": "Sequences preempted (blocks freed, to be recomputed) because KV ran out.",
    "prompt_tokens": "Prompt tokens of admitted requests.",
    "generation_tokens": "Tokens generated.",
    "prefix_cache_queries": "Prompt tokens looked up in the prefix cache.",
    "prefix_cache_hits": "Prompt tokens found in the prefix cache.",
    "request_success": "Requests that ended, labelled by finish reason (one per request, whatever n).",
    "engine_steps": "Engine steps run (one forward of the running batch each).",
    "engine_step_seconds": "Wall time spent in engine steps (schedule, forward, sample, outputs); its rate is the "
                           "share of the time the engine computes, 1 when it never waits for work.",
}
# name -> (help, buckets); the replica's server observes these (iteration_tokens_total: the engine counts it)
HISTOGRAMS = {
    "time_to_first_token_seconds": ("Time from arrival at the ingress to the first token.", TTFT_BUCKETS),
    "inter_token_latency_seconds": ("Time between tokens of one sample's stream.", ITL_BUCKETS),
    "e2e_request_latency_seconds": ("Time from arrival at the ingress to the last token.", E2E_BUCKETS),
    "request_queue_time_seconds": ("Time from arrival at the ingress to the request's first engine step (held "
                                   "by the router, in Serve's queues and in the engine's waiting queue).",
                                   PHASE_BUCKETS),
    "request_prefill_time_seconds": ("Time from the first engine step to the first token.", PHASE_BUCKETS),
    "request_decode_time_seconds": ("Time from the first token to the last.", PHASE_BUCKETS),
    "request_inference_time_seconds": ("Time from the first engine step to the last token (prefill + decode).",
                                       PHASE_BUCKETS),
    "request_prompt_tokens": ("Prompt tokens per finished request.", TOKEN_BUCKETS),
    "request_generation_tokens": ("Tokens generated per finished request, all n samples together.", TOKEN_BUCKETS),
    "request_params_n": ("The n of finished requests.", N_BUCKETS),
    "request_params_max_tokens": ("The max_tokens of finished requests (the room left in the context when "
                                  "unset).", TOKEN_BUCKETS),
    "iteration_tokens_total": ("Tokens per engine step (prefill chunks and decodes together).", None),
}
CACHE_CONFIG_LABELS = ("block_size", "num_gpu_blocks", "cache_dtype", "enable_prefix_caching", "kv_bytes_per_block",
                       "kv_groups")
# fleet-wide, from the board and the autoscaling policy
FLEET_GAUGES = {
    "num_replicas": "Engine replicas reporting now.",
    "autoscaler_current_replicas": "Running replicas as the autoscaling policy last saw them.",
    "autoscaler_desired_replicas": "Replicas the autoscaling policy last asked for.",
    "autoscaler_demand_blocks": "Projected KV demand of the whole fleet, in blocks, at the policy's last look.",
    "autoscaler_needed_replicas": "Replicas the policy's resources need (the largest of KV memory and compute).",
    "autoscaler_kv_need_replicas": "Replicas the projected (and forecast) KV demand needs at the target utilization.",
    "autoscaler_compute_need_replicas": "Replicas the replicas' measured step times need to hold the ITL and TTFT "
                                        "SLOs at the current (and forecast) load.",
    "autoscaler_forecast_growth": "Load at one replica start-up ahead over the load now, as the policy forecasts it.",
    "autoscaler_startup_seconds": "Replica start-up time the forecast looks ahead by (measured once the deployment "
                                  "has scaled up).",
}
DECISIONS = ("autoscaler_decisions", "Scaling decisions of the policy, by direction (up/down) and the reason that "
                                     "bound it (kv_memory, compute, kv_pressure, slo_pressure, quiet).")


def metric_names() -> set[str]:
    """Every series name /metrics can carry (histograms as their _bucket/_sum/_count series)."""
    names = {f"kvscale:{n}" for n in (*GAUGES, *FLEET_GAUGES, "cache_config_info", "model_version_info")}
    names |= {f"kvscale:{n}_total" for n in (*COUNTERS, DECISIONS[0])}
    names |= {f"kvscale:{n}_{part}" for n in HISTOGRAMS for part in ("bucket", "sum", "count")}
    return names


class Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # last: +Inf
        self.sum = 0.0

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += times
        self.sum += value * times

    def snapshot(self) -> dict[str, Any]:
        return {"buckets": list(self.buckets), "counts": list(self.counts), "sum": self.sum}


class ReplicaMetrics:
    """What one engine replica counts beside its engine's own stats. Written by the replica's request
    coroutines (one event loop), read by its reporter thread through snapshot()."""

    def __init__(self) -> None:
        self.histograms = {name: Histogram(buckets) for name, (_, buckets) in HISTOGRAMS.items() if buckets}
        self.finished: dict[str, int] = {}

    def observe(self, name: str, value: float, times: int = 1) -> None:
        self.histograms[name].observe(value, times)

    def request_finished(self, reason: str, *, n: int, max_tokens: int, num_prompt_tokens: int, held: float,
                         start: float, end: float, metrics: Any | None) -> float | None:
        """One finished request. held: seconds it spent before reaching this replica; start/end: when it reached
        the replica and when its last output came (monotonic); metrics: the engine's RequestMetrics (None when
        it ended before a first token). Returns its queue time (arrival at the ingress to its first engine step),
        None without metrics."""
        self.finished[reason] = self.finished.get(reason, 0) + 1
        self.observe("e2e_request_latency_seconds", held + end - start)
        self.observe("request_params_n", n)
        self.observe("request_params_max_tokens", max_tokens)
        self.observe("request_prompt_tokens", num_prompt_tokens)
        if metrics is None:
            return None
        queue_s = held + max(0.0, metrics.first_scheduled_time - start)
        self.observe("request_generation_tokens", metrics.num_generation_tokens)
        self.observe("request_queue_time_seconds", queue_s)
        self.observe("request_prefill_time_seconds", metrics.prefill_time)
        self.observe("request_decode_time_seconds", metrics.decode_time)
        self.observe("request_inference_time_seconds", metrics.inference_time)
        return queue_s

    def snapshot(self, stats: Any, *, cache_config: dict[str, str], max_model_len: int,
                 healthy: bool) -> dict[str, Any]:
        """What the board holds for this replica, from the engine's EngineStats snapshot and our own counts."""
        from engine.llm_engine import ITERATION_TOKENS_BUCKETS

        histograms = {name: h.snapshot() for name, h in self.histograms.items()}
        histograms["iteration_tokens_total"] = {"buckets": list(ITERATION_TOKENS_BUCKETS),
                                                "counts": list(stats.iteration_tokens_counts),
                                                "sum": float(sum(stats.iteration_tokens_sums))}
        used = stats.num_total_blocks - stats.num_free_blocks
        return {
            "gauges": {"kv_cache_usage_perc": used / stats.num_total_blocks,
                       "num_total_blocks": stats.num_total_blocks, "num_free_blocks": stats.num_free_blocks,
                       "num_cached_blocks": stats.num_cached_free_blocks, "kv_demand_blocks": stats.kv_demand_blocks,
                       "num_state_slots": stats.num_state_slots, "num_free_state_slots": stats.num_free_state_slots,
                       "state_blocks_per_seq": stats.state_blocks_per_seq,
                       "num_requests_running": stats.num_running, "num_requests_waiting": stats.num_waiting},
            "counters": {"num_preemptions": stats.num_preemptions_total,
                         "prompt_tokens": stats.num_prompt_tokens_total,
                         "generation_tokens": stats.num_generation_tokens_total,
                         "prefix_cache_queries": stats.prefix_cache_queried_tokens,
                         "prefix_cache_hits": stats.prefix_cache_hit_tokens,
                         "engine_steps": stats.num_steps_total, "engine_step_seconds": stats.step_seconds_total},
            "histograms": histograms,
            "finished": dict(self.finished),
            "cache_config": cache_config,
            "block_size": stats.block_size, "max_model_len": max_model_len,
            "healthy": healthy,
        }


@ray.remote(num_cpus=0)
class StatsBoard:
    def __init__(self) -> None:
        self.snapshots: dict[str, tuple[float, dict]] = {}
        self.autoscaler: tuple[float, dict] | None = None

    def put(self, replica: str, snapshot: dict) -> None:
        self.snapshots[replica] = (time.time(), snapshot)

    def put_autoscaler(self, snapshot: dict) -> None:
        self.autoscaler = (time.time(), snapshot)

    def get_all(self, max_age_s: float = STALE_AFTER_S) -> dict[str, dict]:
        """The snapshots reported within max_age_s (those older than STALE_AFTER_S are dropped for good)."""
        now = time.time()
        self.snapshots = {r: v for r, v in self.snapshots.items() if now - v[0] < STALE_AFTER_S}
        return {r: v[1] for r, v in self.snapshots.items() if now - v[0] < max_age_s}

    def get_metrics(self) -> tuple[dict[str, dict], dict | None]:
        """(live replica snapshots, the autoscaling policy's latest report or None)."""
        fresh = self.autoscaler is not None and time.time() - self.autoscaler[0] < AUTOSCALER_STALE_AFTER_S
        return self.get_all(), (self.autoscaler[1] if fresh else None)


def replica_identity() -> tuple[str, str]:
    """(replica id, app name) of the Serve replica this runs in; ("local", "local") outside one."""
    try:
        from ray import serve

        ctx = serve.get_replica_context()
        return ctx.replica_id.unique_id, ctx.app_name
    except Exception:  # outside a replica (unit tests)
        return "local", "local"


def board_name(app_name: str) -> str:
    return f"stats-board-{app_name}"


def get_board(app_name: str):
    """The app's board, created by the first caller (the ingress, at start) and owned by it: not detached, so
    it goes when the app's actors go. Should its owner go first, the next caller creates it again (replicas
    re-report every REPORT_INTERVAL_S)."""
    return StatsBoard.options(name=board_name(app_name), namespace=BOARD_NAMESPACE, get_if_exists=True).remote()


def render(snapshots: dict[str, dict], autoscaler: dict | None, model_name: str) -> str:
    """Prometheus text exposition of all replicas' snapshots and the autoscaler's latest report."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
    from prometheus_client.exposition import generate_latest
    from prometheus_client.registry import Collector, CollectorRegistry

    per_replica = ["model_name", "replica"]

    def histogram(name: str, doc: str) -> HistogramMetricFamily:
        fam = HistogramMetricFamily(f"kvscale:{name}", doc, labels=per_replica)
        for replica, snap in snapshots.items():
            h = snap["histograms"][name]
            cumulative, running = [], 0
            for bound, count in zip([*h["buckets"], float("inf")], h["counts"]):
                running += count
                cumulative.append((str(bound) if bound != float("inf") else "+Inf", running))
            fam.add_metric([model_name, replica], cumulative, h["sum"])
        return fam

    class _Collector(Collector):
        def collect(self):
            for name, doc in GAUGES.items():
                fam = GaugeMetricFamily(f"kvscale:{name}", doc, labels=per_replica)
                for replica, snap in snapshots.items():
                    fam.add_metric([model_name, replica], float(snap["gauges"][name]))
                yield fam
            fam = GaugeMetricFamily("kvscale:cache_config_info", "The KV cache's configuration, in labels (value 1).",
                                    labels=[*per_replica, *CACHE_CONFIG_LABELS])
            for replica, snap in snapshots.items():
                fam.add_metric([model_name, replica, *(str(snap["cache_config"][k]) for k in CACHE_CONFIG_LABELS)], 1)
            yield fam
            fam = GaugeMetricFamily("kvscale:model_version_info", "The policy version a replica serves (label "
                                    "`version`; 0: the checkpoint on disk) and whether it is paused or asleep "
                                    "(serve_app/rl.py), in labels (value 1).",
                                    labels=[*per_replica, "version", "paused", "sleep_level"])
            for replica, snap in snapshots.items():
                policy = snap.get("policy") or {"model_version": 0, "paused": None, "sleep_level": 0}
                fam.add_metric([model_name, replica, str(policy["model_version"]), str(policy["paused"] or ""),
                                str(policy["sleep_level"])], 1)
            yield fam
            for name, doc in COUNTERS.items():
                if name == "request_success":
                    fam = CounterMetricFamily(f"kvscale:{name}", doc, labels=[*per_replica, "finished_reason"])
                    for replica, snap in snapshots.items():
                        for reason, value in snap["finished"].items():
                            fam.add_metric([model_name, replica, reason], float(value))
                else:
                    fam = CounterMetricFamily(f"kvscale:{name}", doc, labels=per_replica)
                    for replica, snap in snapshots.items():
                        fam.add_metric([model_name, replica], float(snap["counters"][name]))
                yield fam
            for name, (doc, _) in HISTOGRAMS.items():
                yield histogram(name, doc)
            yield from _fleet(len(snapshots))

    def _fleet(num_replicas: int):
        values = {"num_replicas": num_replicas}
        if autoscaler is not None:
            values.update({k: autoscaler[k] for k in FLEET_GAUGES if k in autoscaler})
        for name, doc in FLEET_GAUGES.items():
            fam = GaugeMetricFamily(f"kvscale:{name}", doc, labels=["model_name"])
            if name in values:
                fam.add_metric([model_name], float(values[name]))
            yield fam
        fam = CounterMetricFamily(f"kvscale:{DECISIONS[0]}", DECISIONS[1], labels=["model_name", "direction", "reason"])
        for key, count in (autoscaler or {}).get("decisions", {}).items():
            direction, reason = key.split(":", 1)
            fam.add_metric([model_name, direction, reason], float(count))
        yield fam

    registry = CollectorRegistry()
    registry.register(_Collector())
    return generate_latest(registry).decode()
