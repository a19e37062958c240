"""Structured output: grammar-constrained sampling with xgrammar (what vLLM and SGLang use).

A request asks for one constraint in `SamplingParams.structured_outputs` (a StructuredOutputsParams: a JSON
schema, any JSON object, a regex, an EBNF grammar or a choice of strings). The engine compiles it once
when the request is added (an invalid constraint is the caller's ValueError, so a server answers 400), and
each of the request's samples gets its own matcher. Every step, the sampler asks `mask()` to put the
allowed-token bitmask of the constrained rows on their logits (unconstrained rows are not touched, so they
pay nothing), and tells `accept()` the tokens it chose. When the grammar is complete, only end-of-sequence
tokens are allowed, so the sequence stops with finish_reason "stop".

JSON comes out compact, and tokens holding a raw control character (bytes below 0x20) are never allowed in
it: compact JSON has no place for one (inside strings they must be escaped), yet xgrammar 0.2.9's rule for
strings with a maxLength lets them through, and `json.loads` then refuses the output.

StructuredOutputs owns the compiler, the compiled-grammar cache and one matcher per live sequence; the
engine forgets a sequence's matcher whenever the sequence ends (finish, abort, failure).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

MAX_CACHED_GRAMMARS = 256


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one of the fields is set (vLLM's names)."""

    json: dict | str | None = None  # a JSON schema (dict or its text): the output is JSON valid against it
    json_object: bool = False  # the output is any JSON object
    regex: str | None = None
    grammar: str | None = None  # EBNF, as xgrammar reads it (GBNF-like), with a `root` rule
    choice: list[str] | None = None  # the output is exactly one of these strings

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "grammar", "choice") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError("structured_outputs needs exactly one of json, json_object, regex, grammar or choice; "
                             f"got {given or 'none'}")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError(f"structured_outputs.json must be a JSON schema (an object); got {type(self.json).__name__}")
        for name in ("regex", "grammar"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ValueError(f"structured_outputs.{name} must be a string")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings")

    def key(self) -> tuple[str, str]:
        """(kind, spec): what the compiled grammar is cached by."""
        if self.json is not None:
            # key order kept: properties come out in the schema's order (a model writes "name" before "arguments")
            return "json", self.json if isinstance(self.json, str) else json.dumps(self.json)
        if self.json_object:
            return "json_object", ""
        if self.regex is not None:
            return "regex", self.regex
        if self.grammar is not None:
            return "grammar", self.grammar
        return "choice", json.dumps(self.choice)


class StructuredOutputs:
    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, eos_token_ids
        self._compiler = None  # made on first use: most engines never see a constrained request
        self._compiled: dict[tuple[str, str], Any] = {}
        # seq_id -> (GrammarMatcher, is_json); JSON rows also get control-character tokens banned
        self._matchers: dict[str, tuple[Any, bool]] = {}
        self._bitmask = None  # (rows, words) int32, grown as needed
        self._control_tokens = None  # LongTensor of token ids whose bytes hold a control character

    @property
    def num_live(self) -> int:
        return len(self._matchers)

    def _get_compiler(self):
        if self._compiler is None:
            try:
                import xgrammar as xgr
            except ImportError as e:
                raise ValueError("structured output needs the xgrammar package: pip install xgrammar") from e
            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=list(self.eos_token_ids))
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=True)
            import torch

            self._control_tokens = torch.tensor(
                [i for i, b in enumerate(info.decoded_vocab) if any(c < 0x20 for c in b)
                 and i not in self.eos_token_ids], dtype=torch.long)
        return self._compiler

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar; ValueError naming the problem when the constraint is invalid."""
        key = params.key()
        hit = self._compiled.get(key)
        if hit is not None:
            return hit
        compiler = self._get_compiler()
        kind, spec = key
        try:
            if kind == "json":
                json.loads(spec)  # a clear error for text that is not JSON at all
                # compact JSON: no runs of whitespace between tokens, which a sampling model can spin in
                # until max_tokens cuts the object short
                compiled = compiler.compile_json_schema(spec, any_whitespace=False, strict_mode=True)
            elif kind == "json_object":  # OpenAI's json_object: a JSON object, not any JSON value
                compiled = compiler.compile_json_schema('{"type": "object"}', any_whitespace=False,
                                                        strict_mode=False)
            elif kind == "regex":
                compiled = compiler.compile_regex(spec)
            elif kind == "grammar":
                compiled = compiler.compile_grammar(spec)
            else:
                import xgrammar as xgr

                choices = json.loads(spec)
                ebnf = "root ::= " + " | ".join(json.dumps(c) for c in choices)
                compiled = compiler.compile_grammar(xgr.Grammar.from_ebnf(ebnf))
        except json.JSONDecodeError as e:
            raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
        except (RuntimeError, ValueError, TypeError) as e:
            raise ValueError(f"invalid {kind.replace('_', ' ')} constraint: {_first_line(e)}") from None
        if len(self._compiled) >= MAX_CACHED_GRAMMARS:
            self._compiled.pop(next(iter(self._compiled)))
        self._compiled[key] = (compiled, kind in ("json", "json_object"))
        return self._compiled[key]

    def add(self, seq_id: str, compiled: Any) -> None:
        """compiled: what compile() returned."""
        import xgrammar as xgr

        grammar, is_json = compiled
        self._matchers[seq_id] = (xgr.GrammarMatcher(grammar), is_json)

    def forget(self, seq_id: str) -> None:
        self._matchers.pop(seq_id, None)

    def mask(self, logits, seq_ids: list[str]) -> None:
        """In place: -inf on the tokens each constrained row's grammar forbids next. Rows of unconstrained
        sequences are left alone."""
        rows = [i for i, s in enumerate(seq_ids) if s in self._matchers]
        if not rows:
            return
        import torch
        import xgrammar as xgr

        if self._bitmask is None or self._bitmask.shape[0] < len(seq_ids):
            self._bitmask = xgr.allocate_token_bitmask(max(len(seq_ids), 8), self.vocab_size)
        bitmask = self._bitmask[: len(seq_ids)]
        for i in rows:
            self._matchers[seq_ids[i]][0].fill_next_token_bitmask(bitmask, i)
        if logits.device.type == "cpu":
            xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size, indices=rows)
        else:
            xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True),
                                            vocab_size=self.vocab_size,
                                            indices=torch.tensor(rows, dtype=torch.int32, device=logits.device))
        json_rows = [i for i in rows if self._matchers[seq_ids[i]][1]]
        if json_rows and len(self._control_tokens):
            ban = self._control_tokens.to(logits.device)
            logits[torch.tensor(json_rows, device=logits.device)[:, None], ban[None, :]] = float("-inf")

    def accept(self, seq_id: str, token_id: int) -> None:
        entry = self._matchers.get(seq_id)
        if entry is not None and not entry[0].is_terminated():
            if not entry[0].accept_token(token_id):
                raise RuntimeError(f"sequence {seq_id} sampled token {token_id}, which its grammar forbids")


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    # xgrammar prefixes its messages with "[time] /path/file.cc:line: "; what follows is what people need
    line = text.splitlines()[0] if text else type(e).__name__
    if "] " in line and ".cc:" in line:
        line = line.split(": ", 1)[-1]
    return line.replace("Check failed: (error.empty()) is false: ", "")
