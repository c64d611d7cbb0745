"""Every request field of /v1/completions and /v1/chat/completions is honoured or refused, never
ignored: the schema's fields are exactly schemas.HONOURED + schemas.NEUTRAL_ONLY, they cover
OpenAI's and vLLM's request fields, each NEUTRAL_ONLY field with another value is refused with a
400 naming it, an unknown field too; the cheap honoured ones (truncate_prompt_tokens,
add_special_tokens, add_generation_prompt, chat_template_kwargs, messages' name / tool_calls /
tool_call_id, stream_options.continuous_usage_stats) take effect."""

import json
import urllib.error
import urllib.request

import pytest
from pydantic import BaseModel

import moejax
from moejax.server import schemas
from moejax.server.app import ServerThread
from moejax.server.incremental_text import IncrementalText
from moejax.server.protocol import APIError, ServingContext, parse_request
from moejax.tiny.checkpoint import make_random_checkpoint
from moejax.tiny.presets import preset
from moejax.tokenizer import Tokenizer

import openai  # noqa: E402  (in the test extra)
from conftest import openai_client, serving  # noqa: E402

NAME = "tiny-fields"
MAX_LEN = 128

# vLLM's CompletionRequest / ChatCompletionRequest fields (vllm/entrypoints/openai/protocol.py, v0.10),
# OpenAI's own included, plus vLLM's newer structured_outputs
VLLM_COMMON = {
    "model", "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "n", "presence_penalty", "seed", "stop",
    "stream", "stream_options", "temperature", "top_p", "user", "best_of", "use_beam_search", "top_k", "min_p",
    "repetition_penalty", "length_penalty", "stop_token_ids", "include_stop_str_in_output", "ignore_eos",
    "min_tokens", "skip_special_tokens", "spaces_between_special_tokens", "truncate_prompt_tokens",
    "allowed_token_ids", "prompt_logprobs", "add_special_tokens", "response_format", "guided_json",
    "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend", "guided_whitespace_pattern",
    "priority", "request_id", "logits_processors", "return_tokens_as_token_ids", "cache_salt",
    "kv_transfer_params", "vllm_xargs", "echo", "structured_outputs",
}
VLLM_COMPLETION = VLLM_COMMON | {"prompt", "prompt_embeds", "suffix"}
VLLM_CHAT = VLLM_COMMON | {
    "messages", "top_logprobs", "max_completion_tokens", "tools", "tool_choice", "reasoning_effort",
    "include_reasoning", "parallel_tool_calls", "bad_words", "add_generation_prompt", "continue_final_message",
    "documents", "chat_template", "chat_template_kwargs", "mm_processor_kwargs", "structural_tag",
    "functions", "function_call",
}
VLLM_STREAM_OPTIONS = {"include_usage", "continuous_usage_stats"}

# a value other than the neutral one, per NEUTRAL_ONLY field
NOT_NEUTRAL = {
    "suffix": "x", "prompt_embeds": "AAAA",
    "use_beam_search": True, "length_penalty": 0.5,
    "spaces_between_special_tokens": False,
    "guided_whitespace_pattern": " ", "structural_tag": "{}",
    "priority": 1, "logits_processors": ["m.P"], "cache_salt": "salt",
    "kv_transfer_params": {"a": 1}, "vllm_xargs": {"a": 1},
    "functions": [{"name": "f"}], "function_call": "auto",
    "reasoning_effort": "low", "continue_final_message": True,
    "documents": [{"title": "t", "text": "x"}], "chat_template": "{{ messages }}", "mm_processor_kwargs": {"a": 1},
}

PROMPT = {"prompt": "hello there"}
MESSAGES = {"messages": [{"role": "user", "content": "hello there"}]}


def _fields(cls) -> set[str]:
    return set(cls.model_fields)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return make_random_checkpoint(str(tmp_path_factory.mktemp("tiny")), preset("v3-tiny"), seed=7, std=0.1)


