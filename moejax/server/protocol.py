"""OpenAI request validation (-> SamplingParams and prompt token ids), the tokenizer endpoints and OpenAI-style
errors; responses.py builds the answers, incremental_text.py a stream's text deltas."""

from __future__ import annotations

import dataclasses
import json
import os
import time

from pydantic import ValidationError

from moejax.engine import sample_controls
from moejax.engine import parallel_sampling
from moejax.engine.sampling_params import SamplingParams
from moejax.json_file import load_json_file
from moejax.server import schemas
from moejax.server.chat_output import OutputParsing
from moejax.server.parsed_request import ParsedRequest
from moejax.server.responses import Output, token_str
from moejax.structured_output import Constraint, grammars_for

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
    defaults: dict = dataclasses.field(default_factory=dict)  # generation_config.json's: generation_defaults()
    reasoning_parser: type | None = None  # --reasoning-parser's class (reasoning_parsers.py)
    tool_parser: type | None = None  # --tool-call-parser's class (tool_parsers.py)
    enable_auto_tool_choice: bool = False  # --enable-auto-tool-choice: tool_choice "auto" parses calls

    @property
    def max_prompt_chars(self) -> int:
        """More characters than this cannot fit in max_model_len tokens (checked before tokenising)."""
        return self.max_model_len * max(getattr(self.tokenizer, "max_token_chars", 64), 1)


# generation_config.json keys the server applies (vLLM's --generation-config auto reads these)
_GENERATION_KEYS = ("temperature", "top_p", "top_k", "max_new_tokens", "repetition_penalty", "min_p")


