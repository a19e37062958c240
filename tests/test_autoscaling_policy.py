"""The KV autoscaling rule on constructed AutoscalingContexts (no Ray cluster)."""
from __future__ import annotations

import pytest

from serve_app.autoscaling import kvscale_policy


def ctx(current=1, total=100.0, demand=0.0, waiting=0.0, preempted=0.0, state=None, now=100.0, requests=0.0,
        lo=1, hi=4, target=None, last_up=None, last_down=None, config=None, queued=0.0, held=None, fleet=None,
        each=None):
    """fleet: more metrics as fleet totals (split evenly over the replicas); each: metrics every replica reports
    as they are (its step-time coefficients, its recent latencies)."""
    from ray.serve._private.common import DeploymentID, ReplicaID
    from ray.serve.config import AutoscalingContext

    dep = DeploymentID(name="KVEngine", app_name="app")
    replicas = [ReplicaID(unique_id=f"r{i}", deployment_id=dep) for i in range(current)]

    def per_replica(v):
        return {r: v / max(current, 1) for r in replicas}

    metrics = {} if current == 0 else {
        "kv_total_blocks": {r: total for r in replicas}, "kv_demand_blocks": per_replica(demand),
        "num_waiting_for_kv": per_replica(waiting), "preemptions": per_replica(preempted),
        "num_requests": per_replica(requests if held is None else held),
        **{k: per_replica(v) for k, v in (fleet or {}).items()},
        **{k: {r: v for r in replicas} for k, v in (each or {}).items()}}
    return AutoscalingContext(
        deployment_id=dep, deployment_name="KVEngine", app_name="app", current_num_replicas=current,
        target_num_replicas=current if target is None else target, running_replicas=replicas,
        total_num_requests=requests,
        total_queued_requests=queued, aggregated_metrics=metrics, raw_metrics={},
        capacity_adjusted_min_replicas=lo, capacity_adjusted_max_replicas=hi, policy_state=state or {},
        last_scale_up_time=last_up, last_scale_down_time=last_down, current_time=now, config=config)


def test_scales_on_kv_demand_not_request_count():
    assert kvscale_policy(ctx(demand=60.0, requests=50))[0] == 1  # many small requests: fits
    assert kvscale_policy(ctx(demand=160.0, requests=3))[0] == 3  # few long ones: 160 / 75 -> 3


def test_pressure_scales_up_at_once_and_respects_max():
    assert kvscale_policy(ctx(current=2, demand=10.0, waiting=1))[0] == 3
    assert kvscale_policy(ctx(current=2, demand=10.0, preempted=2))[0] == 3
    assert kvscale_policy(ctx(current=4, demand=900.0, waiting=5))[0] == 4


def test_requests_held_in_the_callers_count_as_demand():
    # 4 requests on the replica project 60 blocks (15 each); 6 more wait in the router: 150 blocks
    assert kvscale_policy(ctx(demand=60.0, held=4, queued=6))[0] == 2
    assert kvscale_policy(ctx(demand=60.0, held=4, queued=0))[0] == 1


def test_requests_in_transit_to_idle_replicas_are_not_guessed_into_kv_demand():
    # 16 requests just left the callers and the replica has not reported them yet: it holds none, so it has room
    # and the router holds nothing back; its next report counts them at their real size
    d, state = kvscale_policy(ctx(demand=0.0, held=0, queued=16))
    assert d == 1 and state["last_look"]["kv_need"] == 0


def test_pressure_adds_one_replica_per_settle_period():
    # a replica is still starting (target 3, running 2): ask for the same 3, not a 4th
    assert kvscale_policy(ctx(current=2, target=3, demand=10.0, waiting=1, last_up=95.0))[0] == 3
    # it is running, but the requests queued on the full replica still wait: give the new one time
    assert kvscale_policy(ctx(current=3, demand=10.0, waiting=1, now=100.0, last_up=95.0))[0] == 3
    assert kvscale_policy(ctx(current=3, demand=10.0, waiting=1, now=106.0, last_up=95.0))[0] == 4
    # demand itself still counts at once
    assert kvscale_policy(ctx(current=2, demand=300.0, waiting=1, last_up=99.0))[0] == 4


