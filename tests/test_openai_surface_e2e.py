"""The OpenAI surface users call, through the real `openai` client against a real local Ray cluster:
structured output, tool calling, fields refused rather than dropped, /health that means it, metrics that
count from arrival. Marked slow; CI runs it.
"""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import jsonschema
import pytest
from helpers import local_serve, wait_until_serving

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                     "zip": {"type": "integer", "minimum": 1000, "maximum": 99999}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 1, "maxItems": 3},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "address", "tags", "active"],
    "additionalProperties": False,
}

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a timezone",
    "parameters": {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 8}}, "required": ["tz"],
                   "additionalProperties": False}}}
TOOLS = [WEATHER, CLOCK]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def cluster():
    with local_serve(num_cpus=8, share=True) as base:
        yield base


@pytest.fixture(scope="module")
def server(cluster):
    from ray import serve

    from serve_app import build_app

    # fp32: a request's greedy tokens then do not depend on what else is batched (bf16 GEMMs round differently
    # at other batch sizes), so "unconstrained requests beside constrained ones are unaffected" is exact
    serve.run(build_app({"model": "default", "dtype": "float32", "num_kv_blocks": 512, "max_model_len": 1024,
                         "torch_threads": 1, "max_num_seqs": 32}), name="main", route_prefix="/", blocking=False)
    wait_until_serving([f"{cluster}/health"], 300, "the app")
    return cluster


@pytest.fixture()
def client(server):
    import openai

    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=180)


@pytest.fixture()
def aclient(server):
    import openai

    return openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=180)


def _chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


# ---- structured output ----

def test_json_schema_always_validates_streaming_or_not_and_leaves_other_requests_alone(server, aclient, client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    plain_prompt = "The capital of France is"
    alone = client.completions.create(model=MODEL, prompt=plain_prompt, max_tokens=24, temperature=0)

    async def constrained(seed: int, stream: bool) -> str:
        kw = dict(model=MODEL, messages=_chat("Invent a person."), temperature=1.0, seed=seed, max_tokens=300,
                  response_format=fmt)
        if not stream:
            r = await aclient.chat.completions.create(**kw)
            assert r.choices[0].finish_reason == "stop"
            return r.choices[0].message.content
        parts, finish = [], None
        async for chunk in await aclient.chat.completions.create(**kw, stream=True):
            for ch in chunk.choices:
                parts.append(ch.delta.content or "")
                finish = ch.finish_reason or finish
        assert finish == "stop"
        return "".join(parts)

    async def main():
        plain = aclient.completions.create(model=MODEL, prompt=plain_prompt, max_tokens=24, temperature=0)
        first = await asyncio.gather(plain, *(constrained(seed, seed % 2 == 0) for seed in range(16)))
        # then json_object requests, in one batch of their own
        objects = await asyncio.gather(*(aclient.chat.completions.create(
            model=MODEL, messages=_chat("Give me JSON."), temperature=1.0, seed=seed, max_tokens=300,
            response_format={"type": "json_object"}) for seed in range(4)))
        return first, objects

    (plain, *texts), objects = asyncio.run(main())
    for text in texts:
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise AssertionError(f"not JSON ({e}): {text!r}") from None
        jsonschema.validate(value, PERSON)
    assert len(set(texts)) > 8, "temperature 1.0 over 16 seeds should give varied objects"
    # an unconstrained request batched with them decodes exactly as it does alone
    assert plain.choices[0].text == alone.choices[0].text

    # json_object bounds nothing, so an output may run into max_tokens; every one that ends is an object
    stopped = 0
    for r in objects:
        text = r.choices[0].message.content
        assert text.startswith("{"), text
        if r.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(text), dict), text
            stopped += 1
    assert stopped, "no json_object output ended within 300 tokens"
    r = client.completions.create(model=MODEL, prompt="Pick one:", max_tokens=10, temperature=1.0, seed=1,
                                  extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}})
    assert r.choices[0].text in ("red", "green", "blue")


def test_invalid_schemas_get_400(server):
    bad = [{"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
           {"type": "json_schema", "json_schema": {"name": "x"}},
           {"type": "xml"}]
    for fmt in bad:
        r = httpx.post(f"{server}/v1/chat/completions", timeout=60,
                       json={"model": MODEL, "messages": _chat("hi"), "response_format": fmt})
        assert r.status_code == 400, (fmt, r.text)
        assert r.json()["error"]["param"].startswith("response_format"), r.json()
    r = httpx.post(f"{server}/v1/completions", timeout=60,
                   json={"model": MODEL, "prompt": "x", "structured_outputs": {"regex": "(unclosed"}})
    assert r.status_code == 400 and "regex" in r.json()["error"]["message"], r.text


def test_logit_bias_is_honoured(server, client):
    target = httpx.post(f"{server}/tokenize", json={"model": MODEL, "prompt": " banana"}, timeout=30).json()["tokens"][-1]
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, temperature=0,
                                  logit_bias={str(target): 100})
    assert r.choices[0].text == " banana" * 5


