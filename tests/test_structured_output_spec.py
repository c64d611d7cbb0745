"""Structured outputs with speculative decoding (MTP, k = 2; moejax/structured_output.py's ``mask_rows``): a
verify's row j samples under the grammar's mask after the first j drafts. Against the non-speculative engine
(the reference) on the same float32 checkpoint: 60 requests across several batches (JSON schema, regex,
choice, EBNF grammar; greedy and seeded sampled; unconstrained rows among them), async scheduling on (a
constrained row's drafts read from the step in flight): every constrained output valid under its grammar
(parsed here: json.loads and the schema's rules, re.fullmatch, choice membership) and every output the
reference's tokens. Drafts injected from the reference's own output (all accepted: the rows past the first
follow the drafts, or the steps would not be ceil((n - 1) / 3)), then half and all wrong (a draft the grammar
or the target rejects ends the accepted run): the reference's tokens each time. Start-up compilation covers
the constrained verify (its sampler's mask rows at B x (k + 1)): nothing traces again.

The checkpoint is v3-tiny at two layers with its MTP layer (conftest.v3_tiny_two_layers), random weights of
std 0.1 from a fresh seed (the module fixture prints it)."""

import json

import numpy as np
import pytest

import moejax
from moejax.engine.sampling_params import SamplingParams
from moejax.structured_output import Constraint
from moejax.tiny.checkpoint import make_random_checkpoint

from conftest import v3_tiny_two_layers
from test_structured_output import REGEX, person_schema, satisfies

pytest.importorskip("xgrammar")

CFG = v3_tiny_two_layers(num_nextn_predict_layers=1)
V = CFG["vocab_size"]
EOS = 1
K = 2
KW = dict(dtype="float32", max_model_len=96, max_num_seqs=8, block_size=16, progress=False)
SPEC = {"method": "mtp", "num_speculative_tokens": K}

NAME_CHARS = "a-z"
PERSON = person_schema(NAME_CHARS)
CHOICES = ["red", "green", "grey", 'say "hi"']
GRAMMAR = 'root ::= "(" num ("+" num)? ")"\nnum ::= [1-9] [0-9]?'  # bounded: every output ends
CONSTRAINTS = [Constraint("json", json.dumps(PERSON), any_whitespace=False), Constraint("regex", REGEX),
               Constraint.choice(CHOICES), Constraint("grammar", GRAMMAR)]


def valid(c: Constraint, text: str) -> bool:
    return satisfies(c, text, NAME_CHARS, r"\([1-9][0-9]?(?:\+[1-9][0-9]?)?\)")  # GRAMMAR's texts


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    seed = int(np.random.default_rng().integers(1 << 30))
    print(f"checkpoint seed {seed}")
    return make_random_checkpoint(str(tmp_path_factory.mktemp("mtp")), CFG, seed=seed, std=0.1)


@pytest.fixture(scope="module")
def models(ckpt):
    """The reference (synchronous: the batches the speculative steps run) and the speculative engine."""
    return (moejax.load(ckpt, **KW, async_scheduling=False),
            moejax.load(ckpt, **KW, speculative_config=SPEC))


