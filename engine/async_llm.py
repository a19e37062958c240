"""AsyncLLM: the engine for servers. One background thread builds the engine, owns it and runs the step loop
(so a single thread runs every torch op of the model: see __init__); callers stream with

    async for out in llm.generate(prompt, params, request_id): ...

The engine thread is the only one that touches engine state. Callers reach it through a command queue
(add, abort), get outputs delivered to their event loop, and read `stats()`: an immutable snapshot the
thread publishes once per loop: after the queued commands and the step they lead to. Outputs follow params.output_kind; with DELTA (what
servers ask for) outputs that pile up while a caller is busy are merged into one, so a loaded server
sends fewer, larger chunks instead of falling further behind. Leaving the loop early, or cancelling the
task, aborts the request and frees its blocks.

Control for RL rollouts, also through the command queue and carried out between steps: update_weights
(with pause "abort": live requests end with finish_reason abort; "wait": new requests are held until the
live ones finish; "keep": live requests are preempted, their KV freed, and go on with the new weights,
recomputing what they had), pause / resume (while paused, new requests are refused with EnginePaused; with
"keep" the live ones are frozen, with "wait" they finish), and sleep / wake_up (free the KV pool, level 2 the
weights too; live requests are aborted, new ones refused).

If the loop itself fails (anything escaping a step or a command, not a failed forward, which fails only
its batch), every live request ends with an error, the engine is marked unhealthy (`check_health` raises,
so Ray Serve replaces the replica) and later requests are refused at once.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import threading
from collections.abc import AsyncIterator, Mapping
from typing import Any

from engine.config import EngineConfig
from engine.llm_engine import EngineStats, LLMEngine, check_sleep_level
from engine.outputs import RequestOutput, merge_delta
from engine.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "wait", "keep")


class EnginePaused(RuntimeError):
    """The engine is paused or asleep and takes no new requests now; servers answer 503 with Retry-After."""


class AsyncLLM:
    def __init__(self, config: EngineConfig | None = None, **kwargs: Any) -> None:
        self.config = config or EngineConfig(**kwargs)
        self._dead: str | None = None  # why the engine loop died
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopped = threading.Event()
        # RL control state, written by the engine thread only (read anywhere: plain attributes)
        self.paused: str | None = None  # the pause() mode in force, or None
        self.sleep_level = 0
        self._held: list[tuple] = []  # "add" commands that came while paused, asleep or an update waited
        self._drain_waiters: list[concurrent.futures.Future] = []  # pause("wait") calls, answered when drained
        self._waiting_update: tuple | None = None  # an update_weights(pause="wait") waiting for live requests
        # The engine is built in the thread that steps it, so one thread runs every torch op of this engine:
        # libgomp keeps a pool of workers per thread that opens parallel regions, and once the pools hold more
        # threads than there are CPUs it stops spinning at barriers and sleeps at the end of every region
        # (small ops in a thread after another had opened a pool: 1.3x slower, 2.3x beside an idle Ray app;
        # bench/omp_pools.py).
        built: concurrent.futures.Future = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._build_and_loop, args=(built,), name="kvscale-engine",
                                        daemon=True)
        self._thread.start()
        built.result()  # what building the engine raised, raised here

    def _build_and_loop(self, built: concurrent.futures.Future) -> None:
        try:
            engine = LLMEngine(self.config)
            self._engine = engine  # touched by the engine thread only, from here on
            self.tokenizer = engine.tokenizer
            self.max_model_len = engine.max_model_len
            self.generation_defaults = dict(engine.generation_defaults)
            self.kv_cache_config = engine.kv_cache_config()
            self._stats = engine.stats()
            self.model_version: Any = engine.model_version
        except BaseException as e:
            built.set_exception(e)
            return
        built.set_result(None)
        self._loop()

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
                       min_interval_s: float = 0.0,
                       max_outputs_per_s: float | None = None) -> AsyncIterator[RequestOutput]:
        """Raises ValueError (before yielding) when the request is invalid or its id is already in use;
        RuntimeError if the engine failed it or cannot serve. min_interval_s: after an output, wait at least this
        long before the next, merging what the engine produced meanwhile into it (fewer, larger messages for
        a serving path that pays per message; the first output is never held). max_outputs_per_s: a budget for
        all of this engine's streams together; with n live streams each waits at least n / budget seconds, so a
        serving path that can carry only so many messages a second gets larger ones, not a backlog."""
        self.check_health()
        if self.paused or self.sleep_level:
            raise EnginePaused("the engine is " + (f"asleep (level {self.sleep_level})" if self.sleep_level else
                                                   f"paused ({self.paused})") + " and takes no new requests; retry "
                               "after it is resumed or woken up")
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
                interval = max(min_interval_s, len(self._streams) / max_outputs_per_s if max_outputs_per_s else 0.0)
                if interval and last is not None and (wait := last + interval - loop.time()) > 0:
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

    # ---- RL control: each returns a concurrent Future (await it with asyncio.wrap_future) ----
    def update_weights(self, weights: Mapping[str, Any] | list | str, version: Any, pause: str = "abort",
                       partial: bool = False) -> concurrent.futures.Future:
        """New weights between steps; see LLMEngine.update_weights. The payload is checked in full before any
        request is paused: a bad one fails the future with ValueError and changes nothing."""
        check_pause_mode(pause)
        if not isinstance(weights, (str, Mapping)):
            weights = list(weights)  # checked, then loaded: two passes
        return self._control("update", weights, version, pause, partial)

    def check_weights(self, weights: Mapping[str, Any] | list | str, partial: bool = False) -> concurrent.futures.Future:
        """What update_weights would refuse, without loading: the future fails with ValueError naming it."""
        return self._control("check", weights, partial)

    def pause(self, mode: str = "abort") -> concurrent.futures.Future:
        """Stop taking requests: abort the live ones, let them finish first (the future resolves once they
        have), or keep them frozen with their KV until resume()."""
        check_pause_mode(mode)
        return self._control("pause", mode)

    def resume(self) -> concurrent.futures.Future:
        return self._control("resume")

    def sleep(self, level: int = 1) -> concurrent.futures.Future:
        check_sleep_level(level)  # in the caller's thread, before anything is queued
        return self._control("sleep", level)

    def wake_up(self, weights: Mapping[str, Any] | str | None = None, version: Any = None) -> concurrent.futures.Future:
        """After level 2 the weights come from `weights` (with its version), or the checkpoint on disk."""
        return self._control("wake_up", weights, version)

    def _control(self, *command: Any) -> concurrent.futures.Future:
        self.check_health()
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("control", future, command))
        return future

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
        if kind == "add" and (self.paused or self.sleep_level or self._waiting_update is not None):
            self._held.append(command)  # came in just before the pause, or while an update waits
        elif kind == "control":
            _, future, (name, *args) = command
            try:
                getattr(self, f"_do_{name}")(future, *args)
            except Exception as e:  # the engine refused it (a bad payload, a bad mode): nothing was changed
                future.set_exception(e)
        elif kind == "add":
            _, request_id, prompt, params = command
            try:
                self._engine.add_request(request_id, prompt, params)
            except ValueError as e:
                self._deliver(request_id, e)
            if request_id not in self._streams:  # the caller left before we got to it
                self._engine.abort_request(request_id)
        elif kind == "abort":
            self._engine.abort_request(command[1])

    # ---- engine thread: RL control ----
    def _abort_live(self) -> None:
        for out in self._engine.abort_all():
            self._deliver(out.request_id, out)

    def _apply_update(self, future, weights, version, partial) -> None:
        try:
            future.set_result(self._engine.update_weights(weights, version, partial))
        except Exception as e:  # checked before, so this is the engine failing mid-copy: say so loudly
            logger.exception("kvscale: loading the checked weights failed")
            future.set_exception(e)
        self.model_version = self._engine.model_version

    def _do_update(self, future, weights, version, pause, partial) -> None:
        self._engine.check_weights(weights, partial)  # raises before anything changes
        if pause == "abort":
            self._abort_live()
        elif pause == "keep":
            self._engine.preempt_all()
        elif self._engine.has_unfinished_requests():
            self._waiting_update = (future, weights, version, partial)  # applied once they finish
            return
        self._apply_update(future, weights, version, partial)

    def _do_check(self, future, weights, partial) -> None:
        future.set_result(self._engine.check_weights(weights, partial))

    def _do_pause(self, future, mode) -> None:
        self.paused = mode
        if mode == "abort":
            self._abort_live()
        if mode == "wait" and self._engine.has_unfinished_requests():
            self._drain_waiters.append(future)
            return
        future.set_result(None)

    def _do_resume(self, future) -> None:
        self.paused = None
        self._release_held()
        future.set_result(None)

    def _do_sleep(self, future, level) -> None:
        self._abort_live()
        self._engine.sleep(level)
        self.sleep_level = level
        future.set_result(None)

    def _do_wake_up(self, future, weights, version) -> None:
        self._engine.wake_up(weights, version)
        self.sleep_level = 0
        self.model_version = self._engine.model_version
        self._release_held()
        future.set_result(None)

    def _release_held(self) -> None:
        if self.paused or self.sleep_level or self._waiting_update is not None:
            return
        held, self._held = self._held, []
        for command in held:
            self._handle(command)

    def _after_drain(self) -> None:
        """Live requests all finished: answer pause("wait") calls, apply a waiting update."""
        for future in self._drain_waiters:
            future.set_result(None)
        self._drain_waiters = []
        if self._waiting_update is not None:
            update, self._waiting_update = self._waiting_update, None
            self._apply_update(*update)
            self._release_held()

    def _run_once(self) -> None:
        """Every queued command, then one step, its published snapshot, its outputs; idle, wait for a command."""
        engine = self._engine
        while True:
            try:
                self._handle(self._commands.get_nowait())
            except queue.Empty:
                break
        frozen = self.paused in ("abort", "keep") or self.sleep_level  # no steps (keep: live requests wait)
        outputs = engine.step() if engine.has_unfinished_requests() and not frozen else []
        # the snapshot before the outputs go out: a caller that has its last token sees its blocks back
        self._stats = engine.stats()
        for out in outputs:
            self._deliver(out.request_id, out)
        if not engine.has_unfinished_requests() and (self._drain_waiters or self._waiting_update is not None):
            self._after_drain()
            self._stats = engine.stats()
        if not engine.has_unfinished_requests() or frozen:
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
                elif command[0] == "control":
                    command[1].set_exception(RuntimeError(f"the engine failed: {self._dead}"))
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
        waiting = [u[0] for u in [self._waiting_update] if u is not None] + self._drain_waiters
        self._waiting_update, self._drain_waiters = None, []
        for future in waiting:
            future.set_exception(RuntimeError(error))


def check_pause_mode(mode: str) -> None:
    """ValueError unless mode is one of PAUSE_MODES (AsyncLLM, and serve_app.rl before it asks any replica)."""
    if mode not in PAUSE_MODES:
        raise ValueError(f"pause must be one of {', '.join(PAUSE_MODES)}; got {mode!r}")
