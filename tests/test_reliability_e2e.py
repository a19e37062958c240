"""Reliability of the Ray Serve app on a real local Ray cluster: load, hostile input, disconnects, a replica
killed mid-stream. Whatever happens, every client gets a finished stream or a well-formed error, and every
KV block comes back. Marked slow; CI runs it.
"""
from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from pathlib import Path

import httpx
import pytest
from helpers import local_serve, wait_until_serving

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/ is a folder of scripts, not a package
from bench.loadgen import ERROR_KEYS, replica_metrics, run_load, stream_one  # noqa: E402

pytestmark = pytest.mark.slow

MODEL = "tiny"
KEY = "k3y-for-tests"
AUTH = {"Authorization": f"Bearer {KEY}"}
APP = "rel"
REPLICAS = 2
MAX_MODEL_LEN = 256
BODY_LIMIT = 64 * 1024
LOAD_CLIENTS, LOAD_SECONDS = 200, 15  # 750 of 784 requests ran in 25 s here; 15 s still carries hundreds
STREAMS = 16  # in the kill test: about 8 a replica, 16 blocks each, within one replica's 160


@pytest.fixture(scope="module")
def server(make_tiny_model):
    from ray import serve

    from serve_app import build_app

    with local_serve(num_cpus=8, share=True) as base:
        serve.run(build_app({"model": make_tiny_model("llama"), "served_model_name": MODEL, "dtype": "float32",
                             "num_kv_blocks": 160, "max_model_len": MAX_MODEL_LEN, "max_num_seqs": 48,
                             "max_num_batched_tokens": 96, "api_key": KEY, "max_request_body_bytes": BODY_LIMIT,
                             "max_n": 4, "max_prompts_per_request": 4, "max_waiting_requests": 128,
                             "num_replicas": REPLICAS, "torch_threads": 1, "engine_num_cpus": 1}),
                  name=APP, route_prefix="/", blocking=False)
        wait_until_serving([f"{base}/health"], 300, "the serve app")
        _wait_replicas(base, REPLICAS, timeout=120)
        yield base


def _wait_replicas(base: str, n: int, timeout: float, exclude: set[str] = frozenset()) -> set[str]:
    deadline = time.time() + timeout
    while time.time() < deadline:
        live = set(replica_metrics(base, "num_total_blocks")) - set(exclude)
        if len(live) == n and not set(replica_metrics(base, "num_total_blocks")) & set(exclude):
            return live
        time.sleep(0.5)
    raise AssertionError(f"expected {n} live replicas (none of {exclude}); /metrics shows "
                         f"{sorted(replica_metrics(base, 'num_total_blocks'))}")


def _wait_all_free(base: str, timeout: float = 10.0) -> dict[str, float]:
    deadline = time.time() + timeout
    while True:
        free, total = replica_metrics(base, "num_free_blocks"), replica_metrics(base, "num_total_blocks")
        running = replica_metrics(base, "num_requests_running")
        waiting = replica_metrics(base, "num_requests_waiting")
        if total and free == total and not any(running.values()) and not any(waiting.values()):
            return free
        if time.time() > deadline:
            raise AssertionError(f"KV blocks still held: free={free} total={total} running={running} "
                                 f"waiting={waiting}")
        time.sleep(0.25)


def _assert_openai_error(r: httpx.Response, status: int | tuple[int, ...]) -> dict:
    statuses = (status,) if isinstance(status, int) else status
    assert r.status_code in statuses, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert set(err) == ERROR_KEYS and err["message"] and err["type"], err
    return err


# ---------------------------------------------------------------- hostile input

def _post(base: str, content: bytes | None = None, json_body=None, route: str = "/v1/completions", **kw):
    headers = {**AUTH, "content-type": "application/json", **kw.pop("headers", {})}
    return httpx.post(f"{base}{route}", content=content, json=json_body, headers=headers, timeout=60, **kw)


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


