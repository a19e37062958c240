"""KV-aware autoscaling on a real local Ray cluster, through HTTP.

One deployment of the default model with a small KV pool per replica (96 blocks of 16 tokens), whose engine
steps cost a fixed time (`fake_step_s`), so the phases last as long on any CPU. Two
clients at a time throughout, which is Ray's default target of ongoing requests per replica, so the
request-count policy would keep one replica in every phase below:

1. many short requests (2 in flight at a time, for a while): KV demand stays low, no scale-up;
2. long prompts (2 in flight at a time): their KV does not fit one replica, the second waits for blocks,
   the deployment scales up;
3. load drops to two long low-KV streams, one per replica: after the quiet period the deployment scales
   back down while both streams run, and the one on the replica being removed still finishes (drain).

Every request in every phase must end with all its tokens, finish_reason "length" and [DONE].
A second app with min_replicas=0 shows the cold start from zero and reports its time. A third is compute-bound:
many short concurrent streams whose steps (`fake_step_s` + `fake_step_s_per_token` per token) push the
inter-token latency over its SLO with KV mostly free; it scales up on compute, and back down when the load
drops, with no stream cut.
"""
from __future__ import annotations

import asyncio
import json
import math
import random
import re
import threading
import time

import httpx
import pytest
from helpers import local_serve, wait_until_serving

pytestmark = pytest.mark.slow

BLOCKS, BLOCK = 96, 16
STEP_S = 0.06  # seconds per engine step in the scaling test: 330 decode steps (20 s) outlast the 6 s quiet period


@pytest.fixture(scope="module")
def cluster():
    with local_serve(num_cpus=4) as base:
        yield base


def _running_replicas(app: str) -> int:
    from ray import serve

    status = serve.status().applications.get(app)
    if status is None or "KVEngine" not in status.deployments:
        return 0
    states = status.deployments["KVEngine"].replica_states
    return sum(n for state, n in states.items() if str(getattr(state, "value", state)) == "RUNNING")


def _wait_until(predicate, timeout: float, what: str, poll: float = 0.5):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")


class ReplicaWatch:
    """Samples the running replica count in the background; `.samples` is [(t, count)]."""

    def __init__(self, app: str, period: float = 0.25) -> None:
        self.app, self.period, self.samples = app, period, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.samples.append((time.time(), _running_replicas(self.app)))
            except Exception:
                pass
            self._stop.wait(self.period)

    def between(self, t0: float, t1: float) -> list[int]:
        return [n for t, n in self.samples if t0 <= t <= t1]

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


async def stream_completion(c: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int) -> dict:
    """One streaming request, checked chunk by chunk; returns what the client saw."""
    body = {"model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.time()
    seen = {"tokens": 0, "finish": None, "done": False, "usage": None, "ttft": None, "status": None}
    async with c.stream("POST", url, json=body) as r:
        seen["status"] = r.status_code
        if r.status_code != 200:
            seen["error"] = (await r.aread()).decode()
            return seen
        async for line in r.aiter_lines():
            if not line:
                continue
            assert line.startswith("data: "), f"malformed SSE line: {line!r}"
            data = line[len("data: "):]
            if data == "[DONE]":
                seen["done"] = True
                continue
            chunk = json.loads(data)
            assert "error" not in chunk, chunk
            if chunk.get("usage"):
                seen["usage"] = chunk["usage"]
            for choice in chunk.get("choices", []):
                if choice.get("text") and seen["ttft"] is None:
                    seen["ttft"] = time.time() - t0
                seen["finish"] = choice.get("finish_reason") or seen["finish"]
    seen["tokens"] = (seen["usage"] or {}).get("completion_tokens", 0)
    return seen


def assert_whole(results: list[dict], max_tokens: int) -> None:
    for r in results:
        assert r["status"] == 200, r
        assert r["done"] and r["finish"] == "length" and r["tokens"] == max_tokens, f"cut or failed stream: {r}"


async def running_per_replica(c: httpx.AsyncClient, metrics_url: str) -> list[float]:
    text = (await c.get(metrics_url)).text
    return sorted(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                  if line.startswith("kvscale:num_requests_running{"))


def _serving(cluster: str, app: str) -> tuple[str, ReplicaWatch]:
    """Once the app answers: its completions URL, and a watch on its replica count."""
    wait_until_serving([f"{cluster}/{app}/v1/models"], 300, f"the {app} app")
    return f"{cluster}/{app}/v1/completions", ReplicaWatch(app)


def random_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 40000) for _ in range(n)]


