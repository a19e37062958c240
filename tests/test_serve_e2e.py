"""The Ray Serve app end to end: a real local Ray cluster, real HTTP, the `openai` client.

Marked slow (Ray takes a while to start on 2 cores); CI runs it anyway.
"""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from helpers import local_serve, wait_until_serving

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def server(make_tiny_model):
    from ray import serve

    from serve_app import build_app

    with local_serve(num_cpus=8, share=True) as base:
        serve.run(build_app({"model": "default", "num_kv_blocks": 256, "max_model_len": 1024, "torch_threads": 1,
                             "engine_num_cpus": 1}), name="main", route_prefix="/", blocking=False)
        tiny = make_tiny_model("llama")
        serve.run(build_app({"model": tiny, "served_model_name": "tiny", "dtype": "float32", "num_kv_blocks": 64,
                             "max_model_len": 256, "api_key": "s3cret", "max_request_body_bytes": 4096,
                             "max_num_seqs": 1, "max_waiting_requests": 1, "torch_threads": 1}),
                  name="secure", route_prefix="/secure", blocking=False)
        wait_until_serving([f"{base}/health", f"{base}/secure/health", f"{base}/v1/models"], 300, "the serve apps")
        yield base


@pytest.fixture(scope="module")
def offline():
    from engine import LLM

    return LLM(num_kv_blocks=256, show_progress=False)


@pytest.fixture()
def client(server):
    import openai

    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)


def _metric(base: str, name: str, prefix: str = "") -> list[float]:
    text = httpx.get(f"{base}{prefix}/metrics", timeout=10).text
    return [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(f"kvscale:{name}{{")]


def _wait_all_free(base: str, prefix: str = "", timeout: float = 5.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        free, total = _metric(base, "num_free_blocks", prefix), _metric(base, "num_total_blocks", prefix)
        running = _metric(base, "num_requests_running", prefix)
        if free and free == total and not any(running):
            return
        time.sleep(0.2)
    raise AssertionError(f"KV blocks still held: free={free} total={total} running={running}")


def test_completions_match_offline_engine(client, offline, server):
    from engine import SamplingParams

    prompt = "The three most common colors of cars are"
    expected = offline.generate(prompt, SamplingParams(temperature=0, max_tokens=24))[0].outputs[0]
    r = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=24)
    assert r.choices[0].text == expected.text
    assert r.choices[0].finish_reason == ("length" if expected.finish_reason == "length" else "stop")
    assert r.usage.prompt_tokens == len(offline.get_tokenizer().encode(prompt))
    assert r.usage.completion_tokens == len(expected.token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens

    chunks = list(client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=24, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
    assert len([c for c in chunks if c.choices and c.choices[0].text]) > 3  # streamed, not buffered
    assert chunks[-1].usage.completion_tokens == len(expected.token_ids) and chunks[-1].choices == []
    _wait_all_free(server)


def test_chat_matches_offline_engine(client, offline):
    from engine import SamplingParams

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    expected = offline.chat(messages, SamplingParams(temperature=0, max_tokens=30))[0].outputs[0]
    r = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=30)
    assert r.choices[0].message.content == expected.text and "Paris" in expected.text
    assert r.choices[0].message.role == "assistant" and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == len(expected.token_ids)
    stream = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=30,
                                            stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_n_seed_stop_logprobs(client, offline):
    r = client.completions.create(model=MODEL, prompt="Once upon a time", n=2, temperature=1.0, seed=7,
                                  max_tokens=12, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1]
    again = client.completions.create(model=MODEL, prompt="Once upon a time", n=2, temperature=1.0, seed=7,
                                      max_tokens=12, extra_body={"ignore_eos": True})
    assert [c.text for c in again.choices] == [c.text for c in r.choices]  # seeded: reproducible
    full = client.completions.create(model=MODEL, prompt="Count: one, two, three,", temperature=0, max_tokens=20)
    text = full.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = client.completions.create(model=MODEL, prompt="Count: one, two, three,", temperature=0, max_tokens=20,
                                    stop=[stop])
    assert cut.choices[0].text == text[: text.index(stop)] and cut.choices[0].finish_reason == "stop"
    lp = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], temperature=0,
                                        max_tokens=4, logprobs=True, top_logprobs=2)
    content = lp.choices[0].logprobs.content
    assert len(content) == lp.usage.completion_tokens and all(len(t.top_logprobs) == 2 for t in content)
    assert all(t.logprob <= 0 for t in content)