def test_scale_down_waits_for_a_quiet_period_then_goes_to_what_demand_needs():
    # replicas start at once here (startup_s=0): what pressure asked for holds only for the quiet period
    def policy(c):
        return kvscale_policy(c, startup_s=0.0)

    d, state = policy(ctx(current=3, demand=10.0, waiting=1, now=0.0))
    assert d == 4
    d, state = policy(ctx(current=3, demand=10.0, state=state, now=10.0))
    assert d == 3  # still within the quiet period
    for t in (31.0, 31.1, 32.0):  # the same answer on every call until Ray applies it
        d, state = policy(ctx(current=3, demand=80.0, state=state, now=t))
        assert d == 2  # 80 blocks need 2 replicas at 75 % of 100
    d, state = policy(ctx(current=2, demand=10.0, state=state, now=40.0, last_down=32.0))
    assert d == 2  # the next step down needs another quiet period after the last one
    d, _ = policy(ctx(current=2, demand=10.0, state=state, now=62.5, last_down=32.0))
    assert d == 1
    d, state = policy(ctx(current=4, demand=0.0, now=1000.0, lo=1))
    assert d == 4  # a policy that has just started holds the fleet it found for one window
    d, _ = policy(ctx(current=4, demand=0.0, now=1031.0, lo=1, state=state))
    assert d == 1  # then, idle: straight down to the minimum


def test_under_rays_own_control_loop(monkeypatch):
    """Driven the way Ray's controller drives it: every 0.1 s, through Ray's wrapper that adds the
    upscale/downscale delays, with the decision applied as Ray applies it."""
    import types

    import ray.serve.autoscaling_policy as ray_policy
    from ray.serve.autoscaling_policy import _apply_autoscaling_config
    from ray.serve.config import AutoscalingConfig

    from serve_app.autoscaling import autoscaling_config
    from serve_app.config import ServeConfig

    raw = autoscaling_config(ServeConfig(num_replicas=None, min_replicas=1, max_replicas=4, downscale_quiet_s=5,
                                         downscale_window_s=5))
    config = AutoscalingConfig(**{k: v for k, v in raw.items() if k != "policy"})
    kwargs = raw["policy"]["policy_kwargs"]
    policy = _apply_autoscaling_config(lambda c: kvscale_policy(c, **kwargs))
    current, state, last_up, last_down, history = 1, {}, None, None, []
    clock = types.SimpleNamespace(time=lambda: now)
    monkeypatch.setattr(ray_policy, "time", clock)  # Ray's delay logic reads the wall clock
    for tick in range(0, 600):
        now = tick * 0.1
        busy = 5.0 <= now < 20.0  # a KV-heavy burst: 250 blocks of demand, some requests waiting for KV
        c = ctx(current=current, demand=250.0 if busy else 5.0, waiting=2.0 if busy and current < 3 else 0.0,
                state=state, now=now, last_up=last_up, last_down=last_down, config=config)
        desired, state = policy(c)
        desired = max(1, min(4, int(desired)))
        if desired > current:
            last_up = now
        elif desired < current:
            last_down = now
        current = desired
        history.append((now, current))
    up_at = next(t for t, n in history if n > 1)
    assert 5.0 <= up_at <= 6.5, "pressure scales up within the upscale delay"
    assert max(n for t, n in history if t < 20.0) == 4  # 250 blocks need 4 replicas at 75 % of 100
    downs = [t for (t, n), (_, prev) in zip(history[1:], history) if n < prev]
    assert downs and downs[0] >= 25.0, "no step down before the quiet period after the burst"
    assert all(b - a >= 5.0 for a, b in zip(downs, downs[1:])), "at most one step down per quiet period"
    assert history[-1][1] == 1
    flips = sum(1 for (_, a), (_, b) in zip(history, history[1:]) if a != b)
    assert flips == 1 + len(downs), "one step up, then only steps down: no flapping"


def test_no_scale_down_when_rest_would_be_over_target():
    d, _ = kvscale_policy(ctx(current=2, demand=140.0, now=1000.0))
    assert d == 2  # 140 blocks need 2 replicas at 75 % of 100


@pytest.mark.parametrize("requests,expected", [(0.0, 0), (2.0, 1)])
def test_cold_start_from_zero(requests, expected):
    assert kvscale_policy(ctx(current=0, requests=requests, lo=0))[0] == expected


def test_autoscaling_app_builds_with_our_policy():
    from serve_app import build_app
    from serve_app.app import engine_deployment_options
    from serve_app.config import ServeConfig

    cfg = ServeConfig(num_replicas=None, min_replicas=0, max_replicas=3, downscale_quiet_s=4,
                      kv_target_utilization=0.6)
    assert "num_replicas" not in engine_deployment_options(cfg)
    app = build_app(cfg)  # the application Ray Serve deploys: ingress bound to the engine deployment
    engine = app._bound_deployment.init_args[0]._bound_deployment
    auto = engine._deployment_config.autoscaling_config
    assert engine.name == "KVEngine" and (auto.min_replicas, auto.max_replicas, auto.initial_replicas) == (0, 3, 1)
    assert auto.policy.policy_function == "serve_app.autoscaling:KVAutoscalingPolicy"
    assert auto.policy.policy_kwargs == {"target_utilization": 0.6, "downscale_quiet_s": 4.0,
                                         "downscale_window_s": 900.0, "ttft_slo_s": 5.0, "itl_slo_s": 0.25,
                                         "startup_s": 30.0}  # the CPU's default SLOs
    router = engine._deployment_config.request_router_config
    assert router.request_router_class == "serve_app.router:KVAwareRouter"


