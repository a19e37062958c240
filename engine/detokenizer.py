"""Incremental detokenization and stop strings.

Decoding one token at a time breaks words that span tokens and multi-byte characters, so each step
decodes a small window twice (before and after the new tokens) and emits only the difference, holding
back while the tail is an incomplete UTF-8 sequence. Stop strings are searched only where new text could
complete one; in streams, a tail that might be the start of a stop string is held back until it is not.
"""
from __future__ import annotations

from typing import Any


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.prefix_offset = max(len(prompt_token_ids) - 5, 0)  # a little prompt context for leading spaces
        self.read_offset = len(prompt_token_ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def step(self, token_ids: list[int]) -> str:
        """New text after the latest token(s); token_ids is the whole sequence so far."""
        prefix_text = self._decode(token_ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(token_ids[self.prefix_offset :])
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(token_ids)
            return full_text[len(prefix_text) :]
        return ""


def find_stop_string(text: str, num_new_chars: int, stop: list[str]) -> tuple[str, int] | None:
    """(stop string, index where it starts) of the earliest stop string that new text completed."""
    best: tuple[str, int] | None = None
    for s in stop:
        start = max(0, len(text) - num_new_chars - len(s) + 1)
        idx = text.find(s, start)
        if idx != -1 and (best is None or idx < best[1]):
            best = (s, idx)
    return best


def stream_safe_length(text: str, stop: list[str], finished: bool) -> int:
    """How much of text may be streamed now: all of it, less a tail that could begin a stop string."""
    if finished or not stop:
        return len(text)
    hold = 0
    for s in stop:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                hold = max(hold, k)
                break
    return len(text) - hold
