"""ServeConfig: every setting of the app, engine and deployments, one documented pydantic model.

`serve run serve_app/config.yaml` passes its `args:` here; `serve run serve_app:app` uses the defaults.
The engine's settings are not declared here again: `engine` is the engine's own EngineConfig (validated by
its __post_init__), and its fields may be written flat in the YAML. `to_engine_config()` is the one place
the engine's config is handed over.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from engine.config import EngineConfig
from serve_app.autoscaling import SLO, default_slo


ENGINE_FIELDS = frozenset(f.name for f in dataclasses.fields(EngineConfig))


class ServeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    # ---- engine ----
    engine: EngineConfig = Field(default_factory=EngineConfig, description=(
        "The engine's settings: every field of engine/config.py:EngineConfig (model, dtype, device, block_size, "
        "num_kv_blocks, kv_cache_bytes, max_num_seqs, max_num_batched_tokens, max_model_len, ...), documented "
        "there. They may also be given flat, beside the fields below, as serve_app/config.yaml does."))
    served_model_name: str | None = Field(None, description="Name clients send as `model`; default: the folder "
                                                            "name, or SmolLM2-135M-Instruct for the default.")
    stream_interval_s: float = Field(0.05, ge=0.0, description="Each stream's tokens leave the engine replica at most "
                                                                "this often, those of the steps between merged into "
                                                                "one message (the first token is never held): fewer "
                                                                "messages through Ray at high token rates. 0: every "
                                                                "step's tokens as their own message.")
    stream_max_messages_per_s: float | None = Field(
        250.0, gt=0.0, description="All of a replica's streams together send at most about this many messages a "
        "second: with n streams live, each waits at least n / this between messages (max with stream_interval_s), "
        "its tokens merged. Every message costs CPU in the replica, the ingress and the proxy (about 1.5 ms in all "
        "on this project's 2-core machine, where they carried at most about 1,000 a second); past that they queue "
        "and tokens reach clients long after they were made. None: no budget.")
    torch_threads: int | None = Field(None, description="CPU threads for torch (and our C kernels) in each replica; "
                                                        "None: every core the replica's process may run on (Ray "
                                                        "would otherwise cap it at the replica's num_cpus).")

    # ---- API ----
    api_key: str | None = Field(None, description="If set, every /v1 route needs `Authorization: Bearer <key>`.")
    max_request_body_bytes: int = Field(4 << 20, description="Larger request bodies get 413.")
    max_waiting_requests: int = Field(512, description="A replica with this many requests not yet at their first "
                                                       "token gets no more; each ingress holds at most this many "
                                                       "more for a replica with room, the rest get 503 with "
                                                       "Retry-After.")
    max_prompts_per_request: int = Field(64, description="Most prompts in one /v1/completions list.")
    max_n: int = Field(16, description="Largest `n` a request may ask for.")
    admin_api: bool = Field(False, description="Serve the RL admin routes (/admin/update_weights, pause, resume, "
                                               "sleep, wake_up, version: serve_app/rl.py) for trainers outside "
                                               "Ray; they need the API key like every route when one is set.")

    # ---- deployments ----
    num_replicas: int | None = Field(1, description="Fixed engine replicas; None: autoscale between the limits.")
    min_replicas: int = Field(1, description="Autoscaling lower bound (0 allowed: cold starts on first request).")
    max_replicas: int = Field(4, description="Autoscaling upper bound.")
    kv_target_utilization: float = Field(0.75, gt=0.0, le=1.0, description="Autoscaling aims for projected KV "
                                                                            "demand at this fraction of capacity.")
    downscale_quiet_s: float = Field(30.0, ge=0.0, description="Scale down only after this long without "
                                                               "pressure (requests waiting for KV, preemptions, "
                                                               "observed latency over the SLO).")
    downscale_window_s: float = Field(900.0, ge=0.0, description="Never scale below the most replicas the sustained "
                                                                 "load needed over this long (its mean rate, and its "
                                                                 "bursts computed within the TTFT SLO), and hold the "
                                                                 "fleet this long after start: bursts that recur "
                                                                 "within it find their replicas up.")
    ttft_slo_s: float | None = Field(None, gt=0.0, description="Time-to-first-token SLO (from arrival at the ingress) "
                                                               "the autoscaler sizes for, met by 99 % of requests; "
                                                               "None: 1 s on a GPU, 5 s on a CPU.")
    itl_slo_s: float | None = Field(None, gt=0.0, description="SLO on each request's mean inter-token latency, met by "
                                                              "99 % of requests; None: 0.05 s on a GPU, 0.25 s on a "
                                                              "CPU.")
    replica_startup_s: float = Field(30.0, ge=0.0, description="Start-up time of a new replica the arrival forecast "
                                                               "looks ahead by, until the policy has measured this "
                                                               "deployment's own.")
    engine_num_cpus: float = Field(1.0, description="CPUs Ray reserves for each engine replica.")
    engine_num_gpus: float = Field(0.0, description="GPUs Ray reserves for each engine replica.")
    ingress_num_cpus: float = Field(0.0, description="CPUs Ray reserves for the HTTP ingress.")
    graceful_shutdown_timeout_s: float = Field(120.0, description="How long a replica being removed keeps serving "
                                                                  "its in-flight streams.")
    max_ongoing_requests: int = Field(1024, description="Ray Serve's per-replica cap on in-flight requests.")

    @model_validator(mode="before")
    @classmethod
    def _nest_engine_fields(cls, data: Any) -> Any:
        """Engine fields given flat (`model: default` beside `num_replicas: 1`) go into `engine`."""
        if not isinstance(data, dict):
            return data
        engine = data.get("engine") or {}
        engine = dataclasses.asdict(engine) if isinstance(engine, EngineConfig) else dict(engine)
        unknown = sorted(engine.keys() - ENGINE_FIELDS)
        if unknown:
            raise ValueError(f"engine: unknown field(s) {', '.join(unknown)}; the engine's fields are those of "
                             "engine/config.py:EngineConfig")
        if not ENGINE_FIELDS & data.keys():
            return data
        both = sorted(ENGINE_FIELDS & data.keys() & engine.keys())
        if both:
            raise ValueError(f"{', '.join(both)} given both flat and under `engine`; give each once")
        rest = {k: v for k, v in data.items() if k not in ENGINE_FIELDS}
        return {**rest, "engine": {**engine, **{k: data[k] for k in ENGINE_FIELDS & data.keys()}}}

    @model_validator(mode="after")
    def _check(self) -> ServeConfig:
        if self.min_replicas < 0 or self.max_replicas < max(1, self.min_replicas):
            raise ValueError("need 0 <= min_replicas <= max_replicas and max_replicas >= 1")
        return self

    def slo(self) -> SLO:
        """The latency SLO the autoscaler sizes for: the configured one, else the device's default."""
        default = default_slo(self.engine_num_gpus > 0 or self.engine.device.startswith("cuda"))
        return SLO(self.ttft_slo_s or default.ttft_s, self.itl_slo_s or default.itl_s)

    def to_engine_config(self) -> EngineConfig:
        return dataclasses.replace(self.engine, show_progress=False)  # no progress bars in replica logs

    @property
    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        model = self.engine.model
        if model in ("", "default"):
            from engine.default_model import DEFAULT_MODEL_NAME

            return DEFAULT_MODEL_NAME
        return model.rstrip("/").split("/")[-1]
