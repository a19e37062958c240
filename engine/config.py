"""EngineConfig: every knob of the engine in one validated, typed place, documented here only.

`LLM(**kwargs)` and `AsyncLLM(**kwargs)` take these fields; the serve config (serve_app/config.py) holds
one of these as its `engine` field instead of declaring them again.
"""
from __future__ import annotations

from dataclasses import dataclass

DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30  # 1 GiB of KV on CPU unless told otherwise
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9


@dataclass
class EngineConfig:
    model: str = "default"  # a local HF folder (config.json + safetensors + tokenizer), or "default" (SmolLM2-135M)
    dtype: str = "auto"  # "auto" | "float32" | "bfloat16" | "float16"; auto: bf16 where the device has it
    device: str = "auto"  # "auto" | "cpu" | "cuda" | "cuda:N"
    block_size: int = 16  # tokens per KV block
    num_kv_blocks: int | None = None  # KV pool size in blocks; None: size the pool from the memory budget
    max_num_seqs: int = 256  # most sequences running in one step
    max_num_batched_tokens: int = 2048  # token budget of one step (prefills are chunked by it)
    max_model_len: int | None = None  # longest prompt + output; None: min(model's max positions, KV pool tokens)
    enable_prefix_caching: bool = True  # reuse KV blocks of shared prompt prefixes
    # what the KV pool stores: "auto" (the model's dtype) | "fp8_e4m3" | "fp8_e5m2" (1 byte an element, per-layer
    # scales calibrated at start-up: kernels/kv_cache.py); "fp8" means fp8_e4m3
    kv_cache_dtype: str = "auto"
    # sliding-window layers give back KV blocks behind their window while a sequence runs, with a block table
    # per layer group where sliding and full layers mix (engine/kv_groups.py). False keeps every block (windows
    # still mask attention): the comparison point for benchmarks, and a way out should the grouping misbehave
    free_out_of_window_blocks: bool = True
    # each request's tokens and logprobs bit-identical whether it runs alone or in any batch, however its prompt
    # is chunked or cached (RL rollouts, reproducible evals): every linear layer and attention call sums in one
    # fixed order (kernels.batch_invariant_ops). Slower (bench/batch_invariant.py); sampled requests also need a
    # `seed` to draw the same noise, greedy ones do not
    batch_invariant: bool = False
    seed: int = 0  # seed of the sampler for unseeded requests
    kv_cache_bytes: int | None = None  # CPU budget for the KV pool; None: DEFAULT_CPU_KV_CACHE_BYTES
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION  # CUDA: fraction of the device's memory
    attention_backend: str = "auto"  # "auto" | "reference" (plain torch) | "cpu" (C kernels + oneDNN + SDPA) | "triton"
    enforce_eager: bool = False  # CUDA: run decode steps eagerly, no CUDA graphs (CPU steps are always eager)
    show_progress: bool = True  # progress bar while loading weights
    # benchmarks only (bench/stream_capacity.py): each step sleeps this long instead of running the model and
    # samples a fixed token, so the scheduler, block manager, detokenizer and serving path carry a known load
    fake_step_s: float | None = None
    fake_step_s_per_token: float = 0.0  # ... plus this per token computed, so a fake step's cost grows with load

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be one of auto, float32, bfloat16, float16; got {self.dtype!r}")
        if self.kv_cache_dtype == "fp8":
            self.kv_cache_dtype = "fp8_e4m3"
        if self.kv_cache_dtype not in ("auto", "fp8_e4m3", "fp8_e5m2"):
            raise ValueError(f"kv_cache_dtype must be one of auto, fp8, fp8_e4m3, fp8_e5m2; got {self.kv_cache_dtype!r}")
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N; got {self.device!r}")
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be one of 8, 16, 32, 64, 128; got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1 or None; got {self.num_kv_blocks}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1; got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1; got {self.max_num_batched_tokens}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2 or None; got {self.max_model_len}")
        if self.fake_step_s is not None and self.fake_step_s < 0:
            raise ValueError(f"fake_step_s must be >= 0 or None; got {self.fake_step_s}")
        if self.fake_step_s_per_token < 0:
            raise ValueError(f"fake_step_s_per_token must be >= 0; got {self.fake_step_s_per_token}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes < 1:
            raise ValueError(f"kv_cache_bytes must be positive or None; got {self.kv_cache_bytes}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1]; got {self.gpu_memory_utilization}")
        if self.attention_backend not in ("auto", "reference", "cpu", "triton"):
            raise ValueError(f"attention_backend must be auto, reference, cpu or triton; got "
                             f"{self.attention_backend!r}" + (" ('torch' is now 'cpu', or 'reference' for plain "
                                                              "torch)" if self.attention_backend == "torch" else ""))