@pytest.fixture(scope="module")
def ctx(tiny_path):
    return ServingContext((NAME,), Tokenizer(tiny_path), MAX_LEN, 260)


def _parse(ctx, chat: bool, **body):
    return parse_request(json.dumps({**(MESSAGES if chat else PROMPT), **body}).encode(), ctx, chat)


def _refused(ctx, chat: bool, **body) -> APIError:
    with pytest.raises(APIError) as ei:
        _parse(ctx, chat, **body)
    assert ei.value.status == 400 and ei.value.type == "invalid_request_error"
    return ei.value


def test_every_field_is_honoured_or_refused():
    """The two tables partition the schema's fields, and cover vLLM's (and so OpenAI's) request fields:
    a field added to a request class without a decision fails here."""
    assert not set(schemas.HONOURED) & set(schemas.NEUTRAL_ONLY)
    decided = set(schemas.HONOURED) | set(schemas.NEUTRAL_ONLY)
    for cls, vllm in ((schemas.CompletionRequest, VLLM_COMPLETION), (schemas.ChatCompletionRequest, VLLM_CHAT)):
        assert _fields(cls) - decided == set(), cls.__name__
        assert vllm - _fields(cls) == set(), cls.__name__
    assert decided == _fields(schemas.CompletionRequest) | _fields(schemas.ChatCompletionRequest)
    assert _fields(schemas.StreamOptions) == VLLM_STREAM_OPTIONS
    assert set(NOT_NEUTRAL) == set(schemas.NEUTRAL_ONLY)
    # every body class, nested ones too (messages, tools, response_format, structured_outputs, ...): an
    # unknown key anywhere is a 400, never dropped
    classes = [c for c in vars(schemas).values() if isinstance(c, type) and issubclass(c, BaseModel)
               and c is not BaseModel]
    assert {schemas.CompletionRequest, schemas.ChatCompletionRequest, schemas.StreamOptions, schemas.ChatMessage,
            schemas.ResponseFormat, schemas.StructuredOutputsParams, schemas.ToolDefinition} <= set(classes)
    for cls in classes:
        assert cls.model_config["extra"] == "forbid", cls.__name__


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_not_neutral_values_refused_naming_the_field(ctx, chat):
    cls = schemas.ChatCompletionRequest if chat else schemas.CompletionRequest
    for key, value in NOT_NEUTRAL.items():
        err = _refused(ctx, chat, **{key: value})
        if key in _fields(cls):
            assert err.param == key and key in err.message and "refused" in err.message, (key, err.message)
        else:  # the other endpoint's field: unknown here
            assert err.param == key and "not a field" in err.message, (key, err.message)


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_neutral_values_accepted(ctx, chat):
    cls = schemas.ChatCompletionRequest if chat else schemas.CompletionRequest
    neutral = {k: v for k, v in schemas.NEUTRAL_ONLY.items() if k in _fields(cls)}
    assert _parse(ctx, chat).prompt_ids == _parse(ctx, chat, **neutral).prompt_ids


def test_unknown_fields_refused(ctx):
    for chat in (False, True):
        err = _refused(ctx, chat, no_such_field=1)
        assert err.param == "no_such_field" and "not a field" in err.message
    err = _refused(ctx, False, stream=True, stream_options={"include_usage": True, "odd": 1})
    assert err.param == "stream_options" and "stream_options.odd" in err.message
    err = _refused(ctx, True, messages=[{"role": "user", "content": "x", "audio": 1}])
    assert err.param == "messages" and "messages.0.audio" in err.message


