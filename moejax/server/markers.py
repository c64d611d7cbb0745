"""Finding marker strings (``</think>``, ``<｜tool▁calls▁begin｜>``, ...) in text that arrives in pieces.

A stream's text comes a few characters at a time and a marker can be cut anywhere, even inside one
token's text on a byte-level tokenizer; so a parser emits a piece only once no marker can begin in it,
and holds back the tail that could be a marker's start (as the stream's stop strings are held back,
incremental_text.IncrementalText).
"""

from __future__ import annotations


def held_back(text: str, *markers: str) -> int:
    """How many characters at the end of ``text`` could be the start of one of ``markers`` (the longest
    proper prefix of a marker that ``text`` ends with; 0 if none)."""
    hold = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), hold, -1):
            if text.endswith(m[:k]):
                hold = k
                break
    return hold


class MarkerBuffer:
    """Text fed in pieces, read up to a marker: ``until(marker)`` takes the text before it (or, while the
    marker has not come, what surely precedes it)."""

    def __init__(self):
        self.text = ""  # fed, not yet taken
        self.final = False  # no more text will come: nothing is held back

    def feed(self, text: str, final: bool) -> None:
        self.text += text
        self.final = self.final or final

    def until(self, *markers: str) -> tuple[str, str | None]:
        """(text before the first of ``markers``, that marker) with both taken from the buffer; while none
        has come, (the text that cannot be the start of one, None)."""
        found = [(i, m) for m in markers if (i := self.text.find(m)) >= 0]
        if found:
            i, m = min(found)
            head, self.text = self.text[:i], self.text[i + len(m):]
            return head, m
        keep = 0 if self.final else held_back(self.text, *markers)
        head, self.text = self.text[:len(self.text) - keep], self.text[len(self.text) - keep:]
        return head, None

    def starts(self, *markers: str) -> str | None:
        """The marker the buffer starts with (taken), else None; ``""`` while it is a marker's prefix and more
        text may come (wait)."""
        for m in markers:
            if self.text.startswith(m):
                self.text = self.text[len(m):]
                return m
        if not self.final and any(m.startswith(self.text) for m in markers):
            return ""
        return None