def test_scale_from_zero_reports_cold_start(cluster, make_tiny_model):
    from ray import serve

    from serve_app import build_app

    serve.run(build_app({"model": make_tiny_model("llama"), "served_model_name": "SmolLM2-135M-Instruct",
                         "dtype": "float32", "num_kv_blocks": 32, "max_model_len": 256, "torch_threads": 1,
                         "num_replicas": None, "min_replicas": 0, "max_replicas": 1, "downscale_quiet_s": 1,
                         "downscale_window_s": 1, "engine_num_cpus": 0.5}),
              name="zero", route_prefix="/zero", blocking=False)
    wait_until_serving([f"{cluster}/zero/v1/models"], 300, "the min_replicas=0 app")
    _wait_until(lambda: _running_replicas("zero") == 0 or None, 120, "the idle app to scale to zero")

    async def main():
        async with httpx.AsyncClient(timeout=300) as c:
            t0 = time.time()
            r = await stream_completion(c, f"{cluster}/zero/v1/completions", [5, 6, 7, 8], 8)
            return r, time.time() - t0

    result, cold = asyncio.run(main())
    assert_whole([result], 8)
    assert _running_replicas("zero") == 1
    print(f"\ncold start from zero replicas (tiny model, 2-core CPU): first token after {result['ttft']:.1f} s, "
          f"whole request {cold:.1f} s")
    serve.delete("zero")


def _fake_model(make_tiny_model) -> dict:
    """The steps are fake (a sleep of known cost), so the weights only have to load: a tiny random-init model with
    the default model's tokenizer, under its served name, starts a replica in a few seconds less on 2 busy cores
    than the 135M one, and each phase below waits for a replica to start."""
    return {"model": make_tiny_model("llama", max_position_embeddings=1024), "dtype": "float32",
            "served_model_name": "SmolLM2-135M-Instruct"}


