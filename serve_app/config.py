"""ServeConfig: every setting of the app, engine and deployments, one documented pydantic model.

`serve run serve_app/config.yaml` passes its `args:` here; `serve run serve_app:app` uses the defaults.
`to_engine_config()` is the one place it becomes the engine's EngineConfig.
"""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from engine.config import EngineConfig


class ServeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    # ---- engine ----
    model: str = Field("default", description="Local HF folder (config.json + safetensors + tokenizer), or "
                                              "'default' for the bundled SmolLM2-135M-Instruct.")
    served_model_name: str | None = Field(None, description="Name clients send as `model`; default: the folder "
                                                            "name, or SmolLM2-135M-Instruct for the default.")
    dtype: str = Field("auto", description="auto | float32 | bfloat16 | float16.")
    device: str = Field("auto", description="auto | cpu | cuda | cuda:N.")
    block_size: int = Field(16, description="Tokens per KV block.")
    num_kv_blocks: int | None = Field(None, description="KV pool size in blocks per replica; None: from memory.")
    kv_cache_bytes: int | None = Field(None, description="CPU only: bytes for the KV pool (default 1 GiB).")
    gpu_memory_utilization: float = Field(0.9, description="CUDA only: fraction of free memory to use.")
    max_num_seqs: int = Field(256, description="Most sequences running in one step.")
    max_num_batched_tokens: int = Field(2048, description="Token budget of one step (chunked prefill).")
    max_model_len: int | None = Field(None, description="Longest prompt + output; None: model and pool limit.")
    enforce_eager: bool = Field(False, description="CUDA: run decode steps eagerly instead of replaying CUDA "
                                                   "graphs (CPU steps are always eager).")
    enable_prefix_caching: bool = Field(True, description="Reuse KV blocks of shared prompt prefixes.")
    seed: int = Field(0, description="Seed of the engine's sampler for unseeded requests.")
    torch_threads: int | None = Field(None, description="CPU threads for torch in each replica; None: torch default.")

    # ---- API ----
    api_key: str | None = Field(None, description="If set, every /v1 route needs `Authorization: Bearer <key>`.")
    max_request_body_bytes: int = Field(4 << 20, description="Larger request bodies get 413.")
    max_waiting_requests: int = Field(512, description="A replica with this many requests not yet at their first "
                                                       "token gets no more; each ingress holds at most this many "
                                                       "more for a replica with room, the rest get 503 with "
                                                       "Retry-After.")
    max_prompts_per_request: int = Field(64, description="Most prompts in one /v1/completions list.")
    max_n: int = Field(16, description="Largest `n` a request may ask for.")

    # ---- deployments ----
    num_replicas: int | None = Field(1, description="Fixed engine replicas; None: autoscale between the limits.")
    min_replicas: int = Field(1, description="Autoscaling lower bound (0 allowed: cold starts on first request).")
    max_replicas: int = Field(4, description="Autoscaling upper bound.")
    kv_target_utilization: float = Field(0.75, gt=0.0, le=1.0, description="Autoscaling aims for projected KV "
                                                                            "demand at this fraction of capacity.")
    downscale_quiet_s: float = Field(30.0, ge=0.0, description="Scale down only after this long without KV "
                                                               "pressure (waiting requests, preemptions).")
    engine_num_cpus: float = Field(1.0, description="CPUs Ray reserves for each engine replica.")
    engine_num_gpus: float = Field(0.0, description="GPUs Ray reserves for each engine replica.")
    ingress_num_cpus: float = Field(0.0, description="CPUs Ray reserves for the HTTP ingress.")
    graceful_shutdown_timeout_s: float = Field(120.0, description="How long a replica being removed keeps serving "
                                                                  "its in-flight streams.")
    max_ongoing_requests: int = Field(1024, description="Ray Serve's per-replica cap on in-flight requests.")

    @model_validator(mode="after")
    def _check(self) -> ServeConfig:
        self.to_engine_config()  # raises ValueError naming the bad field
        if self.min_replicas < 0 or self.max_replicas < max(1, self.min_replicas):
            raise ValueError("need 0 <= min_replicas <= max_replicas and max_replicas >= 1")
        return self

    def to_engine_config(self) -> EngineConfig:
        return EngineConfig(
            model=self.model, dtype=self.dtype, device=self.device, block_size=self.block_size,
            num_kv_blocks=self.num_kv_blocks, kv_cache_bytes=self.kv_cache_bytes,
            gpu_memory_utilization=self.gpu_memory_utilization, max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens, max_model_len=self.max_model_len,
            enable_prefix_caching=self.enable_prefix_caching, seed=self.seed, show_progress=False,
            enforce_eager=self.enforce_eager,
        )

    @property
    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        if self.model in ("", "default"):
            from engine.default_model import DEFAULT_MODEL_NAME

            return DEFAULT_MODEL_NAME
        return self.model.rstrip("/").split("/")[-1]
