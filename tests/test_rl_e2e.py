"""RL rollout serving end to end, on a real local Ray cluster with two engine replicas: token-in/token-out
with logprobs a trainer can use, weights pushed to every replica (one restarted after a crash too) from this
driver and over the admin routes, pause / resume / sleep / wake_up answered with 503 meanwhile. Marked slow;
CI runs it."""
from __future__ import annotations

import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from helpers import local_serve, wait_until_serving

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.models import hf_greedy  # noqa: E402

pytestmark = pytest.mark.slow

APP = "kvscale"  # rl's default app name, the one serve_app/config.yaml deploys
KEY = "rl-secret"
PROMPT = list(range(100, 140))


@pytest.fixture(scope="module")
def policies(make_tiny_model):
    # 2048 positions: long enough streams that a weight update lands while they run (test_each_pause_mode...)
    old = make_tiny_model("llama", max_position_embeddings=2048)
    new = make_tiny_model("llama", initializer_range=0.3, max_position_embeddings=2048)
    return {"old": old, "new": new, "want_old": hf_greedy(old, [PROMPT], 8)[0], "want_new": hf_greedy(new, [PROMPT], 8)[0]}


def _app_config(policies, replicas: int) -> dict:
    return {"model": policies["old"], "dtype": "float32", "num_kv_blocks": 256, "num_replicas": replicas,
            "torch_threads": 1, "admin_api": True, "api_key": KEY}


@pytest.fixture(scope="module")
def server(policies):
    from ray import serve

    from serve_app import build_app, rl

    with local_serve(num_cpus=8, share=True) as base:
        serve.run(build_app(_app_config(policies, 2)), name=APP, route_prefix="/", blocking=False)
        wait_until_serving([f"{base}/health"], 300, "the app")
        yield base
        rl.reset(app_name=APP)


def _headers():
    return {"Authorization": f"Bearer {KEY}"}


def _greedy(base: str, model: str) -> dict:
    r = httpx.post(f"{base}/v1/completions", headers=_headers(), timeout=120, json={
        "model": Path(model).name, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True})
    assert r.status_code == 200, r.text
    return r.json()


def _weights(path: str) -> dict[str, torch.Tensor]:
    from engine.loader import iter_weights

    return dict(iter_weights(path, show_progress=False))


def test_token_in_token_out_with_logprobs_of_the_sampled_distribution(server, policies):
    import openai
    from transformers import AutoModelForCausalLM

    client = openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=120)
    prompts = [PROMPT, PROMPT[:13], list(range(2000, 2031))]
    resp = client.completions.create(model=Path(policies["old"]).name, prompt=prompts, max_tokens=10, temperature=1.0,
                                     seed=5, logprobs=0, extra_body={"return_token_ids": True, "ignore_eos": True})
    assert resp.model_extra["model_version"] == 0
    hf = AutoModelForCausalLM.from_pretrained(policies["old"], dtype=torch.float32).eval()
    for prompt, choice in zip(prompts, resp.choices):
        extra = choice.model_extra
        assert extra["prompt_token_ids"] == prompt and len(extra["token_ids"]) == 10
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + extra["token_ids"]])).logits[0, len(prompt) - 1 : -1]
        want = torch.log_softmax(logits, -1).gather(1, torch.tensor(extra["token_ids"])[:, None])[:, 0]
        assert max(abs(a - b) for a, b in zip(choice.logprobs.token_logprobs, want.tolist())) < 1e-4
    # streamed: token ids per chunk, the prompt's on the first
    chunks = list(client.completions.create(model=Path(policies["old"]).name, prompt=PROMPT, max_tokens=8,
                                            temperature=0, stream=True,
                                            extra_body={"return_token_ids": True, "ignore_eos": True}))
    assert chunks[0].choices[0].model_extra["prompt_token_ids"] == PROMPT
    assert sum((c.choices[0].model_extra["token_ids"] for c in chunks if c.choices), []) == policies["want_old"]


def _replica_versions() -> dict[str, object]:
    from serve_app import rl

    return rl.version(app_name=APP)["replicas"]


