"""RL rollout control of a running kvscale app: push policy weights to every replica, pause, resume, sleep.

From any Ray driver or actor in the cluster (a trainer):

    from serve_app import rl
    rl.update_weights(policy.state_dict(), version=3)   # HF-named tensors, or a safetensors path
    rl.pause("keep"); rl.resume(); rl.sleep(1); rl.wake_up(); rl.version()

How. The app's policy store (a named, detached Ray actor) holds the fleet's desired state: the weight updates
since the last full one (each a Ray object the store owns, which every replica pulls, or a safetensors path every
replica can read), the pause mode and the sleep level. Every engine replica follows it (PolicyFollower): once at start,
before Serve routes it a request, and then every REPORT_INTERVAL_S. So a replica the autoscaler starts, or
that Serve restarts after a crash, serves the latest pushed version, not the checkpoint on disk. Each call
here changes the store, then waits until every live replica reports that it has followed.

A payload is checked on one replica before it is published (all replicas run the same model): a bad one
raises ValueError naming the parameter, and no replica changes. The store outlives the app (it is detached)
until reset() or the Ray cluster stops, so a redeployed app of the same name serves the latest pushed version.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

import ray

from engine.async_llm import check_pause_mode
from engine.llm_engine import check_sleep_level
from serve_app.metrics import BOARD_NAMESPACE, board_name

logger = logging.getLogger(__name__)

ENGINE_DEPLOYMENT = "KVEngine"
FRESH_S = 3.0  # a replica whose last report is older than this is not waited for


def store_name(app_name: str) -> str:
    return f"policy-store-{app_name}"


@ray.remote(num_cpus=0)
class PolicyStore:
    """The fleet's desired policy state. Replicas read it; the functions below write it."""

    def __init__(self) -> None:
        self.updates: list[dict[str, Any]] = []  # since the last full update, oldest first
        self.next_seq = 1
        self.pause: str | None = None
        self.sleep = 0

    def publish(self, version: Any, source: list | str, partial: bool, pause: str) -> int:
        """source: [ObjectRef] (owned by this actor) or a safetensors path. Returns the update's number."""
        update = {"seq": self.next_seq, "version": version, "source": source, "partial": partial, "pause": pause}
        self.next_seq += 1
        self.updates = [*self.updates, update] if partial else [update]  # a full update makes the rest moot
        return update["seq"]

    def hold(self, weights: dict[str, Any]) -> list:
        """Put a payload in Ray's object store owned by this actor, so it outlives the trainer that sent it;
        returns [its ref] (in a list, so that passing it on does not resolve it)."""
        return [ray.put(weights)]

    def set_pause(self, mode: str | None) -> None:
        self.pause = mode

    def set_sleep(self, level: int) -> None:
        self.sleep = level

    def desired(self) -> dict[str, Any]:
        return {"updates": self.updates, "pause": self.pause, "sleep": self.sleep,
                "version": self.updates[-1]["version"] if self.updates else None}


def _store(app_name: str, create: bool = False):
    if create:
        return PolicyStore.options(name=store_name(app_name), namespace=BOARD_NAMESPACE, lifetime="detached",
                                   get_if_exists=True).remote()
    try:
        return ray.get_actor(store_name(app_name), namespace=BOARD_NAMESPACE)
    except ValueError:
        return None


