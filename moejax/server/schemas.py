"""The OpenAI request bodies of /v1/completions and /v1/chat/completions as pydantic models.

Parsed straight from the raw body (``model_validate_json``: pydantic's Rust JSON parser), so
lone surrogates, NaN / Infinity and nesting deeper than its recursion limit are refused as
invalid JSON, never reach Python as odd objects, and cannot raise a RecursionError. Strict
types: no bool for an int, no float for an int, no string for a number. Every integer is
bounded to what the engine and its kernels take (int32 for top_k), every float finite.
Every field is honoured or refused, never ignored (vLLM warns and ignores unknown ones; a
client then gets silently wrong output): a field no class declares is refused with a 400
naming it, and each declared field is either in HONOURED or in NEUTRAL_ONLY (refused with a
400 naming it unless it has the neutral value that changes nothing). tests/test_api_fields.py
checks that the two tables cover every field and vLLM's request fields.
Cross-field rules (lengths against max_model_len, ...) stay in protocol.py.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from moejax.layers.sampler import MAX_TOP_LOGPROBS

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1

TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
Count = Annotated[int, Field(ge=-INT32_MAX, le=INT32_MAX)]  # range checked in protocol.py with its message


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid")


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # usage in every chunk too


class JsonSchemaFormat(_Body):
    name: str | None = None  # OpenAI's label of the schema (no effect on the output)
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None  # the output always matches the schema here (the grammar holds it)


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsParams(_Body):
    """vLLM's structured_outputs: exactly one constraint."""
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF (xgrammar's)
    json_object: bool | None = None
    disable_any_whitespace: bool = False


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
    # the sampling controls (SamplingParams' fields; protocol.py: token ids against the vocabulary)
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0, le=100)] | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None  # token id (a string) -> bias
    min_tokens: Count | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    allowed_token_ids: list[TokenId] | None = None
    bad_words: list[str] | None = None
    best_of: Count | None = None  # sequences run a prompt, its n best returned (engine/parallel_sampling.py)
    # vLLM's sampling and extra params; typed Any where only the neutral value is taken, so the
    # refusal names the field whatever the value's type
    truncate_prompt_tokens: Annotated[int, Field(ge=1, le=INT32_MAX)] | None = None
    add_special_tokens: bool | None = None
    use_beam_search: Any = None
    length_penalty: Any = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: Any = None
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None  # vLLM's
    # structured outputs, one of them at a time (protocol.py -> moejax/structured_output.py)
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: Literal["xgrammar", "auto"] | None = None  # xgrammar: the one backend here
    guided_whitespace_pattern: Any = None
    structural_tag: Any = None
    structured_outputs: StructuredOutputsParams | None = None
    priority: Any = None
    request_id: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    logits_processors: Any = None
    cache_salt: Any = None
    kv_transfer_params: Any = None
    vllm_xargs: Any = None


class CompletionRequest(_Sampling):
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]] | None = None
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    echo: bool | None = None
    suffix: str | None = None
    prompt_embeds: Any = None


class TextPart(_Body):
    type: str
    text: str | None = None


class ChatMessage(_Body):
    """Every field goes to the chat template (a template that does not read one drops it, as in HF)."""
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool message's answer to one


class FunctionDefinition(_Body):
    name: Annotated[str, Field(min_length=1, max_length=256)]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # its arguments' JSON schema (the chat template shows it)
    strict: bool | None = None  # true: protocol.py refuses it (no grammar holds "auto" calls to the schema)


class ToolDefinition(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Body):
    name: Annotated[str, Field(min_length=1, max_length=256)]


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] | None = None
    max_completion_tokens: Count | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    echo: bool | None = None  # vLLM's: the last message's content before the answer's
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: Any = None
    function_call: Any = None
    reasoning_effort: Any = None
    include_reasoning: bool | None = None
    continue_final_message: Any = None
    documents: Any = None
    chat_template: Any = None
    mm_processor_kwargs: Any = None


class TokenizeCompletionRequest(_Body):
    """POST /tokenize with a prompt (vLLM's form)."""
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_Body):
    """POST /tokenize with messages: the prompt the chat endpoint would build."""
    model: str | None = None
    messages: list[ChatMessage]
    tools: list[ToolDefinition] | None = None  # given to the chat template, as the chat endpoint does
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = False
    return_token_strs: bool = False


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[TokenId]


