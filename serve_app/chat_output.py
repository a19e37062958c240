"""Chat output beyond plain text: tool calls and reasoning, in OpenAI's shapes.

- Tools in the prompt: `render_tool_messages` prepares messages for chat templates that know tools (passed as
  `tools=`) and, for templates that do not (the default model's), writes the tools and past calls in the
  Hermes style (`<tools>`, `<tool_call>`, `<tool_response>`), which is also what Qwen2.5/Qwen3 templates do.
- Tool choice as a grammar: `tool_constraint` turns `required` and a named function into a JSON schema the
  engine samples under (engine.structured_output), so the arguments always parse and validate:
  `required` -> a JSON array of {"name", "arguments"} calls; a named function -> its arguments object.
- The model's output back into a message: `ChatOutputParser` takes text as it streams and splits it into
  `reasoning_content` (a leading `<think>...</think>`), `content`, and `tool_calls` (Hermes `<tool_call>`
  blocks under `auto`; the whole JSON under `required` / named). Streaming and non-streaming use the same
  parser, so the deltas of a stream assemble to the non-streamed message.
"""
from __future__ import annotations

import json
import re
import uuid
from typing import Any

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
# Under tool_choice="required", at most this many calls in one turn: a small model sampling greedily can
# otherwise repeat calls until max_tokens cuts the array (and its JSON) short.
MAX_PARALLEL_CALLS = 8
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"

HERMES_SYSTEM = (
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
    "XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>"
)


def tool_constraint(tools: list[dict], tool_choice: Any, parallel: bool) -> dict | None:
    """structured_outputs for the engine, or None when the model chooses freely (auto / none)."""
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        fn = next((t["function"] for t in tools if t["function"]["name"] == name), None)
        if fn is None:
            raise LookupError(name)
        return {"json": _parameters(fn)}
    if tool_choice == "required":
        calls = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                   "arguments": _parameters(t["function"])},
                  "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
        array = {"type": "array", "items": {"anyOf": calls}, "minItems": 1,
                 "maxItems": MAX_PARALLEL_CALLS if parallel else 1}
        return {"json": array}
    return None


def _parameters(fn: dict) -> dict:
    return fn.get("parameters") or {"type": "object", "properties": {}}


