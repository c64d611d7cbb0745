"""A byte-level tokenizer for tiny random models: every byte is a token, plus
DeepSeek's special tokens. Any text round-trips; it needs no training data."""

from __future__ import annotations

import json
import os
import tempfile

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

SPECIAL_TOKENS = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"]
BOS_ID, EOS_ID = 0, 1
# A DeepSeek-style chat template (the real one, shortened to its core).
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}"
    "{% elif message['role'] == 'user' %}<｜User｜>{{ message['content'] }}"
    "{% elif message['role'] == 'assistant' %}<｜Assistant｜>{{ message['content'] }}<｜end▁of▁sentence｜>"
    "{% else %}{{ raise_exception('unknown role: ' + message['role']) }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<｜Assistant｜>{% endif %}"
)
VOCAB_USED = len(SPECIAL_TOKENS) + 256


def build_tokenizer() -> Tokenizer:
    byte_chars = list(pre_tokenizers.ByteLevel.alphabet())
    byte_chars.sort()
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    for ch in byte_chars:
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    # BOS through the post-processor, not only tokenizer_config's add_bos_token: transformers' AutoTokenizer on
    # the checkpoint directory (TokenizersBackend) reads no add_bos_token, so without it lm-eval's or any HF
    # client's ids would lack the BOS the server's tokenizer adds. With it both add one, to every text.
    bos = SPECIAL_TOKENS[BOS_ID]
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                       special_tokens=[(bos, BOS_ID)])
    return tok


def write_tokenizer(directory: str) -> None:
    build_tokenizer().save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({
            "add_bos_token": True, "add_eos_token": False,
            "bos_token": SPECIAL_TOKENS[BOS_ID], "eos_token": SPECIAL_TOKENS[EOS_ID],
            "model_max_length": 16384, "tokenizer_class": "PreTrainedTokenizerFast",
            "chat_template": CHAT_TEMPLATE,
        }, f, indent=2, ensure_ascii=False)


def temp_tokenizer_dir() -> str:
    """A new temporary directory holding this tokenizer's files (for models without their own)."""
    directory = tempfile.mkdtemp(prefix="moejax-tok-")
    write_tokenizer(directory)
    return directory