def test_ray_hands_our_settings_to_the_policy():
    """Resolved the way Ray's controller resolves it, the policy runs with the configured quiet period
    (Ray forwards policy_kwargs only to class policies: a bare function would silently use 30 s)."""
    from ray.serve._private.autoscaling_state import _resolve_policy_callable
    from ray.serve.config import AutoscalingConfig

    from serve_app.app import engine_deployment_options
    from serve_app.config import ServeConfig

    opts = engine_deployment_options(ServeConfig(num_replicas=None, max_replicas=3, downscale_quiet_s=4,
                                                 downscale_window_s=4, replica_startup_s=0))
    policy = _resolve_policy_callable(AutoscalingConfig(**opts["autoscaling_config"]).policy)
    _, state = policy(ctx(current=2, demand=10.0, waiting=1, now=0.0))
    assert policy(ctx(current=2, demand=10.0, state=state, now=3.0))[0] == 2
    assert policy(ctx(current=2, demand=10.0, state=state, now=4.5))[0] == 1  # 4 s, not the default 30


def test_serve_config_rejects_bad_fields_with_names():
    from pydantic import ValidationError

    from serve_app.config import ServeConfig

    with pytest.raises(ValidationError, match="block_size"):
        ServeConfig(block_size=7)
    with pytest.raises(ValidationError, match="no_such_field"):
        ServeConfig(no_such_field=1)
    with pytest.raises(ValidationError, match="no_such_field"):
        ServeConfig(engine={"no_such_field": 1})
    with pytest.raises(ValidationError, match="max_num_seqs given both"):
        ServeConfig(max_num_seqs=4, engine={"max_num_seqs": 8})


def test_serve_config_is_derived_from_the_engine_config():
    """One source: every engine field is accepted flat (as in serve_app/config.yaml) or nested, with the
    engine's own defaults, and reaches the engine unchanged; none is declared a second time."""
    import dataclasses

    from engine.config import EngineConfig
    from serve_app.config import ServeConfig

    flat = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    assert not set(flat) & set(ServeConfig.model_fields)  # not re-declared
    assert ServeConfig().to_engine_config() == dataclasses.replace(EngineConfig(), show_progress=False)
    changed = {"model": "/models/x", "block_size": 32, "max_num_seqs": 7, "attention_backend": "triton",
               "kv_cache_bytes": 12345, "enforce_eager": True}
    for config in (ServeConfig(**changed), ServeConfig(engine=changed)):
        assert config.to_engine_config() == EngineConfig(**changed, show_progress=False)
        assert ServeConfig(**config.model_dump()) == config  # what the app hands its replicas round-trips


def test_the_policy_class_starts_no_ray_outside_a_cluster():
    """The class Serve's controller calls also reports its decisions to the app's stats board; outside a Ray
    process it must not start Ray (ray.get_actor would, and leave a local cluster on the dashboard port)."""
    import ray

    from serve_app.autoscaling import KVAutoscalingPolicy

    assert not ray.is_initialized()
    policy = KVAutoscalingPolicy(target_utilization=0.75)
    assert policy(ctx(current=1, demand=160.0))[0] == 3
    assert not ray.is_initialized()


# ---- compute, arrivals and SLOs ----
# A replica whose step takes 10 ms + 20 us per token + 10 ns per KV token read (an 8B model on a fast GPU, roughly)
STEP = {"step_c0": 0.010, "step_c1": 20e-6, "step_c2": 10e-9}
SLO = {"ttft_slo_s": 1.0, "itl_slo_s": 0.05}


def test_compute_bound_load_scales_with_kv_mostly_free():
    """Many short requests: 2000 running sequences of 500 tokens hold 60 % of one replica's KV blocks (of 16), below
    the 75 % target, but its step would take 10 + 40 + 10 = 60 ms, over the 50 ms ITL SLO; two replicas' take 35."""
    load = {"num_running": 2000.0, "running_tokens": 1_000_000.0, "arrival_rps": 0.0, "arrival_prompt_tps": 0.0}
    d, state = kvscale_policy(ctx(current=1, total=100_000.0, demand=60_000.0, fleet=load, each=STEP), **SLO)
    assert d == 2
    assert state["last_look"]["bound"] == "compute" and state["last_look"]["kv_need"] == 1
    # the same load without measured step times (a replica that has not stepped yet): KV alone decides
    d, _ = kvscale_policy(ctx(current=1, total=100_000.0, demand=60_000.0, fleet=load), **SLO)
    assert d == 1


