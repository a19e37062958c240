"""AsyncLLM: the engine for servers. One background thread runs the step loop; callers stream with

    async for out in llm.generate(prompt, params, request_id): ...

Each yielded RequestOutput carries the text and tokens new since the previous one (text_delta,
token_ids_delta); outputs that pile up while the caller is busy are merged into one, so a loaded server
sends fewer, larger chunks instead of falling further behind. Leaving the loop early, or cancelling the
task, aborts the request and frees its blocks.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator
from typing import Any

from engine.config import EngineConfig
from engine.llm_engine import EngineStats, LLMEngine
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class AsyncLLM:
    def __init__(self, config: EngineConfig | None = None, **kwargs: Any) -> None:
        self.config = config or EngineConfig(**kwargs)
        self.engine = LLMEngine(self.config)
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kvscale-engine", daemon=True)
        self._thread.start()

    # ---- caller side ----
    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def stats(self) -> EngineStats:
        return self.engine.stats()

    async def generate(self, prompt: str | list[int] | dict, params: SamplingParams,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        """Raises ValueError (before yielding) when the request is invalid; RuntimeError if the engine failed it."""
        if self._stopped.is_set():
            raise RuntimeError("the engine is shut down")
        loop = asyncio.get_running_loop()
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (loop, stream)
        self._commands.put(("add", request_id, prompt, params))
        finished = False
        try:
            while True:
                item = await stream.get()
                while not isinstance(item, BaseException) and not stream.empty():
                    item = _merge(item, stream.get_nowait())  # a slow reader gets one item, not a backlog
                if isinstance(item, BaseException):
                    raise item
                if item.error:
                    raise RuntimeError(item.error)
                finished = item.finished
                yield item
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
                self.engine.add_request(request_id, prompt, params)
            except ValueError as e:
                self._deliver(request_id, e)
            if request_id not in self._streams:  # the caller left before we got to it
                self.engine.abort_request(request_id)
        elif kind == "abort":
            self.engine.abort_request(command[1])

    def _loop(self) -> None:
        while not self._stopped.is_set():
            try:
                idle = not self.engine.has_unfinished_requests()
                self._handle(self._commands.get(timeout=0.5) if idle else self._commands.get_nowait())
                continue  # drain all commands before the next step
            except queue.Empty:
                pass
            if not self.engine.has_unfinished_requests():
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:  # a bug in scheduling itself: fail everything rather than hang clients
                logger.exception("engine loop failed; aborting all requests")
                for request_id in list(self.engine.requests):
                    self.engine.abort_request(request_id)
                    self._deliver(request_id, RuntimeError(f"engine failed: {e}"))
                continue
            for out in outputs:
                self._deliver(out.request_id, out)
        for request_id in list(self.engine.requests):
            self.engine.abort_request(request_id)
            self._deliver(request_id, RuntimeError("the engine shut down"))


def _merge(older: RequestOutput, newer: RequestOutput | BaseException) -> RequestOutput | BaseException:
    """One output standing for two consecutive ones: the newer state, with both deltas."""
    if isinstance(newer, BaseException) or newer.error:
        return newer
    by_index = {c.index: c for c in older.outputs}
    for c in newer.outputs:
        prev = by_index.get(c.index)
        if prev is not None:
            c.text_delta = prev.text_delta + c.text_delta
            c.token_ids_delta = prev.token_ids_delta + c.token_ids_delta
    return newer
