"""Find a checkpoint folder, read its config, stream its safetensors weights, load its tokenizer."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from engine.models import SUPPORTED_ARCHITECTURES


def resolve_model_path(model: str | None) -> str:
    from engine.default_model import PACKAGED_MODELS, default_model_dir, packaged_model_dir

    if model in (None, ""):
        return default_model_dir()
    if model in PACKAGED_MODELS:
        return packaged_model_dir(model)
    path = Path(model).expanduser()
    if not path.is_dir() and _looks_like_repo_id(model):
        path = Path(_from_hub(model))
    if not path.is_dir():
        raise FileNotFoundError(
            f"model {model!r} is not a local folder or a Hugging Face repo id (org/name). Pass a folder with "
            "config.json, *.safetensors and tokenizer files, a repo id, or a packaged model's name: 'default' "
            "(SmolLM2-135M-Instruct) or 'gemma-3-270m'."
        )
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"model folder {path} has no config.json")
    return str(path)


HUB_FILES = ["config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json", "tokenizer*",
             "special_tokens_map.json", "chat_template.jinja", "vocab.*", "merges.txt"]


def _looks_like_repo_id(model: str) -> bool:
    parts = model.split("/")
    return len(parts) == 2 and all(parts) and not model.startswith((".", "~")) and "\\" not in model


def _from_hub(repo_id: str) -> str:
    """A Hugging Face repo id: from the local HF cache if it is there; else downloaded (config, tokenizer,
    safetensors only), unless HF_HUB_OFFLINE is set or there is no network, which is then said plainly."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return snapshot_download(repo_id, allow_patterns=HUB_FILES, local_files_only=True)
    except LocalEntryNotFoundError:
        pass
    try:
        return snapshot_download(repo_id, allow_patterns=HUB_FILES)
    except LocalEntryNotFoundError as e:  # offline mode, or the network refused
        raise FileNotFoundError(
            f"model {repo_id!r} is not in the local Hugging Face cache and could not be downloaded ({e}). "
            "Download it where there is network (`hf download " + repo_id + "`) or pass a local folder."
        ) from None
    except Exception as e:
        raise FileNotFoundError(f"could not fetch model {repo_id!r} from the Hugging Face Hub: "
                                f"{type(e).__name__}: {e}") from None


def load_hf_config(path: str) -> Any:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    archs = getattr(config, "architectures", None) or []
    if not archs:
        raise ValueError(f"{path}/config.json names no architectures; expected one of {SUPPORTED_ARCHITECTURES}")
    if archs[0] not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{path}: architecture {archs[0]!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    if archs[0] in TEXT_OF_MULTIMODAL:  # the engine runs the language model: its config is the text_config
        text = config.text_config
        text.architectures = [archs[0]]
        for key in ("tie_word_embeddings", "eos_token_id", "bos_token_id", "pad_token_id"):
            if getattr(text, key, None) is None and getattr(config, key, None) is not None:
                setattr(text, key, getattr(config, key))
        return text
    return config


# vision-language architectures whose language model the engine serves, text only (engine.models)
TEXT_OF_MULTIMODAL = ("Qwen3_5ForConditionalGeneration",)


def safetensors_files(path: str) -> list[Path]:
    folder = Path(path)
    index = folder / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (folder / s).exists()]
        if missing:
            raise FileNotFoundError(f"{folder}: the index names shards that are missing: {', '.join(missing)}")
        return [folder / s for s in shards]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder} holds no *.safetensors weights (only safetensors checkpoints load)")
    return files


def iter_weights(path: str, show_progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open
    from tqdm import tqdm

    files = safetensors_files(path)
    handles = [safe_open(str(f), framework="pt") for f in files]
    names = [(h, k) for h in handles for k in h.keys()]
    for handle, name in tqdm(names, desc="loading weights", unit="tensor", disable=not show_progress):
        yield name, handle.get_tensor(name)


def load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError) as e:
        raise FileNotFoundError(
            f"could not load a tokenizer from {path} ({e}); the folder needs tokenizer.json or the files of a "
            "slow tokenizer, as saved by tokenizer.save_pretrained()"
        ) from e
