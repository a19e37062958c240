"""EngineServer: the Ray Serve deployment whose replicas each own one engine (AsyncLLM).

It speaks serve_app.messages over the handle: `generate(GenerateRequest)` streams OutputDelta messages
(only what is new) as the engine produces tokens, or one ErrorMessage for a request the engine refuses or
fails. It reads the engine only through AsyncLLM's public surface: `generate`, the published `stats()`
snapshot (for /metrics, Ray Serve's autoscaler and the router), `check_health`, and the RL controls that
serve_app.rl's PolicyFollower drives (update_weights, pause, resume, sleep, wake_up).
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterator
from typing import Any

from engine.async_llm import AsyncLLM, EnginePaused
from engine.llm import apply_chat_template
from engine.outputs import CompletionOutput
from engine.sampling_params import RequestOutputKind, SamplingParams
from serve_app.autoscaling import ArrivalMeter, LatencyWindow, autoscaling_metrics
from serve_app.chat_output import render_tool_messages
from serve_app.config import ServeConfig
from serve_app.messages import ChoiceDelta, ErrorMessage, GenerateRequest, OutputDelta, TokenLogprob
from serve_app.metrics import REPORT_INTERVAL_S, ReplicaMetrics, get_board, replica_identity
from serve_app.protocol import APIError
from serve_app.rl import PolicyFollower
from serve_app.router import prefix_fingerprint, routing_stats

MAX_REMEMBERED_PREFIXES = 256

logger = logging.getLogger("ray.serve")


class EngineServer:
    def __init__(self, config: ServeConfig | dict) -> None:
        self.config = config if isinstance(config, ServeConfig) else ServeConfig(**config)
        _check_priority()
        # Ray sets OMP_NUM_THREADS to the actor's num_cpus (1 by default), which would leave a CPU engine on one
        # core; the engine is the replica's work, so it gets the cores unless the config says otherwise.
        threads = self.config.torch_threads or (len(os.sched_getaffinity(0)) if self.config.engine_num_gpus == 0 else 0)
        if threads:
            import torch

            torch.set_num_threads(threads)
        with _ordinary_scheduling():  # the engine thread and its OpenMP workers, which it starts
            self.llm = AsyncLLM(self.config.to_engine_config())
        self.tokenizer = self.llm.get_tokenizer()
        self._template_knows_tools = "tools" in str(getattr(self.tokenizer, "chat_template", "") or "")
        self.replica_id, self.app_name = replica_identity()
        self.metrics = ReplicaMetrics()
        self._preemptions_reported = 0
        # what the autoscaler sizes from besides the engine's stats: arrival rates, and the latencies requests
        # saw over the last seconds (TTFT from the ingress, each finished sample's mean ITL), against the SLO
        self._arrivals = ArrivalMeter()
        self._ttft_window, self._itl_window, self._queue_window = LatencyWindow(), LatencyWindow(), LatencyWindow()
        self._num_unstarted = 0  # requests in generate() that have not had their first token yet
        self._recent_prefixes: OrderedDict[str, None] = OrderedDict()  # prompt fingerprints, LRU, for routing
        self._prefix_snapshot: tuple[str, ...] = ()  # what the routing-stats thread reads
        self._board = None
        # RL: follow the app's pushed policy (serve_app/rl.py), before taking any request
        self.policy = PolicyFollower(self.llm, self.app_name)
        if self.app_name != "local":
            self.policy.follow(block=True)
        self._stopped = threading.Event()
        self._reporter = threading.Thread(target=self._report_loop, name="kvscale-stats", daemon=True)
        self._reporter.start()

    # ---- requests ----
    def model_info(self) -> dict[str, Any]:
        """What the ingress needs to know about the model: /v1/models' max_model_len, and how to read chat output."""
        vocab = self.tokenizer.get_vocab()
        return {"max_model_len": self.llm.max_model_len, "template_knows_tools": self._template_knows_tools,
                "reasoning": "<think>" in vocab and "</think>" in vocab}

    def tokenize(self, body: dict[str, Any]) -> dict[str, Any] | ErrorMessage:
        """/tokenize: a prompt or chat messages to token ids, as the engine would see them."""
        try:
            if body.get("messages") is not None:
                ids = apply_chat_template(self.tokenizer, render_tool_messages(body["messages"], None, self._template_knows_tools),
                                          body.get("add_generation_prompt", True),
                                          **(body.get("chat_template_kwargs") or {}))
            else:
                ids = self.tokenizer.encode(body["prompt"], add_special_tokens=body.get("add_special_tokens", True))
        except Exception as e:
            return ErrorMessage.of(APIError(400, f"could not tokenize: {type(e).__name__}: {e}",
                                            param="messages" if body.get("messages") is not None else "prompt"))
        return {"tokens": ids, "count": len(ids), "max_model_len": self.llm.max_model_len}

    def detokenize(self, tokens: list[int]) -> dict[str, Any] | ErrorMessage:
        vocab = len(self.tokenizer)
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab for t in tokens):
            return ErrorMessage.of(APIError(400, f"tokens must be token ids in [0, {vocab})", param="tokens"))
        return {"prompt": self.tokenizer.decode(tokens)}

    def _prepare(self, req: GenerateRequest) -> tuple[Any, SamplingParams]:
        sampling = {**self.llm.generation_defaults, **req.sampling}  # the model's defaults under the request's
        try:
            params = SamplingParams(**sampling, output_kind=RequestOutputKind.DELTA)
        except (ValueError, TypeError) as e:
            raise _refusal(str(e), req.kind) from e
        if params.n > self.config.max_n:
            raise APIError(400, f"n must be <= {self.config.max_n}; got {params.n}", param="n")
        if req.kind == "chat":
            knows = self._template_knows_tools
            try:
                messages = render_tool_messages(req.messages or [], req.tools, knows)
                prompt: Any = {"prompt_token_ids": apply_chat_template(
                    self.tokenizer, messages, req.add_generation_prompt, tools=req.tools if knows else None,
                    **(req.chat_template_kwargs or {}))}
            except Exception as e:  # a template that rejects these messages is the caller's error
                raise APIError(400, f"the chat template could not render these messages: {e}",
                               param="messages") from e
        else:
            prompt = req.prompt
        return prompt, params

    async def generate(self, req: GenerateRequest) -> AsyncIterator[OutputDelta | ErrorMessage]:
        start = time.monotonic()
        request_id = req.request_id or uuid.uuid4().hex
        try:
            prompt, params = self._prepare(req)
            # Counted here, synchronously, so a burst cannot all slip in before the engine thread sees it.
            if self._num_unstarted >= self.config.max_waiting_requests:
                raise APIError(503, f"this replica already has {self._num_unstarted} requests waiting for their "
                                    "first token; retry shortly", code="queue_full", retry_after=1)
        except APIError as e:
            yield ErrorMessage.of(e)
            return
        self._remember_prefix(req)
        # Latencies count from the request's arrival at the ingress (held there and in Serve's queues too), by
        # the wall clock the two share; inside the replica, between tokens, by the monotonic clock.
        held = max(0.0, time.time() - req.arrival_time) if req.arrival_time else 0.0
        last, first_seen, sent_prompt = start, False, False
        reasons: dict[int, str] = {}
        samples: dict[int, tuple[float, float | None, int]] = {}  # per sample: first and latest token times, count
        self._num_unstarted += 1
        try:
            async for out in self.llm.generate(prompt, params, request_id, self.config.stream_interval_s,
                                               self.config.stream_max_messages_per_s):
                now = time.monotonic()
                n_new = sum(len(c.token_ids) for c in out.outputs)
                if n_new and not first_seen:
                    self.metrics.observe("time_to_first_token_seconds", held + now - start)
                    self._ttft_window.add(now, held + now - start)
                    first_seen = True
                    self._num_unstarted -= 1
                for c in out.outputs:  # each sample is its own stream: time between its own tokens
                    if not c.token_ids:
                        continue
                    k = len(c.token_ids)
                    first_at, latest, count = samples.get(c.index, (now, None, 0))
                    if latest is not None:
                        self.metrics.observe("inter_token_latency_seconds", (now - latest) / k, k)
                    elif k > 1:  # its first token starts its clock; the rest came within this interval
                        self.metrics.observe("inter_token_latency_seconds", (now - last) / k, k - 1)
                    samples[c.index] = (first_at, now, count + k)
                    if c.finish_reason and count + k > 1:  # the sample's mean ITL, as the SLO counts it
                        self._itl_window.add(now, (now - first_at) / (count + k - 1))
                last = now
                yield OutputDelta([_choice(c, params.logprobs) for c in out.outputs], out.finished,
                                  len(out.prompt_token_ids), None if sent_prompt else list(out.prompt_token_ids),
                                  out.model_versions)
                sent_prompt = True
                for c in out.outputs:  # DELTA: a sample's finish_reason comes exactly once
                    if c.finish_reason:
                        reasons[c.index] = c.finish_reason
                if out.finished:  # one request, counted once, by its first sample's reason
                    reason = reasons.get(0) or next(iter(reasons.values()), "abort")
                    queue_s = self.metrics.request_finished(
                        reason, n=params.n, max_tokens=params.max_tokens or self.llm.max_model_len - len(
                            out.prompt_token_ids), num_prompt_tokens=len(out.prompt_token_ids), held=held, start=start,
                        end=now, metrics=out.metrics)
                    if queue_s is not None:  # arrival at the ingress to its first engine step
                        self._queue_window.add(now, queue_s)
        except ValueError as e:
            yield ErrorMessage.of(_refusal(str(e), req.kind))
        except EnginePaused as e:
            yield ErrorMessage.of(APIError(503, str(e), code="engine_paused", retry_after=1))
        except RuntimeError as e:
            yield ErrorMessage.of(APIError(500, str(e), code="engine_error"))
        finally:
            if not first_seen:
                self._num_unstarted -= 1

    def _remember_prefix(self, req: GenerateRequest) -> None:
        fingerprint = prefix_fingerprint(req)
        if fingerprint is None:
            return
        self._recent_prefixes[fingerprint] = None
        self._recent_prefixes.move_to_end(fingerprint)
        while len(self._recent_prefixes) > MAX_REMEMBERED_PREFIXES:
            self._recent_prefixes.popitem(last=False)
        self._prefix_snapshot = tuple(self._recent_prefixes)

    # ---- stats ----
    def stats(self) -> dict[str, Any]:
        s = self.llm.stats()
        snap = self.metrics.snapshot(s, cache_config=self.llm.kv_cache_config,
                                     max_model_len=self.llm.max_model_len,
                                     healthy=s.is_healthy and self.llm.is_healthy)
        snap["policy"] = self.policy.report(s.num_running + s.num_waiting)
        return snap

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Ray Serve's custom-metrics hook: what serve_app.autoscaling's policy reads. Plain floats only."""
        s = self.llm.stats()
        preempted = s.num_preemptions_total - self._preemptions_reported
        self._preemptions_reported = s.num_preemptions_total
        now = time.monotonic()
        return autoscaling_metrics(s, preempted, self._arrivals.rates(now, s), self._ttft_window.quantile(now, 0.99),
                                   self._itl_window.quantile(now, 0.99), self._queue_window.quantile(now, 0.99))

    def record_routing_stats(self) -> dict[str, Any]:
        """Ray Serve's routing-stats hook: what serve_app.router's KVAwareRouter reads."""
        return routing_stats(self.llm.stats(), self._num_unstarted, self.config.max_waiting_requests,
                             self._prefix_snapshot, time.time())

    def check_health(self) -> None:
        self.llm.check_health()

    # ---- RL control (serve_app/rl.py) ----
    async def check_weights(self, source: list | str, partial: bool) -> int:
        """rl.update_weights asks one replica whether a payload fits the model before publishing it."""
        weights = (await source[0]) if isinstance(source, list) else source
        return await asyncio.wrap_future(self.llm.check_weights(weights, partial))

    def _report_loop(self) -> None:
        while not self._stopped.wait(REPORT_INTERVAL_S):
            try:
                self.policy.follow()
            except Exception:  # the store may be gone or slow; try again next time
                logger.warning("kvscale: could not follow the policy store", exc_info=True)
            try:
                if self._board is None:
                    self._board = get_board(self.app_name)
                self._board.put.remote(self.replica_id, self.stats())
            except Exception:  # metrics must never take the replica down
                logger.warning("kvscale: could not report stats to the board", exc_info=True)
                self._board = None

    def __del__(self) -> None:
        self._stopped.set()
        self.llm.shutdown()


def _check_priority() -> None:
    """Ray starts actor processes at nice 15 (its worker_niceness) unless RAY_worker_niceness=0 is in the
    environment Ray started with; then the engine yields the cores to anything else on the machine, a load
    generator or Ray's own daemons (measured on 2 cores: 74.5 tok/s served at nice 15 against 91.1 at nice 0,
    README: Performance). Not changed here: raised alone, the engine would outrank its own proxy and ingress,
    which run at Ray's niceness too. Says how to start Ray instead."""
    try:
        nice = os.getpriority(os.PRIO_PROCESS, 0)
    except OSError:  # no priorities on this platform
        return
    if nice > 0:
        logger.warning(f"kvscale: this engine replica runs at nice {nice} (Ray's worker_niceness), so it yields the "
                       "CPU to every other process on the machine; start Ray with RAY_worker_niceness=0 in its "
                       "environment for full speed (`kvscale serve` and scripts/serve.sh do)")