def test_pushed_weights_reach_every_replica_and_one_restarted_after_a_crash(server, policies):
    import ray

    from serve_app import rl

    assert _greedy(server, policies["old"])["choices"][0]["token_ids"] == policies["want_old"]
    result = rl.update_weights(_weights(policies["new"]), version=1, app_name=APP)
    assert result["replicas"] == 2 and result["bytes"] > 0
    for _ in range(6):  # whichever replica answers: the new policy, no stale prefix KV
        body = _greedy(server, policies["old"])
        assert body["choices"][0]["token_ids"] == policies["want_new"] and body["model_version"] == 1
    before = _replica_versions()
    assert list(before.values()) == [1, 1]

    bad = _weights(policies["new"])
    bad["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.q_proj\.weight"):
        rl.update_weights(bad, version=2, app_name=APP)
    assert _replica_versions() == before  # nobody moved

    # a replica that crashes comes back on the pushed policy, not the checkpoint on disk
    victim = next(a for a in ray.util.list_named_actors(all_namespaces=True) if "KVEngine" in a["name"])
    ray.kill(ray.get_actor(victim["name"], namespace=victim["namespace"]), no_restart=True)
    deadline = time.time() + 180
    while time.time() < deadline:
        now = _replica_versions()
        if len(now) == 2 and set(now) != set(before):
            break
        time.sleep(0.25)
    assert len(now) == 2 and set(now) != set(before), now
    assert list(now.values()) == [1, 1]
    for _ in range(4):
        assert _greedy(server, policies["old"])["choices"][0]["token_ids"] == policies["want_new"]

    # replicas started after the update (the app scaled to 3, as an autoscaler's scale-up starts one) come up on
    # the pushed policy too
    from ray import serve

    from serve_app import build_app

    serve.run(build_app(_app_config(policies, 3)), name=APP, route_prefix="/", blocking=False)
    deadline = time.time() + 240
    while time.time() < deadline and len(now := _replica_versions()) != 3:
        time.sleep(0.25)
    assert len(now) == 3 and set(now) - set(before), now
    assert list(now.values()) == [1, 1, 1]
    serve.run(build_app(_app_config(policies, 2)), name=APP, route_prefix="/", blocking=False)
    deadline = time.time() + 240
    while time.time() < deadline and len(now := _replica_versions()) != 2:
        time.sleep(0.25)
    assert list(now.values()) == [1, 1]
    wait_until_serving([f"{server}/health"], 120, "the app")


