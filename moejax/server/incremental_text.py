"""A stream's text deltas from its token ids (vLLM's incremental detokenization): never a partial UTF-8
character, never text past (or the start of) a stop string."""

from __future__ import annotations


class IncrementalText:
    """Streams text deltas from token ids without re-decoding the whole output each token: a small
    window of ids is decoded (vLLM's prefix/read offsets), so each token costs O(window).

    Never emits a partial UTF-8 character (a window ending in U+FFFD waits for more ids) nor text
    that could be the start of a stop string, so nothing past a stop string is ever sent."""

    def __init__(self, tokenizer, stop: list[str], include_stop: bool = False, skip_special_tokens: bool = True):
        self.tokenizer, self.stop, self.include_stop, self.skip = tokenizer, stop, include_stop, skip_special_tokens
        self.ids: list[int] = []
        self.prefix = self.read = 0
        self.text = ""  # decoded so far (complete characters)
        self.sent = ""

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        prefix_text = decode(self.ids[self.prefix:self.read], skip_special_tokens=self.skip) \
            if self.read > self.prefix else ""
        new_text = decode(self.ids[self.prefix:], skip_special_tokens=self.skip)
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self.text += new_text[len(prefix_text):]
            self.prefix, self.read = self.read, len(self.ids)
        text = self.text
        for s in self.stop:
            i = text.find(s, max(0, len(self.sent) - len(s)))
            if i >= 0:
                text = text[:i + len(s) if self.include_stop else i]
        hold = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), hold, -1):
                if text.endswith(s[:k]):
                    hold = k
                    break
        return self._emit(text[:len(text) - hold] if hold else text)

    def finish(self, final_text: str) -> str:
        return self._emit(final_text)

    def _emit(self, safe: str) -> str:
        if len(safe) <= len(self.sent) or not safe.startswith(self.sent):
            return ""
        delta = safe[len(self.sent):]
        self.sent = safe
        return delta