@contextlib.contextmanager
def _ordinary_scheduling() -> Iterator[None]:
    """Threads started inside run under Linux's ordinary policy where this thread runs under SCHED_BATCH.

    `kvscale serve` starts Ray under SCHED_BATCH (serve_app/cli.py), so Ray's daemons, the proxy, the ingress and
    the replicas' own gRPC and event-loop threads do not preempt a running thread when they wake, and wait for the
    scheduler's tick instead. The engine's compute threads are the exception: the engine thread and torch's
    OpenMP workers, which it starts and which inherit its policy. Elsewhere (no SCHED_BATCH, not Linux) this does
    nothing."""
    batch = getattr(os, "SCHED_BATCH", None)
    try:
        switch = batch is not None and os.sched_getscheduler(0) == batch
        if switch:
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    except OSError:
        switch = False
    try:
        yield
    finally:
        if switch:
            os.sched_setscheduler(0, batch, os.sched_param(0))


def _choice(c: CompletionOutput, top_k: int | None) -> ChoiceDelta:
    logprobs = None
    if top_k is not None:
        logprobs = [TokenLogprob(tid, entry[tid].decoded_token, entry[tid].logprob,
                                 [(lp.decoded_token, lp.logprob) for lp in sorted(entry.values(), key=lambda lp: lp.rank)
                                  if lp.rank <= top_k])
                    for tid, entry in zip(c.token_ids, c.logprobs or [])]
    return ChoiceDelta(c.index, c.text, c.token_ids, c.finish_reason, c.num_output_tokens, logprobs)


_PARAMS = frozenset(f.name for f in dataclasses.fields(SamplingParams)) - {"output_kind"}


def _refusal(message: str, kind: str) -> APIError:
    """The 400 for a request the engine refused: `param` names the field the message is about (or None), and a
    prompt or max_tokens that does not fit the context gets OpenAI's code context_length_exceeded."""
    first = message.split(" ", 1)[0].split("=", 1)[0].split(".", 1)[0].rstrip(":")
    param = first if first in _PARAMS else None
    code = None
    if "max_model_len" in message:
        code = "context_length_exceeded"
        param = param or ("messages" if kind == "chat" else "prompt")
    elif param is None and ("prompt" in message.split(" ", 3)[:3] or message.startswith("the prompt")):
        param = "messages" if kind == "chat" else "prompt"
    elif param is None and ("JSON schema" in message or "constraint" in message):
        param = "response_format"
    return APIError(400, message, param=param, code=code)