# ---- the trainer's side ----
def update_weights(weights: Mapping[str, Any] | str, *, version: Any, app_name: str = "kvscale",
                   pause: str = "abort", partial: bool = False, timeout_s: float = 600.0) -> dict[str, Any]:
    """Push new policy weights to every replica of `app_name`, now and later. weights: HF-named tensors (put in
    Ray's object store once; every replica pulls them) or a path to safetensors files the replicas can read.
    pause: what in-flight requests do, "abort" (end with finish_reason abort), "wait" (finish first, new ones
    are held) or "keep" (frozen, then go on with the new weights, their KV recomputed). partial: only some
    parameters (otherwise every one must be given). Returns {"version", "replicas", "seconds", "bytes"}: bytes
    of tensors pushed (0 for a path) and the seconds from the call until every replica serves the version."""
    check_pause_mode(pause)
    if not isinstance(weights, (str, Mapping)):
        raise TypeError(f"weights must be a dict of name -> tensor or a safetensors path; got {type(weights).__name__}")
    start = time.monotonic()
    store = _store(app_name, create=True)
    if ray.get(store.desired.remote())["sleep"]:
        raise RuntimeError(f"app {app_name!r} is asleep; wake_up() before updating its weights")
    if isinstance(weights, str):
        source: list | str = weights
        size = 0
    else:
        source = ray.get(store.hold.remote(dict(weights)))  # the store owns the copy: it outlives this caller
        size = sum(t.numel() * t.element_size() for t in weights.values())
    engine = _engine_handle(app_name)
    try:
        engine.check_weights.remote(source, partial).result(timeout_s=timeout_s)
    except Exception as e:
        raise ValueError(f"the weights were refused, and no replica changed: {_cause(e)}") from None
    seq = ray.get(store.publish.remote(version, source, partial, pause))
    replicas = _wait(app_name, lambda p: p["policy_seq"] >= seq or p.get("policy_error_seq") == seq, timeout_s,
                     f"version {version!r}")
    failed = {r: p["policy_error"] for r, p in replicas.items() if p.get("policy_error_seq") == seq}
    if failed:
        raise RuntimeError(f"replicas failed to load version {version!r}: {failed}")
    return {"version": version, "replicas": len(replicas), "seconds": time.monotonic() - start, "bytes": size}


def pause(mode: str = "abort", *, app_name: str = "kvscale", timeout_s: float = 600.0) -> None:
    """Every replica stops taking requests (new ones get 503 with Retry-After): "abort" ends the in-flight
    ones, "wait" lets them finish (returns once they have), "keep" freezes them, KV kept, until resume()."""
    check_pause_mode(mode)
    ray.get(_store(app_name, create=True).set_pause.remote(mode))
    _wait(app_name, lambda p: p["paused"] == mode and (mode != "wait" or p["running"] == 0), timeout_s,
          f"pause({mode!r})")


def resume(*, app_name: str = "kvscale", timeout_s: float = 600.0) -> None:
    ray.get(_store(app_name, create=True).set_pause.remote(None))
    _wait(app_name, lambda p: p["paused"] is None, timeout_s, "resume()")


def sleep(level: int = 1, *, app_name: str = "kvscale", timeout_s: float = 600.0) -> None:
    """Every replica frees its KV pool (level 1) or its KV pool and weights (level 2); in-flight requests are
    aborted and new ones get 503 until wake_up()."""
    check_sleep_level(level)
    ray.get(_store(app_name, create=True).set_sleep.remote(level))
    _wait(app_name, lambda p: p["sleep_level"] == level, timeout_s, f"sleep({level})")


def wake_up(*, app_name: str = "kvscale", timeout_s: float = 600.0) -> None:
    ray.get(_store(app_name, create=True).set_sleep.remote(0))
    _wait(app_name, lambda p: p["sleep_level"] == 0 and p["policy_seq"] >= p.get("policy_target", 0), timeout_s,
          "wake_up()")


def version(*, app_name: str = "kvscale") -> dict[str, Any]:
    """{"version": the latest pushed (None: the checkpoint on disk), "replicas": {replica id: its version}}."""
    store = _store(app_name)
    latest = ray.get(store.desired.remote())["version"] if store is not None else None
    return {"version": latest, "replicas": {r: p["model_version"] for r, p in _policies(app_name).items()}}


def reset(*, app_name: str = "kvscale") -> None:
    """Forget every pushed update (the store goes): replicas started from now on load the checkpoint on disk."""
    store = _store(app_name)
    if store is not None:
        ray.kill(store)


def _engine_handle(app_name: str):
    from ray import serve

    return serve.get_deployment_handle(ENGINE_DEPLOYMENT, app_name)


def _policies(app_name: str) -> dict[str, dict]:
    board = ray.get_actor(board_name(app_name), namespace=BOARD_NAMESPACE)
    return {r: s["policy"] for r, s in ray.get(board.get_all.remote(FRESH_S)).items() if "policy" in s}


def _running_replicas(app_name: str) -> int:
    """How many engine replicas Serve counts as running (0 when it cannot say)."""
    try:
        from ray import serve

        states = serve.status().applications[app_name].deployments[ENGINE_DEPLOYMENT].replica_states
        return int(states.get("RUNNING", 0))
    except Exception:
        return 0


