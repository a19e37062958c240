"""AsyncLLM: the engine for servers. One background thread owns the engine and runs the step loop; callers
stream with

    async for out in llm.generate(prompt, params, request_id): ...

The engine thread is the only one that touches engine state. Callers reach it through a command queue
(add, abort), get outputs delivered to their event loop, and read `stats()`: an immutable snapshot the
thread publishes once per loop: after the queued commands and the step they lead to. Outputs follow params.output_kind; with DELTA (what
servers ask for) outputs that pile up while a caller is busy are merged into one, so a loaded server
sends fewer, larger chunks instead of falling further behind. Leaving the loop early, or cancelling the
task, aborts the request and frees its blocks.

If the loop itself fails (anything escaping a step or a command, not a failed forward, which fails only
its batch), every live request ends with an error, the engine is marked unhealthy (`check_health` raises,
so Ray Serve replaces the replica) and later requests are refused at once.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
from collections.abc import AsyncIterator
from typing import Any

from engine.config import EngineConfig
from engine.llm_engine import EngineStats, LLMEngine
from engine.outputs import RequestOutput, merge_delta
from engine.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)


class AsyncLLM:
    def __init__(self, config: EngineConfig | None = None, **kwargs: Any) -> None:
        self.config = config or EngineConfig(**kwargs)
        engine = LLMEngine(self.config)
        self._engine = engine  # touched by the engine thread only, from here on
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.generation_defaults = dict(engine.generation_defaults)
        self.kv_cache_config = engine.kv_cache_config()
        self._stats = engine.stats()
        self._dead: str | None = None  # why the engine loop died
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kvscale-engine", daemon=True)
        self._thread.start()

    # ---- caller side ----
    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def stats(self) -> EngineStats:
        """The latest snapshot the engine thread published; safe from any thread."""
        return self._stats

    @property
    def is_healthy(self) -> bool:
        return self._dead is None and self._thread.is_alive()

    def check_health(self) -> None:
        """Raises RuntimeError saying why when the engine can no longer serve."""
        if self._dead is not None:
            raise RuntimeError(f"the engine loop failed and serves no more requests: {self._dead}")
        if not self._thread.is_alive():
            raise RuntimeError("the engine loop thread is not running (the engine was shut down)")

    async def generate(self, prompt: str | list[int] | dict, params: SamplingParams, request_id: str,
                       min_interval_s: float = 0.0) -> AsyncIterator[RequestOutput]:
        """Raises ValueError (before yielding) when the request is invalid or its id is already in use;
        RuntimeError if the engine failed it or cannot serve. min_interval_s: after an output, wait at least this
        long before the next, merging what the engine produced meanwhile into it (fewer, larger messages for
        a serving path that pays per message; the first output is never held)."""
        self.check_health()
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use by a running request; use a unique id")
        loop = asyncio.get_running_loop()
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (loop, stream)
        self._commands.put(("add", request_id, prompt, params))
        delta = params.output_kind is RequestOutputKind.DELTA
        finished, last = False, None
        try:
            while True:
                if min_interval_s and last is not None and (wait := last + min_interval_s - loop.time()) > 0:
                    await asyncio.sleep(wait)
                item = await stream.get()
                while not isinstance(item, BaseException) and not stream.empty():
                    newer = stream.get_nowait()  # a slow reader gets one item, not a backlog
                    item = newer if isinstance(newer, BaseException) or not delta else merge_delta(item, newer)
                if isinstance(item, BaseException):
                    raise item
                if item.error:
                    raise RuntimeError(item.error)
                finished = item.finished
                yield item
                last = loop.time()
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._commands.put(("abort", request_id))

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    def shutdown(self) -> None:
        self._stopped.set()
        self._commands.put(("stop",))
        self._thread.join(timeout=10)

    # ---- engine thread ----
    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        target = self._streams.get(request_id)
        if target is None:
            return
        loop, stream = target
        try:
            loop.call_soon_threadsafe(stream.put_nowait, item)
        except RuntimeError:  # the caller's loop closed; nobody is listening
            self._commands.put(("abort", request_id))

    def _handle(self, command: tuple) -> None:
        kind = command[0]
        if kind == "add":
            _, request_id, prompt, params = command
            try:
                self._engine.add_request(request_id, prompt, params)
            except ValueError as e:
                self._deliver(request_id, e)
            if request_id not in self._streams:  # the caller left before we got to it
                self._engine.abort_request(request_id)
        elif kind == "abort":
            self._engine.abort_request(command[1])

    def _run_once(self) -> None:
        """Every queued command, then one step, then one published snapshot; idle, wait for a command."""
        engine = self._engine
        while True:
            try:
                self._handle(self._commands.get_nowait())
            except queue.Empty:
                break
        if engine.has_unfinished_requests():
            for out in engine.step():
                self._deliver(out.request_id, out)
        self._stats = engine.stats()
        if not engine.has_unfinished_requests():
            try:
                self._handle(self._commands.get(timeout=0.5))
            except queue.Empty:
                pass

    def _loop(self) -> None:
        try:
            while not self._stopped.is_set():
                self._run_once()
        except Exception as e:  # a bug in scheduling or bookkeeping: fail everything rather than hang clients
            logger.exception("kvscale engine loop failed; failing every live request and refusing new ones")
            self._dead = f"{type(e).__name__}: {e}"
            self._fail_all(f"the engine failed: {self._dead}")
            while not self._stopped.is_set():  # answer what was queued meanwhile, so no caller hangs
                try:
                    command = self._commands.get(timeout=0.5)
                except queue.Empty:
                    continue
                if command[0] == "add":
                    self._deliver(command[1], RuntimeError(f"the engine failed: {self._dead}"))
            return
        self._fail_all("the engine shut down")

    def _fail_all(self, error: str) -> None:
        """Free every request, publish the last snapshot (unhealthy if the loop died), then tell the callers."""
        try:
            self._engine.fail_requests(self._engine.request_ids, error)
            self._stats = dataclasses.replace(self._engine.stats(), is_healthy=self._dead is None)
        except Exception:  # the bookkeeping itself may be what broke; the callers still get their error
            logger.exception("kvscale: could not free the requests' blocks after the failure")
            self._stats = dataclasses.replace(self._stats, is_healthy=self._dead is None)
        for request_id in list(self._streams):
            self._deliver(request_id, RuntimeError(error))
