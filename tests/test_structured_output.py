"""Structured outputs through xgrammar (moejax/structured_output.py): the constraints compiled (bad ones a
ValueError naming what is wrong), a sequence's mask row against a reference built from the choices'
bytes, catching up on tokens and rolling back dropped ones; in the engine, every output of a mixed batch
valid (JSON schema, JSON object, regex, choice, EBNF grammar; greedy and sampled), the same tokens with
async scheduling on and off, and an unconstrained request in the batch unchanged."""

import json
import re

import numpy as np
import pytest

import moejax
from moejax.engine.sampling_params import SamplingParams
from moejax.structured_output import Constraint, SequenceGrammar, grammars_for, sequence_grammar
from moejax.tiny.checkpoint import make_random_checkpoint
from moejax.tiny.presets import preset
from moejax.tokenizer import Tokenizer

from conftest import openai_client, serving

pytest.importorskip("xgrammar")  # the test extra installs it; the structured extra for users

VOCAB = 260
EOS = 1


def person_schema(name_chars: str) -> dict:
    """A JSON schema: a name of 1 to 6 of ``name_chars`` (a regex character class's body), an age 0-120, an
    optional pet (cat, dog, null). tests/test_structured_output_spec.py takes it too. (A string's maxLength
    is not used: xgrammar 0.2.8's rule for it lets raw control characters in, which JSON forbids; the
    pattern bounds the name instead.)"""
    return {"type": "object", "properties": {"name": {"type": "string", "pattern": f"^[{name_chars}]{{1,6}}$"},
                                             "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                             "pet": {"enum": ["cat", "dog", None]}},
            "required": ["name", "age"], "additionalProperties": False}


def is_person(v, name_chars: str) -> bool:
    """Whether the parsed JSON ``v`` is what person_schema(name_chars) allows (checked without xgrammar)."""
    return (isinstance(v, dict) and {"name", "age"} <= set(v) <= {"name", "age", "pet"}
            and isinstance(v["name"], str) and re.fullmatch(f"[{name_chars}]{{1,6}}", v["name"]) is not None
            and type(v["age"]) is int and 0 <= v["age"] <= 120 and v.get("pet") in ("cat", "dog", None))


NAME_CHARS = "a-z "
PERSON = person_schema(NAME_CHARS)
REGEX = r"(yes|no)-[0-9]{2,4}"
CHOICES = ["red", "green", 'say "hi"\\', "grün"]
GRAMMAR = 'root ::= "(" num (("+" | "*") num)* ")"\nnum ::= [1-9] [0-9]?'


def satisfies(c: Constraint, text: str, name_chars: str, grammar_re: str) -> bool:
    """Whether ``text`` satisfies ``c``, checked without xgrammar: a "json" constraint is person_schema(name_chars),
    a grammar's texts are those ``grammar_re`` matches."""
    if c.kind in ("json", "json_object"):
        try:
            v = json.loads(text)
        except ValueError:
            return False
        return isinstance(v, dict) if c.kind == "json_object" else is_person(v, name_chars)
    if c.kind == "regex":
        return re.fullmatch(c.spec, text) is not None
    if c.kind == "choice":
        return text in json.loads(c.spec)
    return re.fullmatch(grammar_re, text) is not None


def valid(c: Constraint, text: str) -> bool:
    return satisfies(c, text, NAME_CHARS, r"\((?:[1-9][0-9]?[+*])*[1-9][0-9]?\)")  # GRAMMAR's texts


CONSTRAINTS = [Constraint("json", json.dumps(PERSON), any_whitespace=False), Constraint("json_object", any_whitespace=False),
               Constraint("regex", REGEX), Constraint.choice(CHOICES), Constraint("grammar", GRAMMAR)]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return make_random_checkpoint(str(tmp_path_factory.mktemp("tiny")), preset("v3-tiny"), seed=11, std=0.1)


@pytest.fixture(scope="module")
def tok(tiny_path):
    return Tokenizer(tiny_path)


def test_bad_constraints_name_the_problem(tok):
    g = grammars_for(tok, VOCAB)
    for c, what in ((Constraint("regex", "a("), "regex"), (Constraint("json", "{not json"), "json"),
                    (Constraint("json", '{"type": "frob"}'), "json"), (Constraint("grammar", "root ::= "), "grammar")):
        with pytest.raises(ValueError, match=f"the {what} constraint cannot be compiled") as ei:
            g.compile(c)
        assert "grammar_matcher.cc" not in str(ei.value) and "/project/" not in str(ei.value)
    for bad in (dict(kind="xml"), dict(kind="regex", spec=5)):
        with pytest.raises(ValueError, match="structured_outputs"):
            Constraint(**bad)
    with pytest.raises(ValueError, match="choice"):
        Constraint.choice([])
    assert Constraint.of({"kind": "regex", "spec": "a"}) == Constraint("regex", "a")  # from JSON (the router)
    for field, kw in (("ignore_eos", dict(ignore_eos=True)), ("min_tokens", dict(min_tokens=2))):
        with pytest.raises(ValueError, match=field):
            sequence_grammar(SamplingParams(structured_outputs=Constraint("regex", "a"), **kw), tok, VOCAB, (EOS,))
    assert sequence_grammar(SamplingParams(), tok, VOCAB, (EOS,)) is None


def _allowed(row: np.ndarray) -> set[int]:
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")[:VOCAB]
    return set(np.nonzero(bits)[0].tolist())


def _byte_ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def test_mask_rows_follow_the_choices(tok):
    """After each prefix of an option the row allows exactly the next bytes of the options that prefix
    begins (and EOS once an option is complete), a reference computed from the options' bytes alone."""
    g = SequenceGrammar(grammars_for(tok, VOCAB), Constraint.choice(CHOICES), (EOS,))
    options = [_byte_ids(tok, o) for o in CHOICES]
    for opt in options:
        for k in range(len(opt) + 1):
            prefix = opt[:k]
            want = {o[k] for o in options if o[:k] == prefix and len(o) > k} | ({EOS} if prefix in options else set())
            assert _allowed(g.mask_row(prefix)) == want, (prefix, want)  # catches up and rolls back as needed
    g.mask_row([])
    assert g.accepted == []
    g.pending = (1, [options[0][1]])  # a token still in flight, taken before the host has appended it
    assert _allowed(g.mask_row(options[0][:1])) == {options[0][2]} and g.accepted == options[0][:2]
    with pytest.raises(RuntimeError, match="against the grammar"):
        g.mask_row(_byte_ids(tok, "x"))
    g = SequenceGrammar(grammars_for(tok, VOCAB), Constraint.choice(["ab"]), (EOS,))
    assert _allowed(g.mask_row(_byte_ids(tok, "ab") + [EOS])) == {EOS}  # ended: only EOS, never an empty row


def test_mask_rows_follow_the_drafts(tok):
    """A speculative verify's rows (speculative decoding): row j after the output, the pending tokens and the first
    j drafts; a draft the grammar rejects leaves the rows from it allowing every token (their samples are
    dropped); after a draft EOS the row allows only the stop tokens; the matcher is back where the real tokens
    left it, so the next step's rows follow the tokens actually accepted."""
    g = SequenceGrammar(grammars_for(tok, VOCAB), Constraint.choice(["red", "green", "grey"]), (EOS,))
    b = {c: _byte_ids(tok, c)[0] for c in "rgedny"}
    every = set(range(VOCAB))
    g.drafts = [b["g"], b["r"], b["e"], b["e"]]
    rows = g.mask_rows([], 5)
    assert [_allowed(r) for r in rows] == [{b["r"], b["g"]}, {b["r"]}, {b["e"]}, {b["e"], b["y"]}, {b["n"]}]
    assert g.accepted == [] and g.drafts is None
    g.drafts = [b["e"], b["y"], b["d"]]  # "gree" taken, then "y" rejected ("greey" begins no choice)
    g.pending = (2, [b["e"]])  # "gre" with its last token in flight
    rows = g.mask_rows([b["g"], b["r"]], 4)
    assert [_allowed(r) for r in rows] == [{b["e"], b["y"]}, {b["n"]}, every, every]
    assert g.accepted == [b["g"], b["r"], b["e"]]
    g.drafts = [b["y"], EOS, b["r"]]  # "grey", EOS, then a token past the stop token
    rows = g.mask_rows([b["g"], b["r"], b["e"]], 4)
    assert [_allowed(r) for r in rows] == [{b["e"], b["y"]}, {EOS}, {EOS}, every]
    assert g.accepted == [b["g"], b["r"], b["e"]]
    # the verify accepted "y" and EOS, then sampled a bonus token: the run past EOS is not the grammar's
    g.pending = (3, [b["y"], EOS, b["r"]])
    assert _allowed(g.mask_rows([b["g"], b["r"], b["e"]], 2)[0]) == {EOS} and g.accepted[-1] == EOS
    c = Constraint.choice(["red"])  # the thinking's end in the drafts: the grammar from the draft after it
    g = SequenceGrammar(grammars_for(tok, VOCAB), Constraint(c.kind, c.spec, after="</think>"), (EOS,), tok)
    think = _byte_ids(tok, "ok </think")
    g.drafts = _byte_ids(tok, ">r")
    rows = g.mask_rows(think, 3)
    assert [_allowed(r) for r in rows] == [every, {b["r"]}, {b["e"]}]
    assert g.start is None and g.accepted == []
    assert len(_allowed(g.mask_row(think + _byte_ids(tok, "!")))) == VOCAB  # not the marker: still thinking


def test_grammar_starts_after_the_thinking(tok):
    """With ``after`` (a reasoning parser's </think>) every token may come until the text has the marker, however
    the tokens cut it; the grammar holds the tokens after it; a dropped step that took the marker away (a
    shorter output) starts the search again."""
    c = Constraint.choice(["red", "green"])
    g = SequenceGrammar(grammars_for(tok, VOCAB), Constraint(c.kind, c.spec, after="</think>"), (EOS,), tok)
    thinking = _byte_ids(tok, "so, </thi")
    assert len(_allowed(g.mask_row(thinking))) == VOCAB
    done = thinking + _byte_ids(tok, "nk>")
    assert _allowed(g.mask_row(done)) == {_byte_ids(tok, "r")[0], _byte_ids(tok, "g")[0]}
    assert _allowed(g.mask_row(done + _byte_ids(tok, "gr"))) == {_byte_ids(tok, "e")[0]}
    assert len(_allowed(g.mask_row(thinking + _byte_ids(tok, "n")))) == VOCAB  # rolled back before the marker
    assert _allowed(g.mask_row(done + _byte_ids(tok, "red"))) == {EOS}


def _run(engine, tokenizer, requests):
    seqs = [engine.add_request(tokenizer.encode(prompt), p) for prompt, p in requests]
    engine.run_to_completion(seqs)
    return seqs


def test_engine_outputs_are_valid(tiny_path):
    """A batch mixing every kind of constraint, greedy and sampled (seeded), with an unconstrained greedy
    request among them: each constrained output ends by EOS and satisfies its constraint; the same tokens
    with async scheduling off; the unconstrained request's tokens are those it gets alone."""
    model = moejax.load(tiny_path, dtype="float32", max_model_len=256, max_num_seqs=8, progress=False)
    eng, tk = model.engine, model.tokenizer
    assert eng.async_scheduling
    plain = SamplingParams(max_new_tokens=12, ignore_eos=True)
    alone = _run(eng, tk, [("free text", plain)])[0].output_ids
    requests = [(f"q{i}", SamplingParams(max_new_tokens=200, temperature=0.0 if i % 2 == 0 else 1.0, seed=i,
                                         structured_outputs=c))
                for i, c in enumerate(CONSTRAINTS + CONSTRAINTS)]
    requests.insert(3, ("free text", plain))
    runs = []
    for async_on in (True, False):
        eng.async_scheduling = async_on
        seqs = _run(eng, tk, requests)
        runs.append([s.output_ids for s in seqs])
        for s in seqs:
            c = s.params.structured_outputs
            if c is None:
                assert s.output_ids == alone
                continue
            assert s.finish_reason == "stop" and s.output_ids[-1] == EOS, (c.kind, s.text)
            assert valid(c, s.text), (c.kind, s.text)
    eng.async_scheduling = True
    assert runs[0] == runs[1]


# ----- through the server ----------------------------------------------------------------------------

NAME = "tiny-structured"


@pytest.fixture(scope="module")
def client(tiny_path):
    with serving(tiny_path, NAME, max_model_len=256, max_num_seqs=8) as srv:
        yield openai_client(srv.url, timeout=300)


NO_WS = {"disable_any_whitespace": True}
# (request fields, the constraint they mean, how they sample): vLLM's spellings of each kind. On a random
# model, free whitespace (vLLM's default) can keep a greedy answer in whitespace up to max_tokens: those forms
# run sampled only. A JSON object (nothing bounds its strings and numbers) can run as long: its own test below.
BOTH, SAMPLED = (0.0, 1.0), (1.0,)
FORMS = [
    ({"structured_outputs": {"json": PERSON, **NO_WS}}, CONSTRAINTS[0], BOTH),
    ({"structured_outputs": {"regex": REGEX}}, CONSTRAINTS[2], BOTH),
    ({"structured_outputs": {"choice": CHOICES}}, CONSTRAINTS[3], BOTH),
    ({"structured_outputs": {"grammar": GRAMMAR}}, CONSTRAINTS[4], BOTH),
    ({"guided_regex": REGEX}, CONSTRAINTS[2], BOTH),
    ({"guided_choice": CHOICES}, CONSTRAINTS[3], BOTH),
    ({"guided_grammar": GRAMMAR, "guided_decoding_backend": "xgrammar"}, CONSTRAINTS[4], BOTH),
    ({"guided_json": json.dumps(PERSON)}, CONSTRAINTS[0], SAMPLED),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}},
     CONSTRAINTS[0], SAMPLED),
]


