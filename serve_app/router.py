"""The routing rule: send a request where its KV fits best, and where its prompt may already be cached.

Each engine replica reports (record_routing_stats): free blocks, blocks its live requests will still
claim (projected demand), its waiting count and limit, and fingerprints of recent prompt prefixes. For a
request needing `d` blocks, a replica's headroom is free - (demand - held) - d, i.e. what is left after
everything it has admitted grows to its expected size. The rules:
1. A replica at its waiting limit gets nothing new; nor does one that already has requests waiting and
   no headroom for this one. If no replica qualifies the request waits in the caller (Ray backs off and
   asks again), where a new replica can take it, instead of queueing behind a full one.
2. A replica that saw the same prompt prefix is preferred if its headroom is not negative.
3. Otherwise, power of two choices: of the two, one whose headroom fits the request first, then the one with
   fewer requests waiting for their first token (prefill queued there: what TTFT waits for), then headroom.
Stats are a second old at most; what this router sent to a replica since its last report is added to
that replica's demand and waiting count (PendingBook), so a burst does not all land on one replica.
`rank_replicas` holds the rule and needs no Ray.
"""
from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

from serve_app.messages import GenerateRequest

DEFAULT_MAX_TOKENS_GUESS = 256  # a request without max_tokens is assumed to want this many
CHARS_PER_TOKEN = 4  # the router does not tokenize; a text prompt is estimated at this rate
FINGERPRINT_CHARS = 256


def routing_stats(stats: Any, waiting: int, max_waiting: int, prefixes: Sequence[str],
                  reported_at: float) -> dict[str, Any]:
    """What a replica reports to the router (record_routing_stats), from an engine.llm_engine.EngineStats
    snapshot; the simulator (bench/autoscale_sim.py) reports through this same function."""
    return {"free_blocks": stats.num_free_blocks, "used_blocks": stats.num_used_blocks,
            "demand_blocks": stats.kv_demand_blocks, "waiting": waiting, "max_waiting": max_waiting,
            "block_size": stats.block_size, "prefixes": list(prefixes), "reported_at": reported_at}


