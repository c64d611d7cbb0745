"""Tool-call parsers (``moejax serve --enable-auto-tool-choice --tool-call-parser NAME``, vLLM's names):
the calls a model writes in its own format, taken out of the answer's text as OpenAI ``tool_calls``,
whole or streamed (chat_output.py builds the message and the deltas from them).

``deepseek_v3`` (DeepSeek-V3 / R1; the format its chat template renders an assistant's calls in)::

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    ```json
    ARGUMENTS
    ```<｜tool▁call▁end｜>(more calls)<｜tool▁calls▁end｜>

The arguments are the model's JSON text as written (streamed as it comes, as vLLM's
DeepSeekV3ToolParser streams them).

``step3`` (StepFun Step3, its steptml form, as vLLM's Step3ToolParser and SGLang's Step3Detector read it)::

    <｜tool_calls_begin｜><｜tool_call_begin｜>function<｜tool_sep｜><steptml:invoke name="NAME">
    <steptml:parameter name="KEY">VALUE</steptml:parameter>...</steptml:invoke><｜tool_call_end｜><｜tool_calls_end｜>

Its values are text: each is typed by the tool's JSON schema (integer, number, boolean, null; object and
array values parsed as JSON), and the arguments are sent as one JSON object once the call is complete.

Text before the calls is content; so is text after ``tool calls end`` (vLLM drops DeepSeek's; nothing the
model wrote is lost here). A call cut off before its name is complete (max_tokens) is not reported; one cut
off after it is, DeepSeek's with its arguments text so far, Step3's with none (the finish_reason says
"length"). Markers are found
in the text, wherever the tokenizer cuts them (markers.py).
"""

from __future__ import annotations

import abc
import dataclasses
import json
import re
import uuid

from moejax.server.markers import MarkerBuffer


@dataclasses.dataclass
class ToolCallDelta:
    """A piece of the call at ``index``: its id and name come once, first; its arguments in pieces."""
    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"  # vLLM's form


class ToolParser(abc.ABC):
    """One answer's calls; ``feed`` the text as it comes, each call returns (content piece, call pieces)."""

    CALLS_BEGIN = CALLS_END = CALL_BEGIN = CALL_END = SEP = ""

    def __init__(self, tools: list[dict] | None = None):
        self.tools = {t["function"]["name"]: t["function"] for t in tools or []}
        self._buf = MarkerBuffer()
        self._state = "text"
        self.num_calls = 0  # calls reported (named) so far

    @property
    def markers(self) -> tuple[str, ...]:
        return self.CALLS_BEGIN, self.CALLS_END, self.CALL_BEGIN, self.CALL_END, self.SEP

    def feed(self, text: str, final: bool = False) -> tuple[str, list[ToolCallDelta]]:
        self._buf.feed(text, final)
        content: list[str] = []
        calls: list[ToolCallDelta] = []
        while True:
            before = (self._state, len(self._buf.text))
            if self._state == "text":
                head, m = self._buf.until(self.CALLS_BEGIN)
                content.append(head)
                if m is not None:
                    self._state = "block"
            elif self._state == "block":  # between calls: whitespace means nothing here
                self._buf.text = self._buf.text.lstrip()
                head, m = self._buf.until(self.CALL_BEGIN, self.CALLS_END)
                content.append(head)
                if m == self.CALL_BEGIN:
                    self._state = "call"
                    self._begin_call()
                elif m == self.CALLS_END:
                    self._state = "after"
            elif self._state == "call":
                if self._call(calls):
                    self._state = "block"
            else:  # after the calls: content again
                content.append(self._buf.text)
                self._buf.text = ""
            if (self._state, len(self._buf.text)) == before:
                return "".join(content), calls

    @abc.abstractmethod
    def _begin_call(self) -> None:
        """A call's begin marker was taken."""

    @abc.abstractmethod
    def _call(self, calls: list[ToolCallDelta]) -> bool:
        """Reads the call in progress, appending its pieces to ``calls``; True once its end marker is taken."""


class DeepSeekV3ToolParser(ToolParser):
    CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
    ARGS_OPEN = "\n```json\n"
    ARGS_CLOSE = "\n```" + CALL_END

    def _begin_call(self) -> None:
        self._named = False

    def _call(self, calls: list[ToolCallDelta]) -> bool:
        buf = self._buf
        if not self._named:  # TYPE<sep>NAME\n```json\n, whole, before anything is sent
            i = buf.text.find(self.SEP)
            j = buf.text.find(self.ARGS_OPEN, i + len(self.SEP)) if i >= 0 else -1
            if j < 0:
                return False
            name = buf.text[i + len(self.SEP):j].strip()
            buf.text = buf.text[j + len(self.ARGS_OPEN):]
            self._index = self.num_calls
            self.num_calls += 1
            self._named = True
            calls.append(ToolCallDelta(self._index, new_call_id(), name))
        args, end = buf.until(self.ARGS_CLOSE)
        if args:
            calls.append(ToolCallDelta(self._index, arguments=args))
        return end is not None


_INVOKE = re.compile(r'\s*(?P<type>[^<]*?)\s*<｜tool_sep｜>\s*<steptml:invoke name="(?P<name>[^"]+)">')
_PARAM = re.compile(r'<steptml:parameter name="(?P<key>[^"]+)">(?P<value>.*?)</steptml:parameter>', re.DOTALL)


class Step3ToolParser(ToolParser):
    CALLS_BEGIN, CALLS_END = "<｜tool_calls_begin｜>", "<｜tool_calls_end｜>"
    CALL_BEGIN, CALL_END, SEP = "<｜tool_call_begin｜>", "<｜tool_call_end｜>", "<｜tool_sep｜>"

    def _begin_call(self) -> None:
        self._body = ""
        self._index = self._name = None

    def _call(self, calls: list[ToolCallDelta]) -> bool:
        part, end = self._buf.until(self.CALL_END)
        self._body += part
        if self._name is None:
            m = _INVOKE.match(self._body)
            if m and m["type"] == "function":  # the only type there is; others are not calls (vLLM's rule)
                self._name, self._index = m["name"], self.num_calls
                self.num_calls += 1
                calls.append(ToolCallDelta(self._index, new_call_id(), self._name))
        if end is None:
            return False
        if self._name is not None:
            args = {m["key"]: m["value"].strip() for m in _PARAM.finditer(self._body)}
            calls.append(ToolCallDelta(self._index, arguments=json.dumps(self._typed(args), ensure_ascii=False)))
        return True

    def _typed(self, args: dict[str, str]) -> dict:
        """Each value as its schema's type says (text when it has none, or does not parse as it)."""
        props = (self.tools.get(self._name, {}).get("parameters") or {}).get("properties") or {}
        out = {}
        for key, value in args.items():
            typ = (props.get(key) or {}).get("type") if isinstance(props.get(key), dict) else None
            out[key] = _as_type(value, typ)
        return out


def _as_type(value: str, typ) -> object:
    try:
        if typ == "integer":
            return int(value)
        if typ == "number":
            return float(value)
        if typ == "boolean" and value.lower() in ("true", "false"):
            return value.lower() == "true"
        if typ == "null" and value.lower() == "null":
            return None
        if typ in ("object", "array"):
            parsed = json.loads(value)
            if isinstance(parsed, dict if typ == "object" else list):
                return parsed
    except ValueError:
        pass
    return value


# --tool-call-parser NAME (cli.py: argparse choices)
TOOL_PARSERS = {"deepseek_v3": DeepSeekV3ToolParser, "step3": Step3ToolParser}