def test_admin_routes(server, policies):
    url = f"{server}/admin"
    assert httpx.get(f"{url}/version", timeout=30).status_code == 401  # the API key, like every route
    r = httpx.post(f"{url}/pause", headers=_headers(), json={"mode": "bogus"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "mode"
    r = httpx.post(f"{url}/update_weights", headers=_headers(), json={"path": "/nope", "version": 3}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "path" and "/nope" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/update_weights", headers=_headers(), json={"path": policies["old"], "version": "v3"},
                   timeout=300)
    assert r.status_code == 200, r.text
    body = _greedy(server, policies["old"])
    assert body["choices"][0]["token_ids"] == policies["want_old"] and body["model_version"] == "v3"
    assert httpx.get(f"{url}/version", headers=_headers(), timeout=30).json()["version"] == "v3"

    assert httpx.post(f"{url}/pause", headers=_headers(), json={"mode": "abort"}, timeout=60).status_code == 200
    r = httpx.post(f"{server}/v1/completions", headers=_headers(), timeout=60,
                   json={"model": Path(policies["old"]).name, "prompt": PROMPT, "max_tokens": 4})
    assert r.status_code == 503 and "retry-after" in r.headers and "paused" in r.json()["error"]["message"]
    assert httpx.post(f"{url}/resume", headers=_headers(), timeout=60).status_code == 200
    assert _greedy(server, policies["old"])["choices"][0]["token_ids"] == policies["want_old"]

    r = httpx.post(f"{url}/update_weights", headers=_headers(), json={"path": policies["new"], "version": "v4"},
                   timeout=300)
    assert r.status_code == 200, r.text
    assert httpx.post(f"{url}/sleep", headers=_headers(), json={"level": 2}, timeout=60).status_code == 200
    r = httpx.post(f"{server}/v1/completions", headers=_headers(), timeout=60,
                   json={"model": Path(policies["old"]).name, "prompt": PROMPT, "max_tokens": 4})
    assert r.status_code == 503 and "asleep" in r.json()["error"]["message"]
    assert httpx.post(f"{url}/wake_up", headers=_headers(), timeout=300).status_code == 200
    body = _greedy(server, policies["old"])  # level 2 dropped the weights: back on the pushed version, not the disk's
    assert body["choices"][0]["token_ids"] == policies["want_new"] and body["model_version"] == "v4"


def test_admin_routes_fuzzed_get_clear_errors_and_change_nothing(server, policies):
    """Invalid bodies for every admin route (schemathesis, from the served OpenAPI document): each gets a 4xx
    with an OpenAI-style error, never a 5xx, and no replica moves off its version or pauses."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from schemathesis import GenerationMode

    before = _replica_versions()
    schema = schemathesis.openapi.from_dict(httpx.get(f"{server}/openapi.json", timeout=30).json())
    statuses: dict[int, int] = {}
    for op_result in schema.get_all_operations():
        op = op_result.ok()
        if not op.path.startswith("/admin/") or not op.body:  # resume, wake_up and version take no input
            continue

        @given(case=op.as_strategy(generation_mode=GenerationMode.NEGATIVE))
        @settings(max_examples=25, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        def fuzz(case):
            r = case.call(base_url=server, headers=_headers(), timeout=120)
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            assert 400 <= r.status_code < 500 and set(r.json()["error"]) >= {"message", "type", "param", "code"}, r.text

        fuzz()
    assert statuses.get(400, 0) >= 20, statuses
    assert _replica_versions() == before
    assert _greedy(server, policies["old"])["model_version"] is not None  # still serving, not paused


def _stream(base: str, model: str, max_tokens: int, started, out: dict) -> None:
    """One greedy stream; out gets its finish_reason, token count and the model_version of its last chunk."""
    import json

    tokens, finish, version = 0, None, None
    with httpx.stream("POST", f"{base}/v1/completions", headers=_headers(), timeout=300, json={
            "model": Path(model).name, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "return_token_ids": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            version = chunk.get("model_version", version)
            for choice in chunk["choices"]:
                tokens += len(choice.get("token_ids") or [])
                finish = choice.get("finish_reason") or finish
            if tokens:
                started.release()
    out.update(finish=finish, tokens=tokens, version=version)


def _kv_in_use(base: str) -> list[float]:
    text = httpx.get(f"{base}/metrics", headers=_headers(), timeout=30).text
    return [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith("kvscale:kv_cache_usage_perc{") and "replica=" in line]


LONG = 1300  # tokens per stream: 3 x (40 + 1300) fit one replica's 4096-token pool, so nothing is preempted


@pytest.mark.parametrize("mode", ["abort", "wait", "keep"])
def test_each_pause_mode_under_concurrent_streams(server, policies, mode):
    """update_weights while 3 streams run on the two replicas: abort ends them with finish_reason abort; wait
    lets them finish on the old version before the update lands; keep freezes them and finishes them on the new
    weights, their model_version the list of both. Every replica's KV is back to empty after."""
    import threading

    from serve_app import rl

    old_version = rl.version(app_name=APP)["version"]
    target = "old" if mode != "wait" else "new"
    new_version = f"{mode}-{target}"
    weights = _weights(policies[target])  # read before the streams start: the update follows their first token
    started, outs = threading.Semaphore(0), [{} for _ in range(3)]
    threads = [threading.Thread(target=_stream, args=(server, policies["old"], LONG, started, o)) for o in outs]
    for t in threads:
        t.start()
    for _ in threads:  # every stream has its first token: all four are in flight
        assert started.acquire(timeout=120)
    rl.update_weights(weights, version=new_version, app_name=APP, pause=mode)
    for t in threads:
        t.join(timeout=300)
    for o in outs:
        if mode == "abort":
            assert o["finish"] == "abort" and o["tokens"] < LONG, o
        elif mode == "wait":
            assert o["finish"] == "length" and o["tokens"] == LONG and o["version"] == old_version, o
        else:
            assert o["finish"] == "length" and o["tokens"] == LONG and o["version"] == [old_version, new_version], o
    body = _greedy(server, policies["old"])
    assert body["model_version"] == new_version
    assert body["choices"][0]["token_ids"] == policies[f"want_{target}"]
    deadline = time.time() + 30
    while any(_kv_in_use(server)) and time.time() < deadline:
        time.sleep(0.5)
    assert _kv_in_use(server) == [0.0, 0.0]
