"""Reasoning parsers (``moejax serve --reasoning-parser NAME``, vLLM's names): a chat answer's thinking
split from its content, returned as ``reasoning_content`` beside ``content``, whole or streamed.

- ``deepseek_r1``: DeepSeek-R1 thinks, then writes ``</think>`` and the answer. Its chat template opens
  the ``<think>`` block in the prompt, so the output usually starts inside it; a ``<think>`` the model
  writes itself at the very start is dropped. Everything before the first ``</think>`` is reasoning,
  everything after it content; an answer with no ``</think>`` (cut by max_tokens, or a model that never
  closes it) is all reasoning, ``content`` null (vLLM's DeepSeekR1ReasoningParser).
- ``step3``: Step3 likewise ends its thinking with ``</think>`` (its generation prompt opens the block);
  vLLM's Step3ReasoningParser takes everything before the first ``</think>`` as reasoning and strips no
  ``<think>``, so a ``<think>`` the model writes stays in the reasoning text.

The split is made on the text (markers.py), not on token ids: it holds wherever the tokenizer cuts
``</think>`` (one added token in the real checkpoints, several bytes in the tiny byte-level one), and
the streamed pieces add up to the whole answer's split exactly (chat_output.py runs both through it).
"""

from __future__ import annotations

from moejax.server.markers import MarkerBuffer

THINK_START, THINK_END = "<think>", "</think>"


class ReasoningParser:
    """One answer's split; ``feed`` the text as it comes, each call returns its (reasoning, content) pieces."""

    strip_start = True  # a <think> opening the output is not reasoning text
    end = THINK_END  # where the thinking ends (a structured output's grammar starts after it)
    markers = (THINK_START, THINK_END)

    def __init__(self):
        self._buf = MarkerBuffer()
        self._state = "start" if self.strip_start else "think"

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        buf = self._buf
        buf.feed(text, final)
        reasoning = content = ""
        if self._state == "start":
            m = buf.starts(THINK_START)
            if m == "":
                return "", ""  # may yet be <think>
            self._state = "think"
        if self._state == "think":
            reasoning, end = buf.until(THINK_END)
            if end is not None:
                self._state = "content"
        if self._state == "content":
            content, buf.text = buf.text, ""
        return reasoning, content

    @property
    def in_reasoning(self) -> bool:
        """Still before ``</think>``."""
        return self._state != "content"


class DeepSeekR1ReasoningParser(ReasoningParser):
    strip_start = True


class Step3ReasoningParser(ReasoningParser):
    strip_start = False


# --reasoning-parser NAME (cli.py: argparse choices)
REASONING_PARSERS = {"deepseek_r1": DeepSeekR1ReasoningParser, "step3": Step3ReasoningParser}