def test_truncate_and_special_tokens(ctx):
    """truncate_prompt_tokens keeps the last N tokens (the max_tokens room then counts those);
    add_special_tokens false drops the BOS a completion prompt gets; a chat's is encoded with the
    tokenizer's special-token rule only when true (the template writes BOS itself)."""
    full = _parse(ctx, False).prompt_ids
    assert full[0] == ctx.tokenizer.bos_token_id
    assert _parse(ctx, False, truncate_prompt_tokens=4).prompt_ids == full[-4:]
    assert _parse(ctx, False, truncate_prompt_tokens=100).prompt_ids == full
    assert _parse(ctx, False, add_special_tokens=False).prompt_ids == full[1:]
    long_prompt = "y" * (MAX_LEN + 20)  # too long as a whole, fine once truncated
    r = _parse(ctx, False, prompt=long_prompt[:MAX_LEN - 2], truncate_prompt_tokens=8, max_tokens=MAX_LEN - 8)
    assert len(r.prompt_ids) == 8 and r.params.max_new_tokens == MAX_LEN - 8
    assert _refused(ctx, False, truncate_prompt_tokens=0).param == "truncate_prompt_tokens"
    chat = _parse(ctx, True).prompt_ids
    assert chat[0] == ctx.tokenizer.bos_token_id and chat[1] != ctx.tokenizer.bos_token_id
    text = ctx.tokenizer.apply_chat_template(MESSAGES["messages"])
    assert chat == ctx.tokenizer.encode(text, add_special_tokens=False)
    assert _parse(ctx, True, add_special_tokens=True).prompt_ids == ctx.tokenizer.encode(text, add_special_tokens=True)


def test_chat_template_gets_message_fields_and_kwargs(tiny_path):
    """name, tool_calls, tool_call_id and chat_template_kwargs reach the template; add_generation_prompt
    false leaves the assistant tag off."""
    tok = Tokenizer(tiny_path)
    tok.chat_template = (
        "{% for m in messages %}[{{ m.role }}{% if m.name is defined %}:{{ m.name }}{% endif %}]"
        "{{ m.content }}{% if m.tool_calls is defined %}{% for c in m.tool_calls %}<call {{ c.function.name }}"
        "({{ c.function.arguments }})>{% endfor %}{% endif %}{% if m.tool_call_id is defined %}"
        "<for {{ m.tool_call_id }}>{% endif %}{% endfor %}{% if thinking is defined and thinking %}<think>"
        "{% endif %}{% if add_generation_prompt %}[assistant]{% endif %}")
    c = ServingContext((NAME,), tok, MAX_LEN, 260)
    messages = [
        {"role": "user", "content": "w?", "name": "ann"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get", "arguments": "{\"x\": 1}"}}]},
        {"role": "tool", "content": "3", "tool_call_id": "c1"},
    ]
    text = tok.decode(_parse(c, True, messages=messages, chat_template_kwargs={"thinking": True}).prompt_ids)
    assert text == "[user:ann]w?[assistant]<call get({\"x\": 1})>[tool]3<for c1><think>[assistant]"
    text = tok.decode(_parse(c, True, messages=messages, add_generation_prompt=False).prompt_ids)
    assert text == "[user:ann]w?[assistant]<call get({\"x\": 1})>[tool]3<for c1>"
    err = _refused(c, True, chat_template_kwargs={"messages": []})
    assert err.param == "chat_template_kwargs"


@pytest.fixture(scope="module")
def client(tiny_path):
    with serving(tiny_path, NAME, max_model_len=MAX_LEN, max_num_seqs=4) as srv:
        yield openai_client(srv.url)


def test_server_refuses_with_openai_error(client):
    """Through the openai client: a refused field and an unknown one are 400s naming them."""
    for extra, param in (({"min_p": 1.5}, "min_p"), ({"guided_regex": "a("}, "guided_regex"),
                         ({"frobnicate": 1}, "frobnicate")):
        with pytest.raises(openai.BadRequestError) as ei:
            client.completions.create(model=NAME, prompt="hi", max_tokens=2, extra_body=extra)
        assert ei.value.body["param"] == param and ei.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       response_format={"type": "json_schema"})
    assert ei.value.body["param"] == "response_format"


