"""Tool calling and reasoning, as vLLM serves them: the parsers on the exact formats (DeepSeek-V3's and
Step3's tool calls, R1's and Step3's </think>), whole and streamed with the text cut at every position
and at random ones (the streamed deltas always add up to the whole message); the request rules (tools
refused without --enable-auto-tool-choice, tool_choice none / auto, the refused forms); and end to end
through the server and the openai client on the tiny model, whose greedy tokens a test-only tokenizer
decodes to a tool call."""

import json
import random

import openai
import pytest

import moejax
from moejax.server.app import ServerThread, build_app, make_app
from moejax.server.chat_output import OutputParsing, check_markers
from moejax.server.cli import parse_args, serving_parsers
from moejax.server.protocol import APIError, ServingContext, parse_request
from moejax.server.reasoning_parsers import DeepSeekR1ReasoningParser, ReasoningParser, Step3ReasoningParser
from moejax.server.tool_parsers import DeepSeekV3ToolParser, Step3ToolParser
from moejax.tiny.checkpoint import make_random_checkpoint
from moejax.tiny.presets import preset
from moejax.tokenizer import Tokenizer

NAME = "tiny-tools"
MAX_LEN = 128

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                                     "metric": {"type": "boolean"}, "tags": {"type": "array"}}}}},
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}]


