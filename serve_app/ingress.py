"""OpenAIIngress: the HTTP front. Routes from OpenAI's API to the engine deployment, over Ray Serve handles.

Every route streams from the engine as tokens are produced. A request the engine refuses is known from
the first item of its stream, before any HTTP status is sent, so bad input always gets its 4xx. A client
that disconnects cancels its handle streams, which aborts the engine request and frees its KV blocks.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import ray
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import ValidationError
from ray.serve.exceptions import BackPressureError

from serve_app.config import ServeConfig
from serve_app.messages import ChoiceDelta, ErrorMessage, GenerateRequest, OutputDelta, TokenLogprob
from serve_app.metrics import get_board, render, replica_identity
from serve_app.protocol import APIError, ChatCompletionRequest, CompletionRequest, ErrorResponse

logger = logging.getLogger("ray.serve")

fastapi_app = FastAPI(title="kvscale", description="OpenAI-compatible API over kvscale's engine on Ray Serve")

_ERRORS = {status: {"model": ErrorResponse, "description": what} for status, what in (
    (400, "invalid request (the message and `param` say which field and why)"),
    (401, "missing or wrong API key"), (404, "no such model"), (413, "request body over the size limit"),
    (503, "no replica can take the request now; retry after `Retry-After` seconds"))}
_AUTH_ERRORS = {401: _ERRORS[401]}


def _json_body(model) -> dict[str, Any]:
    """OpenAPI for a route that reads its own body (under the size cap) and validates it as `model`."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


