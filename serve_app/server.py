"""EngineServer: the Ray Serve deployment whose replicas each own one engine (AsyncLLM).

It speaks plain dicts over the handle: `generate(payload)` streams {"type": "output", ...} items as the
engine produces tokens, or a single {"type": "error", ...} item for a request the engine refuses. It also
reports its KV stats for /metrics (and, in the autoscaling issue, to Ray Serve's autoscaler and router).
"""
from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

from engine.async_llm import AsyncLLM
from engine.llm import apply_chat_template
from engine.sampling_params import SamplingParams
from serve_app.config import ServeConfig
from serve_app.metrics import (E2E_BUCKETS, ITL_BUCKETS, REPORT_INTERVAL_S, TTFT_BUCKETS, Histogram, get_board,
                               replica_identity)
from serve_app.protocol import APIError
from serve_app.router import prefix_fingerprint

MAX_REMEMBERED_PREFIXES = 256

logger = logging.getLogger("ray.serve")


class EngineServer:
    def __init__(self, config: ServeConfig | dict) -> None:
        self.config = config if isinstance(config, ServeConfig) else ServeConfig(**config)
        if self.config.torch_threads:
            import torch

            torch.set_num_threads(self.config.torch_threads)
        self.llm = AsyncLLM(self.config.to_engine_config())
        self.tokenizer = self.llm.get_tokenizer()
        self.replica_id, self.app_name = replica_identity()
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.finished: dict[str, int] = {}
        self._preemptions_reported = 0
        self._num_unstarted = 0  # requests in generate() that have not had their first token yet
        self._recent_prefixes: OrderedDict[str, None] = OrderedDict()  # prompt fingerprints, LRU, for routing
        self._board = None
        self._stopped = threading.Event()
        self._reporter = threading.Thread(target=self._report_loop, name="kvscale-stats", daemon=True)
        self._reporter.start()

    # ---- requests ----
    def _prepare(self, payload: dict[str, Any]) -> tuple[Any, SamplingParams]:
        try:
            params = SamplingParams(**payload["sampling"])
        except (ValueError, TypeError) as e:
            raise APIError(400, str(e), param=_field_in(str(e))) from e
        if params.n > self.config.max_n:
            raise APIError(400, f"n must be <= {self.config.max_n}; got {params.n}", param="n")
        if payload["kind"] == "chat":
            try:
                prompt: Any = {"prompt_token_ids": apply_chat_template(
                    self.tokenizer, payload["messages"], payload.get("add_generation_prompt", True))}
            except Exception as e:  # a template that rejects these messages is the caller's error
                raise APIError(400, f"the chat template could not render these messages: {e}",
                               param="messages") from e
        else:
            prompt = payload["prompt"]
        return prompt, params

    async def generate(self, payload: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        start = time.monotonic()
        request_id = payload.get("request_id") or uuid.uuid4().hex
        try:
            prompt, params = self._prepare(payload)
            # Counted here, synchronously, so a burst cannot all slip in before the engine thread sees it.
            if self._num_unstarted >= self.config.max_waiting_requests:
                raise APIError(503, f"this replica already has {self._num_unstarted} requests waiting for their "
                                    "first token; retry shortly", code="queue_full", retry_after=1)
        except APIError as e:
            yield {"type": "error", **e.to_dict()}
            return
        self._remember_prefix(payload)
        want_logprobs = params.logprobs is not None
        last, first_seen = start, False
        self._num_unstarted += 1
        try:
            async for out in self.llm.generate(prompt, params, request_id):
                now = time.monotonic()
                n_new = sum(len(c.token_ids_delta) for c in out.outputs)
                if n_new and not first_seen:
                    self.ttft.observe(now - start)
                    first_seen = True
                    self._num_unstarted -= 1
                elif n_new:
                    self.itl.observe((now - last) / n_new, n_new)
                last = now
                yield {
                    "type": "output", "finished": out.finished, "prompt_tokens": len(out.prompt_token_ids),
                    "choices": [{
                        "index": c.index, "text": c.text_delta, "token_ids": c.token_ids_delta,
                        "finish_reason": c.finish_reason, "num_tokens": len(c.token_ids),
                        "logprobs": self._logprobs(c, len(c.token_ids_delta), params.logprobs) if want_logprobs else None,
                    } for c in out.outputs if c.token_ids_delta or c.text_delta or c.finish_reason],
                }
                if out.finished:
                    for c in out.outputs:
                        self.finished[c.finish_reason] = self.finished.get(c.finish_reason, 0) + 1
                    self.e2e.observe(now - start)
        except ValueError as e:
            yield {"type": "error", **APIError(400, str(e), param=_field_in(str(e))).to_dict()}
        except RuntimeError as e:
            yield {"type": "error", **APIError(500, str(e), code="engine_error").to_dict()}
        finally:
            if not first_seen:
                self._num_unstarted -= 1

    def _remember_prefix(self, payload: dict[str, Any]) -> None:
        fingerprint = prefix_fingerprint(payload)
        if fingerprint is None:
            return
        self._recent_prefixes[fingerprint] = None
        self._recent_prefixes.move_to_end(fingerprint)
        while len(self._recent_prefixes) > MAX_REMEMBERED_PREFIXES:
            self._recent_prefixes.popitem(last=False)

    @staticmethod
    def _logprobs(c, n_new: int, top_k: int) -> list[dict[str, Any]]:
        entries = c.logprobs[len(c.logprobs) - n_new:] if n_new else []
        return [{
            "token_id": tid, "token": entry[tid].decoded_token, "logprob": entry[tid].logprob,
            "top": [(lp.decoded_token, lp.logprob) for lp in sorted(entry.values(), key=lambda lp: lp.rank)
                    if lp.rank <= top_k],
        } for tid, entry in zip(c.token_ids_delta, entries)]

    # ---- stats ----
    def stats(self) -> dict[str, Any]:
        s = self.llm.stats()
        used = s.num_total_blocks - s.num_free_blocks
        return {
            "gauges": {"kv_cache_usage_perc": used / s.num_total_blocks, "num_total_blocks": s.num_total_blocks,
                       "num_free_blocks": s.num_free_blocks, "num_cached_blocks": s.num_cached_free_blocks,
                       "num_requests_running": s.num_running, "num_requests_waiting": s.num_waiting},
            "counters": {"num_preemptions": s.num_preemptions_total, "prompt_tokens": s.num_prompt_tokens_total,
                         "generation_tokens": s.num_generation_tokens_total,
                         "prefix_cache_queries": s.prefix_cache_queried_tokens,
                         "prefix_cache_hits": s.prefix_cache_hit_tokens},
            "histograms": {"time_to_first_token_seconds": self.ttft.snapshot(),
                           "inter_token_latency_seconds": self.itl.snapshot(),
                           "e2e_request_latency_seconds": self.e2e.snapshot()},
            "finished": dict(self.finished),
            "block_size": s.block_size, "max_model_len": self.llm.max_model_len,
        }

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Ray Serve's custom-metrics hook: what serve_app.autoscaling's policy reads. Plain floats only."""
        s = self.llm.stats()
        preempted = s.num_preemptions_total - self._preemptions_reported
        self._preemptions_reported = s.num_preemptions_total
        return {"kv_total_blocks": float(s.num_total_blocks), "kv_free_blocks": float(s.num_free_blocks),
                "kv_used_blocks": float(s.num_used_blocks),
                "kv_demand_blocks": float(self.llm.engine.projected_demand_blocks()),
                "num_waiting": float(s.num_waiting), "num_waiting_for_kv": float(s.num_waiting_for_kv),
                "num_requests": float(s.num_running + s.num_waiting),
                "preemptions": float(preempted)}

    def record_routing_stats(self) -> dict[str, Any]:
        """Ray Serve's routing-stats hook: what serve_app.router's KVAwareRouter reads."""
        s = self.llm.stats()
        return {"free_blocks": s.num_free_blocks, "used_blocks": s.num_used_blocks,
                "demand_blocks": self.llm.engine.projected_demand_blocks(), "waiting": self._num_unstarted,
                "max_waiting": self.config.max_waiting_requests, "block_size": s.block_size,
                "prefixes": list(self._recent_prefixes), "reported_at": time.time()}

    def check_health(self) -> None:
        if not self.llm._thread.is_alive():
            raise RuntimeError("the engine loop thread died")

    def _report_loop(self) -> None:
        while not self._stopped.wait(REPORT_INTERVAL_S):
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


def _field_in(message: str) -> str | None:
    first = message.split(" ", 1)[0]
    return first if first.isidentifier() else None
