"""A chat answer's parts: its text split into ``reasoning_content``, ``content`` and ``tool_calls`` by the
server's reasoning parser (reasoning_parsers.py) and tool-call parser (tool_parsers.py), as vLLM's
chat endpoint returns them, whole (``message``) or as stream deltas (``feed``).

The reasoning parser goes first; the tool parser reads the content after the thinking (vLLM's order).
The whole message is the stream's parser fed the whole text at once, so a stream's deltas always add
up to the non-streamed message.

A tool_choice that forces a call (a named function, or "required") needs no parser: a grammar
(protocol._tool_constraint, structured outputs) makes the whole answer the call, as in vLLM. A named
function's answer is its arguments, streamed as they come; "required"'s is a JSON array of
``{"name", "parameters"}``, each call sent once its object is complete.
"""

from __future__ import annotations

import dataclasses
import json

from moejax.server.reasoning_parsers import ReasoningParser
from moejax.server.tool_parsers import ToolCallDelta, ToolParser, new_call_id


@dataclasses.dataclass(frozen=True)
class OutputParsing:
    """What a request's answer is parsed for (protocol.parse_request decides it)."""
    reasoning: type[ReasoningParser] | None = None  # --reasoning-parser
    tools: type[ToolParser] | None = None  # the tool parser, when tool_choice is "auto"
    tool_defs: tuple = ()  # the request's tools (their schemas type Step3's values)
    include_reasoning: bool = True  # false: the reasoning is left out of the response (vLLM's)
    parallel_tool_calls: bool = True  # false: only the first call is returned
    forced: str | None = None  # "required", or the function a named tool_choice forces (the answer is the call)

    def new(self) -> ChatOutput:
        return ChatOutput(self)


def check_markers(tokenizer, parser_cls, flag: str) -> None:
    """A ValueError naming ``flag`` when the tokenizer drops one of the parser's markers from decoded text
    (a special token, skipped by skip_special_tokens): the parser could never see it."""
    for marker in parser_cls().markers:
        if tokenizer.decode(tokenizer.encode(marker, add_special_tokens=False)) != marker:
            raise ValueError(f"{flag}: this tokenizer decodes {marker!r} to nothing (a special token, skipped "
                             "with skip_special_tokens), so its calls could not be read from the text")


class ChatOutput:
    """One answer being parsed: ``feed`` its text as it comes; ``called`` once a tool call was found."""

    def __init__(self, spec: OutputParsing):
        self.spec = spec
        self._reasoning = spec.reasoning() if spec.reasoning else None
        self._tools = spec.tools([dict(t) for t in spec.tool_defs]) if spec.tools else None
        self._forced = _RequiredCalls() if spec.forced == "required" else None
        self.called = False

    def feed(self, text: str, final: bool = False) -> dict:
        """The stream delta for this piece of text (OpenAI's keys; empty when everything is held back)."""
        reasoning, content = self._reasoning.feed(text, final) if self._reasoning else ("", text)
        calls: list[ToolCallDelta] = []
        if self.spec.forced is not None:  # the answer after the thinking is the call
            calls, content = self._forced_calls(content, final), ""
        elif self._tools is not None:
            content, calls = self._tools.feed(content, final)
            if not self.spec.parallel_tool_calls:
                calls = [c for c in calls if c.index == 0]
        self.called = self.called or bool(calls)
        delta = {}
        if reasoning and self.spec.include_reasoning:
            delta["reasoning_content"] = reasoning
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = _merged(calls)
        return delta

    def _forced_calls(self, text: str, final: bool) -> list[ToolCallDelta]:
        if self._forced is not None:
            return self._forced.feed(text)
        if self.called:
            return [ToolCallDelta(0, arguments=text)] if text else []
        # the named function: its call opens with the first piece (or the end, for an empty answer)
        return [ToolCallDelta(0, new_call_id(), self.spec.forced, text)] if text or final else []

    def message(self, text: str) -> dict:
        """The whole answer as the response's ``message``."""
        d = self.feed(text, final=True)
        msg = {"role": "assistant", "content": d.get("content") or None}
        if self._reasoning is not None:
            msg["reasoning_content"] = d.get("reasoning_content", "") if self.spec.include_reasoning else None
        if self._tools is not None or self.spec.forced is not None:
            msg["tool_calls"] = [{"id": c["id"], "type": "function", "function": c["function"]}
                                 for c in d.get("tool_calls", [])]
        return msg

    def finish_reason(self, reason: str | None) -> str | None:
        """The engine's reason as the response gives it: a call ended by the model is "tool_calls" (vLLM's: not
        for a named function, whose call the request asked for)."""
        if self.spec.forced not in (None, "required"):
            return reason
        return "tool_calls" if reason == "stop" and self.called else reason


class _RequiredCalls:
    """tool_choice "required"'s answer, a JSON array of {"name", "parameters"} objects (the grammar's): each
    object is a call, sent once it is complete (its arguments the parameters as JSON text)."""

    def __init__(self):
        self.text = ""
        self.scanned = 0
        self.depth = 0
        self.in_string = self.escaped = False
        self.start = 0
        self.count = 0

    def feed(self, text: str) -> list[ToolCallDelta]:
        self.text += text
        calls = []
        for i in range(self.scanned, len(self.text)):
            ch = self.text[i]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "[{":
                self.depth += 1
                if self.depth == 2:
                    self.start = i
            elif ch in "]}":
                self.depth -= 1
                if self.depth == 1 and ch == "}":
                    item = json.loads(self.text[self.start:i + 1])
                    calls.append(ToolCallDelta(self.count, new_call_id(), item["name"],
                                               json.dumps(item["parameters"], ensure_ascii=False)))
                    self.count += 1
        self.scanned = len(self.text)
        return calls


def _merged(calls: list[ToolCallDelta]) -> list[dict]:
    """The deltas of one piece, one entry per call (its first has id, type and name; arguments add up)."""
    out: dict[int, dict] = {}
    for c in calls:
        entry = out.setdefault(c.index, {"index": c.index})
        if c.id is not None:
            entry.update(id=c.id, type="function")
            entry.setdefault("function", {})["name"] = c.name
        fn = entry.setdefault("function", {})
        if c.arguments or c.id is not None:
            fn["arguments"] = fn.get("arguments", "") + c.arguments
    return list(out.values())