def test_prefill_load_sizes_for_the_ttft_slo():
    """40k prompt tokens/s of 2000-token prompts: prefill alone would be 80 % of one replica's time (20 us x 40k),
    over the share the policy plans for; a tighter TTFT SLO leaves less room for queueing, so more replicas."""
    from serve_app.autoscaling import FleetLoad, SLO as Slo, compute_replicas

    load = FleetLoad(running=20.0, running_tokens=40_000.0, prefill_tps=40_000.0, arrival_rps=20.0)
    r, why = compute_replicas(load, (0.010, 20e-6, 10e-9), Slo(1.0, 0.05), 32)
    assert r >= 2 and "replica" in why
    tight, _ = compute_replicas(load, (0.010, 20e-6, 10e-9), Slo(0.1, 0.05), 32)
    assert tight > r  # a tighter TTFT SLO needs more replicas for the same load


def test_a_backlog_the_running_replicas_clear_before_a_new_one_is_up_asks_for_none():
    """40k queued prompt tokens at 20 us each: 0.8 s of one replica's time. With a 0.5 s TTFT target a cold
    fleet needs 2 to compute them in time; a running replica computes them long before a replica asked for now
    would start (60 s), so it asks for none; a backlog that outlasts the start-up still counts."""
    from serve_app.autoscaling import FleetLoad, SLO as Slo, compute_replicas

    coeffs, slo = (0.010, 20e-6, 10e-9), Slo(0.5, 0.05)
    load = FleetLoad(running=1.0, running_tokens=100.0, prefill_tps=0.0, arrival_rps=0.0, backlog_tokens=40_000.0)
    assert compute_replicas(load, coeffs, slo, 32)[0] == 2
    assert compute_replicas(load, coeffs, slo, 32, ready=1, startup_s=60.0)[0] == 1
    huge = FleetLoad(running=1.0, running_tokens=100.0, prefill_tps=0.0, arrival_rps=0.0, backlog_tokens=4e6)
    assert compute_replicas(huge, coeffs, slo, 32, ready=1, startup_s=60.0)[0] > 1


def test_the_floor_keeps_what_recent_bursts_need_within_the_ttft_slo():
    """A 10 s burst of 200k prompt tokens/s in a quiet minute (20 us a token, 8k-token steps: ~48k tokens/s a
    replica): to compute it within a 1 s TTFT SLO takes its peak (5 replicas); within 10 s it may queue, and
    fewer do. The mean rate alone would keep one."""
    from serve_app.autoscaling import FleetLoad, SLO as Slo, burst_replicas

    history = [(float(t), 200_000.0 if 30 <= t < 40 else 1_000.0, 1.0) for t in range(120)]
    load = FleetLoad(running=1.0, running_tokens=1000.0, prefill_tps=1_000.0, arrival_rps=1.0, token_budget=8192)
    coeffs = (0.010, 20e-6, 10e-9)
    tight = burst_replicas(history, load, coeffs, Slo(1.0, 0.05), 32)
    loose = burst_replicas(history, load, coeffs, Slo(10.0, 0.05), 32)
    assert tight >= 4 and 1 < loose < tight
    assert burst_replicas([(float(t), 1_000.0, 1.0) for t in range(120)], load, coeffs, Slo(1.0, 0.05), 32) == 1


def test_rising_arrivals_scale_up_before_the_load_lands():
    """Prompt tokens/s doubling over the last minute, with a 60 s start-up: the policy sizes for the forecast."""
    state, d = {}, 1
    for t in range(0, 61, 1):
        rate = 5_000.0 + 250.0 * t  # 5k -> 20k prompt tokens/s
        load = {"num_running": rate / 100, "running_tokens": rate * 10, "arrival_rps": rate / 2000,
                "arrival_prompt_tps": rate}
        d, state = kvscale_policy(ctx(current=1, hi=16, total=100_000.0, fleet=load, each=STEP, now=float(t),
                                      state=state), startup_s=60.0, **SLO)
    now_only, _ = kvscale_policy(ctx(current=1, hi=16, total=100_000.0, fleet=load, each=STEP, now=61.0),
                                 startup_s=60.0, forecast=False, **SLO)
    assert state["last_look"]["growth"] > 1.5
    assert d > now_only  # more replicas than today's load needs: they will be up when the load arrives


