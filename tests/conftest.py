"""Shared fixtures: tiny random HF checkpoints (fixed seed) saved as real safetensors folders, with the
default model's real tokenizer beside them, so the engine loads them exactly as it loads a real model."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

if os.environ.get("KVSCALE_KERNEL_DEVICE") != "cuda":
    # Triton kernels run in Triton's CPU interpreter, on CPU tensors, GPU or not: the suite is the same on
    # every machine. Must be set before triton.jit decorates anything, i.e. before kernels.triton_ops is
    # imported, which is why it is here. scripts/gpu_check.sh sets KVSCALE_KERNEL_DEVICE=cuda to run
    # tests/test_kernels.py's kernels compiled, on the GPU.
    os.environ.setdefault("TRITON_INTERPRET", "1")

# End-to-end modules that run their apps on one local cluster, one after another (tests/helpers.py:local_serve
# with share=True). They run after every other module, in their usual order, so the cluster they share never
# sits idle beside other tests.
SHARES_CLUSTER = ("test_openai_surface_e2e.py", "test_reliability_e2e.py", "test_rl_e2e.py", "test_serve_e2e.py")


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.path.name in SHARES_CLUSTER)  # stable: the order within each group stays


@pytest.fixture(scope="session", autouse=True)
def _stop_the_shared_cluster():
    yield
    import helpers

    helpers.stop_shared()


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


@pytest.fixture(scope="session")
def default_model_path() -> str:
    from engine.default_model import default_model_dir

    return default_model_dir()


def _hf_config(arch: str, **overrides):
    import transformers

    base = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
                initializer_range=0.1, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
           "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config,
           "gemma3": transformers.Gemma3TextConfig, "qwen3_5": transformers.Qwen3_5TextConfig}[arch]
    if arch == "mistral":
        base["sliding_window"] = None
    if arch == "gemma3":  # the 270M's shape in small: MQA, a wide head, 2 sliding layers to 1 full
        base.update(num_hidden_layers=3, num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=24,
                    sliding_window=12, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                    rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                     "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}},
                    tie_word_embeddings=True, initializer_range=0.02)
    if arch == "qwen3_5":  # the hybrid in small: Gated DeltaNet layers around gated full attention
        base.update(num_hidden_layers=4, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                    linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
                    layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
                    initializer_range=0.05)
    base.update(overrides)
    return cls(**base)


@pytest.fixture(scope="session")
def make_tiny_model(tmp_path_factory, default_model_path):
    """make_tiny_model(arch, **config overrides) -> path of a saved random-init checkpoint (cached per args)."""
    cache: dict[tuple, str] = {}

    def make(arch: str, **overrides) -> str:
        key = (arch, tuple(sorted((k, repr(v)) for k, v in overrides.items())))
        if key in cache:
            return cache[key]
        import torch
        from transformers import AutoModelForCausalLM

        config = _hf_config(arch, **overrides)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():  # HF starts Gemma's (1 + w) norms at w = 0; make w count in the tests
            for name, param in model.named_parameters():
                if arch in ("gemma3", "qwen3_5") and "norm" in name:  # zero-centred norms start at w = 0
                    param.normal_(0.0, 0.3)
        out = tmp_path_factory.mktemp(f"tiny-{arch}")
        model.save_pretrained(out)
        for name in TOKENIZER_FILES:
            src = Path(default_model_path) / name
            if src.exists():
                shutil.copy(src, out / name)
        cache[key] = str(out)
        return cache[key]

    return make