def _requests(rng, n: int) -> list[tuple[list[int], SamplingParams]]:
    """n requests cycling through the constraints and an unconstrained one (EOS ignored, its own length),
    greedy and seeded top-p sampled in turn, prompts of 2-12 random tokens."""
    out = []
    for i in range(n):
        c = (CONSTRAINTS + [None])[i % 5]
        kw = dict(temperature=0.9, top_p=0.95, seed=int(rng.integers(1 << 30))) if (i // 5) % 2 else {}
        if c is None:
            p = SamplingParams(max_new_tokens=int(rng.integers(4, 24)), ignore_eos=True, **kw)
        else:
            p = SamplingParams(max_new_tokens=80, structured_outputs=c, **kw)
        out.append((rng.integers(2, V, size=int(rng.integers(2, 13))).tolist(), p))
    return out


def _run(model, requests):
    """The finished sequences and the decode steps that gave tokens (with async scheduling a run can leave a
    step of finished sequences in flight, read as an empty step by the next run)."""
    eng = model.engine
    seqs = [eng.add_request(prompt, p) for prompt, p in requests]
    steps = 0
    while any(not s.is_finished for s in seqs):
        kind, stepped = eng.step()
        assert kind != "idle"
        steps += kind == "decode" and bool(stepped)
    assert eng.blocks.num_free == eng.blocks.num_blocks
    return seqs, steps


def _check(seqs, want):
    """Each constrained output valid and ended by EOS; every output the reference's tokens."""
    for s, w in zip(seqs, want):
        c = s.params.structured_outputs
        if c is not None:
            assert s.finish_reason == "stop" and s.output_ids[-1] == EOS, (c.kind, s.text)
            assert valid(c, s.text), (c.kind, s.text)
        assert s.output_ids == w.output_ids, (c, s.text, w.text)


def test_outputs_valid_and_same_as_without_speculation(models):
    """60 requests (48 constrained) through batches of 8 with async scheduling: a constrained row's next step
    is dispatched while its step before is in flight (its drafts and accepted tokens then read for its masks)."""
    base, spec = models
    assert spec.engine.async_scheduling
    requests = _requests(np.random.default_rng(), 60)
    want, _ = _run(base, requests)
    for s in want:
        if s.params.structured_outputs is not None:
            assert valid(s.params.structured_outputs, s.text), s.text
    drafter = spec.engine.runner.proposer
    fed = []
    dispatch = drafter.dispatch

    def recording(seqs, prev=None):  # constrained rows whose step before is in flight
        fed.append(sum(1 for s in seqs if s.grammar is not None and s.num_pending_tokens))
        return dispatch(seqs, prev)
    drafter.dispatch = recording
    try:
        got, _ = _run(spec, requests)
    finally:
        del drafter.dispatch
    _check(got, want)
    assert sum(fed) > 0 and spec.engine.stats.spec_num_draft_tokens > 0


def test_injected_drafts(models):
    """Drafts from the reference's own output: all right (every draft accepted, EOS included: ceil((n - 1) / 3)
    steps for n tokens), the first right and the second wrong (2 tokens a step), all wrong (as many steps as
    the reference). The reference's tokens each time, every constrained output valid."""
    base, spec = models
    requests = _requests(np.random.default_rng(), 8)  # one batch
    want, base_steps = _run(base, requests)
    full = {tuple(prompt): prompt + w.output_ids + [0] * K for (prompt, _), w in zip(requests, want)}

    def right(seq):
        return full[tuple(seq.token_ids[:seq.num_prompt_tokens])][len(seq):len(seq) + K]

    n = [len(w.output_ids) for w in want]
    drafter = spec.engine.runner.proposer
    try:
        for drafts, steps in ((right, max(-(-(m - 1) // (K + 1)) for m in n)),
                              (lambda s: right(s)[:1] + [(t + 1) % V for t in right(s)[1:]],
                               max(-(-(m - 1) // 2) for m in n)),
                              (lambda s: [(t + 1) % V for t in right(s)], base_steps)):
            drafter.draft_override = drafts
            got, got_steps = _run(spec, requests)
            _check(got, want)
            assert got_steps == steps, (got_steps, steps)
    finally:
        drafter.draft_override = None


def test_precompile_covers_constrained_verify(ckpt):
    """After start-up compilation constrained requests (greedy and sampled, among unconstrained ones) on a
    speculative engine trace no program again."""
    spec = moejax.load(ckpt, **{**KW, "max_num_seqs": 2, "max_model_len": 32, "block_size": 8},
                       speculative_config=SPEC)
    spec.engine.precompile(progress=False)
    counts = dict(spec.engine.runner.trace_counts)
    rng = np.random.default_rng()
    short = [Constraint("regex", REGEX), Constraint.choice(CHOICES)]
    requests = [(rng.integers(2, V, size=5).tolist(),
                 SamplingParams(max_new_tokens=12, structured_outputs=short[i % 2],
                                **(dict(temperature=1.0, seed=i) if i % 3 else {}))) for i in range(5)]
    requests.insert(2, ([5, 6, 7], SamplingParams(max_new_tokens=6, ignore_eos=True)))
    got, _ = _run(spec, requests)
    assert dict(spec.engine.runner.trace_counts) == counts
    for s in got:
        c = s.params.structured_outputs
        assert c is None or (s.finish_reason == "stop" and valid(c, s.text)), s.text