def _wait(app_name: str, done, timeout_s: float, what: str) -> dict[str, dict]:
    """Until every live replica's policy report satisfies done: at least as many as Serve counts running (a
    replica busy loading weights still reports, so none drops out of the count), and at least one."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            policies = _policies(app_name)
        except ValueError:  # no board yet: the app is still starting
            policies = {}
        if (policies and all(done(p) for p in policies.values())
                and len(policies) >= _running_replicas(app_name)):
            return policies
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: after {timeout_s:.0f} s not every replica of {app_name!r} has followed: "
                               f"{policies}")
        time.sleep(0.2)


def _cause(e: BaseException) -> str:
    """The replica's own error message from a Ray-wrapped exception."""
    cause = getattr(e, "cause", None) or e
    return f"{type(cause).__name__}: {cause}"


# ---- the replica's side ----
class PolicyFollower:
    """Brings one replica's AsyncLLM to the store's desired state, one change at a time. follow() runs on the
    replica's reporting thread and never blocks it on a slow change (an update waiting for requests to finish):
    it starts the change and looks at it again on the next call; follow(block=True), in the replica's
    constructor, returns once the replica is where the store says. report() is what it tells the board."""

    def __init__(self, llm: Any, app_name: str) -> None:
        self.llm, self.app_name = llm, app_name
        self.applied_seq = 0  # the last update this replica loaded
        self.target_seq = 0  # the last update the store holds
        self.error: str | None = None
        self.error_seq = 0
        self._busy: tuple[str, Any, dict | None] | None = None  # (what, its future, the update) in progress

    def follow(self, block: bool = False) -> None:
        while True:
            if self._busy is not None:
                if block:
                    self._busy[1].exception()  # waits
                elif not self._busy[1].done():
                    return
                busy, self._busy = self._busy, None
                self._finish(*busy)  # may start the next part of the same change (fetched -> load)
                if self._busy is not None:
                    continue
            self._step()
            if self._busy is None or not block:
                return

    def _load(self, weights: Any, update: dict) -> None:
        self._busy = ("update", self.llm.update_weights(weights, update["version"], update["pause"],
                                                        update["partial"]), update)

    def _finish(self, what: str, future: Any, update: dict | None) -> None:
        error = future.exception()
        if what == "fetch":
            if error is None:
                self._load(future.result(), update)
                return
            what = "update"
        if what != "update":
            if error is not None:
                logger.error("kvscale: %s failed: %s", what, error)
            return
        if error is None:
            self.applied_seq = update["seq"]
            logger.info("kvscale: now serving policy version %r", update["version"])
        else:  # checked before publishing, so this is rare: report it, do not retry it
            logger.error("kvscale: could not load policy version %r: %s", update["version"], error)
            self.error, self.error_seq = f"{type(error).__name__}: {error}", update["seq"]

    def _step(self) -> None:
        """Start the first change the store asks for that this replica has not made."""
        if not ray.is_initialized():  # outside a Ray process: no store to follow (and starting Ray is not ours)
            return
        store = _store(self.app_name)
        if store is None:
            return
        desired = ray.get(store.desired.remote(), timeout=30)
        llm = self.llm
        updates = desired["updates"]
        self.target_seq = updates[-1]["seq"] if updates else 0
        if desired["sleep"] == 0 and llm.sleep_level:
            if llm.sleep_level == 2:  # the weights come back from the checkpoint: load the pushed chain again
                self.applied_seq = 0
            self._busy = ("wake_up", llm.wake_up(), None)
            return
        if not llm.sleep_level:
            for update in updates:
                if update["seq"] > max(self.applied_seq, self.error_seq):
                    source = update["source"]
                    if isinstance(source, list):  # pulled without blocking the reports: loaded on a later call
                        self._busy = ("fetch", source[0].future(), update)
                    else:
                        self._load(source, update)
                    return
        mode = desired["pause"]
        if mode != llm.paused:
            self._busy = (f"pause({mode!r})", llm.resume() if mode is None else llm.pause(mode), None)
            return
        if desired["sleep"] and not llm.sleep_level:
            self._busy = (f"sleep({desired['sleep']})", llm.sleep(desired["sleep"]), None)

    def report(self, num_running: int) -> dict[str, Any]:
        return {"model_version": self.llm.model_version, "policy_seq": self.applied_seq,
                "policy_target": self.target_seq, "paused": self.llm.paused, "sleep_level": self.llm.sleep_level,
                "running": num_running, "policy_error": self.error, "policy_error_seq": self.error_seq}
