"""Streaming load on the OpenAI API: `clients` concurrent clients, each sending streaming completions back to
back for `duration_s`, every SSE stream checked for shape as it is read.

Shared by tests/test_reliability_e2e.py (bounded, in CI) and bench/load.py (longer, with figures). A stream
counts as `ok` only if it is well formed to the end: `data: ` lines, JSON chunks, exactly one `[DONE]` last,
a finish_reason on the last chunk only, and usage that matches the tokens asked for (ignore_eos). A refusal
(HTTP 503 with an OpenAI error body and Retry-After, or an error event then `[DONE]`) is a well-formed error.
Anything else is `malformed`, with the reason.
"""
from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

WORDS = ("the quick brown fox jumps over a lazy dog while seven curious otters count shiny pebbles near an old "
         "river bank under pale winter light").split()
ERROR_KEYS = {"message", "type", "param", "code"}


@dataclass
class LoadResult:
    clients: int
    duration_s: float
    ok: int = 0
    errors: Counter = field(default_factory=Counter)  # "503:queue_full", "event:engine_unavailable", ...
    malformed: list[str] = field(default_factory=list)
    completion_tokens: int = 0
    ttft_s: list[float] = field(default_factory=list)
    latency_s: list[float] = field(default_factory=list)

    @property
    def requests(self) -> int:
        return self.ok + sum(self.errors.values()) + len(self.malformed)

    def summary(self) -> str:
        def pct(xs: list[float], q: float) -> float:
            return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")

        return (f"{self.clients} clients x {self.duration_s:.0f} s: {self.requests} requests, {self.ok} ok, "
                f"errors {dict(self.errors) or 0}, malformed {len(self.malformed)}; "
                f"{self.completion_tokens / self.duration_s:.0f} tok/s; TTFT p50 {pct(self.ttft_s, .5):.2f} s "
                f"p99 {pct(self.ttft_s, .99):.2f} s; latency p50 {pct(self.latency_s, .5):.2f} s "
                f"p99 {pct(self.latency_s, .99):.2f} s")


def replica_metrics(base_url: str, name: str) -> dict[str, float]:
    """{replica: value} of one `kvscale:<name>` metric on the app's /metrics (one series per replica)."""
    out = {}
    for line in httpx.get(f"{base_url}/metrics", timeout=10).text.splitlines():
        if line.startswith(f"kvscale:{name}{{"):
            labels, value = line.rsplit(" ", 1)
            out[labels.split('replica="', 1)[1].split('"', 1)[0]] = float(value)
    return out


def request_body(model: str, rng: random.Random, max_prompt_words: int, max_tokens: tuple[int, int]) -> dict:
    words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, max_prompt_words)))
    return {"model": model, "prompt": words, "max_tokens": rng.randint(*max_tokens), "temperature": 0.8,
            "seed": rng.randrange(1 << 30), "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}


async def stream_one(client: httpx.AsyncClient, url: str, body: dict, headers: dict) -> tuple[str, str, dict]:
    """('ok' | 'error' | 'malformed', detail, timings) for one streaming request."""
    start = time.monotonic()
    timings: dict[str, float] = {}
    async with client.stream("POST", url, json=body, headers=headers) as r:
        if r.status_code != 200:
            raw = await r.aread()
            try:
                err = json.loads(raw)["error"]
                assert set(err) == ERROR_KEYS and err["message"]
            except Exception:
                return "malformed", f"HTTP {r.status_code} without an OpenAI error body: {raw[:120]!r}", timings
            if r.status_code == 503 and not r.headers.get("retry-after"):
                return "malformed", "503 without Retry-After", timings
            return "error", f"{r.status_code}:{err['code']}", timings
        if not r.headers.get("content-type", "").startswith("text/event-stream"):
            return "malformed", f"content-type {r.headers.get('content-type')}", timings
        events: list = []
        done = 0
        async for line in r.aiter_lines():
            if not line:
                continue
            if not line.startswith("data: "):
                return "malformed", f"not an SSE data line: {line[:80]!r}", timings
            payload = line[6:]
            if done:
                return "malformed", "data after [DONE]", timings
            if payload == "[DONE]":
                done = 1
                continue
            try:
                events.append(json.loads(payload))
            except json.JSONDecodeError:
                return "malformed", f"chunk is not JSON: {payload[:80]!r}", timings
            if "ttft" not in timings and events[-1].get("choices"):
                timings["ttft"] = time.monotonic() - start
    timings["latency"] = time.monotonic() - start
    if not done:
        return "malformed", "stream ended without [DONE]", timings
    if events and "error" in events[-1]:
        err = events[-1]["error"]
        if set(err) != ERROR_KEYS or not err["message"]:
            return "malformed", f"error event not OpenAI-shaped: {err}", timings
        return "error", f"event:{err['code']}", timings
    chunks = [e for e in events if e.get("choices")]
    if not chunks or not events or "usage" not in events[-1]:
        return "malformed", "no chunks or no usage chunk", timings
    finishes = [e["choices"][0]["finish_reason"] for e in chunks]
    if finishes[-1] != "length" or any(f is not None for f in finishes[:-1]):
        return "malformed", f"finish reasons {finishes[-3:]}", timings
    if events[-1]["usage"]["completion_tokens"] != body["max_tokens"]:
        return "malformed", f"usage {events[-1]['usage']} for max_tokens={body['max_tokens']}", timings
    timings["tokens"] = body["max_tokens"]
    return "ok", "", timings


async def run_load(base_url: str, model: str, clients: int, duration_s: float, headers: dict | None = None,
                   max_prompt_words: int = 40, max_tokens: tuple[int, int] = (4, 32), seed: int = 0,
                   timeout_s: float = 300.0) -> LoadResult:
    result = LoadResult(clients, duration_s)
    url = f"{base_url}/v1/completions"
    deadline = time.monotonic() + duration_s

    async def client_loop(c: httpx.AsyncClient, i: int) -> None:
        rng = random.Random(seed * 100_003 + i)
        while time.monotonic() < deadline:
            body = request_body(model, rng, max_prompt_words, max_tokens)
            try:
                kind, detail, t = await stream_one(c, url, body, headers or {})
            except httpx.HTTPError as e:
                kind, detail, t = "malformed", f"transport error {type(e).__name__}: {e}", {}
            if kind == "ok":
                result.ok += 1
                result.completion_tokens += t["tokens"]
                result.ttft_s.append(t["ttft"])
                result.latency_s.append(t["latency"])
            elif kind == "error":
                result.errors[detail] += 1
                await asyncio.sleep(0.2 + rng.random() * 0.3)  # a client honouring Retry-After, roughly
            else:
                result.malformed.append(detail)

    start = time.monotonic()
    limits = httpx.Limits(max_connections=clients + 8, max_keepalive_connections=clients + 8)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as c:
        await asyncio.gather(*(client_loop(c, i) for i in range(clients)))
    result.duration_s = time.monotonic() - start
    return result