HOSTILE_BODIES = {
    "max_tokens 10^12": {"model": MODEL, "prompt": "hi", "max_tokens": 10**12},
    "max_tokens 10^40": {"model": MODEL, "prompt": "hi", "max_tokens": 10**40},
    "max_completion_tokens 10^40": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                    "max_completion_tokens": 10**40},
    "n 10^6": {"model": MODEL, "prompt": "hi", "n": 10**6},
    "n 10^40": {"model": MODEL, "prompt": "hi", "n": 10**40},
    "n true": {"model": MODEL, "prompt": "hi", "n": True},
    "1000 prompts": {"model": MODEL, "prompt": ["hi"] * 1000},
    "3000 token prompts": {"model": MODEL, "prompt": [[5]] * 3000},
    "token id 2^70": {"model": MODEL, "prompt": [2**70]},
    "negative token id": {"model": MODEL, "prompt": [5, -1]},
    "prompt over max_model_len": {"model": MODEL, "prompt": [5] * (MAX_MODEL_LEN + 10)},
    "seed 2^200": {"model": MODEL, "prompt": "hi", "seed": 2**200, "max_tokens": 2},
    "stop_token_ids 2^70": {"model": MODEL, "prompt": "hi", "stop_token_ids": [2**70], "min_tokens": 1},
    "stop_token_ids past vocab": {"model": MODEL, "prompt": "hi", "stop_token_ids": [10**6], "min_tokens": 1},
    "top_k 10^30": {"model": MODEL, "prompt": "hi", "top_k": 10**30},
    "logprobs 10^6": {"model": MODEL, "prompt": "hi", "logprobs": 10**6},
    "top_logprobs 10^6": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                          "top_logprobs": 10**6},
    "nested content parts": {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": json.loads(_nested(200))}}]}]},
    "content part without text": {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text"},
                                                                                          "plain"]}]},
    "5000 messages": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}] * 5000},
    "model list": {"model": [MODEL], "prompt": "hi"},
    "stop list of objects": {"model": MODEL, "prompt": "hi", "stop": [{"a": 1}]},
    "stream_options wrong": {"model": MODEL, "prompt": "hi", "stream": True, "stream_options": "yes"},
}


@pytest.mark.parametrize("name", list(HOSTILE_BODIES))
def test_hostile_json_gets_an_openai_4xx(server, name):
    body = HOSTILE_BODIES[name]
    route = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = _post(server, json_body=body, route=route)
    _assert_openai_error(r, (400, 413))  # 413 where the body itself is over the limit (5000 messages)


@pytest.mark.parametrize("name,raw", [
    ("deep nesting", _nested(30_000).encode()),  # 60 kB: under the body limit
    ("deep nesting in a field", b'{"model": "tiny", "prompt": ' + _nested(25_000).encode() + b"}"),
    ("invalid UTF-8", b'{"model": "tiny", "prompt": "\xff\xfe\xfd"}'),
    ("invalid UTF-8 outside strings", b"\xc3\x28{}"),
    ("lone surrogate", b'{"model": "tiny", "prompt": "\\ud800 hi", "max_tokens": 2}'),
    ("lone surrogate in chat", b'{"model": "tiny", "messages": [{"role": "user", "content": "\\udfff"}]}'),
    ("NaN temperature", b'{"model": "tiny", "prompt": "hi", "temperature": NaN}'),
    ("Infinity top_p", b'{"model": "tiny", "prompt": "hi", "top_p": Infinity}'),
    ("huge exponent", b'{"model": "tiny", "prompt": "hi", "temperature": 1e999}'),
    ("empty body", b""),
    ("a bare string", b'"hello"'),
    ("truncated", b'{"model": "tiny", "prompt": "hi'),
    ("duplicate keys", b'{"model": "tiny", "model": 5, "prompt": "hi"}'),
])
def test_malformed_bytes_get_an_openai_400(server, name, raw):
    route = "/v1/chat/completions" if b"messages" in raw else "/v1/completions"
    _assert_openai_error(_post(server, content=raw, route=route), 400)


def test_oversized_bodies_get_413_declared_or_streamed(server):
    big = json.dumps({"model": MODEL, "prompt": "x" * (BODY_LIMIT + 10)}).encode()
    _assert_openai_error(_post(server, content=big), 413)

    def chunks():  # no Content-Length: chunked transfer, the cap must hold while reading
        for _ in range(BODY_LIMIT // 1000 + 10):
            yield b" " * 1000

    _assert_openai_error(_post(server, content=chunks()), 413)
    # A declared length of a terabyte is refused from the headers alone, without waiting for the body.
    import socket

    host, port = server.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {10**12}\r\n\r\n{{}}".encode())
        raw = b""
        while b"\r\n\r\n" not in raw or len(raw.split(b"\r\n\r\n", 1)[1]) < _content_length(raw):
            chunk = sock.recv(65536)
            if not chunk:
                break
            raw += chunk
    head, body = raw.decode(errors="replace").split("\r\n\r\n", 1)
    assert head.startswith("HTTP/1.1 413"), head[:200]
    assert json.loads(body)["error"]["message"]
    _wait_all_free(server)


def _content_length(raw: bytes) -> int:
    for line in raw.split(b"\r\n\r\n", 1)[0].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":", 1)[1])
    return 1 << 30