def test_observed_latency_over_the_slo_adds_a_replica():
    """A TTFT breach asks for a replica once it has lasted a latency window (a short burst's misses leave the
    window sooner, and a replica asked for then would serve after the burst); an ITL breach at once."""
    from serve_app.autoscaling import BREACH_PERSIST_S

    d, state = kvscale_policy(ctx(current=2, demand=10.0, each={"ttft_recent_s": 1.6}), **SLO)
    assert d == 2
    d, state = kvscale_policy(ctx(current=2, demand=10.0, each={"ttft_recent_s": 1.6}, now=100.0 + BREACH_PERSIST_S,
                                  state=state), **SLO)
    assert d == 3 and state["decisions"] == {"up:slo_pressure": 1}
    # a breach that ended in between starts over
    _, state = kvscale_policy(ctx(current=2, demand=10.0, each={"ttft_recent_s": 1.6}), **SLO)
    _, state = kvscale_policy(ctx(current=2, demand=10.0, now=105.0, state=state), **SLO)
    d, _ = kvscale_policy(ctx(current=2, demand=10.0, each={"ttft_recent_s": 1.6}, now=100.0 + BREACH_PERSIST_S,
                              state=state), **SLO)
    assert d == 2
    d, _ = kvscale_policy(ctx(current=2, demand=10.0, each={"itl_recent_s": 0.08}), **SLO)
    assert d == 3
    d, _ = kvscale_policy(ctx(current=2, demand=10.0, each={"ttft_recent_s": 0.5, "itl_recent_s": 0.04}), **SLO)
    assert d == 2


def test_scale_down_never_below_the_windows_need_and_keeps_starting_replicas():
    kw = dict(downscale_quiet_s=10.0, downscale_window_s=100.0)
    _, state = kvscale_policy(ctx(current=1, demand=300.0, now=0.0), **kw)  # needs 4
    d, state = kvscale_policy(ctx(current=1, target=4, demand=10.0, now=5.0, state=state), **kw)
    assert d == 4  # the need fell while 3 replicas start: they stay asked for (the window remembers 4)
    d, state = kvscale_policy(ctx(current=4, demand=10.0, now=50.0, state=state), **kw)
    assert d == 4  # quiet, but 4 were needed within the window
    d, state = kvscale_policy(ctx(current=4, demand=10.0, now=101.0, state=state), **kw)
    assert d == 1


def test_startup_time_is_learned_from_scale_ups():
    from serve_app.autoscaling import _learn_startup

    state = {}
    assert _learn_startup(ctx(current=1, target=3, now=0.0), state, 0.0, 30.0) == 30.0
    _learn_startup(ctx(current=1, target=3, now=10.0), state, 10.0, 30.0)
    assert _learn_startup(ctx(current=2, target=3, now=45.0), state, 45.0, 30.0) == 45.0
    assert _learn_startup(ctx(current=3, target=3, now=55.0), state, 55.0, 30.0) == 50.0  # mean of 45 and 55


def test_step_time_model_learns_a_replicas_costs():
    import random

    from engine.perf_model import StepTimeModel

    m, rng = StepTimeModel(), random.Random(0)
    for _ in range(500):
        tokens, kv = rng.randint(1, 2048), rng.randint(0, 400_000)
        m.observe(tokens, kv, 0.004 + 30e-6 * tokens + 5e-9 * kv)
    c0, c1, c2 = m.coefficients()
    assert abs(c0 - 0.004) < 1e-4 and abs(c1 - 30e-6) < 1e-7 and abs(c2 - 5e-9) < 1e-10
    only_decode = StepTimeModel()  # one batch size only: the terms are not separable, none comes out negative
    for _ in range(50):
        only_decode.observe(8, 8000, 0.012)
    assert all(c >= 0 for c in only_decode.coefficients()) and abs(only_decode.predict(8, 8000) - 0.012) < 1e-3


def test_replica_meters():
    from types import SimpleNamespace

    from serve_app.autoscaling import ArrivalMeter, LatencyWindow

    meter = ArrivalMeter(window_s=5.0)
    for t in range(11):
        rates = meter.rates(float(t), SimpleNamespace(num_added_total=2 * t, num_added_prompt_tokens_total=1000 * t,
                                                      num_generation_tokens_total=50 * t))
    assert rates == (2.0, 1000.0, 50.0)
    window = LatencyWindow(window_s=10.0)
    for i in range(100):
        window.add(i * 0.1, 0.01 * i)
    assert window.quantile(10.0, 0.99) == 0.99
    assert window.quantile(100.0, 0.99) == 0.0  # all older than the window: nothing to say
