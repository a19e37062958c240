"""KV capacity from a model's config.json: the seed's M = 2 * L * H_kv * d_head * T * b, per layer group.

Layer groups: full attention (keeps every token's K/V: L in the formula), sliding-window attention (keeps at
most its window per sequence), and linear attention (Gated DeltaNet, Mamba-style: no KV, a fixed recurrent
state per sequence). Pure Python (reads the JSON; no torch, no transformers), so it works for any model's
config, whether the engine runs it or not. `kvscale capacity` prints it.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}
KV_DTYPE_BYTES = {"fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}


@dataclass
class LayerGroup:
    kind: str  # "full" | "sliding" | "linear"
    num_layers: int
    window: int | None = None  # sliding: tokens kept per sequence
    bytes_per_token: int = 0  # K and V of every layer of the group, per token (full, sliding)
    state_bytes_per_seq: int = 0  # linear: recurrent + conv state of every layer of the group


@dataclass
class CapacityReport:
    model_type: str
    kv_dtype: str
    bytes_per_element: int
    num_kv_heads: int
    head_dim: int
    groups: list[LayerGroup] = field(default_factory=list)

    @property
    def full_bytes_per_token(self) -> int:
        """What grows with every token of a sequence: the seed's formula over the layers that keep full KV."""
        return sum(g.bytes_per_token for g in self.groups if g.kind == "full")

    def bytes_per_sequence(self, num_tokens: int) -> int:
        """KV (and state) one sequence of num_tokens holds: full layers every token, sliding layers at most their
        window, linear layers their fixed state."""
        total = 0
        for g in self.groups:
            if g.kind == "full":
                total += g.bytes_per_token * num_tokens
            elif g.kind == "sliding":
                total += g.bytes_per_token * min(num_tokens, g.window or num_tokens)
            else:
                total += g.state_bytes_per_seq
        return total

    def sequences_that_fit(self, memory_bytes: int, num_tokens: int) -> int:
        return memory_bytes // max(1, self.bytes_per_sequence(num_tokens))

    def tokens_that_fit(self, memory_bytes: int) -> int:
        """Tokens of full-attention KV the memory holds (per-sequence bounded parts not counted)."""
        per = self.full_bytes_per_token
        return memory_bytes // per if per else 0

    def render(self, memory_bytes: int, seq_len: int) -> str:
        lines = [f"{self.model_type}: KV in {self.kv_dtype} ({self.bytes_per_element} B per element), "
                 f"{self.num_kv_heads} KV heads x head dim {self.head_dim}"]
        for g in self.groups:
            if g.kind == "full":
                lines.append(f"  full attention     {g.num_layers:3d} layers: 2 x {g.num_layers} x {self.num_kv_heads} x "
                             f"{self.head_dim} x {self.bytes_per_element} B = {_size(g.bytes_per_token)} per token")
            elif g.kind == "sliding":
                lines.append(f"  sliding window {g.window:>6} {g.num_layers:3d} layers: {_size(g.bytes_per_token)} per "
                             f"token, at most {_size(g.bytes_per_token * g.window)} per sequence")
            else:
                lines.append(f"  linear attention   {g.num_layers:3d} layers: no KV; {_size(g.state_bytes_per_seq)} of "
                             "state per sequence")
        per_seq = self.bytes_per_sequence(seq_len)
        lines.append(f"one sequence of {seq_len} tokens: {_size(per_seq)}")
        lines.append(f"in {_size(memory_bytes)}: {self.sequences_that_fit(memory_bytes, seq_len)} sequences of "
                     f"{seq_len} tokens" + (f"; {self.tokens_that_fit(memory_bytes):,} tokens of full-attention KV"
                                            if self.full_bytes_per_token else ""))
        if any(g.kind == "sliding" for g in self.groups):
            lines.append("(kvscale's sliding layers give back blocks behind their window, with a block table per "
                         "layer group where they sit beside full layers: engine/kv_groups.py; a sliding group also "
                         "holds up to one block more than its window, and during a prefill the chunk being computed)")
        return "\n".join(lines)