def test_api_key_guards_every_v1_route_and_is_compared_in_constant_time(server, monkeypatch):
    import hmac

    from serve_app.ingress import OpenAIIngress

    paths = httpx.get(f"{server}/openapi.json", timeout=30).json()["paths"]  # every route the app serves
    routes = [(path, method.upper()) for path, item in paths.items() if path.startswith("/v1") for method in item]
    assert {("/v1/models", "GET"), ("/v1/completions", "POST"), ("/v1/chat/completions", "POST")} <= set(routes)
    wrong = "x" * len(KEY)  # same length: only a byte-by-byte compare could tell it apart early
    for path, method in routes:
        for headers in ({}, {"Authorization": f"Bearer {wrong}"}, {"Authorization": KEY},
                        {"Authorization": f"Basic {KEY}"}, {"Authorization": f"Bearer {KEY}x"}):
            r = httpx.request(method, f"{server}{path}", json={"model": MODEL, "prompt": "hi"}, headers=headers,
                              timeout=30)
            assert _assert_openai_error(r, 401)["code"] == "invalid_api_key", (path, headers)
    assert httpx.get(f"{server}/v1/models", headers=AUTH, timeout=30).json()["data"][0]["id"] == MODEL

    calls = []
    real = hmac.compare_digest
    monkeypatch.setattr(hmac, "compare_digest", lambda a, b: calls.append((a, b)) or real(a, b))
    ingress = OpenAIIngress.__new__(OpenAIIngress)
    ingress.config = type("C", (), {"api_key": KEY})()
    request = type("R", (), {"headers": {"authorization": f"Bearer {wrong}"}})()
    with pytest.raises(Exception, match="API key"):
        ingress._authorize(request)
    assert calls == [(wrong.encode(), KEY.encode())]


