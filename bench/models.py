"""Random-init Llama checkpoints for the benchmarks (seed 0), saved as real safetensors folders with the
default model's tokenizer beside them, so the engine and HF load them exactly as they load a real model;
and HF transformers' greedy fp32 tokens on a checkpoint, the reference the engine is held to."""
from __future__ import annotations

import shutil
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def random_model(path: Path, config, dtype: str = "float32", init_device: str = "cpu") -> str:
    """Saves (once, seed 0) and returns a random-init model of this HF config at `path`, with the default
    model's tokenizer beside it. init_device: where the random weights are drawn (a GPU draws an 8B model in
    a second, where a CPU takes minutes)."""
    import torch
    from transformers import AutoModelForCausalLM

    from engine.default_model import default_model_dir

    if not any((path / name).exists() for name in ("model.safetensors", "model.safetensors.index.json")):
        # (a sharded save, as an 8B one is, writes its index last: the tokenizer goes first)
        path.mkdir(parents=True, exist_ok=True)
        for name in TOKENIZER_FILES:
            if (Path(default_model_dir()) / name).exists():
                shutil.copy(Path(default_model_dir()) / name, path / name)
        torch.manual_seed(0)
        with torch.device(init_device):
            model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
        model.save_pretrained(path)
        del model
        if init_device.startswith("cuda"):
            torch.cuda.empty_cache()  # the device's memory goes back to whoever loads the checkpoint next
    return str(path)


def random_llama(path: Path, **config) -> str:
    """Saves (once) and returns a LlamaConfig(vocab 49152, bos 1, eos 2, **config) model at `path`."""
    from transformers import LlamaConfig

    return random_model(path, LlamaConfig(**{"vocab_size": 49152, "bos_token_id": 1, "eos_token_id": 2, **config}))


def tiny_llama(path: Path) -> str:
    """2 layers of hidden 64: fast steps, for soak and load tests of everything but the model."""
    return random_llama(path, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, max_position_embeddings=1024)


def llama_125m(path: Path) -> str:
    """A Llama-shaped model of 123M parameters: 12 layers, hidden 768, GQA 12/4, tied embeddings."""
    return random_llama(path, hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                        num_key_value_heads=4, max_position_embeddings=2048, tie_word_embeddings=True,
                        initializer_range=0.02)


def hf_greedy(path: str, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """HF `generate`, greedy, fp32, EOS ignored, one prompt at a time: `max_new` new tokens per prompt."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    gen = GenerationConfig(max_new_tokens=max_new, do_sample=False, eos_token_id=None, pad_token_id=0)
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen)
            outs.append(out[0, len(p):].tolist())
    return outs