def test_scales_on_kv_not_request_count_and_drains_on_the_way_down(cluster, make_tiny_model):
    from ray import serve
    from ray.serve.config import AutoscalingConfig

    from serve_app import build_app

    target_ongoing = AutoscalingConfig().get_target_ongoing_requests()  # Ray's default policy
    concurrency = 2
    assert math.ceil(concurrency / target_ongoing) == 1, "the request-count policy would stay at one replica"
    serve.run(build_app({**_fake_model(make_tiny_model), "num_kv_blocks": BLOCKS, "block_size": BLOCK, "max_model_len": 1024,
                         "torch_threads": 1, "max_num_seqs": 8, "num_replicas": None, "min_replicas": 1,
                         "max_replicas": 2, "kv_target_utilization": 0.9, "downscale_quiet_s": 6,
                         "downscale_window_s": 6,
                         # Every engine step costs STEP_S (the real scheduler, block manager and KV accounting
                         # run; the model's forward is a sleep). The phases below are timed against the
                         # autoscaler's quiet period, so their length must not follow this CPU's decode
                         # speed: the test broke once when the bf16 kernels made the model 3x faster.
                         "fake_step_s": STEP_S,
                         # A replica being removed gets this long to finish its stream; the test is about
                         # draining, not about the deadline.
                         "graceful_shutdown_timeout_s": 400}),
              name="kv", route_prefix="/kv", blocking=False)
    url, watch = _serving(cluster, "kv")
    rng = random.Random(0)
    in_flight, peak = 0, 0

    async def client_loop(c, prompts, max_tokens, until=None):
        nonlocal in_flight, peak
        out = []
        for p in prompts:
            if until is not None and time.time() > until:
                break
            in_flight += 1
            peak = max(peak, in_flight)
            try:
                out.append(await stream_completion(c, url, p, max_tokens))
            finally:
                in_flight -= 1
        return out

    async def phase(loops):
        async with httpx.AsyncClient(timeout=600) as c:
            results = await asyncio.gather(*(client_loop(c, *args) for args in loops))
        return [r for rs in results for r in rs]

    try:
        # 1. Short requests, two at a time, for ~6 s: a few blocks each.
        t0 = time.time()
        short = asyncio.run(phase([([random_prompt(rng, 24) for _ in range(1000)], 16, t0 + 6)
                                   for _ in range(concurrency)]))
        time.sleep(4)  # what the autoscaler saw last has had time to act
        t1 = time.time()
        assert_whole(short, 16)
        assert len(short) >= 6
        assert max(watch.between(t0, t1)) == 1, "short requests must not scale the deployment up"

        # 2. Long prompts, two at a time, in rounds: 700 + 100 tokens = 50 blocks each, two do not fit in 96,
        #    so the second waits for blocks. Rounds go on until the second replica is up (it loads the model
        #    on a busy 2-core machine, which takes a while) or for at most 10 rounds (~2 min).
        long_results = []
        for _ in range(10):
            long_results += asyncio.run(phase([([random_prompt(rng, 700)], 100) for _ in range(concurrency)]))
            if max(watch.between(t1, time.time())) == 2:
                break
        t2 = time.time()
        assert_whole(long_results, 100)
        assert peak <= concurrency
        assert max(watch.between(t1, t2)) == 2, "long prompts at the same request count must scale up"

        # 3. Two long, low-KV streams (16 + 330 tokens = 22 blocks each: both fit one replica under target),
        #    each outlasting the quiet period (330 steps of STEP_S), so the step down comes while both are in
        #    flight.
        async def drain_phase():
            async with httpx.AsyncClient(timeout=600) as c:
                first = asyncio.create_task(stream_completion(c, url, random_prompt(rng, 16), 330))
                await asyncio.sleep(1.5)  # routing stats refresh: the second goes to the emptier replica
                second = asyncio.create_task(stream_completion(c, url, random_prompt(rng, 16), 330))
                await asyncio.sleep(2.5)
                running = await running_per_replica(c, f"{cluster}/kv/metrics")
                results = [await first, await second]
                return results, running, time.time()

        drained, running, drain_end = asyncio.run(drain_phase())
        assert_whole(drained, 330)
        assert running == [1, 1], f"the router should put the two streams on different replicas: {running}"
        _wait_until(lambda: _running_replicas("kv") == 1 or None, 60, "the scale-down to one replica")
        t3 = time.time()
        ups = watch.between(t1, t2)
        print(f"\nreplicas: short phase max {max(watch.between(t0, t1))}, long phase max {max(ups)}, "
              f"{len(short)} short + {len(long_results)} long + 2 drained requests, none failed or cut; "
              f"back to 1 replica {t3 - t2:.0f} s after the long phase")
        down_at = next((t for t, n in watch.samples if t > t2 and n == 1), t3)  # the watcher may not have sampled it yet
        assert down_at < drain_end, "the scale-down should have happened while both streams were in flight"
        # /metrics shows the policy's decisions, each counted once, with the resource that bound it
        decisions = {}
        for line in httpx.get(f"{cluster}/kv/metrics", timeout=10).text.splitlines():
            if line.startswith("kvscale:autoscaler_decisions_total{"):
                labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
                decisions[(labels["direction"], labels["reason"])] = float(line.rsplit(" ", 1)[1])
        n_up = sum(v for (d, _), v in decisions.items() if d == "up")
        n_down = sum(v for (d, _), v in decisions.items() if d == "down")
        assert n_up >= 1 and n_down >= 1 and ("down", "quiet") in decisions, decisions
    finally:
        watch.stop()
        serve.delete("kv")