# Where each request field takes effect (protocol.py unless said otherwise).
HONOURED = {
    "model": "checked against the served names",
    "prompt": "tokenised (or token ids)", "messages": "through the chat template",
    "max_tokens": "SamplingParams.max_new_tokens", "max_completion_tokens": "chat's max_tokens",
    "temperature": "sampler", "top_p": "sampler", "top_k": "sampler", "seed": "sampler's per-request key",
    "stream": "app.py: SSE", "stream_options": "app.py: usage chunks", "stop": "engine's stop strings",
    "stop_token_ids": "engine", "ignore_eos": "engine", "logprobs": "sampler", "top_logprobs": "sampler",
    "return_token_ids": "response", "return_tokens_as_token_ids": "response's logprobs",
    "user": "an end-user id for the operator's logs (OpenAI: no effect on the output)",
    "truncate_prompt_tokens": "keeps the prompt's last N tokens",
    "add_special_tokens": "tokeniser (completions: default true, chat: default false)",
    "add_generation_prompt": "chat template", "chat_template_kwargs": "chat template's variables",
    "request_id": "the response's id (cmpl-<id> / chatcmpl-<id>, vLLM's)",
    "n": "samples of each prompt (engine/parallel_sampling.py), the prompt prefilled once",
    "best_of": "samples run, the n of highest cumulative logprob returned",
    "echo": "completions: the prompt (text, logprobs) before the completion; chat: the last message's content "
            "(responses.py)",
    "prompt_logprobs": "each prompt token's logprob and top N, from the prefill (engine/prompt_logprobs.py); "
                       "streamed: 0 only (vLLM's), in each choice's first chunk",
    "include_stop_str_in_output": "engine's stop cut and the stream's", "skip_special_tokens": "detokenisation",
    "tools": "chat template; parsed from the answer with --tool-call-parser (chat_output.py)",
    "tool_choice": "none: not parsed; auto: --enable-auto-tool-choice's parser", "parallel_tool_calls": "false: the first call only",
    "include_reasoning": "false: reasoning_content left out (--reasoning-parser)",
    "response_format": "json_object / json_schema: structured outputs (moejax/structured_output.py)",
    "structured_outputs": "json / regex / choice / grammar / json_object (moejax/structured_output.py)",
    "guided_json": "structured outputs", "guided_regex": "structured outputs", "guided_choice": "structured outputs",
    "guided_grammar": "structured outputs", "guided_decoding_backend": "xgrammar, the one backend",
    "presence_penalty": "sampler (controls)", "frequency_penalty": "sampler (controls)",
    "repetition_penalty": "sampler (controls)", "logit_bias": "sampler (controls)",
    "min_tokens": "sampler's mask of EOS and stop_token_ids", "min_p": "sampler (controls)",
    "allowed_token_ids": "sampler's mask", "bad_words": "sampler (tokenised as vLLM does)",
}

# Refused (400 naming the field) unless given this value, which is what the server does anyway.
NEUTRAL_ONLY = {
    "suffix": None, "prompt_embeds": None,
    "use_beam_search": False, "length_penalty": 1,
    "spaces_between_special_tokens": True,
    "guided_whitespace_pattern": None, "structural_tag": None, "priority": 0,
    "logits_processors": None, "cache_salt": None, "kv_transfer_params": None, "vllm_xargs": None,
    "functions": None, "function_call": None,
    "reasoning_effort": None, "continue_final_message": False,
    "documents": None, "chat_template": None, "mm_processor_kwargs": None,
}


def refused_field(body: BaseModel) -> tuple[str, Any] | None:
    """The first field given a value this server does not carry out (NEUTRAL_ONLY), with that value."""
    for key, neutral in NEUTRAL_ONLY.items():
        v = getattr(body, key, None)
        if v is not None and v != neutral:
            return key, v
    return None


def describe(e: ValidationError) -> tuple[str, str | None]:
    """(message, param) of a pydantic error, in OpenAI terms: the first failing field is the param."""
    errs = e.errors(include_url=False)
    first = errs[0]
    if first["type"] == "json_invalid":
        return f"malformed JSON body: {first['msg'].removeprefix('Invalid JSON: ')}", None
    if first["type"] == "model_type" and not first["loc"]:
        return "the request body must be a JSON object", None
    loc = first["loc"]
    if first["type"] == "extra_forbidden":
        where = ".".join(str(p) for p in loc)
        return f"'{where}' is not a field this server knows; it is refused rather than ignored", str(loc[0])
    param = str(loc[0]) if loc else None
    where = ".".join(str(p) for p in loc) or "body"
    msg = first["msg"]
    # a union (e.g. prompt) reports every branch; the first says enough, the count tells it was a union
    more = f" (and {len(errs) - 1} other problem(s))" if len(errs) > 1 else ""
    inp = repr(first.get("input"))[:80]
    return f"'{where}': {msg}, got {inp}{more}", param