def generation_defaults(source: str | None) -> dict:
    """The sampling defaults of requests that omit them: ``source`` "auto" or a directory holding a
    generation_config.json (absent: none), "vllm" none (vLLM's spellings of --generation-config)."""
    if source in (None, "vllm"):
        return {}
    path = os.path.join(source, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    cfg = load_json_file(path, "generation_config.json")
    out = {k: cfg[k] for k in _GENERATION_KEYS if cfg.get(k) is not None}
    SamplingParams(**out)  # a ValueError naming the key at start-up, not at every request
    return out


def check_model(model: str | None, ctx: ServingContext) -> str:
    if model is not None and model not in ctx.model_names:
        raise APIError(f"The model `{model}` does not exist.", status=404, param="model", code="model_not_found")
    return ctx.model_names[0]


def _check_chars(n_chars: int, ctx: ServingContext, what: str) -> None:
    if n_chars > ctx.max_prompt_chars:
        raise APIError(f"This model's maximum context length is {ctx.max_model_len} tokens. However, your {what} "
                       f"has {n_chars} characters, more than {ctx.max_model_len} tokens can hold.", param=what)


MAX_PROMPTS = 1024  # prompts in one completion request (lm-eval sends its --batch_size)


def _prompt_ids(p, ctx: ServingContext, add_special_tokens: bool, what: str) -> list[int]:
    if isinstance(p, str):
        _check_chars(len(p), ctx, "prompt")
        ids = ctx.tokenizer.encode(p, add_special_tokens=add_special_tokens)
    else:
        ids = list(p)
    if not ids:
        raise APIError(f"'{what}' must not be empty", param="prompt")
    bad = [t for t in ids if not 0 <= t < ctx.vocab_size]
    if bad:
        raise APIError(f"{what} token ids must lie in [0, {ctx.vocab_size}); got {bad[0]}", param="prompt")
    return ids


def _prompt_list(p, ctx: ServingContext, add_special_tokens: bool) -> list[list[int]]:
    """A completion's prompt (a string, token ids, or a list of either) -> one id list a prompt."""
    if p is None:
        raise APIError("'prompt' is required", param="prompt")
    if isinstance(p, list) and p and isinstance(p[0], (str, list)):  # a batch of prompts
        if len(p) > MAX_PROMPTS:
            raise APIError(f"at most {MAX_PROMPTS} prompts in one request, got {len(p)}", param="prompt")
        return [_prompt_ids(x, ctx, add_special_tokens, f"prompt[{i}]") for i, x in enumerate(p)]
    return [_prompt_ids(p, ctx, add_special_tokens, "prompt")]


def _content_text(content, i: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if part.type != "text" or part.text is None:
            raise APIError(f"messages[{i}].content: only text parts are supported", param="messages")
        parts.append(part.text)
    return "".join(parts)


_TEMPLATE_OWN = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token", "raise_exception")


def _template_message(m, i: int) -> dict:
    """A message as HF chat templates read it: content as text, the optional fields only when given."""
    d = {"role": m.role, "content": _content_text(m.content, i)}
    for key in ("name", "tool_calls", "tool_call_id"):
        v = getattr(m, key)
        if v is not None:
            d[key] = v
    return d


def _chat_prompt_ids(body, ctx: ServingContext) -> list[int]:
    msgs = body.messages
    if not msgs:
        raise APIError("'messages' must be a non-empty list of messages", param="messages")
    clean = [_template_message(m, i) for i, m in enumerate(msgs)]
    _check_chars(sum(len(m["content"]) for m in clean), ctx, "messages")
    kwargs = body.chat_template_kwargs or {}
    clash = [k for k in kwargs if k in _TEMPLATE_OWN]
    if clash:
        raise APIError(f"'chat_template_kwargs' may not set {clash[0]!r}: the server sets it", param="chat_template_kwargs")
    try:
        # tools as HF's apply_chat_template passes them: the list of definitions, or None
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if getattr(body, "tools", None) else None
        text = ctx.tokenizer.apply_chat_template(clean, add_generation_prompt=body.add_generation_prompt, tools=tools,
                                                 **kwargs)
    except ValueError as e:
        raise APIError(str(e), param="messages") from None
    except Exception as e:  # noqa: BLE001 - a template error on odd input is the client's problem
        raise APIError(f"chat template failed: {e}", param="messages") from None
    # the template writes BOS itself; add_special_tokens (vLLM's, default false) adds it again
    return ctx.tokenizer.encode(text, add_special_tokens=bool(body.add_special_tokens))


def parse_request(raw: bytes, ctx: ServingContext, chat: bool) -> ParsedRequest:
    """The raw JSON body -> a ParsedRequest (tokenised). CPU-bound: the app runs it in a worker thread."""
    body = _validate(schemas.ChatCompletionRequest if chat else schemas.CompletionRequest, raw)
    model = check_model(body.model, ctx)
    _refuse_unsupported(body)
    logprobs, top_n = _logprobs_asked(body, chat)
    prompts = _request_prompts(body, ctx, chat)
    max_tokens, echo_only = _max_tokens(body, ctx, chat, max(len(ids) for ids in prompts))
    params = _sampling_params(body, ctx, max_tokens, logprobs, top_n)
    so = body.stream_options
    req = ParsedRequest(chat, prompts, params, body.stream, so.include_usage if so else False, logprobs,
                         body.return_token_ids, model, top_n, body.return_tokens_as_token_ids,
                         so.continuous_usage_stats if so else False, body.request_id,
                        _output_parsing(body, ctx) if chat else None)
    return _with_samples(req, body, ctx, echo_only)


def _refuse_unsupported(body) -> None:
    """A 400 for a field this server does not honour (refused rather than ignored) and for stream_options
    without a stream."""
    refused = schemas.refused_field(body)
    if refused is not None:
        key, v = refused
        neutral = schemas.NEUTRAL_ONLY[key]
        raise APIError(f"'{key}'={v!r}"[:200] + f" is not supported by this server (only {neutral!r}); it is "
                       "refused rather than ignored", param=key)
    if body.stream_options is not None and not body.stream:
        raise APIError("'stream_options' can only be given when 'stream' is true", param="stream_options")


def _logprobs_asked(body, chat: bool) -> tuple[bool, int]:
    """(the sampled token's logprob asked, how many alternatives): chat's logprobs / top_logprobs, a
    completion's logprobs N (the sampled token's and N alternatives)."""
    if not chat:
        return body.logprobs is not None, body.logprobs or 0
    top_n = body.top_logprobs or 0
    if top_n and not body.logprobs:  # as OpenAI and vLLM: no silent null
        raise APIError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    return body.logprobs, top_n


def _request_prompts(body, ctx: ServingContext, chat: bool) -> list[list[int]]:
    """The request's prompts as token ids (truncated as asked), each leaving room for a completion."""
    if chat:
        prompts = [_chat_prompt_ids(body, ctx)]
    else:
        prompts = _prompt_list(body.prompt, ctx, add_special_tokens=body.add_special_tokens is not False)
    if body.truncate_prompt_tokens is not None:
        prompts = [ids[-body.truncate_prompt_tokens:] for ids in prompts]  # vLLM's rule: the last N tokens
    if body.stream and len(prompts) > 1:
        raise APIError("a list of prompts cannot be streamed (stream: false, or one request a prompt)",
                       param="prompt")
    n = max(len(ids) for ids in prompts)
    what = "messages" if chat else "prompt"
    if n >= ctx.max_model_len:
        raise APIError(f"This model's maximum context length is {ctx.max_model_len} tokens. However, your "
                       f"{what} has {n} tokens, which leaves no room for a completion.", param=what)
    return prompts


def _max_tokens(body, ctx: ServingContext, chat: bool, n: int) -> tuple[int, bool]:
    """(the completion's token budget, whether only the prompt is echoed) for a longest prompt of ``n``
    tokens: the request's max_tokens (chat: or max_completion_tokens), else the server's default, within
    the context."""
    key, max_tokens = "max_tokens", body.max_tokens
    if chat and max_tokens is None:
        key, max_tokens = "max_completion_tokens", body.max_completion_tokens
    echo_only = not chat and body.echo is True and max_tokens == 0  # vLLM's: the prompt alone
    if echo_only:
        max_tokens = 1  # the prefill samples a token anyway; sample_outputs drops it
    room = ctx.max_model_len - n
    what = "messages" if chat else "prompt"
    if max_tokens is None:
        max_tokens = min(ctx.defaults.get("max_new_tokens", room if chat else 16), room)
    elif max_tokens < 1:
        raise APIError(f"'{key}' must be at least 1, got {max_tokens}", param=key)
    elif max_tokens > room:
        raise APIError(f"This model's maximum context length is {ctx.max_model_len} tokens. However, you "
                       f"requested {n + max_tokens} tokens ({n} in the {what}, {max_tokens} for the "
                       f"completion). Please reduce the length of the {what} or the completion.", param=key)
    return max_tokens, echo_only


def _sampling_params(body, ctx: ServingContext, max_tokens: int, logprobs: bool, top_n: int) -> SamplingParams:
    """The request's SamplingParams (the server's defaults where it gives none), checked and prepared; a
    400 naming the field SamplingParams refuses."""
    stop = [body.stop] if isinstance(body.stop, str) else (body.stop or [])
    kw = dict(
        max_new_tokens=max_tokens,
        temperature=ctx.defaults.get("temperature", 1.0) if body.temperature is None else body.temperature,
        top_p=ctx.defaults.get("top_p", 1.0) if body.top_p is None else body.top_p,
        top_k=ctx.defaults.get("top_k", 0) if body.top_k is None else body.top_k,
        seed=body.seed,
        stop=[x for x in stop if x],
        stop_token_ids=body.stop_token_ids or [],
        ignore_eos=body.ignore_eos,
        logprobs=logprobs,
        top_logprobs=top_n,
        include_stop_str_in_output=bool(body.include_stop_str_in_output),
        skip_special_tokens=body.skip_special_tokens is not False,
        structured_outputs=_constraint(body, ctx),
        **_controls(body, ctx),
    )
    try:
        params = SamplingParams(**kw)
        sample_controls.prepare(params, ctx.tokenizer, ctx.vocab_size, ())  # token ids, bad words' tokens
    except ValueError as e:
        msg = str(e).replace("max_new_tokens", "max_tokens")
        field = msg.split(" ", 1)[0].rstrip(":")
        raise APIError(msg, param=field if field in body.model_fields_set else None) from None
    return params


def _tool_choice(body):
    """The request's tool_choice by vLLM's rules: "auto" when tools are given without one, "none" without
    tools; "required" with an empty tools list is "none"; a named function must be one of the tools."""
    tools = getattr(body, "tools", None)
    choice = getattr(body, "tool_choice", None)
    if choice is None:
        return "auto" if tools else "none"
    if choice == "required" and tools == []:
        return "none"
    if choice != "none" and not tools:
        raise APIError("When using 'tool_choice', 'tools' must be set.", param="tool_choice")
    if not isinstance(choice, str) and choice.function.name not in {t.function.name for t in tools}:
        raise APIError(f"tool_choice names {choice.function.name!r}, which is not one of the tools", param="tool_choice")
    return choice


def _tool_constraint(body) -> Constraint | None:
    """tool_choice "required" or a named function: the grammar that makes the answer the call (vLLM's: a named
    function's arguments as its parameters' schema; "required": a JSON array of {"name", "parameters"}), with no
    free whitespace (vLLM allows it): the arguments are read by programs, and a model that rambles in whitespace
    cannot then run to max_tokens inside the call."""
    choice = _tool_choice(body)
    if choice in ("none", "auto"):
        return None
    fns = {t.function.name: t.function.parameters or {"type": "object"} for t in body.tools}
    if choice != "required":
        return Constraint("json", json.dumps(fns[choice.function.name]), any_whitespace=False)
    items = [{"type": "object", "properties": {"name": {"type": "string", "enum": [name]}, "parameters": params},
              "required": ["name", "parameters"]} for name, params in fns.items()]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if body.parallel_tool_calls is False:
        schema["maxItems"] = 1
    return Constraint("json", json.dumps(schema), any_whitespace=False)


def _output_parsing(body, ctx: ServingContext) -> OutputParsing | None:
    """What the chat answer is parsed for, from tools / tool_choice / parallel_tool_calls / include_reasoning and
    the server's parsers (vLLM's rules: tools default tool_choice to "auto", which needs
    --enable-auto-tool-choice and --tool-call-parser); None: the answer is all content."""
    tools = body.tools or None
    choice = _tool_choice(body)
    param = "tool_choice" if body.tool_choice is not None else "tools"
    if choice == "auto" and not (ctx.enable_auto_tool_choice and ctx.tool_parser is not None):
        raise APIError('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set '
                       "(tool_choice \"none\" passes the tools to the chat template only)", param=param)
    if body.include_reasoning is False and ctx.reasoning_parser is None:
        raise APIError("'include_reasoning' false needs the server started with --reasoning-parser (without one the "
                       "reasoning is part of the content)", param="include_reasoning")
    if choice not in ("none", "auto"):  # the grammar (_constraint) makes the answer the call(s)
        return OutputParsing(ctx.reasoning_parser, include_reasoning=body.include_reasoning is not False,
                             forced="required" if choice == "required" else choice.function.name)
    strict = [t.function.name for t in tools or () if t.function.strict]
    if strict and choice == "auto":
        raise APIError(f"tools[].function.strict true ({strict[0]!r}): \"auto\" calls are not held to their schema "
                       "by a grammar here (a named function or \"required\" is); it is refused rather than ignored",
                       param="tools")
    if ctx.reasoning_parser is None and choice != "auto":
        return None
    return OutputParsing(ctx.reasoning_parser, ctx.tool_parser if choice == "auto" else None,
                         tuple(t.model_dump(exclude_none=True) for t in tools or ()),
                         body.include_reasoning is not False, body.parallel_tool_calls is not False)


# vLLM's structured-output fields: one of them at a time (a response_format of type text is none)
_STRUCTURED = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
               "guided_grammar")


def _constraint(body, ctx: ServingContext) -> Constraint | None:
    """The request's structured output, compiled here (the engine finds it compiled) so that a bad one, or
    xgrammar missing, is a 400 naming its field."""
    given = [k for k in _STRUCTURED if getattr(body, k) is not None
             and not (k == "response_format" and body.response_format.type == "text")]
    forced = _tool_constraint(body)
    if forced is not None:
        if given:
            raise APIError(f"'{given[0]}' cannot go with a tool_choice that forces a call (that is a grammar too)",
                           param=given[0])
        given = ["tool_choice"]
    if not given:
        return None
    key = given[0]
    if len(given) > 1:
        raise APIError(f"only one structured output may be given; got {', '.join(given)}", param=given[1])
    for name in ("ignore_eos", "min_tokens"):  # structured_output.check_request's rule, with the right param
        if getattr(body, name):
            raise APIError(f"'{name}' cannot go with '{key}': a structured output ends with EOS once its grammar "
                           "is complete", param=name)
    try:
        c = forced or _constraint_of(key, getattr(body, key))
        grammars_for(ctx.tokenizer, ctx.vocab_size).compile(c)
        if ctx.reasoning_parser is not None:  # the grammar holds the answer after the thinking (vLLM's rule)
            c = dataclasses.replace(c, after=ctx.reasoning_parser.end)
    except ValueError as e:
        raise APIError(f"'{key}': {e}", param=key) from None
    return c


def _constraint_of(key: str, v) -> Constraint:
    def schema(s):
        return s if isinstance(s, str) else json.dumps(s)
    if key == "response_format":
        if v.type == "json_object":
            return Constraint("json_object")
        if v.json_schema is None:
            raise ValueError("type json_schema needs 'json_schema': {\"name\": ..., \"schema\": {...}}")
        return Constraint("json", json.dumps(v.json_schema.schema_))
    if key == "structured_outputs":
        kinds = {"json": v.json_, "regex": v.regex, "choice": v.choice, "grammar": v.grammar,
                 "json_object": v.json_object or None}
        chosen = [k for k, x in kinds.items() if x is not None]
        if len(chosen) != 1:
            raise ValueError(f"exactly one of json, regex, choice, grammar, json_object (true) is needed; got "
                             f"{chosen or 'none'}")
        k, ws = chosen[0], not v.disable_any_whitespace
        if k == "choice":
            return Constraint.choice(v.choice)
        return Constraint(k, "" if k == "json_object" else schema(kinds[k]) if k == "json" else kinds[k],
                          any_whitespace=ws)
    if key == "guided_json":
        return Constraint("json", schema(v))
    if key == "guided_choice":
        return Constraint.choice(v)
    return Constraint("regex" if key == "guided_regex" else "grammar", v)


def _controls(body, ctx: ServingContext) -> dict:
    """The sampling controls' SamplingParams fields (engine/sample_controls.py): logit_bias' keys, token ids
    as strings (OpenAI's), made integers; repetition_penalty and min_p default to generation_config.json's."""
    bias = None
    if body.logit_bias is not None:
        bias = {}
        for k, v in body.logit_bias.items():
            if not k.isdigit():
                raise APIError(f"'logit_bias' keys must be token ids (non-negative integers as strings), "
                               f"got {k!r}"[:200], param="logit_bias")
            bias[int(k)] = v
    d = ctx.defaults
    return dict(
        presence_penalty=body.presence_penalty or 0.0, frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=d.get("repetition_penalty", 1.0) if body.repetition_penalty is None
        else body.repetition_penalty,
        min_p=d.get("min_p", 0.0) if body.min_p is None else body.min_p,
        logit_bias=bias, min_tokens=body.min_tokens or 0, allowed_token_ids=body.allowed_token_ids,
        bad_words=body.bad_words or [],
    )


# ----- samples of each prompt (n, best_of), echo, prompt logprobs --------------------------------

def _with_samples(req: ParsedRequest, body, ctx: ServingContext, echo_only: bool) -> ParsedRequest:
    """n / best_of (engine/parallel_sampling.py), completions' echo and vLLM's prompt_logprobs, checked with
    vLLM's rules; the engine computes the most prompt alternatives either asks for."""
    n = 1 if body.n is None else body.n
    try:
        runs = parallel_sampling.check(n, body.best_of)
    except ValueError as e:
        raise APIError(str(e), param=str(e).split(" ", 1)[0]) from None
    if body.stream and runs > n:
        raise APIError("'best_of' larger than 'n' cannot be streamed: the best are known only at the end",
                       param="best_of")
    if len(req.prompts) * runs > MAX_PROMPTS:
        raise APIError(f"{len(req.prompts)} prompt(s) x {runs} samples is more than {MAX_PROMPTS} sequences",
                       param="best_of" if body.best_of is not None else "n")
    echo = bool(body.echo)
    k = body.prompt_logprobs
    if k is not None and k > 0 and body.stream:  # 0 (each token's own logprob and rank) is streamed
        raise APIError("'prompt_logprobs' above 0 are not available when 'stream' is true (vLLM's rule)",
                       param="prompt_logprobs")
    # a completion's echo with logprobs shows its prompt tokens' (chat's echo is the content only, as vLLM's)
    want = [x for x in (k, req.top_logprobs if echo and req.logprobs and not req.chat else None) if x is not None]
    params = dataclasses.replace(req.params, prompt_logprobs=max(want)) if want else req.params
    texts = None
    if echo:
        texts = [_chat_echo_text(body)] if req.chat else _echo_texts(body, req.prompts, ctx.tokenizer)
    return dataclasses.replace(req, params=params, n=n, best_of=runs, echo=echo, echo_only=echo_only,
                               prompt_logprobs=k, prompt_texts=texts)


def _chat_echo_text(body) -> str:
    """vLLM's chat echo: the last message's content when its role is the answer's (the assistant's with
    add_generation_prompt, else the last message's own: the answer continues it), else nothing."""
    last = body.messages[-1]
    role = "assistant" if body.add_generation_prompt else last.role
    return _content_text(last.content, len(body.messages) - 1) if last.role == role else ""


def _echo_texts(body, prompts: list[list[int]], tokenizer) -> list[str]:
    """Each prompt as echoed: the string given (vLLM's), else (token ids, a truncated prompt) its decoding."""
    p = body.prompt
    given = [p] if isinstance(p, str) or isinstance(p[0], int) else list(p)
    return [g if isinstance(g, str) and body.truncate_prompt_tokens is None
            else tokenizer.decode(ids, skip_special_tokens=False) for g, ids in zip(given, prompts)]


def sample_outputs(req: ParsedRequest, outputs: list[Output]) -> list[Output]:
    """The choices of a request's sequences (req.best_of a prompt, in prompt order): each prompt's best n,
    prompt i's j-th at i * n + j (vLLM's index rule), each with its prompt's logprobs (its first sample's)."""
    out = []
    for i in range(len(req.prompts)):
        group = outputs[i * req.best_of:(i + 1) * req.best_of]
        # an engine that does not give them (a disaggregated router: the prefill worker keeps its rows): refused
        if req.params.prompt_logprobs is not None and group[0].prompt_logprobs is None:
            raise APIError("prompt logprobs are not served by this server's engine (a disaggregated server's prefill "
                           "worker keeps them); it is refused rather than ignored",
                           param="prompt_logprobs" if req.prompt_logprobs is not None else "echo")
        if req.best_of > req.n and any(o.cumulative_logprob is None for o in group):
            raise APIError("best_of is not served by this server's engine (no cumulative logprobs); it is refused "
                           "rather than ignored", param="best_of")
        for k in parallel_sampling.best([o.cumulative_logprob for o in group], req.n):
            o = dataclasses.replace(group[k], prompt_logprobs=group[0].prompt_logprobs)
            if req.echo_only:  # max_tokens 0: the token the prefill sampled is not part of the answer
                o = dataclasses.replace(o, text="", token_ids=[], lps=[], tops=[], finish_reason="length")
            out.append(o)
    return out


# ----- the tokenizer endpoints (vLLM's /tokenize, /detokenize, /tokenizer_info) --------------

def _validate(cls, raw: bytes):
    try:
        return cls.model_validate_json(raw)
    except ValidationError as e:
        msg, param = schemas.describe(e)
        raise APIError(msg, param=param) from None


def tokenize(raw: bytes, ctx: ServingContext) -> dict:
    """A prompt (or messages, through the chat template) -> its token ids, as the generation endpoints
    tokenise it."""
    try:  # the form is told by its keys; a body that is no JSON object gets pydantic's error below
        chat = "messages" in json.loads(raw)
    except (ValueError, TypeError):
        chat = False
    body = _validate(schemas.TokenizeChatRequest if chat else schemas.TokenizeCompletionRequest, raw)
    check_model(body.model, ctx)
    if chat:
        ids = _chat_prompt_ids(body, ctx)
    else:
        _check_chars(len(body.prompt), ctx, "prompt")
        ids = ctx.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    strs = [token_str(ctx.tokenizer, t) for t in ids] if body.return_token_strs else None
    return {"count": len(ids), "max_model_len": ctx.max_model_len, "tokens": ids, "token_strs": strs}


def detokenize(raw: bytes, ctx: ServingContext) -> dict:
    body = _validate(schemas.DetokenizeRequest, raw)
    check_model(body.model, ctx)
    bad = [t for t in body.tokens if t >= ctx.vocab_size]
    if bad:
        raise APIError(f"token ids must lie in [0, {ctx.vocab_size}); got {bad[0]}", param="tokens")
    return {"prompt": ctx.tokenizer.decode(body.tokens)}


def tokenizer_info(ctx: ServingContext) -> dict:
    tok = ctx.tokenizer
    return {"tokenizer_class": type(tok).__name__, "bos_token": tok.bos_token, "eos_token": tok.eos_token,
            "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "add_bos_token": tok.add_bos_token,
            "chat_template": tok.chat_template, "model_max_length": ctx.max_model_len,
            "vocab_size": tok.vocab_size}


def model_card(ctx: ServingContext) -> dict:
    return {"id": ctx.model_names[0], "object": "model", "created": int(time.time()), "owned_by": "moejax",
            "root": ctx.model_names[-1], "max_model_len": ctx.max_model_len}
