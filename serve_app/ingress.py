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

from serve_app.chat_output import ChatOutputParser, tool_constraint
from serve_app.config import ServeConfig
from serve_app.messages import ChoiceDelta, ErrorMessage, GenerateRequest, OutputDelta, TokenLogprob
from serve_app.metrics import ALIVE_WITHIN_S, STALE_AFTER_S, get_board, render, replica_identity
from serve_app import rl
from serve_app.protocol import (AdminPauseRequest, AdminSleepRequest, AdminUpdateWeightsRequest, APIError,
                                ChatCompletionRequest, CompletionRequest, DetokenizeRequest, ErrorResponse,
                                NamedToolChoice, TokenizeRequest)

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
        for model in (CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest,
                      AdminUpdateWeightsRequest, AdminPauseRequest, AdminSleepRequest):
            js = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(js.pop("$defs", {}))
            components[model.__name__] = js
        schema["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        for path, item in schema["paths"].items():
            if path.startswith(("/v1/", "/admin/")):
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
    if first.get("type") == "extra_forbidden":
        return APIError(400, f"unrecognized request argument supplied: {param}. This server does not support it, "
                             "and ignoring it could change what you get; remove it", param=param,
                        code="unsupported_parameter")
    return APIError(400, f"{param + ': ' if param else ''}{first.get('msg', 'invalid value')}", param=param)


def _sse(obj: Any) -> bytes:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode()


class OpenAIIngress:
    def __init__(self, engine_handle: Any, config: dict[str, Any]) -> None:
        self.engine = engine_handle
        self.config = ServeConfig(**config)
        self.model_name = self.config.model_name
        self._board = get_board(replica_identity()[1])  # created here, so the app owns it
        self._model_info: dict[str, Any] | None = None  # from an engine replica, on first need

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

    @staticmethod
    def _validate(cls, data: dict[str, Any]):
        try:
            return cls(**data)
        except ValidationError as e:
            raise _from_validation(e.errors()) from None

    def _parse(self, cls, data: dict[str, Any]):
        req = self._validate(cls, data)
        self._check_model(req.model)
        if req.n > self.config.max_n:
            raise APIError(400, f"n must be <= {self.config.max_n}; got {req.n}", param="n")
        return req

    async def _ask_board(self, method: str, *args: Any) -> Any:
        try:
            return await getattr(self._board, method).remote(*args)
        except ray.exceptions.RayActorError:  # its owner went away; the replicas report to a new one
            self._board = get_board(replica_identity()[1])
            return await getattr(self._board, method).remote(*args)

    async def _snapshots(self, max_age_s: float = STALE_AFTER_S) -> dict[str, dict]:
        return await self._ask_board("get_all", max_age_s)

    async def _info(self) -> dict[str, Any]:
        """The model's facts from an engine replica (fetched once): max_model_len, how to read chat output."""
        if self._model_info is None:
            try:
                self._model_info = await asyncio.wait_for(self.engine.model_info.remote(), timeout=60)
            except Exception as e:
                raise APIError(503, f"no engine replica answered ({type(e).__name__}); retry shortly",
                               code="engine_unavailable", retry_after=1) from None
        return self._model_info

    # ---- routes ----
    @fastapi_app.get("/health", responses={503: {"model": ErrorResponse, "description": "no engine replica can serve"}})
    async def health(self) -> JSONResponse:
        """200 when at least one engine replica has loaded its model and reports a live engine loop; 503 before
        that (startup) and when none is alive. For load balancers and Kubernetes readiness probes."""
        try:
            snapshots = await asyncio.wait_for(self._snapshots(ALIVE_WITHIN_S), timeout=5)
        except Exception as e:
            return _error_response(APIError(503, f"the stats board did not answer ({type(e).__name__})",
                                            code="engine_unavailable", retry_after=1))
        ready = sum(1 for snap in snapshots.values() if snap.get("healthy"))
        if not ready:
            return _error_response(APIError(
                503, "no engine replica is ready: the model is still loading, or every replica failed (see `serve "
                     "status`; `RAY_AUTH_MODE=token serve status` where Ray runs with token authentication, its default "
                     "for a local cluster)", code="engine_unavailable", retry_after=1))
        return JSONResponse({"status": "ok", "ready_replicas": ready})

    @fastapi_app.get("/metrics")
    async def metrics(self) -> PlainTextResponse:
        snapshots, autoscaler = await self._ask_board("get_metrics")
        return PlainTextResponse(render(snapshots, autoscaler, self.model_name),
                                 media_type="text/plain; version=0.0.4")

    def _model_card(self, info: dict[str, Any] | None) -> dict[str, Any]:
        card = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "kvscale"}
        if info is not None:
            card["max_model_len"] = info["max_model_len"]
        return card

    @fastapi_app.get("/v1/models", responses=_AUTH_ERRORS)
    async def models(self, request: Request) -> dict[str, Any]:
        self._authorize(request)
        return {"object": "list", "data": [self._model_card(self._model_info)]}

    @fastapi_app.get("/v1/models/{model_id:path}", responses={**_AUTH_ERRORS, 404: _ERRORS[404]})
    async def model(self, model_id: str, request: Request) -> dict[str, Any]:
        self._authorize(request)
        if model_id != self.model_name:
            raise APIError(404, f"model {model_id!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")
        return self._model_card(await self._info())

    @fastapi_app.post("/tokenize", openapi_extra=_json_body(TokenizeRequest), responses=_ERRORS)
    async def tokenize(self, request: Request) -> dict[str, Any]:
        """vLLM's /tokenize: {"model", "prompt"} or {"model", "messages"} -> {"tokens", "count", "max_model_len"}."""
        self._authorize(request)
        req = self._validate(TokenizeRequest, await self._read_json(request))
        self._check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "send exactly one of prompt or messages", param="prompt")
        body = req.model_dump(exclude_none=True)
        if req.messages is not None:
            body["messages"] = [_flatten_message(m.model_dump(exclude_none=True)) for m in req.messages]
        return await self._engine_call(self.engine.tokenize.remote(body))

    @fastapi_app.post("/detokenize", openapi_extra=_json_body(DetokenizeRequest), responses=_ERRORS)
    async def detokenize(self, request: Request) -> dict[str, Any]:
        """vLLM's /detokenize: {"model", "tokens"} -> {"prompt"}."""
        self._authorize(request)
        req = self._validate(DetokenizeRequest, await self._read_json(request))
        self._check_model(req.model)
        return await self._engine_call(self.engine.detokenize.remote(req.tokens))

    async def _engine_call(self, response) -> dict[str, Any]:
        try:
            result = await asyncio.wait_for(response, timeout=60)
        except Exception as e:
            raise APIError(503, f"no engine replica could take the request: {type(e).__name__}",
                           code="engine_unavailable", retry_after=1) from None
        if isinstance(result, ErrorMessage):
            raise result.to_error()
        return result

    def _check_model(self, model: Any) -> None:
        if model != self.model_name:
            raise APIError(404, f"model {model!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    # ---- RL admin (serve_app/rl.py), for trainers outside Ray; absent unless admin_api ----
    async def _admin_request(self, request: Request, model=None):
        """The checks every admin route makes: enabled, authorized, and its body valid (model: its schema)."""
        if not self.config.admin_api:
            raise APIError(404, f"{request.url.path} is not served: set admin_api: true in the serve config to "
                                "enable the RL admin routes", code="not_found")
        self._authorize(request)
        return self._validate(model, await self._read_json(request)) if model is not None else None

    async def _admin_call(self, call, param: str | None = None, **kwargs: Any) -> dict[str, Any]:
        """Run an rl function (it blocks until every replica followed) off the event loop."""
        try:
            result = await asyncio.to_thread(call, app_name=replica_identity()[1], **kwargs)
        except ValueError as e:  # a payload the replicas refused: nothing changed
            raise APIError(400, str(e), param=param) from None
        except (TimeoutError, RuntimeError) as e:
            raise APIError(503, str(e), code="admin_unavailable", retry_after=5) from None
        return {"ok": True, **(result if isinstance(result, dict) else {})}

    @fastapi_app.post("/admin/update_weights", openapi_extra=_json_body(AdminUpdateWeightsRequest), responses=_ERRORS)
    async def admin_update_weights(self, request: Request) -> dict[str, Any]:
        req = await self._admin_request(request, AdminUpdateWeightsRequest)
        return await self._admin_call(rl.update_weights, "path", weights=req.path, version=req.version,
                                      pause=req.pause, partial=req.partial)

    @fastapi_app.post("/admin/pause", openapi_extra=_json_body(AdminPauseRequest), responses=_ERRORS)
    async def admin_pause(self, request: Request) -> dict[str, Any]:
        req = await self._admin_request(request, AdminPauseRequest)
        return await self._admin_call(rl.pause, mode=req.mode)

    @fastapi_app.post("/admin/resume", responses=_ERRORS)
    async def admin_resume(self, request: Request) -> dict[str, Any]:
        await self._admin_request(request)
        return await self._admin_call(rl.resume)

    @fastapi_app.post("/admin/sleep", openapi_extra=_json_body(AdminSleepRequest), responses=_ERRORS)
    async def admin_sleep(self, request: Request) -> dict[str, Any]:
        req = await self._admin_request(request, AdminSleepRequest)
        return await self._admin_call(rl.sleep, level=req.level)

    @fastapi_app.post("/admin/wake_up", responses=_ERRORS)
    async def admin_wake_up(self, request: Request) -> dict[str, Any]:
        await self._admin_request(request)
        return await self._admin_call(rl.wake_up)

    @fastapi_app.get("/admin/version", responses=_ERRORS)
    async def admin_version(self, request: Request) -> dict[str, Any]:
        await self._admin_request(request)
        return await self._admin_call(rl.version)

    @fastapi_app.post("/v1/completions", openapi_extra=_json_body(CompletionRequest), responses=_ERRORS)
    async def completions(self, request: Request):
        self._authorize(request)
        arrival = time.time()
        req: CompletionRequest = self._parse(CompletionRequest, await self._read_json(request))
        for name, unsupported in (("echo", req.echo), ("suffix", req.suffix is not None),
                                  ("best_of", req.best_of is not None and req.best_of != req.n)):
            if unsupported:
                raise APIError(400, f"{name} is not supported by this server; remove it", param=name,
                               code="unsupported_parameter")
        prompts = _prompt_list(req.prompt, self.config.max_prompts_per_request)
        sampling = {**req.sampling_kwargs(), "logprobs": req.logprobs}
        rid = f"cmpl-{uuid.uuid4().hex}"
        requests = [GenerateRequest(f"{rid}-{i}", "completion", sampling, prompt=p, arrival_time=arrival)
                    for i, p in enumerate(prompts)]
        return await self._serve(rid, "completion", req, requests)

    @fastapi_app.post("/v1/chat/completions", openapi_extra=_json_body(ChatCompletionRequest),
                      responses=_ERRORS)
    async def chat_completions(self, request: Request):
        self._authorize(request)
        arrival = time.time()
        req: ChatCompletionRequest = self._parse(ChatCompletionRequest, await self._read_json(request))
        sampling = req.sampling_kwargs()
        if req.max_completion_tokens is not None:
            if req.max_tokens is not None and req.max_tokens != req.max_completion_tokens:
                raise APIError(400, "max_tokens and max_completion_tokens disagree; send one of them",
                               param="max_completion_tokens")
            sampling["max_tokens"] = req.max_completion_tokens
        sampling["logprobs"] = (req.top_logprobs or 0) if req.logprobs else None
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        choice = req.tool_choice.model_dump() if isinstance(req.tool_choice, NamedToolChoice) else req.tool_choice
        choice = choice if choice is not None else ("auto" if tools else "none")
        if choice != "none" and not tools:
            raise APIError(400, f"tool_choice {choice!r} needs tools", param="tool_choice")
        mode = "text"
        if tools and choice != "none":
            try:
                constraint = tool_constraint(tools, choice, req.parallel_tool_calls)
            except LookupError:
                raise APIError(400, f"tool_choice names function {choice['function']['name']!r}, which is not "
                                    "among tools", param="tool_choice") from None
            if constraint is not None:
                if "structured_outputs" in sampling:
                    raise APIError(400, "a required or named tool_choice already constrains the output; it cannot "
                                        "be combined with response_format or structured_outputs",
                                   param="response_format")
                sampling["structured_outputs"] = constraint
            mode = choice if isinstance(choice, str) else f"named:{choice['function']['name']}"
        info = await self._info()
        messages = [_flatten_message(m.model_dump(exclude_none=True)) for m in req.messages]
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        requests = [GenerateRequest(rid, "chat", sampling, messages=messages,
                                    add_generation_prompt=req.add_generation_prompt,
                                    tools=tools if choice != "none" else None,
                                    chat_template_kwargs=req.chat_template_kwargs, arrival_time=arrival)]
        return await self._serve(rid, "chat", req, requests,
                                 lambda: ChatOutputParser(mode, reasoning=info["reasoning"]))

    # ---- streaming core ----
    async def _serve(self, rid: str, kind: str, req, requests: list[GenerateRequest], make_parser=None):
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
        make_parser = make_parser or (lambda: ChatOutputParser("text", reasoning=False))
        if req.stream:
            return StreamingResponse(self._sse_stream(rid, kind, req, merged, n, created, len(requests), make_parser),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return await self._collect(rid, kind, req, merged, n, created, len(requests), make_parser)

    def _choice_chunk(self, kind: str, index: int, c: ChoiceDelta, first: bool, parser,
                      prompt_ids: list[int] | None) -> dict[str, Any]:
        """One choice of a stream chunk. prompt_ids: the prompt's token ids when return_token_ids asked for them
        (sent on the choice's first chunk), else None."""
        lp = _format_logprobs(kind, c.logprobs) if c.logprobs is not None else None
        ids: dict[str, Any] = {}
        if prompt_ids is not None:
            ids = {"prompt_token_ids": prompt_ids, "token_ids": c.token_ids} if first else {"token_ids": c.token_ids}
        if kind == "completion":
            return {"index": index, "text": c.text, "logprobs": lp, "finish_reason": c.finish_reason, **ids}
        reasoning, content = parser.feed(c.text)
        calls = None
        if c.finish_reason:
            more_reasoning, more_content, calls = parser.finish()
            reasoning, content = reasoning + more_reasoning, content + more_content
        delta: dict[str, Any] = {}
        if first:
            delta["role"] = "assistant"
        if content or not (reasoning or calls):
            delta["content"] = content
        if reasoning:
            delta["reasoning_content"] = reasoning
        if calls:
            delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(calls)]
        finish = "tool_calls" if calls else c.finish_reason
        return {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish, **ids}

    async def _sse_stream(self, rid, kind, req, merged, n, created, num_prompts, make_parser) -> AsyncIterator[bytes]:
        obj = "text_completion" if kind == "completion" else "chat.completion.chunk"
        prompt_tokens: dict[int, int] = {}
        completion_tokens: dict[int, int] = {}
        started: set[int] = set()
        parsers: dict[int, ChatOutputParser] = {}
        prompt_ids: dict[int, list[int]] = {}
        versions: dict[int, list] = {}
        try:
            async for p_idx, item in merged:
                if isinstance(item, ErrorMessage):
                    yield _sse(item.to_error().body())
                    break
                prompt_tokens[p_idx] = item.prompt_tokens
                if item.prompt_token_ids is not None:
                    prompt_ids[p_idx] = item.prompt_token_ids
                choices = []
                for c in item.choices:
                    index = p_idx * n + c.index
                    completion_tokens[index] = c.num_output_tokens
                    parser = parsers.setdefault(index, make_parser()) if kind == "chat" else None
                    ids = prompt_ids.get(p_idx, []) if req.return_token_ids else None
                    choices.append(self._choice_chunk(kind, index, c, index not in started, parser, ids))
                    started.add(index)
                if item.model_versions:
                    versions[p_idx] = item.model_versions
                if choices:
                    yield _sse({"id": rid, "object": obj, "created": created, "model": self.model_name,
                                "choices": choices, "model_version": _version(versions)})
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

    async def _collect(self, rid, kind, req, merged, n, created, num_prompts, make_parser) -> JSONResponse:
        texts: dict[int, list[str]] = {}
        token_ids: dict[int, list[int]] = {}
        prompt_ids: dict[int, list[int]] = {}
        finish: dict[int, str | None] = {}
        versions: dict[int, list] = {}
        lps: dict[int, list] = {}
        prompt_tokens: dict[int, int] = {}
        completion_tokens: dict[int, int] = {}
        try:
            async for p_idx, item in merged:
                if isinstance(item, ErrorMessage):
                    raise item.to_error()
                prompt_tokens[p_idx] = item.prompt_tokens
                if item.prompt_token_ids is not None:
                    prompt_ids[p_idx] = item.prompt_token_ids
                if item.model_versions:
                    versions[p_idx] = item.model_versions
                for c in item.choices:
                    index = p_idx * n + c.index
                    texts.setdefault(index, []).append(c.text)
                    token_ids.setdefault(index, []).extend(c.token_ids)
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
            ids = {"prompt_token_ids": prompt_ids.get(index // n, []),
                   "token_ids": token_ids.get(index, [])} if req.return_token_ids else {}
            if kind == "completion":
                choices.append({"index": index, "text": text, "logprobs": lp, "finish_reason": finish.get(index), **ids})
            else:
                parser = make_parser()
                reasoning, content = parser.feed(text)
                more_reasoning, more_content, calls = parser.finish()
                reasoning, content = reasoning + more_reasoning, content + more_content
                message: dict[str, Any] = {"role": "assistant", "content": content or (None if calls else "")}
                if reasoning:
                    message["reasoning_content"] = reasoning
                if calls:
                    message["tool_calls"] = calls
                choices.append({"index": index, "message": message, "logprobs": lp,
                                "finish_reason": "tool_calls" if calls else finish.get(index), **ids})
        return JSONResponse({"id": rid, "object": "text_completion" if kind == "completion" else "chat.completion",
                             "created": created, "model": self.model_name, "choices": choices,
                             "usage": _usage(prompt_tokens, completion_tokens), "model_version": _version(versions)})


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


def _version(versions: dict[int, list]) -> Any:
    """The policy version whose weights made the response's tokens; a list, in order, when it spans several
    (a weight update with pause="keep" came while it ran, or its prompts ran on different versions)."""
    spanned: list = []
    for p_idx in sorted(versions):
        spanned += [v for v in versions[p_idx] if v not in spanned]
    if not spanned:
        return None
    return spanned[0] if len(spanned) == 1 else spanned


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