def kv_capacity(config: dict[str, Any] | str | Path, kv_cache_dtype: str = "auto") -> CapacityReport:
    """config: a config.json's dict, the file, or its folder. kv_cache_dtype: "auto" (the model's torch_dtype)
    or an fp8 name."""
    if not isinstance(config, dict):
        path = Path(config)
        config = json.loads((path / "config.json" if path.is_dir() else path).read_text())
    text = config.get("text_config") or config  # multimodal checkpoints keep the language model's here
    num_layers = text["num_hidden_layers"]
    num_heads = text["num_attention_heads"]
    kv_heads = text.get("num_key_value_heads") or num_heads
    head_dim = text.get("head_dim") or text["hidden_size"] // num_heads
    if kv_cache_dtype == "auto":
        dtype = str(text.get("torch_dtype") or text.get("dtype") or config.get("torch_dtype") or "float32")
        elem, kv_name = DTYPE_BYTES.get(dtype.removeprefix("torch."), 4), dtype
    elif kv_cache_dtype in KV_DTYPE_BYTES:
        elem, kv_name = KV_DTYPE_BYTES[kv_cache_dtype], kv_cache_dtype
    else:
        raise ValueError(f"kv_cache_dtype must be auto, fp8, fp8_e4m3 or fp8_e5m2; got {kv_cache_dtype!r}")
    per_layer = 2 * kv_heads * head_dim * elem

    kinds = _layer_kinds(text, num_layers)
    report = CapacityReport(str(text.get("model_type") or config.get("model_type") or "model"), kv_name, elem, kv_heads,
                            head_dim)
    window = text.get("sliding_window")
    for kind in ("full", "sliding", "linear"):
        n = kinds.count(kind)
        if not n:
            continue
        if kind == "linear":
            report.groups.append(LayerGroup("linear", n, state_bytes_per_seq=n * _linear_state_bytes(text)))
        else:
            report.groups.append(LayerGroup(kind, n, window if kind == "sliding" else None, n * per_layer))
    return report


def _layer_kinds(text: dict[str, Any], num_layers: int) -> list[str]:
    names = {"full_attention": "full", "attention": "full", "sliding_attention": "sliding",
             "linear_attention": "linear", "mamba": "linear"}
    if text.get("layer_types"):
        return [names.get(t, "full") for t in text["layer_types"]]
    window = text.get("sliding_window")
    if window and text.get("use_sliding_window", True):
        # Qwen2-style: layers from max_window_layers on use the window; Mistral: every layer
        first = text.get("max_window_layers", 0) if "use_sliding_window" in text else 0
        return ["full" if i < first else "sliding" for i in range(num_layers)]
    return ["full"] * num_layers


def _linear_state_bytes(text: dict[str, Any]) -> int:
    """Gated DeltaNet (Qwen3-Next / Qwen3.5): the delta rule's state (value heads x key dim x value dim) and the
    causal conv's last kernel-1 inputs, in fp32 as the reference keeps them."""
    v_heads = text.get("linear_num_value_heads", 0)
    k_heads = text.get("linear_num_key_heads", v_heads)
    k_dim, v_dim = text.get("linear_key_head_dim", 0), text.get("linear_value_head_dim", 0)
    kernel = text.get("linear_conv_kernel_dim", 4)
    conv_channels = 2 * k_heads * k_dim + v_heads * v_dim
    return 4 * (v_heads * k_dim * v_dim + (kernel - 1) * conv_channels)


def parse_size(text: str) -> int:
    """'16GiB', '512 MiB', '8GB', '1e9' -> bytes."""
    units = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20,
             "gib": 2**30, "tib": 2**40}
    s = text.strip().lower().replace(" ", "")
    i = len(s)
    while i and not (s[i - 1].isdigit() or s[i - 1] == "."):
        i -= 1
    if s[i:] not in units:
        raise ValueError(f"cannot read {text!r} as a size: use e.g. 16GiB, 512MiB, 8GB")
    return int(float(s[:i]) * units[s[i:]])


def _size(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            value = n / scale
            return f"{value:.0f} {unit}" if math.isclose(value, round(value)) else f"{value:.2f} {unit}"
    return f"{n:.0f} B"