def test_continuous_usage_stats(client):
    """stream_options.continuous_usage_stats: every chunk carries the usage so far."""
    kw = dict(model=NAME, max_tokens=6, temperature=0, stream=True, extra_body={"ignore_eos": True},
              stream_options={"include_usage": True, "continuous_usage_stats": True})
    chunks = list(client.completions.create(prompt="hello", **kw))
    with_text = [c for c in chunks if c.choices]
    assert all(c.usage is not None for c in chunks)
    counts = [c.usage.completion_tokens for c in with_text]
    assert counts == sorted(counts) and counts[-1] == 6 and chunks[-1].usage.completion_tokens == 6
    plain = list(client.completions.create(prompt="hello", **{**kw, "stream_options": {"include_usage": True}}))
    assert all(c.usage is None for c in plain if c.choices)
    chat = list(client.chat.completions.create(messages=[{"role": "user", "content": "hi"}], **kw))
    assert chat[0].usage.completion_tokens == 0 and chat[-1].usage.completion_tokens == 6


def _http(client, method: str, path: str, body: dict | None = None, headers: dict | None = None):
    url = str(client.base_url).removesuffix("/v1/").removesuffix("/v1") + path
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req) as r:
            return r.status, json.loads(r.read()), r.headers
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), e.headers


def test_tokenizer_endpoints(client, ctx):
    """/tokenize (prompt and messages) gives the ids the generation routes prefill (usage agrees),
    /detokenize inverts it, /tokenizer_info names the special tokens; bad bodies are 400s naming the field."""
    tok = ctx.tokenizer
    status, body, _ = _http(client, "POST", "/tokenize", {"prompt": "hello there", "return_token_strs": True})
    assert status == 200 and body["tokens"] == tok.encode("hello there") and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == MAX_LEN and len(body["token_strs"]) == body["count"]
    r = client.completions.create(model=NAME, prompt="hello there", max_tokens=1)
    assert r.usage.prompt_tokens == body["count"]
    status, body2, _ = _http(client, "POST", "/tokenize", {"prompt": "hello there", "add_special_tokens": False})
    assert body2["tokens"] == body["tokens"][1:] and body2["token_strs"] is None
    msgs = [{"role": "user", "content": "hi"}]
    status, chat, _ = _http(client, "POST", "/tokenize", {"model": NAME, "messages": msgs})
    assert status == 200 and chat["tokens"] == _parse(ctx, True, messages=msgs).prompt_ids
    rc = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=1)
    assert rc.usage.prompt_tokens == chat["count"]
    status, text, _ = _http(client, "POST", "/detokenize", {"tokens": body2["tokens"]})
    assert status == 200 and text == {"prompt": "hello there"}
    status, info, _ = _http(client, "GET", "/tokenizer_info")
    assert status == 200 and info["bos_token"] == tok.bos_token and info["eos_token_id"] == tok.eos_token_id
    for path, bad, param in (("/tokenize", {"prompt": 5}, "prompt"), ("/tokenize", {"prompt": "x", "odd": 1}, "odd"),
                             ("/detokenize", {"tokens": [10**6]}, "tokens"), ("/detokenize", {}, "tokens"),
                             ("/tokenize", {"prompt": "x", "model": "nope"}, "model")):
        status, err, _ = _http(client, "POST", path, bad)
        assert status in (400, 404) and err["error"]["param"] == param, (path, bad, err)