def test_200_requests_all_valid(client):
    """200 structured-output requests (every form above, completions and chat, greedy and seeded sampling, 8 at a
    time): each answer ends by the model's stop and satisfies its constraint; streamed answers too."""
    import concurrent.futures
    jobs = []
    for i in range(200):
        fields, c, temps = FORMS[i % len(FORMS)]
        jobs.append((i, fields, c, temps[(i // len(FORMS)) % len(temps)]))

    def one(job):
        i, fields, c, temp = job
        kw = dict(model=NAME, max_tokens=200, temperature=temp, seed=i, extra_body=dict(fields))
        if i % 3 == 0:  # completions (response_format in the body: the client's completions take no such argument)
            r = client.completions.create(prompt=f"answer {i}:", **kw)
            return job, r.choices[0].text, r.choices[0].finish_reason
        if i % 7 == 1:
            chunks = list(client.chat.completions.create(messages=[{"role": "user", "content": f"q{i}"}], stream=True,
                                                         **kw))
            text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
            return job, text, [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1]
        if "response_format" in fields:  # the client's own argument
            kw["response_format"] = kw["extra_body"].pop("response_format")
        r = client.chat.completions.create(messages=[{"role": "user", "content": f"q{i}"}], **kw)
        return job, r.choices[0].message.content, r.choices[0].finish_reason

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, jobs))
    bad = [(job[0], job[1], job[3], text[:100], fin) for job, text, fin in results
           if fin != "stop" or not valid(job[2], text)]
    assert not bad, "\n".join(map(repr, bad))
    assert len({text for _, text, _ in results}) > 20  # the answers vary (not one string the mask forces)


def test_json_object_answers(client):
    """A JSON object (response_format json_object, structured_outputs json_object): every answer that ends is
    one (a random model may also run to max_tokens inside a long string or number: finish_reason length)."""
    ended = 0
    for i in range(12):
        kw = dict(model=NAME, messages=[{"role": "user", "content": f"o{i}"}], max_tokens=120, seed=i,
                  temperature=float(i % 2))
        if i < 6:
            r = client.chat.completions.create(response_format={"type": "json_object"}, **kw)
        else:
            r = client.chat.completions.create(extra_body={"structured_outputs": {"json_object": True, **NO_WS}}, **kw)
        ch = r.choices[0]
        assert ch.finish_reason in ("stop", "length")
        if ch.finish_reason == "stop":
            ended += 1
            assert isinstance(json.loads(ch.message.content), dict), ch.message.content
        else:
            assert ch.message.content.startswith("{")
    assert ended >= 3


def test_structured_request_errors(client, tok, monkeypatch):
    """Bad constraints and the fields that cannot go with one are 400s naming the field; without xgrammar the
    request is a 400 saying how to install it."""
    import openai
    msgs = [{"role": "user", "content": "hi"}]
    cases = [({"guided_regex": "a("}, "guided_regex"), ({"structured_outputs": {"regex": "a", "choice": ["b"]}},
                                                         "structured_outputs"),
             ({"structured_outputs": {"regex": "a", "odd": 1}}, "structured_outputs"),
             ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
             ({"guided_json": {"type": "frob"}}, "guided_json"), ({"guided_choice": []}, "guided_choice"),
             ({"guided_regex": "a", "ignore_eos": True}, "ignore_eos"),
             ({"guided_regex": "a", "min_tokens": 3}, "min_tokens"),
             ({"guided_decoding_backend": "outlines", "guided_regex": "a"}, "guided_decoding_backend"),
             ({"response_format": {"type": "json_schema"}}, "response_format"),
             ({"guided_whitespace_pattern": " ", "guided_regex": "a"}, "guided_whitespace_pattern")]
    for extra, param in cases:
        with pytest.raises(openai.BadRequestError) as ei:
            client.chat.completions.create(model=NAME, messages=msgs, max_tokens=4, extra_body=extra)
        assert ei.value.body["param"] == param, (extra, ei.value.body)
    from moejax.server.protocol import APIError, ServingContext, parse_request
    ctx = ServingContext((NAME,), Tokenizer.__new__(type(tok)), 256, VOCAB)  # a tokenizer not compiled for yet
    ctx.tokenizer.__dict__.update(tok.__dict__)
    monkeypatch.setitem(__import__("sys").modules, "xgrammar", None)  # as if not installed
    with pytest.raises(APIError) as ei:
        parse_request(json.dumps({"prompt": "x", "guided_regex": "a"}).encode(), ctx, False)
    assert ei.value.param == "guided_regex" and "pip install 'moejax[structured]'" in ei.value.message
    assert parse_request(json.dumps({"prompt": "x"}).encode(), ctx, False).params.structured_outputs is None
