"""Tokenizer from an HF checkpoint's tokenizer.json / tokenizer_config.json."""

from __future__ import annotations

import os

import jinja2
from tokenizers import Tokenizer as _HFTokenizer

from moejax.json_file import load_json_file


def _token_text(tok):
    if isinstance(tok, dict):
        return tok.get("content")
    return tok


class Tokenizer:
    def __init__(self, directory: str):
        path = os.path.join(directory, "tokenizer.json")
        if not os.path.exists(path):
            raise ValueError(f"{directory} has no tokenizer.json")
        try:
            self._tok = _HFTokenizer.from_file(path)
        except Exception as e:  # noqa: BLE001 - the tokenizers library raises its own Exception type
            raise ValueError(f"tokenizer.json {path} is corrupt: {str(e)[:200]}") from None
        cfg_path = os.path.join(directory, "tokenizer_config.json")
        cfg = {}
        if os.path.exists(cfg_path):
            cfg = load_json_file(cfg_path, "tokenizer_config.json")
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.add_bos_token = bool(cfg.get("add_bos_token", False))
        self.chat_template = cfg.get("chat_template")
        self._max_token_chars = None
        if isinstance(self.chat_template, list):  # named templates: use "default"
            self.chat_template = next((t["template"] for t in self.chat_template if t.get("name") == "default"), None)

    def set_chat_template(self, spec: str) -> None:
        """The server's --chat-template (vLLM's): a file holding a Jinja template, or the template itself;
        checked here, at start-up, not at the first chat request."""
        if os.path.isfile(spec):
            with open(spec, encoding="utf-8") as f:
                spec = f.read()
        elif "{{" not in spec and "{%" not in spec:
            raise ValueError(f"--chat-template {spec!r}: no such file, and no Jinja template")
        try:
            self._environment().parse(spec)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"--chat-template: {e.message} (line {e.lineno})") from None
        self.chat_template = spec

    @property
    def backend(self) -> _HFTokenizer:
        """The tokenizers library's Tokenizer (for libraries that read the vocabulary: structured_output.py)."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def max_token_chars(self) -> int:
        """The most characters one token can stand for (its longest vocabulary string: byte-level
        and byte-fallback strings are at least as long as the text they cover). A text of more than
        max_model_len * max_token_chars characters is surely too long, before any tokenising."""
        if self._max_token_chars is None:
            self._max_token_chars = max((len(t) for t in self._tok.get_vocab(with_added_tokens=True)), default=1)
        return self._max_token_chars

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        # LlamaTokenizerFast-style configs add BOS through add_bos_token, not the post-processor.
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None and ids[:1] != [self.bos_token_id]:
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    @staticmethod
    def _environment() -> jinja2.Environment:
        env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, undefined=jinja2.StrictUndefined)

        def raise_exception(msg):
            raise ValueError(msg)

        env.globals["raise_exception"] = raise_exception
        return env

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **template_vars) -> str:
        """``template_vars``: more variables for the template (the server's chat_template_kwargs, e.g. thinking)."""
        if not self.chat_template:
            raise ValueError("this model's tokenizer_config.json has no chat_template")
        return self._environment().from_string(self.chat_template).render(
            **template_vars, messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "")