def test_bos_rule_same_as_transformers_autotokenizer(client, tiny_path):
    """The tokenizer's BOS rule: transformers' AutoTokenizer on the moejax checkpoint directory gives the ids
    the server prefills (/tokenize, the completion's usage) for text prompts, with and without special tokens
    (a text opening with the BOS string gets a second one in both, as HF's rule), and the chat template's."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(tiny_path)
    tok = Tokenizer(tiny_path)
    bos = tok.bos_token
    for text in ("hello there", "", " lead", f"{bos}hi", "a\nb\u00e9"):
        for special in (True, False):
            want = hf.encode(text, add_special_tokens=special)
            assert tok.encode(text, add_special_tokens=special) == want, (text, special)
            status, body, _ = _http(client, "POST", "/tokenize", {"prompt": text, "add_special_tokens": special})
            assert status == 200 and body["tokens"] == want, (text, special)
    assert hf.encode("hello there")[0] == tok.bos_token_id
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}, {"role": "user", "content": "x"}]
    want = hf.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
    want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
    status, body, _ = _http(client, "POST", "/tokenize", {"messages": msgs})
    assert status == 200 and body["tokens"] == list(want)
    r = client.completions.create(model=NAME, prompt="hello there", max_tokens=1)
    assert r.usage.prompt_tokens == len(hf.encode("hello there"))


def test_model_by_id_and_request_id_echo(client):
    """/v1/models/{id}: the served model's card, 404 for another; X-Request-Id comes back on the response;
    the body's request_id (or that header) is the response's id."""
    assert client.models.retrieve(NAME).id == NAME
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    status, _, headers = _http(client, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 1},
                               headers={"X-Request-Id": "abc-123"})
    assert status == 200 and headers["X-Request-Id"] == "abc-123"
    status, _, headers = _http(client, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 1, "odd": 1},
                               headers={"X-Request-Id": "abc-124"})
    assert status == 400 and headers["X-Request-Id"] == "abc-124"
    status, body, _ = _http(client, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 1},
                            headers={"X-Request-Id": "abc-125"})
    assert body["id"] == "cmpl-abc-125"  # the header names the response, as vLLM
    r = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=1,
                                       extra_body={"request_id": "mine-1"})
    assert r.id == "chatcmpl-mine-1"
    chunks = list(client.completions.create(model=NAME, prompt="hi", max_tokens=2, stream=True,
                                            extra_body={"request_id": "mine-2"}))
    assert {c.id for c in chunks} == {"cmpl-mine-2"}
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model=NAME, prompt="hi", max_tokens=1, extra_body={"request_id": ""})
    assert ei.value.body["param"] == "request_id"


def test_list_of_prompts(client, ctx):
    """A list of prompts (strings or token-id lists, lm-eval's batches): one choice each, in order, the same
    greedy tokens as one request a prompt; usage sums them; a streamed list is a 400 naming prompt."""
    prompts = ["hello there", "abc", "the quick brown fox"]
    kw = dict(model=NAME, max_tokens=5, temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})
    one = [client.completions.create(prompt=p, **kw) for p in prompts]
    for batch in (prompts, [ctx.tokenizer.encode(p) for p in prompts]):
        r = client.completions.create(prompt=batch, **kw)
        assert [c.index for c in r.choices] == [0, 1, 2]
        assert [c.text for c in r.choices] == [o.choices[0].text for o in one]
        assert [c.model_extra["token_ids"] for c in r.choices] == [o.choices[0].model_extra["token_ids"] for o in one]
        assert r.usage.prompt_tokens == sum(o.usage.prompt_tokens for o in one)
        assert r.usage.completion_tokens == 15
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(prompt=prompts, stream=True, **kw)
    assert ei.value.body["param"] == "prompt"
    err = _refused(ctx, False, prompt=[[5], []])
    assert err.param == "prompt" and "prompt[1]" in err.message


def test_chat_template_override(tiny_path, tmp_path):
    """--chat-template (a file or the text) replaces the tokenizer's; a missing file or a syntax error is a
    ValueError naming the flag, at start-up."""
    from moejax.server.cli import parse_args
    assert parse_args(["--chat-template", "t.jinja"]).chat_template == "t.jinja"
    tok = Tokenizer(tiny_path)
    f = tmp_path / "t.jinja"
    f.write_text("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}")
    tok.set_chat_template(str(f))
    c = ServingContext((NAME,), tok, MAX_LEN, 260)
    assert tok.decode(_parse(c, True).prompt_ids) == "<user>hello there"
    tok.set_chat_template("{{ messages[0].content }}!")
    assert tok.decode(_parse(c, True).prompt_ids) == "hello there!"
    for bad in (str(tmp_path / "missing.jinja"), "{% for %}"):
        with pytest.raises(ValueError, match="--chat-template"):
            tok.set_chat_template(bad)


def test_generation_config_defaults(ctx, tmp_path):
    """--generation-config auto: generation_config.json's temperature / top_p / top_k / max_new_tokens /
    repetition_penalty / min_p are the defaults of requests that omit them (vLLM's keys); a request's own
    value wins; a bad default (repetition_penalty 0) stops the start-up with its name; vllm: none."""
    from moejax.server.protocol import generation_defaults
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_new_tokens": 7, "bos_token_id": 0,
         "repetition_penalty": 1.1, "min_p": 0.05}))
    defaults = generation_defaults(str(tmp_path))
    assert defaults == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_new_tokens": 7,
                        "repetition_penalty": 1.1, "min_p": 0.05}
    assert generation_defaults("vllm") == {} and generation_defaults(str(tmp_path / "none")) == {}
    c = ServingContext((NAME,), ctx.tokenizer, MAX_LEN, 260, defaults)
    p = _parse(c, False).params
    assert (p.temperature, p.top_p, p.top_k, p.max_new_tokens, p.repetition_penalty, p.min_p) == (0.6, 0.95, 20, 7,
                                                                                                 1.1, 0.05)
    p = _parse(c, True, temperature=0, top_p=1, top_k=-1, max_tokens=3, repetition_penalty=1, min_p=0).params
    assert (p.temperature, p.top_p, p.top_k, p.max_new_tokens, p.repetition_penalty, p.min_p) == (0, 1, 0, 3, 1, 0)
    for bad, name in (({"repetition_penalty": 0}, "repetition_penalty"), ({"top_p": 0}, "top_p")):
        (tmp_path / "generation_config.json").write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=name):
            generation_defaults(str(tmp_path))


def test_disaggregated_router_context_takes_the_flags(tiny_path, tmp_path):
    """The disaggregated router parses the requests (its workers get the sampling parameters): its context has
    --generation-config's defaults (auto: the checkpoint's generation_config.json; vllm: none; a directory) and
    --chat-template, as make_app gives a colocated server."""
    import shutil

    from moejax.server.cli import parse_args, router_context
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_path, ckpt)
    (ckpt / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "max_new_tokens": 7}))
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"top_k": 5}))
    for flag, want in (("auto", {"temperature": 0.6, "max_new_tokens": 7}), ("vllm", {}), (str(other), {"top_k": 5})):
        a = parse_args(["--model", str(ckpt), "--generation-config", flag, "--chat-template", "{{ messages[0].content }}!"])
        c = router_context(a, str(ckpt), NAME, MAX_LEN, 260)
        assert c.defaults == want and c.model_names[0] == NAME
        p = _parse(c, True)
        assert c.tokenizer.decode(p.prompt_ids) == "hello there!"
        assert p.params.max_new_tokens == want.get("max_new_tokens", MAX_LEN - len(p.prompt_ids))
        assert p.params.temperature == want.get("temperature", 1.0)


def test_served_chat_template_kwargs_and_generation_config(tiny_path, tmp_path):
    """Through the openai client, a server set up as moejax serve --chat-template T --generation-config DIR sets
    it up: the template renders the messages with the request's chat_template_kwargs; a request that omits
    max_tokens / temperature takes generation_config.json's (5 tokens, greedy: the explicit temperature 0
    tokens whatever the seed)."""
    from moejax.server.app import make_app
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "max_new_tokens": 5}))
    model = moejax.load(tiny_path, dtype="float32", max_model_len=MAX_LEN, max_num_seqs=2, progress=False)
    model.tokenizer.set_chat_template("{{ bos_token }}{% if shout is defined and shout %}!!{% endif %}"
                                      "{% for m in messages %}<｜User｜>{{ m.content }}{% endfor %}<｜Assistant｜>")
    app, _ = make_app(model, NAME, generation_config=str(tmp_path))
    srv = ServerThread(app=app).start()
    try:
        c = openai_client(srv.url)
        msgs = [{"role": "user", "content": "hi"}]
        plain = c.chat.completions.create(model=NAME, messages=msgs, max_tokens=1)
        shout = c.chat.completions.create(model=NAME, messages=msgs, max_tokens=1,
                                          extra_body={"chat_template_kwargs": {"shout": True}})
        assert shout.usage.prompt_tokens == plain.usage.prompt_tokens + 2  # "!!": two byte tokens
        assert plain.usage.prompt_tokens == len(model.tokenizer.encode("<｜User｜>hi<｜Assistant｜>"))
        ids = [c.completions.create(model=NAME, prompt="hello", seed=s,
                                    extra_body={"ignore_eos": True, "return_token_ids": True}) for s in (1, 2)]
        greedy = c.completions.create(model=NAME, prompt="hello", temperature=0, max_tokens=5,
                                      extra_body={"ignore_eos": True, "return_token_ids": True})
        assert [r.usage.completion_tokens for r in ids] == [5, 5]
        want = greedy.choices[0].model_extra["token_ids"]
        assert [r.choices[0].model_extra["token_ids"] for r in ids] == [want, want]
    finally:
        srv.stop()


def test_include_stop_str_and_skip_special_tokens(client, ctx):
    """include_stop_str_in_output: the text ends with the stop string it met (plain and streamed);
    skip_special_tokens false: the text is the tokens' decoding with special tokens kept (plain and streamed;
    the stream's detokeniser checked on ids holding special tokens, which a random model rarely samples)."""
    kw = dict(model=NAME, prompt="hello there", max_tokens=40, temperature=0,
              extra_body={"ignore_eos": True, "return_token_ids": True})
    free = client.completions.create(**kw).choices[0]
    text = ctx.tokenizer.decode(free.model_extra["token_ids"])
    stop = text[5:7]  # a stop string the greedy text meets
    assert stop and text.find(stop) == 5
    cut = client.completions.create(**{**kw, "stop": [stop]}).choices[0]
    assert cut.text == text[:5] and cut.finish_reason == "stop"
    incl = dict(kw, stop=[stop], extra_body={**kw["extra_body"], "include_stop_str_in_output": True})
    assert client.completions.create(**incl).choices[0].text == text[:7]
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **incl) if c.choices)
    assert streamed == text[:7]
    ids = free.model_extra["token_ids"]
    special = [t for t in ids if t < 4]  # the tiny tokenizer's 4 special tokens
    keep = ctx.tokenizer.decode(ids, skip_special_tokens=False)
    noskip = dict(kw, extra_body={**kw["extra_body"], "skip_special_tokens": False})
    assert client.completions.create(**noskip).choices[0].text == keep
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **noskip) if c.choices)
    assert streamed == keep
    if special:
        assert keep != text
    ids = [2] + ctx.tokenizer.encode("hi", add_special_tokens=False) + [3]
    for skip in (True, False):
        d = IncrementalText(ctx.tokenizer, [], skip_special_tokens=skip)
        assert "".join(d.add(t) for t in ids) == ctx.tokenizer.decode(ids, skip_special_tokens=skip)
    assert "<｜User｜>hi<｜Assistant｜>" == ctx.tokenizer.decode(ids, skip_special_tokens=False)