def test_prompt_lists_and_token_prompts(client, offline):
    from engine import SamplingParams

    prompts = ["Paris is", "Rome is"]
    r = client.completions.create(model=MODEL, prompt=prompts, temperature=0, max_tokens=6)
    exp = offline.generate(prompts, SamplingParams(temperature=0, max_tokens=6))
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == [o.outputs[0].text for o in exp]
    ids = offline.get_tokenizer().encode("Paris is")
    r2 = client.completions.create(model=MODEL, prompt=ids, temperature=0, max_tokens=6)
    assert r2.choices[0].text == exp[0].outputs[0].text


@pytest.mark.parametrize("body,status,param", [
    ({"model": MODEL, "prompt": "hi", "temperature": -1}, 400, "temperature"),
    ({"model": MODEL, "prompt": "hi", "top_p": 0}, 400, "top_p"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "hi", "n": 1000}, 400, "n"),
    ({"model": MODEL}, 400, "prompt"),
    ({"model": MODEL, "prompt": "word " * 1100}, 400, None),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 5000}, 400, None),
    ({"model": MODEL, "prompt": []}, 400, "prompt"),
    ({"model": MODEL, "prompt": [[10**9]]}, 400, None),
    ({"model": "gpt-4", "prompt": "hi"}, 404, "model"),
])
def test_completion_errors_are_openai_shaped(server, body, status, param):
    r = httpx.post(f"{server}/v1/completions", json=body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param:
        assert err["param"] == param


@pytest.mark.parametrize("body,status", [
    ({"model": MODEL, "messages": []}, 400),
    ({"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, 400),
    ({"model": MODEL, "messages": "hello"}, 400),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": "yes"}, 400),
])
def test_chat_errors(server, body, status):
    r = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == status and "error" in r.json()


def test_malformed_bodies(server):
    for raw in (b"{not json", b"\xff\xfe\x00garbage", b"[1, 2]", b"[" * 50000 + b"]" * 50000):
        r = httpx.post(f"{server}/v1/completions", content=raw, headers={"content-type": "application/json"},
                       timeout=30)
        assert r.status_code == 400, (raw[:20], r.status_code, r.text[:200])
        assert "error" in r.json()
    _wait_all_free(server)


def test_api_key_body_limit_and_queue_limit(server):
    base = f"{server}/secure"
    good = {"Authorization": "Bearer s3cret"}
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 3}
    assert httpx.get(f"{base}/health").status_code == 200  # health stays open
    for route, method in (("/v1/models", "GET"), ("/v1/completions", "POST"), ("/v1/chat/completions", "POST")):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            r = httpx.request(method, f"{base}{route}", json=body, headers=headers, timeout=30)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.post(f"{base}/v1/completions", json=body, headers=good, timeout=60).status_code == 200
    big = {"model": "tiny", "prompt": "x" * 10000}
    r = httpx.post(f"{base}/v1/completions", json=big, headers=good, timeout=30)
    assert r.status_code == 413 and "error" in r.json()

    async def flood():
        async with httpx.AsyncClient(timeout=120) as c:
            long = {"model": "tiny", "prompt": [5] * 10, "max_tokens": 200, "ignore_eos": True}
            return await asyncio.gather(*(c.post(f"{base}/v1/completions", json=long, headers=good)
                                          for _ in range(6)))

    results = asyncio.run(flood())
    codes = sorted(r.status_code for r in results)
    assert 200 in codes and 503 in codes, codes  # 1 running, 1 waiting, the rest told to come back
    refused = [r for r in results if r.status_code == 503]
    assert all(r.headers.get("retry-after") and r.json()["error"]["type"] for r in refused)
    _wait_all_free(server, "/secure", timeout=30)


def test_64_concurrent_streams_complete_and_free_everything(server):
    async def one(c: httpx.AsyncClient, i: int):
        body = {"model": MODEL, "prompt": f"Request {i}: tell me about number {i}.", "max_tokens": 8 + i % 9,
                "temperature": 0.8, "seed": i, "stream": True, "ignore_eos": True,
                "stream_options": {"include_usage": True}}
        events, done = [], False
        async with c.stream("POST", f"{server}/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line:
                    continue
                assert line.startswith("data: "), line
                payload = line[6:]
                if payload == "[DONE]":
                    done = True
                    continue
                assert not done, "data after [DONE]"
                events.append(json.loads(payload))
        assert done
        usage = events[-1]["usage"]
        assert usage["completion_tokens"] == 8 + i % 9
        finish = [e["choices"][0]["finish_reason"] for e in events if e["choices"]]
        assert finish[-1] == "length" and all(f is None for f in finish[:-1])
        return usage["completion_tokens"]

    async def main():
        async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=100)) as c:
            return await asyncio.gather(*(one(c, i) for i in range(64)))

    counts = asyncio.run(main())
    assert len(counts) == 64
    _wait_all_free(server)


def test_disconnect_frees_blocks_within_a_second(server):
    async def main():
        async with httpx.AsyncClient(timeout=60) as c:
            body = {"model": MODEL, "prompt": "Write a very long essay.", "max_tokens": 900, "ignore_eos": True,
                    "stream": True}
            async with c.stream("POST", f"{server}/v1/completions", json=body) as r:
                n = 0
                async for line in r.aiter_lines():
                    n += line.startswith("data: ")
                    if n >= 3:
                        break  # hang up mid-stream

    asyncio.run(main())
    assert max(_metric(server, "num_requests_running") or [0]) <= 1
    _wait_all_free(server, timeout=1.5)  # one metrics report interval (0.5 s) plus margin


def test_the_stats_board_goes_with_its_app(server, make_tiny_model):
    """Metrics state is the app's own: deleting the app removes its stats actor (it used to be detached
    and outlive every app that ever ran on the cluster)."""
    import ray
    from ray import serve

    from serve_app import build_app
    from serve_app.metrics import BOARD_NAMESPACE

    serve.run(build_app({"model": make_tiny_model("llama"), "served_model_name": "brief", "dtype": "float32",
                         "num_kv_blocks": 16, "max_model_len": 128, "torch_threads": 1}),
              name="brief", route_prefix="/brief", blocking=False)
    wait_until_serving([f"{server}/brief/health"], 300, "the brief app")
    deadline = time.time() + 30
    while not _metric(server, "num_total_blocks", "/brief") and time.time() < deadline:
        time.sleep(0.5)
    assert _metric(server, "num_total_blocks", "/brief") == [16.0]
    assert ray.get_actor("stats-board-brief", namespace=BOARD_NAMESPACE)
    serve.delete("brief")
    deadline = time.time() + 30
    while time.time() < deadline:
        try:
            ray.get_actor("stats-board-brief", namespace=BOARD_NAMESPACE)
        except ValueError:
            break
        time.sleep(0.5)
    else:
        pytest.fail("the stats board outlived its app")
    assert ray.get_actor("stats-board-main", namespace=BOARD_NAMESPACE)  # the other apps keep theirs


def test_a_hybrid_model_serves_through_the_openai_api(server, make_tiny_model):
    """A tiny random Qwen3.5 (Gated DeltaNet + gated full attention) checkpoint as its own app: completions
    (token ids in, HF's greedy tokens out) and streamed chat through the real openai client; afterwards every
    block and state slot is free."""
    import openai
    from ray import serve

    from bench.models import hf_greedy
    from serve_app import build_app

    path = make_tiny_model("qwen3_5")
    serve.run(build_app({"model": path, "served_model_name": "hybrid", "dtype": "float32", "num_kv_blocks": 64,
                         "max_model_len": 256, "max_num_seqs": 4, "torch_threads": 1}),
              name="hybrid", route_prefix="/hybrid", blocking=False)
    try:
        wait_until_serving([f"{server}/hybrid/health"], 300, "the hybrid app")
        client = openai.OpenAI(base_url=f"{server}/hybrid/v1", api_key="unused", max_retries=0, timeout=120)
        prompts = [list(range(100, 137)), list(range(2000, 2009))]
        resp = client.completions.create(model="hybrid", prompt=prompts, max_tokens=10, temperature=0,
                                         extra_body={"ignore_eos": True, "return_token_ids": True})
        want = hf_greedy(path, prompts, 10)
        assert [c.model_extra["token_ids"] for c in sorted(resp.choices, key=lambda c: c.index)] == want
        stream = client.chat.completions.create(model="hybrid", stream=True, max_tokens=12, temperature=0,
                                                messages=[{"role": "user", "content": "Hello there"}])
        chunks = list(stream)
        assert chunks[-1].choices[0].finish_reason in ("length", "stop")
        deadline = time.time() + 30
        while time.time() < deadline:
            slots = _metric(server, "num_state_slots", "/hybrid")
            free_slots = _metric(server, "num_free_state_slots", "/hybrid")
            if slots and slots == free_slots:
                break
            time.sleep(0.5)
        assert slots == [4.0] and free_slots == [4.0]
        _wait_all_free(server, "/hybrid")
    finally:
        serve.delete("hybrid")
