"""Metrics without a cluster: the engine's per-request stage times and per-step token counts, /metrics as
Prometheus parses it (vLLM's names under kvscale:, model_name on every series), the autoscaler's decisions,
and the Grafana dashboard in deploy/ (valid, and every series it queries is one /metrics carries)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine import LLM, SamplingParams
from engine.llm_engine import ITERATION_TOKENS_BUCKETS
from serve_app.autoscaling import kvscale_policy
from serve_app.metrics import ReplicaMetrics, metric_names, render
from test_autoscaling_policy import ctx

DASHBOARD = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "kvscale-dashboard.json"


@pytest.fixture(scope="module")
def llm(make_tiny_model):
    return LLM(make_tiny_model("llama"), dtype="float32", num_kv_blocks=64, max_num_batched_tokens=32,
               enable_prefix_caching=False, show_progress=False)


def test_request_stages_and_iteration_tokens_add_up(llm):
    """Each finished request says when it was queued, first scheduled, got its first and last token; the
    per-step token histogram counts every step and every token the steps ran."""
    before = llm.stats()
    prompts = [[7] * 40, [9] * 5, [11] * 70]  # 40 and 70 tokens take more than one 32-token step
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))
    after = llm.stats()
    outs += llm.generate([[3] * 20], SamplingParams(max_tokens=6, ignore_eos=True, n=2))
    for out in outs:
        m = out.metrics
        assert m is not None
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time
        assert m.num_generation_tokens == 6 * len(out.outputs)  # all samples together
        assert m.queue_time >= 0 and m.prefill_time > 0 and m.decode_time > 0
        assert m.inference_time == pytest.approx(m.prefill_time + m.decode_time)
    steps = after.num_steps_total - before.num_steps_total
    counts = [a - b for a, b in zip(after.iteration_tokens_counts, before.iteration_tokens_counts)]
    sums = [a - b for a, b in zip(after.iteration_tokens_sums, before.iteration_tokens_sums)]
    assert len(counts) == len(ITERATION_TOKENS_BUCKETS) + 1 and sum(counts) == steps
    # every prompt token once, then every generated token but each sample's last is fed back
    assert sum(sums) == sum(len(p) for p in prompts) + len(prompts) * (6 - 1)
    assert all(s <= ITERATION_TOKENS_BUCKETS[i] * c for i, (s, c) in enumerate(zip(sums, counts))
               if i < len(ITERATION_TOKENS_BUCKETS))


def test_metrics_text_parses_with_every_series_and_the_model_label(llm):
    outs = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True, n=3))
    metrics = ReplicaMetrics()
    metrics.request_finished("length", n=3, max_tokens=4, num_prompt_tokens=3, held=0.25, start=outs[0].metrics.arrival_time,
                             end=outs[0].metrics.last_token_time, metrics=outs[0].metrics)
    cache = {"block_size": "16", "num_gpu_blocks": "64", "cache_dtype": "float32", "enable_prefix_caching": "False",
             "kv_bytes_per_block": "4096", "kv_groups": "1 KV group(s) of 2 layer(s): 1 full"}
    snap = metrics.snapshot(llm.stats(), cache_config=cache, max_model_len=256, healthy=True)
    autoscaler = {"autoscaler_current_replicas": 1, "autoscaler_desired_replicas": 2, "autoscaler_demand_blocks": 90.0,
                  "autoscaler_needed_replicas": 2, "autoscaler_kv_need_replicas": 1,
                  "autoscaler_compute_need_replicas": 2, "autoscaler_forecast_growth": 1.5,
                  "autoscaler_startup_seconds": 42.0, "decisions": {"up:compute": 1}}
    text = render({"r1": snap, "r2": snap}, autoscaler, "my-model")

    samples = [s for fam in text_string_to_metric_families(text) for s in fam.samples]
    assert {s.name for s in samples} == metric_names()  # everything declared is there, nothing else
    assert all(s.labels.get("model_name") == "my-model" for s in samples)
    by = {(s.name, s.labels.get("replica"), s.labels.get("le")): s.value for s in samples}
    assert by[("kvscale:num_replicas", None, None)] == 2
    assert by[("kvscale:autoscaler_desired_replicas", None, None)] == 2
    assert by[("kvscale:autoscaler_compute_need_replicas", None, None)] == 2
    assert by[("kvscale:autoscaler_forecast_growth", None, None)] == 1.5
    assert by[("kvscale:request_params_n_sum", "r1", None)] == 3
    assert by[("kvscale:request_generation_tokens_sum", "r1", None)] == 12
    assert by[("kvscale:request_queue_time_seconds_sum", "r1", None)] >= 0.25  # held before the replica counts
    assert by[("kvscale:iteration_tokens_total_count", "r1", None)] == llm.stats().num_steps_total
    assert by[("kvscale:engine_steps_total", "r1", None)] == llm.stats().num_steps_total > 0
    assert 0 < by[("kvscale:engine_step_seconds_total", "r1", None)] == llm.stats().step_seconds_total
    version = next(s for s in samples if s.name == "kvscale:model_version_info")
    assert version.labels["version"] == "0" and version.labels["sleep_level"] == "0"  # no policy pushed: the checkpoint
    info = next(s for s in samples if s.name == "kvscale:cache_config_info")
    assert info.labels["num_gpu_blocks"] == "64" and info.labels["block_size"] == "16"
    decision = next(s for s in samples if s.name == "kvscale:autoscaler_decisions_total")
    assert (decision.labels["direction"], decision.labels["reason"], decision.value) == ("up", "compute", 1)
    # prometheus' own parser found monotone cumulative buckets ending in +Inf = count
    for name in ("time_to_first_token_seconds", "request_prefill_time_seconds", "iteration_tokens_total"):
        buckets = [s for s in samples if s.name == f"kvscale:{name}_bucket" and s.labels["replica"] == "r1"]
        values = [s.value for s in buckets]
        assert values == sorted(values) and buckets[-1].labels["le"] == "+Inf"
        assert values[-1] == by[(f"kvscale:{name}_count", "r1", None)]


def test_no_autoscaler_report_leaves_its_gauges_empty(llm):
    snap = ReplicaMetrics().snapshot(llm.stats(), cache_config=dict.fromkeys(
        ("block_size", "num_gpu_blocks", "cache_dtype", "enable_prefix_caching", "kv_bytes_per_block", "kv_groups"),
        "x"),
        max_model_len=256, healthy=True)
    samples = [s for fam in text_string_to_metric_families(render({"r": snap}, None, "m")) for s in fam.samples]
    names = {s.name for s in samples}
    assert "kvscale:num_replicas" in names and "kvscale:autoscaler_desired_replicas" not in names


def test_the_policy_counts_each_decision_once_by_direction_and_reason():
    state: dict = {}
    for now in (100.0, 101.0, 102.0):  # the same answer on every call while Ray waits to apply it
        desired, state = kvscale_policy(ctx(current=1, demand=160.0, state=state, now=now))
    assert desired == 3 and state["decisions"] == {"up:kv_memory": 1}
    # the need dips while the two replicas start (the policy holds them), then comes back: the same scale-up
    desired, state = kvscale_policy(ctx(current=1, target=3, demand=10.0, state=state, now=102.5))
    assert desired == 3
    desired, state = kvscale_policy(ctx(current=1, target=3, demand=160.0, state=state, now=102.8))
    assert desired == 3 and state["decisions"] == {"up:kv_memory": 1}
    desired, state = kvscale_policy(ctx(current=3, demand=160.0, state=state, now=103.0))
    assert desired == 3  # steady
    desired, state = kvscale_policy(ctx(current=3, demand=10.0, waiting=2, state=state, now=200.0,
                                               last_up=100.0))
    assert desired == 4 and state["decisions"] == {"up:kv_memory": 1, "up:kv_pressure": 1}
    desired, state = kvscale_policy(ctx(current=4, demand=10.0, state=state, now=300.0, last_up=200.0))
    assert desired == 1 and state["decisions"]["down:quiet"] == 1
    look = state["last_look"]
    assert (look["demand"], look["needed"], look["kv_need"], look["compute_need"], look["bound"]) == (
        10.0, 1, 1, 0, "kv_memory")


def _exprs(dashboard: dict) -> list[str]:
    return [t["expr"] for p in dashboard["panels"] for t in p["targets"]]


def test_grafana_dashboard_is_valid_and_queries_only_series_we_export():
    dashboard = json.loads(DASHBOARD.read_text())
    panels = dashboard["panels"]
    assert dashboard["uid"] and dashboard["title"] and isinstance(dashboard["schemaVersion"], int)
    assert len({p["id"] for p in panels}) == len(panels)
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"datasource", "model_name"} <= variables
    for p in panels:
        assert p["type"] == "timeseries" and p["targets"], p["title"]
        assert p["datasource"]["uid"] == "${datasource}"
        assert {"h", "w", "x", "y"} <= set(p["gridPos"]) and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
        assert len({t["refId"] for t in p["targets"]}) == len(p["targets"])
    # panels do not overlap
    cells = set()
    for p in panels:
        g = p["gridPos"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & mine, p["title"]
        cells |= mine
    exported = metric_names()
    for expr in _exprs(dashboard):
        assert expr.count("(") == expr.count(")"), expr
        used = set(re.findall(r"kvscale:[a-z0-9_]+", expr))
        assert used and used <= exported, f"{expr}: {sorted(used - exported)} are not exported"
        assert '{model_name=~"$model_name"}' in expr, expr
    # what the issue asks a dashboard to show
    queried = " ".join(_exprs(dashboard))
    for series in ("kv_cache_usage_perc", "num_free_blocks", "num_replicas", "autoscaler_desired_replicas",
                   "autoscaler_decisions_total", "time_to_first_token_seconds_bucket",
                   "inter_token_latency_seconds_bucket", "num_requests_waiting", "num_preemptions_total"):
        assert f"kvscale:{series}" in queried, series
    assert "histogram_quantile(0.5," in queried and "histogram_quantile(0.99," in queried