def test_scales_on_compute_when_itl_breaks_the_slo_with_kv_free(cluster, make_tiny_model):
    """16 short streams at a time: each step costs 20 ms + 4 ms per token, so one replica's steps take ~90 ms
    against a 60 ms ITL SLO while 16 x 3 of its 512 KV blocks are used. The policy (the replicas' learned step
    times, and the ITL they observe) adds the second replica; after the load drops to two long streams it
    goes back to one while both stream to their last token."""
    from ray import serve

    from serve_app import build_app

    serve.run(build_app({**_fake_model(make_tiny_model), "num_kv_blocks": 512, "block_size": BLOCK, "max_model_len": 1024,
                         "torch_threads": 1, "max_num_seqs": 32, "num_replicas": None, "min_replicas": 1,
                         "max_replicas": 2, "downscale_quiet_s": 6, "downscale_window_s": 6,
                         "itl_slo_s": 0.06, "ttft_slo_s": 5.0, "fake_step_s": 0.02, "fake_step_s_per_token": 0.004,
                         "graceful_shutdown_timeout_s": 400}),
              name="cb", route_prefix="/cb", blocking=False)
    url, watch = _serving(cluster, "cb")
    rng = random.Random(1)
    try:
        async def busy(until: float) -> list[dict]:
            async def loop(c):
                out = []
                while time.time() < until:
                    out.append(await stream_completion(c, url, random_prompt(rng, 8), 32))
                return out

            async with httpx.AsyncClient(timeout=600) as c:
                return [r for rs in await asyncio.gather(*(loop(c) for _ in range(16))) for r in rs]

        t0 = time.time()
        short = []
        while time.time() - t0 < 180:  # until the second replica serves (it loads a model on 2 busy cores)
            short += asyncio.run(busy(time.time() + 10))
            if max(watch.between(t0, time.time()), default=1) == 2:
                break
        t1 = time.time()
        assert_whole(short, 32)
        assert max(watch.between(t0, t1)) == 2, "ITL over the SLO with KV free must scale up on compute"
        text = httpx.get(f"{cluster}/cb/metrics", timeout=10).text
        ups = {labels["reason"] for line in text.splitlines() if line.startswith("kvscale:autoscaler_decisions_total{")
               for labels in [dict(re.findall(r'(\w+)="([^"]*)"', line))] if labels["direction"] == "up"}
        assert ups and ups <= {"compute", "slo_pressure"}, f"scaled up for {ups}, not for compute"
        usage = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                 if line.startswith("kvscale:kv_cache_usage_perc{")]
        assert usage and max(usage) < 0.5, f"KV was not mostly free: {usage}"

        async def drop() -> list[dict]:  # two long streams, one per replica, outlasting the quiet period
            async with httpx.AsyncClient(timeout=600) as c:
                first = asyncio.create_task(stream_completion(c, url, random_prompt(rng, 8), 500))
                await asyncio.sleep(1.5)
                second = asyncio.create_task(stream_completion(c, url, random_prompt(rng, 8), 500))
                return [await first, await second]

        drained = asyncio.run(drop())
        assert_whole(drained, 500)
        _wait_until(lambda: _running_replicas("cb") == 1 or None, 90, "the scale-down to one replica")
        t2 = time.time()
        down_at = next((t for t, n in watch.samples if t > t1 and n == 1), t2)
        print(f"\ncompute-bound: {len(short)} short streams, up to 2 replicas after {t1 - t0:.0f} s, back to 1 "
              f"{down_at - t1:.0f} s after the load dropped; KV use at most {max(usage):.0%}")
    finally:
        watch.stop()
        serve.delete("cb")