# ---- tools ----

def _check_calls(calls, names: set[str]) -> None:
    assert calls, "expected tool calls"
    for call in calls:
        assert call.type == "function" and call.id and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


def test_required_and_named_tool_choice_always_give_valid_calls(aclient):
    async def one(seed: int, choice):
        r = await aclient.chat.completions.create(model=MODEL, messages=_chat("Weather in Paris?"), tools=TOOLS,
                                                  tool_choice=choice, temperature=1.0, seed=seed, max_tokens=300)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls"
        return c.message.tool_calls

    named = {"type": "function", "function": {"name": "get_time"}}

    async def main():
        return await asyncio.gather(*(one(s, "required") for s in range(8)), *(one(s, named) for s in range(8)))

    results = asyncio.run(main())
    for calls in results[:8]:
        _check_calls(calls, {"get_weather", "get_time"})
    for calls in results[8:]:
        _check_calls(calls, {"get_time"})
        assert len(calls) == 1


def test_streamed_tool_calls_assemble_to_the_non_streamed_result(client):
    kw = dict(model=MODEL, messages=_chat("Weather in Oslo?"), tools=TOOLS, tool_choice="required", temperature=0,
              max_tokens=300)
    whole = client.chat.completions.create(**kw).choices[0].message.tool_calls
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            finish = ch.finish_reason or finish
            for d in ch.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"name": "", "arguments": ""})
                call["name"] += (d.function.name or "") if d.function else ""
                call["arguments"] += (d.function.arguments or "") if d.function else ""
    assert finish == "tool_calls"
    assert [calls[i] for i in sorted(calls)] == [{"name": c.function.name, "arguments": c.function.arguments}
                                                 for c in whole]