def ds_call(name: str, args: str) -> str:
    return f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{args}\n```<｜tool▁call▁end｜>"


def ds_calls(*calls: str) -> str:
    return "<｜tool▁calls▁begin｜>" + "\n".join(calls) + "<｜tool▁calls▁end｜>"


def step3_call(name: str, params: dict) -> str:
    body = "".join(f'<steptml:parameter name="{k}">{v}</steptml:parameter>\n' for k, v in params.items())
    return (f'<｜tool_call_begin｜>function<｜tool_sep｜><steptml:invoke name="{name}">\n{body}</steptml:invoke>'
            "<｜tool_call_end｜>")


def step3_calls(*calls: str) -> str:
    return "<｜tool_calls_begin｜>\n" + "\n".join(calls) + "\n<｜tool_calls_end｜>"


def whole(spec: OutputParsing, text: str) -> dict:
    return spec.new().message(text)


def streamed(spec: OutputParsing, text: str, cuts) -> tuple[dict, list[dict]]:
    """The message a client rebuilds from the deltas of ``text`` cut at ``cuts`` (openai's accumulation rule:
    strings add up, a call's pieces by index), and the deltas."""
    out = spec.new()
    bounds = [0, *sorted(set(cuts)), len(text)]
    deltas = [out.feed(text[a:b], final=b == len(text)) for a, b in zip(bounds, bounds[1:])]
    msg = {"role": "assistant", "content": "".join(d.get("content", "") for d in deltas) or None}
    if spec.reasoning is not None:
        msg["reasoning_content"] = ("".join(d.get("reasoning_content", "") for d in deltas)
                                    if spec.include_reasoning else None)
    if spec.tools is not None or spec.forced is not None:
        calls: dict[int, dict] = {}
        for d in deltas:
            for c in d.get("tool_calls", []):
                if "id" in c:
                    assert c["index"] not in calls, "a call's id and name come once"
                    calls[c["index"]] = {"id": c["id"], "type": c["type"],
                                         "function": {"name": c["function"]["name"], "arguments": ""}}
                calls[c["index"]]["function"]["arguments"] += c["function"].get("arguments", "")
        msg["tool_calls"] = [calls[i] for i in sorted(calls)]
    return msg, deltas


def no_ids(msg: dict) -> dict:
    return {**msg, "tool_calls": [{**c, "id": None} for c in msg.get("tool_calls", [])]} if "tool_calls" in msg \
        else msg


def check_every_cut(spec: OutputParsing, text: str, want: dict, seed: int) -> None:
    """The whole message is ``want``; so is the stream's, cut at each single position, at every position, and
    at random ones (``seed`` recorded)."""
    assert no_ids(whole(spec, text)) == want
    rng = random.Random(seed)
    cut_sets = [[i] for i in range(1, len(text))] + [list(range(1, len(text)))]
    cut_sets += [rng.sample(range(1, len(text)), rng.randint(1, min(12, len(text) - 1))) for _ in range(30)]
    for cuts in cut_sets:
        got, _ = streamed(spec, text, cuts)
        assert no_ids(got) == want, (cuts, got)


R1 = OutputParsing(DeepSeekR1ReasoningParser)
STEP3_R = OutputParsing(Step3ReasoningParser)
DS = OutputParsing(None, DeepSeekV3ToolParser, tuple(TOOLS))
DS_R1 = OutputParsing(DeepSeekR1ReasoningParser, DeepSeekV3ToolParser, tuple(TOOLS))
S3 = OutputParsing(Step3ReasoningParser, Step3ToolParser, tuple(TOOLS))


def call(name, args):
    return {"id": None, "type": "function", "function": {"name": name, "arguments": args}}


@pytest.mark.parametrize("text,reasoning,content", [
    ("Let me think: 2+2.</think>It is 4.", "Let me think: 2+2.", "It is 4."),
    ("<think>\nhmm</think>\n\nYes", "\nhmm", "\n\nYes"),  # a <think> the model writes itself is dropped
    ("still thinking, cut by max_tokens", "still thinking, cut by max_tokens", None),
    ("</think>", "", None),
    ("a</think>b</think>c", "a", "b</think>c"),  # only the first closes the thinking
    ("x <think>y</think>z", "x <think>y", "z"),  # a <think> not at the start is text
])
def test_deepseek_r1_reasoning(text, reasoning, content):
    check_every_cut(R1, text, {"role": "assistant", "content": content, "reasoning_content": reasoning},
                    seed=1234)


def test_step3_reasoning_keeps_a_written_think():
    """Step3's parser (vLLM's) strips no <think>: everything before the first </think> is reasoning."""
    check_every_cut(STEP3_R, "<think>a</think>b", {"role": "assistant", "content": "b",
                                                   "reasoning_content": "<think>a"}, seed=99)
    check_every_cut(STEP3_R, "a</think>", {"role": "assistant", "content": None, "reasoning_content": "a"}, seed=98)


def test_reasoning_split_in_a_stream_and_held_back():
    """</think> cut inside: the piece that could be its start is held back, then goes where it belongs."""
    out = R1.new()
    assert out.feed("abc</th") == {"reasoning_content": "abc"}
    assert out.feed("ink>de") == {"content": "de"}
    out = R1.new()
    assert out.feed("<thi") == {}  # maybe R1's own <think>
    assert out.feed("s is not it") == {"reasoning_content": "<this is not it"}
    out = R1.new()
    assert out.feed("x</thi") == {"reasoning_content": "x"}
    assert out.feed("", final=True) == {"reasoning_content": "</thi"}  # the end: nothing held back


def test_include_reasoning_false_drops_it():
    spec = OutputParsing(DeepSeekR1ReasoningParser, include_reasoning=False)
    assert whole(spec, "think</think>answer") == {"role": "assistant", "content": "answer", "reasoning_content": None}
    assert streamed(spec, "think</think>answer", [2, 9])[0]["content"] == "answer"


ARGS = '{"city": "Paris", "days": 3}'


@pytest.mark.parametrize("text,content,calls", [
    (ds_calls(ds_call("get_weather", ARGS)), None, [call("get_weather", ARGS)]),
    ("Checking." + ds_calls(ds_call("get_weather", ARGS), ds_call("now", "{}")), "Checking.",
     [call("get_weather", ARGS), call("now", "{}")]),
    # multi-line JSON arguments, as written (vLLM's regex would miss them: no DOTALL)
    (ds_calls(ds_call("get_weather", '{\n  "city": "Oslo"\n}')), None, [call("get_weather", '{\n  "city": "Oslo"\n}')]),
    (ds_calls(ds_call("now", "{}")) + " done", " done", [call("now", "{}")]),  # text after the calls: content
    ("no calls here, a ``` fence and a <｜tool", "no calls here, a ``` fence and a <｜tool", []),
    # cut by max_tokens: inside the arguments (reported so far), before the name is whole (not reported)
    ("<｜tool▁calls▁begin｜>" + ds_call("get_weather", ARGS).split("Paris")[0] + "Par", None,
     [call("get_weather", '{"city": "Par')]),
    ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_wea", None, []),
])
def test_deepseek_v3_tool_calls(text, content, calls):
    check_every_cut(DS, text, {"role": "assistant", "content": content, "tool_calls": calls}, seed=4321)


def test_deepseek_r1_thinking_then_a_call():
    """The reasoning parser goes first; the tool parser reads what follows </think>."""
    text = "I need the weather.</think>" + ds_calls(ds_call("get_weather", ARGS))
    check_every_cut(DS_R1, text, {"role": "assistant", "content": None, "reasoning_content": "I need the weather.",
                                  "tool_calls": [call("get_weather", ARGS)]}, seed=7)
    # a call written inside the thinking is reasoning text, not a call
    inside = ds_calls(ds_call("now", "{}")) + "</think>ok"
    assert no_ids(whole(DS_R1, inside)) == {"role": "assistant", "content": "ok", "reasoning_content":
                                            ds_calls(ds_call("now", "{}")), "tool_calls": []}


def test_tool_call_stream_deltas_have_vllms_layout():
    """The first delta of a call has index, id, type and name; later ones only index and arguments; the
    arguments stream as the model writes them; finish_reason becomes tool_calls on a stop."""
    out = DS.new()
    text = ds_calls(ds_call("get_weather", ARGS))
    cut = text.index("Paris")
    d1 = out.feed(text[:cut])
    (first,) = d1["tool_calls"]
    assert set(first) == {"index", "id", "type", "function"} and first["type"] == "function"
    assert first["id"].startswith("chatcmpl-tool-") and first["function"] == {"name": "get_weather",
                                                                                "arguments": '{"city": "'}
    d2 = out.feed(text[cut:], final=True)
    assert d2 == {"tool_calls": [{"index": 0, "function": {"arguments": 'Paris", "days": 3}'}}]}
    assert out.finish_reason("stop") == "tool_calls" and out.finish_reason("length") == "length"
    assert DS.new().finish_reason("stop") == "stop"


def test_parallel_tool_calls_false_keeps_the_first():
    spec = OutputParsing(None, DeepSeekV3ToolParser, tuple(TOOLS), parallel_tool_calls=False)
    text = ds_calls(ds_call("get_weather", ARGS), ds_call("now", "{}"))
    check_every_cut(spec, text, {"role": "assistant", "content": None, "tool_calls": [call("get_weather", ARGS)]},
                    seed=11)


def test_step3_tool_calls_typed_by_schema():
    """Step3's steptml parameters become one JSON object, each value typed by the tool's schema (a value that
    does not parse as its type, or has no type, stays text), sent once the call is complete."""
    text = ("Let me look.</think>Sure. " + step3_calls(
        step3_call("get_weather", {"city": " Rome ", "days": "5", "metric": "true", "tags": '["a", 1]',
                                   "extra": "7"}),
        step3_call("get_weather", {"days": "many"}), step3_call("now", {})) + " Bye")
    want_args = [{"city": "Rome", "days": 5, "metric": True, "tags": ["a", 1], "extra": "7"}, {"days": "many"}, {}]
    msg = no_ids(whole(S3, text))
    assert msg["content"] == "Sure.  Bye" and msg["reasoning_content"] == "Let me look."
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["get_weather", "get_weather", "now"]
    assert [json.loads(c["function"]["arguments"]) for c in msg["tool_calls"]] == want_args
    check_every_cut(S3, text, msg, seed=5)
    _, deltas = streamed(S3, text, range(1, len(text)))
    args = [c["function"]["arguments"] for d in deltas for c in d.get("tool_calls", []) if c["function"].get("arguments")]
    assert [json.loads(a) for a in args] == want_args  # whole objects, one delta each
    # a call of another type is not a call (vLLM's rule)
    other = step3_calls(step3_call("now", {}).replace(">function<", ">retrieval<"))
    assert whole(OutputParsing(None, Step3ToolParser), other)["tool_calls"] == []


# ----- the request rules ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return make_random_checkpoint(str(tmp_path_factory.mktemp("tiny")), preset("v3-tiny"), seed=3, std=0.1)


TOOL_TEMPLATE = ("{% if tools %}{% for t in tools %}[tool {{ t.function.name }}]{% endfor %}{% endif %}"
                 "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
                 "{% if add_generation_prompt %}<｜Assistant｜>{% endif %}")


def _ctx(tiny_path, **parsers) -> ServingContext:
    tok = Tokenizer(tiny_path)
    tok.chat_template = TOOL_TEMPLATE
    return ServingContext((NAME,), tok, MAX_LEN, 260, **parsers)


def _chat(ctx, **body):
    return parse_request(json.dumps({"messages": [{"role": "user", "content": "hi"}], **body}).encode(), ctx, True)


def _refused(ctx, **body) -> APIError:
    with pytest.raises(APIError) as ei:
        _chat(ctx, **body)
    assert ei.value.status == 400
    return ei.value


AUTO = dict(enable_auto_tool_choice=True, tool_parser=DeepSeekV3ToolParser)


def test_tools_refused_without_the_flags(tiny_path):
    """vLLM's rules: tools default tool_choice to "auto", which needs --enable-auto-tool-choice and
    --tool-call-parser; tool_choice "none" passes the tools to the template only."""
    plain = _ctx(tiny_path)
    err = _refused(plain, tools=TOOLS)
    assert err.param == "tools" and "--enable-auto-tool-choice" in err.message
    assert _refused(plain, tools=TOOLS, tool_choice="auto").param == "tool_choice"
    assert _refused(_ctx(tiny_path, tool_parser=DeepSeekV3ToolParser), tools=TOOLS).param == "tools"
    r = _chat(plain, tools=TOOLS, tool_choice="none")
    assert r.parsing is None
    assert plain.tokenizer.decode(r.prompt_ids, False) == "[tool get_weather][tool now]<user>hi<｜Assistant｜>"
    assert plain.tokenizer.decode(_chat(plain).prompt_ids, False) == "<user>hi<｜Assistant｜>"


def test_tokenize_with_tools(tiny_path):
    """/tokenize's chat form takes the tools too: the prompt the chat endpoint builds with them."""
    from moejax.server.protocol import tokenize
    ctx = _ctx(tiny_path)
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS}
    got = tokenize(json.dumps(body).encode(), ctx)["tokens"]
    assert got == _chat(ctx, tools=TOOLS, tool_choice="none").prompt_ids != _chat(ctx).prompt_ids


def test_tool_choice_auto_parses(tiny_path):
    r = _chat(_ctx(tiny_path, **AUTO), tools=TOOLS)
    assert r.parsing.tools is DeepSeekV3ToolParser and r.parsing.reasoning is None
    assert [t["function"]["name"] for t in r.parsing.tool_defs] == ["get_weather", "now"]
    assert _chat(_ctx(tiny_path, **AUTO), tools=TOOLS, tool_choice="none").parsing is None
    assert _chat(_ctx(tiny_path, **AUTO), tools=TOOLS, parallel_tool_calls=False).parsing.parallel_tool_calls is False
    r = _chat(_ctx(tiny_path, reasoning_parser=DeepSeekR1ReasoningParser), include_reasoning=False)
    assert r.parsing.reasoning is DeepSeekR1ReasoningParser and r.parsing.include_reasoning is False


def test_refused_tool_forms(tiny_path):
    ctx = _ctx(tiny_path, **AUTO)
    assert _refused(ctx, tool_choice="auto").param == "tool_choice"  # no tools
    assert _refused(ctx, tool_choice={"type": "function", "function": {"name": "nope"}}, tools=TOOLS).param == \
        "tool_choice"
    strict = [{"type": "function", "function": {"name": "f", "strict": True}}]
    assert _refused(ctx, tools=strict).param == "tools"  # "auto": no grammar holds the call to its schema
    assert _refused(ctx, tools=[{"type": "function", "function": {"name": "f", "odd": 1}}]).param == "tools"
    assert _refused(ctx, tools=[{"type": "retrieval", "function": {"name": "f"}}]).param == "tools"
    assert _refused(ctx, tool_choice="sometimes", tools=TOOLS).param == "tool_choice"
    assert _refused(_ctx(tiny_path), include_reasoning=False).param == "include_reasoning"
    assert _refused(ctx, chat_template_kwargs={"tools": []}).param == "chat_template_kwargs"


NAMED = {"type": "function", "function": {"name": "get_weather"}}


def test_forced_tool_choice_is_a_grammar(tiny_path):
    """A named function or "required" needs no flags: the answer is held to the call by a grammar (vLLM's
    schemas: the function's parameters; an array of {"name", "parameters"}, one item when parallel_tool_calls is
    false); "required" with no tools is "none"; another structured output with it is refused; with a reasoning
    parser the grammar starts after </think>."""
    pytest.importorskip("xgrammar")
    plain = _ctx(tiny_path)
    r = _chat(plain, tools=TOOLS, tool_choice=NAMED)
    assert r.parsing.forced == "get_weather" and r.parsing.tools is None
    assert json.loads(r.params.structured_outputs.spec) == TOOLS[0]["function"]["parameters"]
    r = _chat(plain, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    schema = json.loads(r.params.structured_outputs.spec)
    assert r.parsing.forced == "required" and schema["maxItems"] == 1 and schema["minItems"] == 1
    assert [i["properties"]["name"]["enum"] for i in schema["items"]["anyOf"]] == [["get_weather"], ["now"]]
    strict = [{"type": "function", "function": {"name": "f", "strict": True, "parameters": {"type": "object"}}}]
    assert _chat(plain, tools=strict, tool_choice={"type": "function", "function": {"name": "f"}}).parsing.forced == "f"
    r = _chat(plain, tools=[], tool_choice="required")
    assert r.parsing is None and r.params.structured_outputs is None
    assert _refused(plain, tools=TOOLS, tool_choice="required", guided_regex="a").param == "guided_regex"
    r = _chat(_ctx(tiny_path, reasoning_parser=DeepSeekR1ReasoningParser), tools=TOOLS, tool_choice=NAMED)
    assert r.params.structured_outputs.after == "</think>" and r.parsing.reasoning is DeepSeekR1ReasoningParser
    # the thinking, then the call
    assert no_ids(whole(r.parsing, 'hmm</think>{"city": "x"}')) == {
        "role": "assistant", "content": None, "reasoning_content": "hmm", "tool_calls": [call("get_weather",
                                                                                              '{"city": "x"}')]}


@pytest.mark.parametrize("text,calls", [
    ('[{"name": "now", "parameters": {}}]', [call("now", "{}")]),
    (json.dumps([{"name": "get_weather", "parameters": {"city": 'a\\"}{'}}, {"name": "now", "parameters": {}}]),
     [call("get_weather", json.dumps({"city": 'a\\"}{'})), call("now", "{}")]),  # braces and escapes in a string
    ('[{"name": "now", "parameters": {}}, {"name": "get_wea', [call("now", "{}")]),  # cut: the complete ones
])
def test_required_answer_parsed(text, calls):
    check_every_cut(OutputParsing(forced="required"), text, {"role": "assistant", "content": None, "tool_calls": calls},
                    seed=21)


def test_named_answer_is_the_arguments():
    spec = OutputParsing(forced="now")
    check_every_cut(spec, '{"a": [1, 2]}', {"role": "assistant", "content": None,
                                            "tool_calls": [call("now", '{"a": [1, 2]}')]}, seed=22)
    out = spec.new()
    assert out.feed("", final=True)["tool_calls"][0]["function"] == {"name": "now", "arguments": ""}
    assert out.finish_reason("stop") == "stop"  # vLLM's: the call was asked for


def test_cli_flags(tiny_path):
    a = parse_args(["--enable-auto-tool-choice", "--tool-call-parser", "deepseek_v3", "--reasoning-parser",
                    "deepseek_r1"])
    assert serving_parsers(a, Tokenizer(tiny_path)) == {
        "enable_auto_tool_choice": True, "tool_parser": DeepSeekV3ToolParser,
        "reasoning_parser": DeepSeekR1ReasoningParser}
    assert serving_parsers(parse_args(["--tool-call-parser", "step3"]), Tokenizer(tiny_path)) == {
        "enable_auto_tool_choice": False, "tool_parser": Step3ToolParser}
    for argv in (["--enable-auto-tool-choice"], ["--tool-call-parser", "hermes"], ["--reasoning-parser", "x"]):
        with pytest.raises(SystemExit):
            parse_args(argv)


def test_markers_a_tokenizer_drops_are_refused(tiny_path):
    """A parser whose marker the tokenizer skips when decoding (a special token) could never see it: refused at
    start-up, naming the flag."""
    class UserMarker(ReasoningParser):
        markers = ("<｜User｜>",)  # a special token of the tiny tokenizer
    with pytest.raises(ValueError, match="--reasoning-parser x"):
        check_markers(Tokenizer(tiny_path), UserMarker, "--reasoning-parser x")
    check_markers(Tokenizer(tiny_path), DeepSeekV3ToolParser, "--tool-call-parser deepseek_v3")


# ----- end to end ---------------------------------------------------------------------------------

class ScriptedTokenizer(Tokenizer):
    """Test only: decodes the token ids in ``script`` to the given texts (the rest as the byte-level tokenizer
    does), so the tiny random model's greedy tokens can spell a tool call."""

    def __init__(self, directory):
        super().__init__(directory)
        self.script: dict[int, str] = {}

    def decode(self, ids, skip_special_tokens=True):
        out, run = [], []
        for t in ids:
            if t in self.script:
                if run:
                    out.append(super().decode(run, skip_special_tokens))
                    run = []
                out.append(self.script[t])
            else:
                run.append(t)
        if run:
            out.append(super().decode(run, skip_special_tokens))
        return "".join(out)


ANSWER = "Rain is likely.</think>" + ds_calls(ds_call("get_weather", '{"city": "Paris", "days": 2}'))


@pytest.fixture(scope="module")
def servers(tiny_path):
    """One engine, two apps: one served with the flags (R1 reasoning, DeepSeek-V3 tool calls), one without."""
    model = moejax.load(tiny_path, dtype="float32", max_model_len=MAX_LEN, max_num_seqs=2, progress=False)
    model.tokenizer = ScriptedTokenizer(tiny_path)
    model.tokenizer.chat_template = TOOL_TEMPLATE
    app, aengine = make_app(model, NAME, parsers={"reasoning_parser": DeepSeekR1ReasoningParser, **AUTO})
    with_flags = ServerThread(app=app).start()
    plain = ServerThread(app=build_app(aengine, ServingContext((NAME,), model.tokenizer, MAX_LEN, 260))).start()
    yield [openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=120)
           for s in (with_flags, plain)], model.tokenizer
    plain.stop()
    with_flags.stop()


def _script(client, tok, pieces: list[str]) -> tuple[list[dict], int]:
    """Finds a prompt whose first len(pieces) + 1 greedy tokens are distinct, maps them to ``pieces`` (and ""),
    and returns the messages and the last token (the request's stop token)."""
    for i in range(40):
        msgs = [{"role": "user", "content": f"weather {i}?"}]
        r = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=len(pieces) + 1, temperature=0,
                                           tools=TOOLS, tool_choice="none",  # the prompt of the scripted requests
                                           extra_body={"ignore_eos": True, "return_token_ids": True})
        ids = r.choices[0].model_extra["token_ids"]
        if len(set(ids)) == len(ids) == len(pieces) + 1:
            tok.script = dict(zip(ids, pieces + [""]))
            return msgs, ids[-1]
    pytest.fail("no prompt of 40 gives distinct greedy tokens")


def test_served_tool_call_and_reasoning(servers):
    """Through the server and the openai client: the greedy answer (spelling R1 thinking and a DeepSeek-V3
    tool call, cut mid-marker) comes back as reasoning_content and tool_calls with finish_reason tool_calls;
    streamed, the deltas rebuild the same message; the server without the flags refuses the tools with a 400."""
    (client, plain), tok = servers
    cuts = [0, 5, 19, 27, 33, 52, 70, 86, 95, 104, 122, len(ANSWER)]  # inside </think> and the markers too
    pieces = [ANSWER[a:b] for a, b in zip(cuts, cuts[1:])]
    msgs, stop = _script(client, tok, pieces)
    kw = dict(model=NAME, messages=msgs, tools=TOOLS, max_tokens=40, temperature=0,
              extra_body={"ignore_eos": True, "stop_token_ids": [stop]})
    r = client.chat.completions.create(**kw)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None
    assert ch.message.model_extra["reasoning_content"] == "Rain is likely."
    (tc,) = ch.message.tool_calls
    assert tc.type == "function" and tc.id.startswith("chatcmpl-tool-") and tc.function.name == "get_weather"
    assert json.loads(tc.function.arguments) == {"city": "Paris", "days": 2}

    chunks = list(client.chat.completions.create(stream=True, **kw))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == "Rain is likely."
    assert all(not d.content for d in deltas)
    calls = [t for d in deltas for t in d.tool_calls or []]
    assert len(calls) >= 2 and calls[0].function.name == "get_weather" and calls[0].id.startswith("chatcmpl-tool-")
    assert all(t.index == 0 and t.id is None and t.function.name is None for t in calls[1:])
    assert "".join(t.function.arguments or "" for t in calls) == tc.function.arguments
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"

    # tool_choice none: the same tokens, all content (the reasoning parser still splits the thinking)
    r = client.chat.completions.create(**{**kw, "tool_choice": "none"})
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.tool_calls in (None, [])
    assert r.choices[0].message.content == ANSWER.split("</think>")[1]
    with pytest.raises(openai.BadRequestError) as ei:
        plain.chat.completions.create(**kw)
    assert ei.value.body["param"] == "tools" and "--enable-auto-tool-choice" in ei.value.body["message"]
    r = plain.chat.completions.create(**{**kw, "tool_choice": "none"})
    assert r.choices[0].message.content == ANSWER and "reasoning_content" not in r.choices[0].message.model_extra


FORCED_TOOLS = [
    {"type": "function", "function": {"name": "set_unit", "parameters": {
        "type": "object", "properties": {"unit": {"enum": ["c", "f"]}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["unit", "n"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {},
                                                                    "additionalProperties": False}}}]


def _args_valid(name: str, arguments: str) -> bool:
    a = json.loads(arguments)
    if name == "now":
        return a == {}
    return set(a) == {"unit", "n"} and a["unit"] in ("c", "f") and type(a["n"]) is int and 0 <= a["n"] <= 9


def test_served_forced_tool_choice(servers):
    """Through the server without the flags: a named function's answer is that call, its arguments valid for its
    schema (finish_reason stop, as vLLM); "required" gives a call of one of the tools, valid
    (finish_reason tool_calls; parallel_tool_calls false: exactly one); streamed, the same calls (seeded sampling)."""
    pytest.importorskip("xgrammar")
    (_, plain), tok = servers
    tok.script = {}  # plain decoding here
    for i in range(6):
        named = i < 3
        kw = dict(model=NAME, messages=[{"role": "user", "content": f"unit {i}?"}], tools=FORCED_TOOLS, max_tokens=80,
                  temperature=1.0, seed=i,
                  tool_choice={"type": "function", "function": {"name": "set_unit"}} if named else "required",
                  parallel_tool_calls=False)  # "required": one item (a random model's array may not end)
        ch = plain.chat.completions.create(**kw).choices[0]
        assert ch.finish_reason == ("stop" if named else "tool_calls") and ch.message.content is None
        calls = ch.message.tool_calls
        assert len(calls) == 1
        assert all(c.function.name in ("set_unit", "now") and _args_valid(c.function.name, c.function.arguments)
                   for c in calls), calls
        if named:
            assert calls[0].function.name == "set_unit"
        chunks = list(plain.chat.completions.create(stream=True, **kw))
        got: dict[int, list[str]] = {}
        for c in chunks:
            for t in (c.choices[0].delta.tool_calls or []) if c.choices else []:
                if t.id is not None:
                    got[t.index] = [t.function.name, ""]
                got[t.index][1] += t.function.arguments or ""
        assert [got[k] for k in sorted(got)] == [[c.function.name, c.function.arguments] for c in calls]


def test_served_thinking_then_structured_output(servers):
    """With --reasoning-parser the grammar holds the answer after </think> only (vLLM's rule): the first greedy
    token, decoded by the test-only tokenizer as the thinking and its end, is sampled freely; the answer after it
    is one of the choices (plain and streamed)."""
    pytest.importorskip("xgrammar")
    (client, _), tok = servers
    choices = ["red", "green", "blue"]
    tok.script = {}
    for i in range(20):  # a prompt whose first greedy token is none of the choices' letters
        msgs = [{"role": "user", "content": f"colour {i}?"}]
        first = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=1, temperature=0,
                                               extra_body={"return_token_ids": True}).choices[0].model_extra["token_ids"][0]
        if tok.decode([first]) not in "".join(choices):
            break
    tok.script = {first: "Let me pick.</think>"}
    try:
        kw = dict(model=NAME, messages=msgs, max_tokens=30, temperature=0, extra_body={"guided_choice": choices})
        ch = client.chat.completions.create(**kw).choices[0]
        assert ch.finish_reason == "stop" and ch.message.model_extra["reasoning_content"] == "Let me pick."
        assert ch.message.content in choices
        chunks = [c for c in client.chat.completions.create(stream=True, **kw) if c.choices]
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == ch.message.content
        assert "".join(c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in chunks) == "Let me pick."
    finally:
        tok.script = {}
