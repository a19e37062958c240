"""Per-replica metrics with vLLM's meanings under `kvscale:` names, served as Prometheus text by /metrics.

Each engine replica keeps its own counters and latency histograms and pushes a snapshot every
REPORT_INTERVAL_S to one small named Ray actor (the board, removed with the app); the ingress renders all live snapshots with a
`replica` label. A replica that stops reporting drops out after STALE_AFTER_S.
"""
from __future__ import annotations

import bisect
import time
from typing import Any

import ray

REPORT_INTERVAL_S = 0.5
STALE_AFTER_S = 10.0
ALIVE_WITHIN_S = 3.0  # /health counts a replica as alive while it reported this recently
BOARD_NAMESPACE = "kvscale"

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)

GAUGES = {
    "kv_cache_usage_perc": "KV-cache usage: blocks held by running requests over all blocks (1 = full); "
                           "cached-but-evictable blocks count as free.",
    "num_total_blocks": "KV blocks in this replica's pool.",
    "num_free_blocks": "KV blocks free now, evictable cached ones included.",
    "num_cached_blocks": "Free KV blocks that still hold a reusable cached prefix.",
    "num_requests_running": "Sequences in the running batch.",
    "num_requests_waiting": "Sequences waiting for KV blocks or a batch slot.",
}
COUNTERS = {
    "num_preemptions": "Sequences preempted (blocks freed, to be recomputed) because KV ran out.",
    "prompt_tokens": "Prompt tokens of admitted requests.",
    "generation_tokens": "Tokens generated.",
    "prefix_cache_queries": "Prompt tokens looked up in the prefix cache.",
    "prefix_cache_hits": "Prompt tokens found in the prefix cache.",
    "request_success": "Requests that ended, labelled by finish reason.",
}
HISTOGRAMS = {
    "time_to_first_token_seconds": ("Time from arrival at the replica to the first token.", TTFT_BUCKETS),
    "inter_token_latency_seconds": ("Time between tokens of one stream.", ITL_BUCKETS),
    "e2e_request_latency_seconds": ("Time from arrival at the replica to the last token.", E2E_BUCKETS),
}


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


@ray.remote(num_cpus=0)
class StatsBoard:
    def __init__(self) -> None:
        self.snapshots: dict[str, tuple[float, dict]] = {}

    def put(self, replica: str, snapshot: dict) -> None:
        self.snapshots[replica] = (time.time(), snapshot)

    def get_all(self, max_age_s: float = STALE_AFTER_S) -> dict[str, dict]:
        """The snapshots reported within max_age_s (those older than STALE_AFTER_S are dropped for good)."""
        now = time.time()
        self.snapshots = {r: v for r, v in self.snapshots.items() if now - v[0] < STALE_AFTER_S}
        return {r: v[1] for r, v in self.snapshots.items() if now - v[0] < max_age_s}


def replica_identity() -> tuple[str, str]:
    """(replica id, app name) of the Serve replica this runs in; ("local", "local") outside one."""
    try:
        from ray import serve

        ctx = serve.get_replica_context()
        return ctx.replica_id.unique_id, ctx.app_name
    except Exception:  # outside a replica (unit tests)
        return "local", "local"


def get_board(app_name: str):
    """The app's board, created by the first caller (the ingress, at start) and owned by it: not detached, so
    it goes when the app's actors go. Should its owner go first, the next caller creates it again (replicas
    re-report every REPORT_INTERVAL_S)."""
    return StatsBoard.options(name=f"stats-board-{app_name}", namespace=BOARD_NAMESPACE,
                              get_if_exists=True).remote()


def render(snapshots: dict[str, dict]) -> str:
    """Prometheus text exposition of all replicas' snapshots."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
    from prometheus_client.exposition import generate_latest
    from prometheus_client.registry import Collector, CollectorRegistry

    class _Collector(Collector):
        def collect(self):
            for name, doc in GAUGES.items():
                fam = GaugeMetricFamily(f"kvscale:{name}", doc, labels=["replica"])
                for replica, snap in snapshots.items():
                    fam.add_metric([replica], float(snap["gauges"][name]))
                yield fam
            for name, doc in COUNTERS.items():
                if name == "request_success":
                    fam = CounterMetricFamily(f"kvscale:{name}", doc, labels=["replica", "finished_reason"])
                    for replica, snap in snapshots.items():
                        for reason, value in snap["finished"].items():
                            fam.add_metric([replica, reason], float(value))
                else:
                    fam = CounterMetricFamily(f"kvscale:{name}", doc, labels=["replica"])
                    for replica, snap in snapshots.items():
                        fam.add_metric([replica], float(snap["counters"][name]))
                yield fam
            for name, (doc, _) in HISTOGRAMS.items():
                fam = HistogramMetricFamily(f"kvscale:{name}", doc, labels=["replica"])
                for replica, snap in snapshots.items():
                    h = snap["histograms"][name]
                    cumulative, running = [], 0
                    for bound, count in zip([*h["buckets"], float("inf")], h["counts"]):
                        running += count
                        cumulative.append((str(bound) if bound != float("inf") else "+Inf", running))
                    fam.add_metric([replica], cumulative, h["sum"])
                yield fam

    registry = CollectorRegistry()
    registry.register(_Collector())
    return generate_latest(registry).decode()