def prefix_fingerprint(req: GenerateRequest) -> str | None:
    """A stable key for the start of a request's prompt (the part that becomes its first cached blocks)."""
    if req.kind == "chat":
        head = json.dumps((req.messages or [])[:2], sort_keys=True)[:FINGERPRINT_CHARS]
    else:
        prompt = req.prompt
        if isinstance(prompt, str):
            head = prompt[:FINGERPRINT_CHARS]
        elif isinstance(prompt, list):
            head = json.dumps(prompt[: FINGERPRINT_CHARS // CHARS_PER_TOKEN])
        else:
            return None
    if len(head) < FINGERPRINT_CHARS // 2:
        return None  # too short to share a full block worth caring about
    return hashlib.blake2b(head.encode(), digest_size=8).hexdigest()


def estimate_blocks(req: GenerateRequest, block_size: int) -> int:
    """Blocks one request will hold at its end, from the request alone."""
    prompt = req.prompt
    if isinstance(prompt, list):
        prompt_tokens = len(prompt)
    elif isinstance(prompt, str):
        prompt_tokens = len(prompt) // CHARS_PER_TOKEN + 1
    else:
        prompt_tokens = len(json.dumps(req.messages or [])) // CHARS_PER_TOKEN + 1
    sampling = req.sampling
    out = sampling.get("max_tokens") or DEFAULT_MAX_TOKENS_GUESS
    n = sampling.get("n", 1) or 1
    return -(-(prompt_tokens + out * n) // block_size)


@dataclass(frozen=True)
class ReplicaView:
    key: Any  # whatever identifies the replica to the caller
    free_blocks: float
    held_blocks: float
    demand_blocks: float
    waiting: float
    max_waiting: float
    prefixes: frozenset[str]

    def headroom(self, need: int) -> float:
        still_to_claim = max(0.0, self.demand_blocks - self.held_blocks)
        return self.free_blocks - still_to_claim - need

    @property
    def is_full(self) -> bool:
        return self.waiting >= self.max_waiting

    def takes(self, need: int) -> bool:
        return not self.is_full and (self.waiting == 0 or self.headroom(need) >= 0)


def rank_replicas(views: Sequence[ReplicaView], need_blocks: int, fingerprint: str | None,
                  rng: random.Random) -> list[list[Any]]:
    """Ranks of replica keys, most preferred first; [] when no replica should take the request now."""
    open_views = [v for v in views if v.takes(need_blocks)]
    if not open_views:
        return []
    if fingerprint is not None:
        warm = [v for v in open_views if fingerprint in v.prefixes and v.headroom(need_blocks) >= 0]
        if warm:
            best = max(warm, key=lambda v: v.headroom(need_blocks))
            rest = sorted((v for v in open_views if v is not best), key=lambda v: -v.headroom(need_blocks))
            return [[best.key]] + [[v.key] for v in rest]
    pair = rng.sample(list(open_views), 2) if len(open_views) >= 2 else list(open_views)
    pair.sort(key=lambda v: (v.headroom(need_blocks) < 0, v.waiting, -v.headroom(need_blocks)))
    others = [v for v in open_views if v not in pair]
    others.sort(key=lambda v: -v.headroom(need_blocks))
    return [[v.key] for v in pair] + [[v.key] for v in others]


class PendingBook:
    """What this router sent to each replica since that replica's last stats report."""

    def __init__(self) -> None:
        self._entries: dict[Any, list] = {}  # key -> [report stamp, blocks, requests]

    def _entry(self, key: Any, stamp: Any) -> list:
        entry = self._entries.get(key)
        if entry is None or entry[0] != stamp:
            entry = self._entries[key] = [stamp, 0, 0]
        return entry

    def view(self, key: Any, stats: dict[str, Any] | None,
             like: dict[str, Any] | None = None) -> ReplicaView | None:
        """The replica as last reported plus what was sent since. A replica that has not reported yet
        (just started, so empty) is taken to be an empty one shaped `like` a reporting peer, if any."""
        if not stats or "free_blocks" not in stats:
            if not like:
                return None
            stats = {"free_blocks": like["free_blocks"] + like["used_blocks"], "used_blocks": 0,
                     "demand_blocks": 0, "waiting": 0, "max_waiting": like["max_waiting"], "reported_at": None}
        _, blocks, requests = self._entry(key, stats.get("reported_at"))
        return ReplicaView(key=key, free_blocks=stats["free_blocks"], held_blocks=stats["used_blocks"],
                           demand_blocks=stats["demand_blocks"] + blocks, waiting=stats["waiting"] + requests,
                           max_waiting=stats["max_waiting"], prefixes=frozenset(stats.get("prefixes", ())))

    def note(self, key: Any, stats: dict[str, Any] | None, blocks: int) -> None:
        entry = self._entry(key, (stats or {}).get("reported_at"))
        entry[1] += blocks
        entry[2] += 1

    def forget_missing(self, keys: Sequence[Any]) -> None:
        for key in set(self._entries) - set(keys):
            del self._entries[key]


class KVRouting:
    """The routing state and decision without Ray: KVAwareRouter and bench/autoscale_sim.py both use it."""

    def __init__(self, seed: Any = None) -> None:
        self.rng = random.Random(seed)
        self.book = PendingBook()

    def choose(self, candidates: Sequence[tuple[Any, dict[str, Any] | None]], need: int,
               fingerprint: str | None) -> list[list[Any]]:
        """candidates: (key, routing stats or None). Ranks of keys; the first choice is booked."""
        self.book.forget_missing([key for key, _ in candidates])
        like = next((stats for _, stats in candidates if stats and "free_blocks" in stats), None)
        views, unknown = [], []
        for key, stats in candidates:
            v = self.book.view(key, stats, like)
            (views.append(v) if v is not None else unknown.append(key))
        if unknown:  # nobody has reported yet (the deployment just started): any of them
            self.rng.shuffle(unknown)
            return [[key] for key in unknown]
        ranks = rank_replicas(views, need, fingerprint, self.rng)
        if ranks:  # Ray tries the first rank first; count it there (a retry elsewhere is rare)
            first = ranks[0][0]
            self.book.note(first, dict(candidates)[first], need)
        return ranks


class KVAwareRouter(FIFOMixin, RequestRouter):
    """Ray Serve request router for the engine deployment; runs in the caller (ingress) process.

    FIFO: a chosen replica goes to the oldest pending request. Without it Ray matches the choice to the
    request by its internal id, which the n handle calls of one HTTP request (a prompt list) share, and
    all but one of them would wait forever.
    """

    def initialize_state(self, **kwargs: Any) -> None:
        self._routing = KVRouting(kwargs.get("seed"))

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not hasattr(self, "_routing"):
            self.initialize_state()
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True  # every replica was a candidate: back off
        req = pending_request.args[0] if pending_request and pending_request.args else None
        if not isinstance(req, GenerateRequest):  # not a generate call (none other is routed here today)
            req = GenerateRequest("", "completion", {}, prompt="")
        block_size = int(next((r.routing_stats.get("block_size", 16) for r in candidate_replicas
                               if r.routing_stats), 16))
        by_id = {r.replica_id: r for r in candidate_replicas}
        ranks = self._routing.choose([(r.replica_id, r.routing_stats) for r in candidate_replicas],
                                     estimate_blocks(req, block_size), prefix_fingerprint(req))
        return [[by_id[key] for key in rank] for rank in ranks]
