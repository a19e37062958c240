"""The KV autoscaling rule on constructed AutoscalingContexts (no Ray cluster)."""
from __future__ import annotations

import pytest

from serve_app.autoscaling import kv_autoscaling_policy


def ctx(current=1, total=100.0, demand=0.0, waiting=0.0, preempted=0.0, state=None, now=100.0, requests=0.0,
        lo=1, hi=4):
    from ray.serve._private.common import DeploymentID, ReplicaID
    from ray.serve.config import AutoscalingContext

    dep = DeploymentID(name="KVEngine", app_name="app")
    replicas = [ReplicaID(unique_id=f"r{i}", deployment_id=dep) for i in range(current)]

    def per_replica(v):
        return {r: v / max(current, 1) for r in replicas}

    metrics = {} if current == 0 else {
        "kv_total_blocks": {r: total for r in replicas}, "kv_demand_blocks": per_replica(demand),
        "num_waiting_for_kv": per_replica(waiting), "preemptions": per_replica(preempted)}
    return AutoscalingContext(
        deployment_id=dep, deployment_name="KVEngine", app_name="app", current_num_replicas=current,
        target_num_replicas=current, running_replicas=replicas, total_num_requests=requests,
        total_queued_requests=0.0, aggregated_metrics=metrics, raw_metrics={},
        capacity_adjusted_min_replicas=lo, capacity_adjusted_max_replicas=hi, policy_state=state or {},
        last_scale_up_time=None, last_scale_down_time=None, current_time=now, config=None)


def test_scales_on_kv_demand_not_request_count():
    assert kv_autoscaling_policy(ctx(demand=60.0, requests=50))[0] == 1  # many small requests: fits
    assert kv_autoscaling_policy(ctx(demand=160.0, requests=3))[0] == 3  # few long ones: 160 / 75 -> 3


def test_pressure_scales_up_at_once_and_respects_max():
    assert kv_autoscaling_policy(ctx(current=2, demand=10.0, waiting=1))[0] == 3
    assert kv_autoscaling_policy(ctx(current=2, demand=10.0, preempted=2))[0] == 3
    assert kv_autoscaling_policy(ctx(current=4, demand=900.0, waiting=5))[0] == 4


def test_scale_down_waits_for_quiet_period_one_step_at_a_time():
    d, state = kv_autoscaling_policy(ctx(current=3, demand=10.0, waiting=1, now=0.0))
    assert d == 4
    d, state = kv_autoscaling_policy(ctx(current=3, demand=10.0, state=state, now=10.0))
    assert d == 3  # still within the quiet period
    d, state = kv_autoscaling_policy(ctx(current=3, demand=10.0, state=state, now=31.0))
    assert d == 2
    d, state = kv_autoscaling_policy(ctx(current=2, demand=10.0, state=state, now=40.0))
    assert d == 2  # the next step down needs another quiet period
    d, _ = kv_autoscaling_policy(ctx(current=2, demand=10.0, state=state, now=62.0))
    assert d == 1


def test_no_scale_down_when_rest_would_be_over_target():
    d, _ = kv_autoscaling_policy(ctx(current=2, demand=140.0, now=1000.0))
    assert d == 2  # 140 blocks need 2 replicas at 75 % of 100


@pytest.mark.parametrize("requests,expected", [(0.0, 0), (2.0, 1)])
def test_cold_start_from_zero(requests, expected):
    assert kv_autoscaling_policy(ctx(current=0, requests=requests, lo=0))[0] == expected


def test_autoscaling_app_builds_with_our_policy():
    from serve_app import build_app
    from serve_app.app import engine_deployment_options
    from serve_app.config import ServeConfig

    cfg = ServeConfig(num_replicas=None, min_replicas=0, max_replicas=3)
    opts = engine_deployment_options(cfg)
    assert opts["autoscaling_config"]["policy"]["policy_function"] == "serve_app.autoscaling:kv_autoscaling_policy"
    assert "num_replicas" not in opts
    build_app(cfg)  # Ray Serve accepts the deployment options


def test_serve_config_rejects_bad_fields_with_names():
    from pydantic import ValidationError

    from serve_app.config import ServeConfig

    with pytest.raises(ValidationError, match="block_size"):
        ServeConfig(block_size=7)
    with pytest.raises(ValidationError, match="no_such_field"):
        ServeConfig(no_such_field=1)