def test_sampling_controls_parsed(ctx):
    """The sampling controls reach SamplingParams (logit_bias' string keys as token ids); a bad value is a 400
    naming the field: out of range, a key that is no token id, token ids outside the vocabulary, more
    logit_bias entries than the sampler takes, min_tokens above max_tokens, a bad word too long."""
    from moejax.layers.sampler import MAX_BAD_WORD_TOKENS, MAX_LOGIT_BIAS
    for chat in (False, True):
        p = _parse(ctx, chat, presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.2,
                   logit_bias={"5": 3.0}, min_tokens=2, max_tokens=4, min_p=0.1, allowed_token_ids=[65, 66],
                   bad_words=["ab"]).params
        assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.logit_bias, p.min_tokens,
                p.min_p, p.allowed_token_ids, p.bad_words) == (0.5, -0.5, 1.2, {5: 3.0}, 2, 0.1, [65, 66], ["ab"])
    for body, param in (({"presence_penalty": 2.5}, "presence_penalty"),
                        ({"frequency_penalty": -3}, "frequency_penalty"),
                        ({"repetition_penalty": 0}, "repetition_penalty"), ({"min_p": 1.5}, "min_p"),
                        ({"logit_bias": {"x": 1}}, "logit_bias"), ({"logit_bias": {"5": 101}}, "logit_bias"),
                        ({"logit_bias": {"999": 1}}, "logit_bias"),
                        ({"logit_bias": {str(i): 1 for i in range(MAX_LOGIT_BIAS + 1)}}, "logit_bias"),
                        ({"allowed_token_ids": [999]}, "allowed_token_ids"),
                        ({"allowed_token_ids": []}, "allowed_token_ids"),
                        ({"min_tokens": 9, "max_tokens": 4}, "min_tokens"), ({"min_tokens": -1}, "min_tokens"),
                        ({"bad_words": ["x" * 4 * MAX_BAD_WORD_TOKENS]}, "bad_words"),
                        ({"bad_words": "a"}, "bad_words")):
        err = _refused(ctx, False, **body)
        assert err.param == param, (body, err.param, err.message)


