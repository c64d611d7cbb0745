"""The OpenAI request bodies of /v1/completions and /v1/chat/completions as pydantic models.

Parsed straight from the raw body (``model_validate_json``: pydantic's Rust JSON parser), so
lone surrogates, NaN / Infinity and nesting deeper than its recursion limit are refused as
invalid JSON, never reach Python as odd objects, and cannot raise a RecursionError. Strict
types: no bool for an int, no float for an int, no string for a number. Every integer is
bounded to what the engine and its kernels take (int32 for top_k), every float finite.
Unknown fields are kept in ``model_extra`` and ignored (with a warning), as vLLM does.
Cross-field rules (lengths against max_model_len, n=1, ...) stay in protocol.py.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from moejax.layers.sampler import MAX_TOP_LOGPROBS

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1

TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
Count = Annotated[int, Field(ge=-INT32_MAX, le=INT32_MAX)]  # range checked in protocol.py with its message


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="allow")


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    model: str | None = None
    max_tokens: Count | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=INT32_MAX)] | None = None
    n: Count | None = None
    seed: Annotated[int, Field(ge=0, le=INT64_MAX)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False  # vLLM's: logprobs name tokens "token_id:<id>"
    user: str | None = None
    # accepted only at their neutral values (protocol.py says which)
    best_of: Count | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0, le=100)] | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    min_tokens: Count | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]] | None = None
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    echo: bool | None = None
    suffix: str | None = None


class TextPart(_Body):
    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] | None = None
    max_completion_tokens: Count | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    tools: list[Any] | None = None


def describe(e: ValidationError) -> tuple[str, str | None]:
    """(message, param) of a pydantic error, in OpenAI terms: the first failing field is the param."""
    errs = e.errors(include_url=False)
    first = errs[0]
    if first["type"] == "json_invalid":
        return f"malformed JSON body: {first['msg'].removeprefix('Invalid JSON: ')}", None
    if first["type"] == "model_type" and not first["loc"]:
        return "the request body must be a JSON object", None
    loc = first["loc"]
    param = str(loc[0]) if loc else None
    where = ".".join(str(p) for p in loc) or "body"
    msg = first["msg"]
    # a union (e.g. prompt) reports every branch; the first says enough, the count tells it was a union
    more = f" (and {len(errs) - 1} other problem(s))" if len(errs) > 1 else ""
    inp = repr(first.get("input"))[:80]
    return f"'{where}': {msg}, got {inp}{more}", param