def render_tool_messages(messages: list[dict], tools: list[dict] | None, template_knows_tools: bool) -> list[dict]:
    """Messages ready for the chat template. Past tool calls' arguments become objects (what templates expect);
    for a template without tool support, tools and calls are written into the text in the Hermes style."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            calls = [{"type": "function", "id": c.get("id"),
                      "function": {"name": c["function"]["name"], "arguments": _as_object(c["function"]["arguments"])}}
                     for c in m["tool_calls"]]
            if template_knows_tools:
                m["tool_calls"] = calls
            else:
                m.pop("tool_calls")
                text = "\n".join(f"{CALL_OPEN}\n" + json.dumps({"name": c["function"]["name"],
                                                               "arguments": c["function"]["arguments"]}) + f"\n{CALL_CLOSE}"
                                 for c in calls)
                m["content"] = ((m.get("content") or "") + ("\n" if m.get("content") else "") + text)
        if m.get("role") == "tool" and not template_knows_tools:
            m["content"] = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
            m.pop("tool_call_id", None)
        out.append(m)
    if tools and not template_knows_tools:
        listing = "\n".join(json.dumps(t) for t in tools)
        system = HERMES_SYSTEM.format(tools=listing)
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": (out[0].get("content") or "") + "\n\n" + system}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out


def _as_object(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ChatOutputParser:
    """mode: "text" (no tools), "auto" (Hermes tool calls may appear), "required" (the output is a JSON array of
    calls), or "named:<function>" (the output is that function's arguments).

    feed(new_text) -> (reasoning delta, content delta) safe to stream now; finish() -> (reasoning, content,
    tool_calls) still to send. Text that might begin a tag is held until it is known not to."""

    def __init__(self, mode: str, reasoning: bool = True) -> None:
        self.mode = mode
        self.text = ""
        self.sent_reasoning = 0  # chars of the reasoning part already handed out
        self.sent_content = 0  # chars of the content part already handed out
        self.reasoning_enabled = reasoning

    # the text splits as [reasoning][content][tool-call tail]
    def _split(self, final: bool) -> tuple[str, str, str | None, bool]:
        """(reasoning, content, tail, reasoning_open). tail: where tool calls begin (None: none seen)."""
        text = self.text
        reasoning, rest = "", text
        stripped = text.lstrip()
        if self.reasoning_enabled and stripped.startswith(THINK_OPEN):
            body = stripped[len(THINK_OPEN):]
            end = body.find(THINK_CLOSE)
            if end == -1:
                return body, "", None, True
            reasoning, rest = body[:end], body[end + len(THINK_CLOSE):].lstrip("\n")
        elif self.reasoning_enabled and THINK_CLOSE in text and final:  # the template opened the reasoning
            reasoning, rest = text.split(THINK_CLOSE, 1)
            rest = rest.lstrip("\n")
        if self.mode == "text":
            return reasoning, rest, None, False
        if self.mode != "auto":  # the whole answer is the calls' JSON
            return reasoning, "", rest, False
        at = rest.find(CALL_OPEN)
        if at == -1:
            return reasoning, rest, None, False
        return reasoning, rest[:at], rest[at:], False

    def feed(self, new_text: str) -> tuple[str, str]:
        self.text += new_text
        reasoning, content, tail, reasoning_open = self._split(final=False)
        if reasoning_open:  # hold what could be the start of </think>
            safe = len(reasoning) - _partial_suffix(reasoning, THINK_CLOSE)
            return self._take_reasoning(reasoning[:safe]), ""
        if self.reasoning_enabled and THINK_OPEN.startswith(self.text.lstrip()):
            return "", ""  # too early to tell whether reasoning starts
        r = self._take_reasoning(reasoning)
        if self.mode == "auto" and tail is None:
            content = content[: len(content) - _partial_suffix(content, CALL_OPEN)]
        if self.mode not in ("text", "auto"):
            content = ""
        return r, self._take_content(content)

    def finish(self) -> tuple[str, str, list[dict] | None]:
        reasoning, content, tail, _ = self._split(final=True)
        r = self._take_reasoning(reasoning)
        calls = None
        if tail is not None:
            calls = self._parse_calls(tail)
            if calls is None and self.mode == "auto":  # not well-formed calls: it was text after all
                content += tail
        c = self._take_content(content)
        return r, c, calls

    def _take_reasoning(self, reasoning: str) -> str:
        new = reasoning[self.sent_reasoning:]
        self.sent_reasoning = max(self.sent_reasoning, len(reasoning))
        return new

    def _take_content(self, content: str) -> str:
        new = content[self.sent_content:]
        self.sent_content = max(self.sent_content, len(content))
        return new

    def _parse_calls(self, tail: str) -> list[dict] | None:
        try:
            if self.mode == "required":
                items = json.loads(tail)
                return [_call(c["name"], c["arguments"]) for c in items]
            if self.mode.startswith("named:"):
                json.loads(tail)
                return [{"id": new_call_id(), "type": "function",
                         "function": {"name": self.mode[len("named:"):], "arguments": tail.strip()}}]
            calls = []
            for block in re.findall(re.escape(CALL_OPEN) + r"(.*?)(?:" + re.escape(CALL_CLOSE) + r"|$)", tail, re.S):
                obj = json.loads(block.strip())
                calls.append(_call(obj["name"], obj.get("arguments", obj.get("parameters", {}))))
            return calls or None
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
            return None


def _call(name: str, arguments: Any) -> dict:
    if not isinstance(name, str):
        raise TypeError("name")
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": args}}


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of text that is a proper beginning of tag."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0