def test_sampling_controls_through_the_client(client, ctx):
    """Through the openai client: allowed_token_ids=[k] returns only k (issue 43's [65] case), a logit bias of
    100 on a token makes it the greedy choice, bad_words keep a word of the free output out, min_tokens
    holds back a stop token; a bad value is a 400 naming the field."""
    kw = dict(model=NAME, prompt="hello there", max_tokens=6, temperature=0)
    ids = lambda r: r.choices[0].model_extra["token_ids"]  # noqa: E731
    body = {"ignore_eos": True, "return_token_ids": True}
    free = ids(client.completions.create(**kw, extra_body=body))
    assert ids(client.completions.create(**kw, extra_body={**body, "allowed_token_ids": [65]})) == [65] * 6
    assert ids(client.completions.create(**kw, logit_bias={"77": 100}, extra_body=body)) == [77] * 6
    out = ids(client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                             temperature=0, extra_body={**body, "allowed_token_ids": [70]}))
    assert out == [70] * 6
    from moejax.engine.sample_controls import bad_words_token_ids
    def occurs(w, out):
        return any(out[i:i + len(w)] == w for i in range(len(out)))
    word = ctx.tokenizer.decode(free[:2])
    words = bad_words_token_ids([word], ctx.tokenizer)
    banned = ids(client.completions.create(**kw, extra_body={**body, "bad_words": [word]}))
    assert not any(occurs(w, banned) for w in words), (words, banned)
    assert banned != free or not any(occurs(w, free) for w in words)
    stop = free[2]
    got = ids(client.completions.create(**kw, extra_body={"return_token_ids": True, "stop_token_ids": [stop],
                                                          "min_tokens": 4}))
    assert stop not in got[:4] and len(got) >= 4
    for extra, param in (({"allowed_token_ids": [10 ** 6]}, "allowed_token_ids"), ({"min_tokens": 7}, "min_tokens"),
                         ({"repetition_penalty": -1}, "repetition_penalty")):
        with pytest.raises(openai.BadRequestError) as ei:
            client.completions.create(**kw, extra_body=extra)
        assert ei.value.body["param"] == param and ei.value.body["type"] == "invalid_request_error"