def _openapi() -> dict[str, Any]:
    """FastAPI's document plus the request models the routes validate by hand, so clients and fuzzers
    (tests/test_reliability_e2e.py runs schemathesis on it) see the real bodies."""
    if fastapi_app.openapi_schema is None:
        schema = get_openapi(title=fastapi_app.title, version="0.1.0", description=fastapi_app.description,
                             routes=fastapi_app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for model in (CompletionRequest, ChatCompletionRequest):
            js = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(js.pop("$defs", {}))
            components[model.__name__] = js
        schema["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        for path, item in schema["paths"].items():
            if path.startswith("/v1/"):
                for op in item.values():
                    op["security"] = [{"bearer": []}, {}]  # needed only when the server sets api_key
        fastapi_app.openapi_schema = schema
    return fastapi_app.openapi_schema


fastapi_app.openapi = _openapi


def _error_response(e: APIError) -> JSONResponse:
    headers = {"Retry-After": str(int(e.retry_after))} if e.retry_after is not None else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


@fastapi_app.exception_handler(APIError)
async def _api_error(_: Request, e: APIError) -> JSONResponse:
    return _error_response(e)


@fastapi_app.exception_handler(RequestValidationError)
async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
    return _error_response(_from_validation(e.errors()))


@fastapi_app.exception_handler(Exception)
async def _unexpected(_: Request, e: Exception) -> JSONResponse:
    logger.exception("kvscale: unexpected error")
    return _error_response(APIError(500, f"internal error: {type(e).__name__}", code="internal_error"))


def _from_validation(errors: list[dict[str, Any]]) -> APIError:
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body",)]
    param = ".".join(loc) or None
    return APIError(400, f"{param + ': ' if param else ''}{first.get('msg', 'invalid value')}", param=param)


def _sse(obj: Any) -> bytes:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode()


class OpenAIIngress:
    def __init__(self, engine_handle: Any, config: dict[str, Any]) -> None:
        self.engine = engine_handle
        self.config = ServeConfig(**config)
        self.model_name = self.config.model_name
        self._board = get_board(replica_identity()[1])  # created here, so the app owns it

    # ---- checks ----
    def _authorize(self, request: Request) -> None:
        key = self.config.api_key
        if key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise APIError(401, "missing or wrong API key: send `Authorization: Bearer <key>`",
                           code="invalid_api_key")

    async def _read_json(self, request: Request) -> dict[str, Any]:
        limit = self.config.max_request_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise APIError(413, f"request body of {declared} bytes is over the limit of {limit}")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise APIError(413, f"request body is over the limit of {limit} bytes")
        try:
            data = json.loads(bytes(body).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
            raise APIError(400, f"request body is not valid JSON: {type(e).__name__}: {e}") from None
        if not isinstance(data, dict):
            raise APIError(400, "request body must be a JSON object")
        return data

    def _parse(self, cls, data: dict[str, Any]):
        try:
            req = cls(**data)
        except ValidationError as e:
            raise _from_validation(e.errors()) from None
        if req.model != self.model_name:
            raise APIError(404, f"model {req.model!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")
        if req.n > self.config.max_n:
            raise APIError(400, f"n must be <= {self.config.max_n}; got {req.n}", param="n")
        return req

    # ---- routes ----
    @fastapi_app.get("/health")
    async def health(self) -> dict[str, str]:
        return {"status": "ok"}

    @fastapi_app.get("/metrics")
    async def metrics(self) -> PlainTextResponse:
        try:
            snapshots = await self._board.get_all.remote()
        except ray.exceptions.RayActorError:  # its owner went away; the replicas report to a new one
            self._board = get_board(replica_identity()[1])
            snapshots = await self._board.get_all.remote()
        return PlainTextResponse(render(snapshots), media_type="text/plain; version=0.0.4")

    @fastapi_app.get("/v1/models", responses=_AUTH_ERRORS)
    async def models(self, request: Request) -> dict[str, Any]:
        self._authorize(request)
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                            "owned_by": "kvscale"}]}

    @fastapi_app.post("/v1/completions", openapi_extra=_json_body(CompletionRequest), responses=_ERRORS)
    async def completions(self, request: Request):
        self._authorize(request)
        req: CompletionRequest = self._parse(CompletionRequest, await self._read_json(request))
        if req.echo or req.suffix is not None or (req.best_of is not None and req.best_of != req.n):
            raise APIError(400, "echo, suffix and best_of are not supported", param="echo")
        prompts = _prompt_list(req.prompt, self.config.max_prompts_per_request)
        sampling = {**req.sampling_kwargs(), "logprobs": req.logprobs}
        rid = f"cmpl-{uuid.uuid4().hex}"
        requests = [GenerateRequest(f"{rid}-{i}", "completion", sampling, prompt=p) for i, p in enumerate(prompts)]
        return await self._serve(rid, "completion", req, requests)

    @fastapi_app.post("/v1/chat/completions", openapi_extra=_json_body(ChatCompletionRequest),
                      responses=_ERRORS)
    async def chat_completions(self, request: Request):
        self._authorize(request)
        req: ChatCompletionRequest = self._parse(ChatCompletionRequest, await self._read_json(request))
        sampling = req.sampling_kwargs()
        if req.max_completion_tokens is not None:
            sampling["max_tokens"] = req.max_completion_tokens
        sampling["logprobs"] = (req.top_logprobs or 0) if req.logprobs else None
        messages = [_flatten_message(m.model_dump(exclude_none=True)) for m in req.messages]
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        requests = [GenerateRequest(rid, "chat", sampling, messages=messages,
                                    add_generation_prompt=req.add_generation_prompt)]
        return await self._serve(rid, "chat", req, requests)

    # ---- streaming core ----
    async def _serve(self, rid: str, kind: str, req, requests: list[GenerateRequest]):
        streams = [self.engine.options(stream=True).generate.remote(r) for r in requests]
        try:
            firsts = await asyncio.gather(*(s.__anext__() for s in streams))
        except StopAsyncIteration:
            _cancel(streams)
            raise APIError(500, "the engine ended a stream without output", code="engine_error") from None
        except BackPressureError:
            _cancel(streams)
            raise APIError(503, "every engine replica is full and this server already holds as many requests as "
                                "it may for them; retry shortly", code="queue_full", retry_after=1) from None
        except Exception as e:
            _cancel(streams)
            raise APIError(503, f"no engine replica could take the request: {type(e).__name__}",
                           code="engine_unavailable", retry_after=1) from None
        for item in firsts:
            if isinstance(item, ErrorMessage):
                _cancel(streams)
                raise item.to_error()
        n = req.n
        created = int(time.time())
        merged = _merge(streams, firsts)
        if req.stream:
            return StreamingResponse(self._sse_stream(rid, kind, req, merged, n, created, len(requests)),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return await self._collect(rid, kind, req, merged, n, created, len(requests))

    def _choice_chunk(self, kind: str, index: int, c: ChoiceDelta, first: bool) -> dict[str, Any]:
        lp = _format_logprobs(kind, c.logprobs) if c.logprobs is not None else None
        if kind == "completion":
            return {"index": index, "text": c.text, "logprobs": lp, "finish_reason": c.finish_reason}
        delta: dict[str, Any] = {"content": c.text}
        if first:
            delta["role"] = "assistant"
        return {"index": index, "delta": delta, "logprobs": lp, "finish_reason": c.finish_reason}

    async def _sse_stream(self, rid, kind, req, merged, n, created, num_prompts) -> AsyncIterator[bytes]:
        obj = "text_completion" if kind == "completion" else "chat.completion.chunk"
        prompt_tokens: dict[int, int] = {}
        completion_tokens: dict[int, int] = {}
        started: set[int] = set()
        try:
            async for p_idx, item in merged:
                if isinstance(item, ErrorMessage):
                    yield _sse(item.to_error().body())
                    break
                prompt_tokens[p_idx] = item.prompt_tokens
                choices = []
                for c in item.choices:
                    index = p_idx * n + c.index
                    completion_tokens[index] = c.num_output_tokens
                    choices.append(self._choice_chunk(kind, index, c, index not in started))
                    started.add(index)
                if choices:
                    yield _sse({"id": rid, "object": obj, "created": created, "model": self.model_name,
                                "choices": choices})
            else:
                if req.include_usage:
                    yield _sse({"id": rid, "object": obj, "created": created, "model": self.model_name,
                                "choices": [], "usage": _usage(prompt_tokens, completion_tokens)})
        except Exception as e:  # a replica died mid-stream: end the stream with an error event, not a hang
            logger.warning("kvscale: stream %s failed: %r", rid, e)
            yield _sse(APIError(503, f"the engine replica failed mid-stream: {type(e).__name__}",
                                code="engine_unavailable").body())
        finally:
            await merged.aclose()
        yield b"data: [DONE]\n\n"

    async def _collect(self, rid, kind, req, merged, n, created, num_prompts) -> JSONResponse:
        texts: dict[int, list[str]] = {}
        finish: dict[int, str | None] = {}
        lps: dict[int, list] = {}
        prompt_tokens: dict[int, int] = {}
        completion_tokens: dict[int, int] = {}
        try:
            async for p_idx, item in merged:
                if isinstance(item, ErrorMessage):
                    raise item.to_error()
                prompt_tokens[p_idx] = item.prompt_tokens
                for c in item.choices:
                    index = p_idx * n + c.index
                    texts.setdefault(index, []).append(c.text)
                    finish[index] = c.finish_reason or finish.get(index)
                    completion_tokens[index] = c.num_output_tokens
                    if c.logprobs is not None:
                        lps.setdefault(index, []).extend(c.logprobs)
        except APIError:
            raise
        except Exception as e:
            raise APIError(503, f"the engine replica failed: {type(e).__name__}", code="engine_unavailable",
                           retry_after=1) from None
        finally:
            await merged.aclose()
        want_lp = (req.logprobs is not None) if kind == "completion" else bool(req.logprobs)
        choices = []
        for index in range(num_prompts * n):
            text = "".join(texts.get(index, []))
            lp = _format_logprobs(kind, lps.get(index, [])) if want_lp else None
            if kind == "completion":
                choices.append({"index": index, "text": text, "logprobs": lp, "finish_reason": finish.get(index)})
            else:
                choices.append({"index": index, "message": {"role": "assistant", "content": text},
                                "logprobs": lp, "finish_reason": finish.get(index)})
        return JSONResponse({"id": rid, "object": "text_completion" if kind == "completion" else "chat.completion",
                             "created": created, "model": self.model_name, "choices": choices,
                             "usage": _usage(prompt_tokens, completion_tokens)})


def _prompt_list(prompt, limit: int) -> list[Any]:
    if isinstance(prompt, str):
        prompts: list[Any] = [prompt]
    elif prompt and all(isinstance(t, int) for t in prompt):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    if not prompts:
        raise APIError(400, "prompt must not be empty", param="prompt")
    if len(prompts) > limit:
        raise APIError(400, f"at most {limit} prompts per request; got {len(prompts)}", param="prompt")
    return prompts


def _flatten_message(m: dict[str, Any]) -> dict[str, Any]:
    content = m.get("content")
    if isinstance(content, list):  # OpenAI content parts: text only
        if any(part.get("type") != "text" for part in content):
            raise APIError(400, "only text content parts are supported", param="messages")
        m["content"] = "".join(str(part.get("text", "")) for part in content)
    elif content is None:
        m["content"] = ""
    return m


def _usage(prompt_tokens: dict[int, int], completion_tokens: dict[int, int]) -> dict[str, int]:
    p, c = sum(prompt_tokens.values()), sum(completion_tokens.values())
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _format_logprobs(kind: str, entries: list[TokenLogprob]) -> dict[str, Any]:
    if kind == "completion":
        tokens = [e.token for e in entries]
        offsets, pos = [], 0
        for t in tokens:
            offsets.append(pos)
            pos += len(t or "")
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{t: lp for t, lp in e.top} for e in entries], "text_offset": offsets}
    return {"content": [{
        "token": e.token, "logprob": e.logprob, "bytes": list((e.token or "").encode()),
        "top_logprobs": [{"token": t, "logprob": lp, "bytes": list((t or "").encode())} for t, lp in e.top],
    } for e in entries]}


def _cancel(streams) -> None:
    for s in streams:
        try:
            s.cancel()
        except Exception:
            pass


async def _merge(streams, firsts: list[OutputDelta]) -> AsyncIterator[tuple[int, OutputDelta | ErrorMessage]]:
    """Items of several handle streams as they come, tagged with the stream's index; cancels all on exit."""
    if len(streams) == 1:
        try:
            yield 0, firsts[0]
            if not firsts[0].finished:
                async for item in streams[0]:
                    yield 0, item
        finally:
            _cancel(streams)
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int) -> None:
        try:
            await queue.put((i, firsts[i]))
            if not firsts[i].finished:
                async for item in streams[i]:
                    await queue.put((i, item))
        except Exception as e:
            await queue.put((i, e))
        finally:
            await queue.put((i, done))

    tasks = [asyncio.create_task(pump(i)) for i in range(len(streams))]
    remaining = len(streams)
    try:
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        _cancel(streams)