def test_auto_parses_the_calls_the_model_writes(client):
    # Under auto the model decides; a regex makes this small model write a Hermes-style call, which the
    # server must turn into message.tool_calls, streaming or not.
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "unit": "c"}}\n</tool_call>'
    regex = "Let me check\\. " + "".join("\\" + ch if ch in '{}[].()"\\' else ch for ch in call).replace("\n", "\\n")
    kw = dict(model=MODEL, messages=_chat("Weather in Rome?"), tools=TOOLS, tool_choice="auto", temperature=0,
              max_tokens=100, extra_body={"structured_outputs": {"regex": regex}})
    c = client.chat.completions.create(**kw).choices[0]
    assert c.finish_reason == "tool_calls"
    assert c.message.content.strip() == "Let me check."
    assert [(t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls] == [
        ("get_weather", {"city": "Rome", "unit": "c"})]
    content, args = "", ""
    for chunk in client.chat.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            args += "".join(d.function.arguments or "" for d in ch.delta.tool_calls or [])
    assert "<tool_call>" not in content and content.strip() == "Let me check."
    assert json.loads(args) == {"city": "Rome", "unit": "c"}


def test_tool_results_round_trip_into_the_prompt(server, client):
    messages = [
        {"role": "user", "content": "Weather in Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Rome", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees and sunny"},
    ]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=8, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    rendered = httpx.post(f"{server}/tokenize", json={"model": MODEL, "messages": messages}, timeout=30).json()
    text = httpx.post(f"{server}/detokenize", json={"model": MODEL, "tokens": rendered["tokens"]}, timeout=30).json()["prompt"]
    assert "21 degrees and sunny" in text and '"get_weather"' in text and '"Rome"' in text


# ---- fields: honoured or refused, never dropped ----

UNSUPPORTED_CHAT = {
    "functions": [{"name": "f", "parameters": {}}],  # the deprecated form of tools
    "function_call": "auto",
    "audio": {"voice": "alloy", "format": "wav"},
    "modalities": ["text", "audio"],
    "prediction": {"type": "content", "content": "x"},
    "reasoning_effort": "high",
    "web_search_options": {},
    "verbosity": "low",
    "no_such_field": 1,
}
UNSUPPORTED_COMPLETIONS = {"echo": True, "suffix": "end", "best_of": 3, "no_such_field": 1}


@pytest.mark.parametrize("route,field,value", [("chat", k, v) for k, v in UNSUPPORTED_CHAT.items()]
                         + [("completions", k, v) for k, v in UNSUPPORTED_COMPLETIONS.items()])
def test_each_unsupported_field_gets_a_400_naming_it(server, route, field, value):
    body = {"model": MODEL, "max_tokens": 2, field: value}
    body.update({"messages": _chat("hi")} if route == "chat" else {"prompt": "hi"})
    url = f"{server}/v1/chat/completions" if route == "chat" else f"{server}/v1/completions"
    r = httpx.post(url, json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and field in err["message"] and err["type"] == "invalid_request_error", err


def test_supported_extras_defaults_and_errors(server, client):
    # completions default to 16 tokens, as OpenAI's and vLLM's do
    r = client.completions.create(model=MODEL, prompt="Once upon a time", temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 16
    # the stop string is kept when asked
    base = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0).choices[0].text
    stop = base.strip().split()[1]
    cut = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0, stop=[stop])
    kept = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0, stop=[stop],
                                     extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == cut.choices[0].text + stop
    # chat_template_kwargs reach the template (the default template reads none, so it is a smoke test)
    r = client.chat.completions.create(model=MODEL, messages=_chat("hi"), max_completion_tokens=3,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.usage.completion_tokens <= 3
    # the model card and token routes
    card = httpx.get(f"{server}/v1/models/{MODEL}", timeout=30).json()
    assert card["id"] == MODEL and card["max_model_len"] == 1024
    assert httpx.get(f"{server}/v1/models/nope", timeout=30).status_code == 404
    ids = httpx.post(f"{server}/tokenize", json={"model": MODEL, "prompt": "hello world"}, timeout=30).json()
    assert ids["count"] == len(ids["tokens"]) > 0
    back = httpx.post(f"{server}/detokenize", json={"model": MODEL, "tokens": ids["tokens"]}, timeout=30).json()
    assert back["prompt"] == "hello world"
    # a prompt over the context: OpenAI's code, the field named
    r = httpx.post(f"{server}/v1/completions", json={"model": MODEL, "prompt": [5] * 1100}, timeout=30)
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded" and err["param"] == "prompt", err
    r = httpx.post(f"{server}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 5000}, timeout=30)
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded" and err["param"] == "max_tokens", err


# ---- health and metrics ----

def _metric(base: str, name: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(f"{base}/metrics", timeout=10).text.splitlines():
        if line.startswith(f"kvscale:{name}"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def test_health_is_503_until_an_engine_can_serve_and_when_none_is_alive(cluster, make_tiny_model):
    """Also: this app serves from an fp8 KV cache, end to end."""
    import ray
    from ray import serve

    from serve_app import build_app

    tiny = make_tiny_model("llama")
    serve.run(build_app({"model": tiny, "served_model_name": "tiny", "dtype": "float32", "num_kv_blocks": 64,
                         "max_model_len": 256, "torch_threads": 1, "engine_num_cpus": 0.5,
                         "kv_cache_dtype": "fp8_e4m3"}),  # and served from an fp8 KV cache
              name="h", route_prefix="/h", blocking=False)
    url = f"{cluster}/h/health"
    deadline = time.time() + 300
    while time.time() < deadline:
        try:
            code = httpx.get(url, timeout=5).status_code
        except httpx.HTTPError:
            code = None
        if code == 200:
            break
        assert code in (None, 404, 503), code
        time.sleep(0.2)
    assert code == 200
    # healthy means it can serve now
    r = httpx.post(f"{cluster}/h/v1/completions", json={"model": "tiny", "prompt": [5, 6], "max_tokens": 2},
                   timeout=30)
    assert r.status_code == 200, r.text
    r = httpx.post(f"{cluster}/h/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": [5, 6, 7] * 20, "max_tokens": 40, "ignore_eos": True, "n": 2})
    assert r.status_code == 200 and [c["finish_reason"] for c in r.json()["choices"]] == ["length"] * 2, r.text
    assert 'cache_dtype="float8_e4m3fn"' in httpx.get(f"{cluster}/h/metrics", timeout=10).text

    # kill the only engine replica: /health turns 503 until Serve has a new one loaded
    replica = next(a for a in ray.util.list_named_actors(all_namespaces=True)
                   if "KVEngine" in a["name"] and a["name"].startswith("SERVE_REPLICA::h#"))
    ray.kill(ray.get_actor(replica["name"], namespace=replica["namespace"]), no_restart=True)
    seen, deadline = [], time.time() + 300
    while time.time() < deadline:
        seen.append(httpx.get(url, timeout=10).status_code)
        if 503 in seen and seen[-1] == 200:
            break
        time.sleep(0.2)
    assert 503 in seen and seen[-1] == 200, seen[-20:]
    body = httpx.get(url, timeout=10).json()
    assert body["status"] == "ok" and body["ready_replicas"] == 1
    serve.delete("h")


def test_ttft_counts_time_held_before_the_replica_and_n_counts_once(cluster, make_tiny_model):
    """One request at a time per replica: the second waits in the ingress for the first to end, and its TTFT
    must include that wait. A request with n=3 counts once in request_success and its ITL is per sample."""
    from ray import serve

    from serve_app import build_app

    tiny = make_tiny_model("llama")
    serve.run(build_app({"model": tiny, "served_model_name": "tiny", "dtype": "float32", "num_kv_blocks": 64,
                         "max_model_len": 256, "torch_threads": 1, "engine_num_cpus": 0.5,
                         "max_ongoing_requests": 1, "fake_step_s": 0.02, "stream_interval_s": 0}),
              name="held", route_prefix="/held", blocking=False)
    base = f"{cluster}/held"
    wait_until_serving([f"{base}/health"], 300, "the held app")

    async def main():
        async with httpx.AsyncClient(timeout=120) as c:
            body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 100, "ignore_eos": True}
            t0 = time.time()
            first = asyncio.create_task(c.post(f"{base}/v1/completions", json=body))
            await asyncio.sleep(0.3)
            second = await c.post(f"{base}/v1/completions", json=body)
            return (await first).status_code, second.status_code, time.time() - t0

    s1, s2, elapsed = asyncio.run(main())
    assert (s1, s2) == (200, 200)
    time.sleep(1.5)  # a report interval
    ttft = _metric(base, "time_to_first_token_seconds")
    total = sum(v for k, v in ttft.items() if k.startswith("kvscale:time_to_first_token_seconds_sum"))
    # 100 steps of 20 ms: the first request holds the replica ~2 s, all of which the second spent waiting
    assert total >= 1.5, f"TTFT sum {total:.2f} s does not include the wait in the ingress (run took {elapsed:.1f} s)"
    queue = _metric(base, "request_queue_time_seconds_sum")
    assert sum(queue.values()) >= 1.5, f"queue time {queue} does not include the wait in the ingress"
    decode = sum(_metric(base, "request_decode_time_seconds_sum").values())
    assert decode >= 2 * 99 * 0.02 * 0.9, f"decode time {decode:.2f} s for 2 x 99 steps of 20 ms"
    assert sum(_metric(base, "request_generation_tokens_sum").values()) == 200

    before = sum(_metric(base, "request_success").values())
    itl_before = _metric(base, "inter_token_latency_seconds")
    r = httpx.post(f"{base}/v1/completions", timeout=60,
                   json={"model": "tiny", "prompt": [5, 6], "max_tokens": 20, "n": 3, "ignore_eos": True})
    assert r.status_code == 200
    time.sleep(1.5)
    assert sum(_metric(base, "request_success").values()) - before == 1
    assert sum(_metric(base, "request_params_n_sum").values()) == 1 + 1 + 3
    assert sum(_metric(base, "request_generation_tokens_sum").values()) == 200 + 3 * 20
    text = httpx.get(f"{base}/metrics", timeout=10).text
    series = [line for line in text.splitlines() if line.startswith("kvscale:")]
    assert series and all('model_name="tiny"' in line for line in series)
    assert 'num_gpu_blocks="64"' in text and "kvscale:num_replicas{model_name=\"tiny\"} 1.0" in text
    itl = _metric(base, "inter_token_latency_seconds")
    count = sum(v - itl_before.get(k, 0) for k, v in itl.items() if "_count" in k)
    total = sum(v - itl_before.get(k, 0) for k, v in itl.items() if "_sum" in k)
    assert count == 3 * 19, count  # every token after each sample's first
    assert total / count >= 0.015, f"mean ITL {total / count:.4f} s is below the 20 ms step: divided by n samples"
    serve.delete("held")


def test_admin_routes_are_absent_without_admin_api(server):
    for method, path in (("get", "/admin/version"), ("post", "/admin/pause"), ("post", "/admin/update_weights")):
        r = getattr(httpx, method)(f"{server}{path}", timeout=30)
        assert r.status_code == 404 and "admin_api" in r.json()["error"]["message"], (path, r.text)
