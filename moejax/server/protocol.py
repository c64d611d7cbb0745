"""OpenAI request validation (-> SamplingParams and prompt token ids), response and
stream-chunk builders, OpenAI-style errors, and incremental detokenization."""

from __future__ import annotations

import dataclasses
import time
import uuid

from moejax.engine.sampling_params import SamplingParams


class APIError(Exception):
    """Becomes {"error": {"message", "type", "param", "code"}} with HTTP `status`."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 type_: str = "invalid_request_error", code: str | int | None = None):
        super().__init__(message)
        self.message, self.status, self.param, self.type = message, status, param, type_
        self.code = code if code is not None else status

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None, code=None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


@dataclasses.dataclass
class ServingContext:
    model_names: tuple[str, ...]  # the first is reported; any is accepted in requests
    tokenizer: object
    max_model_len: int
    vocab_size: int


@dataclasses.dataclass
class ParsedRequest:
    chat: bool
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    logprobs: bool
    return_token_ids: bool
    model: str


_MISSING = object()


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _field(body: dict, key: str, check, what: str, default=None):
    v = body.get(key, _MISSING)
    if v is _MISSING or v is None:
        return default
    if not check(v):
        raise APIError(f"'{key}' must be {what}, got {type(v).__name__} {v!r}"[:300], param=key)
    return v


def _is_str_list(v) -> bool:
    return isinstance(v, list) and all(isinstance(s, str) for s in v)


def _is_int_list(v) -> bool:
    return isinstance(v, list) and all(_is_int(t) for t in v)


def _check_model(body: dict, ctx: ServingContext) -> str:
    model = _field(body, "model", lambda v: isinstance(v, str), "a string")
    if model is not None and model not in ctx.model_names:
        raise APIError(f"The model `{model}` does not exist.", status=404, param="model", code="model_not_found")
    return ctx.model_names[0]


def _prompt_ids(body: dict, ctx: ServingContext) -> list[int]:
    if "prompt" not in body or body["prompt"] is None:
        raise APIError("'prompt' is required", param="prompt")
    p = body["prompt"]
    if isinstance(p, list) and len(p) == 1 and (isinstance(p[0], str) or _is_int_list(p[0])):
        p = p[0]  # a batch of one prompt
    if isinstance(p, str):
        ids = ctx.tokenizer.encode(p)
    elif _is_int_list(p):
        ids = list(p)
    elif isinstance(p, list) and (all(isinstance(x, str) for x in p) or all(_is_int_list(x) for x in p)):
        raise APIError("only one prompt per request is supported; send several requests", param="prompt")
    else:
        raise APIError("'prompt' must be a string, a list of token ids, or a list holding one of those",
                       param="prompt")
    if not ids:
        raise APIError("'prompt' must not be empty", param="prompt")
    bad = [t for t in ids if not 0 <= t < ctx.vocab_size]
    if bad:
        raise APIError(f"prompt token ids must lie in [0, {ctx.vocab_size}); got {bad[0]}", param="prompt")
    return ids


def _content_text(content, i: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                raise APIError(f"messages[{i}].content: only text parts are supported", param="messages")
        return "".join(parts)
    raise APIError(f"messages[{i}].content must be a string or a list of text parts", param="messages")


def _chat_prompt_ids(body: dict, ctx: ServingContext) -> list[int]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise APIError("'messages' must be a non-empty list of messages", param="messages")
    clean = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError(f"messages[{i}] must be an object with a string 'role'", param="messages")
        clean.append({"role": m["role"], "content": _content_text(m.get("content"), i)})
    try:
        text = ctx.tokenizer.apply_chat_template(clean, add_generation_prompt=True)
    except ValueError as e:
        raise APIError(str(e), param="messages") from None
    except Exception as e:  # noqa: BLE001 - a template error on odd input is the client's problem
        raise APIError(f"chat template failed: {e}", param="messages") from None
    return ctx.tokenizer.encode(text, add_special_tokens=False)  # the template writes BOS itself


def _unsupported(body: dict, key: str, ok) -> None:
    if key in body and body[key] is not None and not ok(body[key]):
        raise APIError(f"'{key}'={body[key]!r} is not supported", param=key)


def parse_request(body, ctx: ServingContext, chat: bool) -> ParsedRequest:
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object")
    model = _check_model(body, ctx)
    ids = _chat_prompt_ids(body, ctx) if chat else _prompt_ids(body, ctx)
    n = len(ids)
    what = "messages" if chat else "prompt"
    if n >= ctx.max_model_len:
        raise APIError(f"This model's maximum context length is {ctx.max_model_len} tokens. However, your "
                       f"{what} has {n} tokens, which leaves no room for a completion.", param=what)

    num = _field(body, "n", _is_int, "an integer", 1)
    if num != 1:
        raise APIError("only n=1 is supported", param="n")
    _unsupported(body, "best_of", lambda v: v == 1)
    _unsupported(body, "echo", lambda v: v is False)
    _unsupported(body, "suffix", lambda v: False)
    _unsupported(body, "presence_penalty", lambda v: v == 0)
    _unsupported(body, "frequency_penalty", lambda v: v == 0)
    _unsupported(body, "repetition_penalty", lambda v: v == 1)
    _unsupported(body, "logit_bias", lambda v: v == {})
    _unsupported(body, "min_tokens", lambda v: v == 0)
    if chat:
        _unsupported(body, "tools", lambda v: v == [])

    key = "max_tokens"
    max_tokens = _field(body, "max_tokens", _is_int, "an integer")
    if chat and max_tokens is None:
        key = "max_completion_tokens"
        max_tokens = _field(body, key, _is_int, "an integer")
    room = ctx.max_model_len - n
    if max_tokens is None:
        max_tokens = room if chat else min(16, room)
    elif max_tokens < 1:
        raise APIError(f"'{key}' must be at least 1, got {max_tokens}", param=key)
    elif max_tokens > room:
        raise APIError(f"This model's maximum context length is {ctx.max_model_len} tokens. However, you "
                       f"requested {n + max_tokens} tokens ({n} in the {what}, {max_tokens} for the "
                       f"completion). Please reduce the length of the {what} or the completion.", param=key)

    if chat:
        logprobs = bool(_field(body, "logprobs", lambda v: isinstance(v, bool), "a boolean", False))
        _field(body, "top_logprobs", lambda v: _is_int(v) and 0 <= v <= 20, "an integer in [0, 20]")
    else:
        lp = _field(body, "logprobs", lambda v: _is_int(v) and 0 <= v <= 20, "an integer in [0, 20]")
        logprobs = lp is not None

    stream = _field(body, "stream", lambda v: isinstance(v, bool), "a boolean", False)
    so = _field(body, "stream_options", lambda v: isinstance(v, dict), "an object")
    if so is not None and not stream:
        raise APIError("'stream_options' can only be given when 'stream' is true", param="stream_options")
    include_usage = bool(_field(so or {}, "include_usage", lambda v: isinstance(v, bool), "a boolean", False))

    stop = _field(body, "stop", lambda v: isinstance(v, str) or _is_str_list(v), "a string or a list of strings")
    if isinstance(stop, str):
        stop = [stop]
    stop = [s for s in (stop or []) if s]
    kw = dict(
        max_new_tokens=max_tokens,
        temperature=_field(body, "temperature", _is_num, "a number", 1.0),
        top_p=_field(body, "top_p", _is_num, "a number", 1.0),
        top_k=_field(body, "top_k", _is_int, "an integer", 0),
        seed=_field(body, "seed", _is_int, "an integer"),
        stop=stop,
        stop_token_ids=_field(body, "stop_token_ids", _is_int_list, "a list of integers", []),
        ignore_eos=_field(body, "ignore_eos", lambda v: isinstance(v, bool), "a boolean", False),
        logprobs=logprobs,
    )
    if kw["temperature"] > 2:
        raise APIError(f"'temperature' must be in [0, 2], got {kw['temperature']}", param="temperature")
    try:
        params = SamplingParams(**kw)
    except ValueError as e:
        msg = str(e).replace("max_new_tokens", "max_tokens")
        field = msg.split(" ", 1)[0]
        raise APIError(msg, param=field if field in body else None) from None
    rti = _field(body, "return_token_ids", lambda v: isinstance(v, bool), "a boolean", False)
    return ParsedRequest(chat, ids, params, stream, include_usage, logprobs, rti, model)


# ----- responses ---------------------------------------------------------------------------

def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def token_str(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def completion_logprobs(tokens: list[str], lps: list[float], offset0: int = 0) -> dict:
    offsets, o = [], offset0
    for t in tokens:
        offsets.append(o)
        o += len(t)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": None, "text_offset": offsets}


def chat_logprobs(tokens: list[str], lps: list[float]) -> dict:
    return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode("utf-8")), "top_logprobs": []}
                        for t, lp in zip(tokens, lps)]}


def full_response(req: ParsedRequest, rid: str, text: str, token_ids: list[int], lps: list[float] | None,
                  finish_reason: str, tokenizer) -> dict:
    lp_obj = None
    if req.logprobs:
        toks = [token_str(tokenizer, t) for t in token_ids]
        lp_obj = chat_logprobs(toks, lps or []) if req.chat else completion_logprobs(toks, lps or [])
    if req.chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": lp_obj,
                  "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "text": text, "logprobs": lp_obj, "finish_reason": finish_reason}
    if req.return_token_ids:
        choice["token_ids"] = list(token_ids)
    out = {"id": rid, "object": "chat.completion" if req.chat else "text_completion", "created": int(time.time()),
           "model": req.model, "choices": [choice], "usage": usage(len(req.prompt_ids), len(token_ids))}
    if req.return_token_ids:
        out["prompt_token_ids"] = list(req.prompt_ids)
    return out


def stream_chunk(req: ParsedRequest, rid: str, created: int, delta_text: str | None, token_ids: list[int],
                 lps: list[float] | None, finish_reason: str | None, tokenizer, first: bool = False,
                 text_offset: int = 0) -> dict:
    lp_obj = None
    if req.logprobs and token_ids:
        toks = [token_str(tokenizer, t) for t in token_ids]
        lp_obj = chat_logprobs(toks, lps or []) if req.chat else completion_logprobs(toks, lps or [], text_offset)
    if req.chat:
        delta = {"role": "assistant", "content": ""} if first else (
            {"content": delta_text} if delta_text or finish_reason is None else {})
        choice = {"index": 0, "delta": delta, "logprobs": lp_obj, "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "text": delta_text or "", "logprobs": lp_obj, "finish_reason": finish_reason}
    if req.return_token_ids:
        choice["token_ids"] = list(token_ids)
    return {"id": rid, "object": "chat.completion.chunk" if req.chat else "text_completion", "created": created,
            "model": req.model, "choices": [choice], "usage": None}


def usage_chunk(req: ParsedRequest, rid: str, created: int, completion_tokens: int) -> dict:
    return {"id": rid, "object": "chat.completion.chunk" if req.chat else "text_completion", "created": created,
            "model": req.model, "choices": [], "usage": usage(len(req.prompt_ids), completion_tokens)}


class IncrementalText:
    """Streams text deltas from token ids without re-decoding the whole output each token: a small
    window of ids is decoded (vLLM's prefix/read offsets), so each token costs O(window).

    Never emits a partial UTF-8 character (a window ending in U+FFFD waits for more ids) nor text
    that could be the start of a stop string, so nothing past a stop string is ever sent."""

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer, self.stop = tokenizer, stop
        self.ids: list[int] = []
        self.prefix = self.read = 0
        self.text = ""  # decoded so far (complete characters)
        self.sent = ""

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix_text = self.tokenizer.decode(self.ids[self.prefix:self.read]) if self.read > self.prefix else ""
        new_text = self.tokenizer.decode(self.ids[self.prefix:])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self.text += new_text[len(prefix_text):]
            self.prefix, self.read = self.read, len(self.ids)
        text = self.text
        for s in self.stop:
            i = text.find(s, max(0, len(self.sent) - len(s)))
            if i >= 0:
                text = text[:i]
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