def test_openapi_fuzz_with_schemathesis_gets_no_5xx(server):
    """Every operation of the served OpenAPI document, fuzzed with valid and invalid inputs (bounded)."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from schemathesis import GenerationMode

    doc = httpx.get(f"{server}/openapi.json", timeout=30).json()
    for name in ("CompletionRequest", "ChatCompletionRequest", "TokenizeRequest", "DetokenizeRequest"):
        # tell the fuzzer the served model's name, or it only finds 404s
        doc["components"]["schemas"][name]["properties"]["model"] = {"enum": [MODEL]}
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        doc["components"]["schemas"][name]["properties"]["max_tokens"] = {
            "anyOf": [{"type": "integer", "minimum": 1, "maximum": 24}, {"type": "null"}]}
    schema = schemathesis.openapi.from_dict(doc)
    statuses: dict[str, int] = {}
    failures: list[str] = []
    tried = 0
    for op_result in schema.get_all_operations():
        op = op_result.ok()
        # the GET routes, and POST routes without a body (/admin/resume), take nothing a fuzzer could get wrong
        has_input = op.method.upper() == "POST" and len(op.body) > 0
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE) if has_input else (GenerationMode.POSITIVE,):
            examples = 40 if has_input else 5

            @given(case=op.as_strategy(generation_mode=mode))
            # derandomize: the same cases every run, so the counts asserted below cannot flake (a random draw
            # once gave 17 successes against the 20 asserted; CI must not hinge on the draw)
            @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
                      suppress_health_check=list(HealthCheck))
            def fuzz(case):
                nonlocal tried
                tried += 1
                r = case.call(base_url=server, headers=AUTH, timeout=60)
                statuses[str(r.status_code)] = statuses.get(str(r.status_code), 0) + 1
                if r.status_code >= 500:
                    failures.append(f"{r.status_code} {op.method} {op.path}: {case.as_curl_command()} -> "
                                    f"{r.text[:200]}")
                elif r.status_code >= 400:
                    err = r.json()["error"]
                    assert set(err) == ERROR_KEYS and err["message"], r.text

            fuzz()
    print(f"schemathesis: {tried} cases, statuses {statuses}")
    assert not failures, "\n".join(failures[:5])
    assert tried >= 150 and statuses.get("200", 0) >= 20 and statuses.get("400", 0) >= 20, statuses
    _wait_all_free(server, timeout=30)


# ---------------------------------------------------------------- load

def test_hundreds_of_concurrent_streams_all_finish_or_fail_cleanly(server):
    result = asyncio.run(run_load(server, MODEL, clients=LOAD_CLIENTS, duration_s=LOAD_SECONDS, headers=AUTH,
                                  max_prompt_words=60, max_tokens=(4, 40)))
    print(result.summary())
    assert not result.malformed, result.malformed[:5]
    assert set(result.errors) <= {"503:queue_full"}, result.errors  # refusals only: nothing failed
    assert result.ok >= LOAD_CLIENTS, result.summary()  # every client got through at least once, on average
    free = _wait_all_free(server, timeout=15)
    assert len(free) == REPLICAS
    print(f"preemptions during load: {replica_metrics(server, 'num_preemptions_total')}")


# ---------------------------------------------------------------- disconnects

def test_disconnects_at_any_point_free_every_block(server):
    """Hang up before the response starts, before the first token, mid-stream, during a long chunked prefill."""
    rng = random.Random(5)

    async def hang_up(c: httpx.AsyncClient, i: int) -> None:
        long_prompt = [rng.randrange(3, 40000) for _ in range(MAX_MODEL_LEN - 40)]  # prefill in 96-token chunks
        body = {"model": MODEL, "prompt": long_prompt if i % 2 else f"story {i}", "max_tokens": 30,
                "ignore_eos": True, "stream": i % 3 != 0}
        when = i % 4

        async def go():
            async with c.stream("POST", f"{server}/v1/completions", json=body, headers=AUTH) as r:
                if when == 1:
                    return  # headers in hand, before any token
                n = 0
                async for line in r.aiter_lines():
                    n += line.startswith("data: ")
                    if when == 2 and n >= 1 or when == 3 and n >= 4:
                        return
        task = asyncio.create_task(go())
        await asyncio.sleep(rng.random() * 0.3 if when == 0 else 0)
        if when == 0:
            task.cancel()  # possibly before the request even reached the engine
        try:
            await task
        except (asyncio.CancelledError, httpx.HTTPError):
            pass

    async def main():
        async with httpx.AsyncClient(timeout=60) as c:
            await asyncio.gather(*(hang_up(c, i) for i in range(48)))

    asyncio.run(main())
    _wait_all_free(server, timeout=10)


# ---------------------------------------------------------------- a replica dies mid-stream

def test_killing_a_replica_mid_stream_fails_only_its_streams_and_service_recovers(server):
    import ray

    async def main():
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=64)) as c:
            bodies = [{"model": MODEL, "prompt": f"long story {i}", "max_tokens": MAX_MODEL_LEN - 16,
                       "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
                       "temperature": 0.5, "seed": i} for i in range(STREAMS)]
            tasks = [asyncio.create_task(stream_one(c, f"{server}/v1/completions", b, AUTH)) for b in bodies]
            deadline = time.time() + 60
            while True:  # until both replicas have streams running
                running = await asyncio.to_thread(_streams_per_replica, server)
                if len(running) == REPLICAS and all(running.values()) and sum(running.values()) == STREAMS:
                    break
                assert time.time() < deadline, f"streams did not spread over the replicas: {running}"
                await asyncio.sleep(0.2)
            victim = max(running, key=running.get)
            actor = _replica_actor(victim)
            ray.kill(actor, no_restart=True)
            killed_at = time.time()
            results = await asyncio.gather(*tasks)
            return victim, running, results, time.time() - killed_at

    victim, running, results, took = asyncio.run(main())
    kinds = [k for k, _, _ in results]
    assert "malformed" not in kinds, [r for r in results if r[0] == "malformed"]
    failed = [d for k, d, _ in results if k == "error"]
    assert len(failed) == running[victim], (running, victim, failed)  # exactly the victim's streams
    assert all(d == "event:engine_unavailable" for d in failed), failed
    assert kinds.count("ok") == STREAMS - running[victim]  # the other replica's clients did not notice
    print(f"killed replica {victim} with {running[victim]} streams; all streams ended {took:.1f} s later")

    live = _wait_replicas(server, REPLICAS, timeout=180, exclude={victim})  # Serve replaced it
    ok = asyncio.run(run_load(server, MODEL, clients=8, duration_s=3, headers=AUTH))
    assert ok.ok >= 8 and not ok.malformed and not ok.errors, ok.summary()
    assert len(_wait_all_free(server)) == REPLICAS and victim not in live


def _streams_per_replica(base: str) -> dict[str, float]:
    running = replica_metrics(base, "num_requests_running")
    waiting = replica_metrics(base, "num_requests_waiting")
    return {r: running[r] + waiting.get(r, 0) for r in running}


def _replica_actor(replica_id: str):
    import ray
    from ray.util import list_named_actors

    names = [a for a in list_named_actors(all_namespaces=True)
             if a["name"].startswith("SERVE_REPLICA::") and a["name"].endswith(replica_id)]
    assert len(names) == 1, (replica_id, names)
    return ray.get_actor(names[0]["name"], namespace=names[0]["namespace"])
