"""Structured outputs (vLLM's ``response_format``, ``structured_outputs`` and ``guided_*``) through xgrammar
(the grammar library vLLM and SGLang use; the optional extra ``pip install 'moejax[structured]'``).

A request's constraint (``Constraint``: a JSON schema, any JSON object, a regex, a choice of strings or an
EBNF grammar) is compiled once per distinct constraint (xgrammar's compiler caches them) against the
tokenizer's vocabulary. Each sequence that has one gets its own matcher (``SequenceGrammar``), which
follows the sequence's output tokens and gives, for the next token, the row of allowed tokens in
layers/sampler.py's vocabulary-mask layout (xgrammar's bitmask: bit t % 32 of int32 word t // 32). The
sampling controls' host side (engine/sample_controls.py) ANDs that row into the sampler's one mask
input, so a constrained request runs the sampler's controls variant and nothing else changes.

When the mask is built: after the step's model program has been dispatched and before its sampler is
(model_runner.py runs them as two programs), so the host fills the rows while the device runs the
model. With async scheduling the token each sequence sampled in the step still in flight is read first
(``peek_pending``: it is done by then, the device having moved on to the next model step), so the
overlap of the model step with the host's work is kept.

With a reasoning parser the grammar holds only the answer after the thinking (vLLM's rule):
``Constraint.after`` names the marker that ends it (``</think>``), and the sequence samples freely until its
text has it, the grammar then starting at the next token (the real checkpoints' ``</think>`` is one token).

The grammar ends the answer: once it is complete the mask allows only the stop tokens (EOS), which the
engine's EOS rule stops on; so ``ignore_eos`` and ``min_tokens`` (which mask EOS) are refused with a
constraint.

With speculative decoding (engine/speculative.py) a verify samples k + 1 rows of a sequence, row j after its
first j drafts; so row j gets the mask of the grammar advanced over those drafts (``mask_rows``, as vLLM's
structured outputs do): the matcher takes the drafts one by one, filling each row, then rolls them back. A
draft the grammar rejects ends the rows that mean something: row j - 1's mask forbids d_j, so the verify
cannot accept it, and the rows after (their samples dropped) allow every token. The accepted tokens then
advance the matcher as any sampled ones (the next ``mask_rows`` catches up on them). The drafts are on the
device when the step before is in flight: ``peek_drafts`` reads them with that step's accepted tokens, once,
for a batch holding a constrained sequence (it waits for that step: the slower path only such batches take).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import weakref

import numpy as np

from moejax.parallel.processes import to_host

XGRAMMAR_VERSION = "0.2.8"  # pyproject.toml's structured extra
KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclasses.dataclass(frozen=True)
class Constraint:
    """What the output must match: ``kind`` one of KINDS; ``spec`` its text (a JSON schema as JSON, a
    regex, the choices as a JSON list, an EBNF grammar; "" for json_object, any JSON object as vLLM's).
    ``any_whitespace`` false: JSON without free whitespace (vLLM's disable_any_whitespace). ``after``: the text
    that ends the thinking, before which nothing is constrained ("": the whole output)."""
    kind: str
    spec: str = ""
    any_whitespace: bool = True
    after: str = ""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"structured_outputs: unknown kind {self.kind!r}; one of {KINDS}")
        if not isinstance(self.spec, str):
            raise ValueError(f"structured_outputs: the {self.kind} constraint must be text, got {type(self.spec).__name__}")

    @classmethod
    def of(cls, value) -> Constraint | None:
        """A Constraint from itself, a dict of its fields (SamplingParams crossing a process as JSON), or None."""
        if value is None or isinstance(value, Constraint):
            return value
        if isinstance(value, dict) and set(value) <= {"kind", "spec", "any_whitespace", "after"}:
            return cls(**value)
        raise ValueError(f"structured_outputs must be a Constraint, got {value!r}"[:200])

    @classmethod
    def choice(cls, options: list[str]) -> Constraint:
        if not options or not all(isinstance(o, str) for o in options):
            raise ValueError("the choice must be a non-empty list of strings")
        return cls("choice", json.dumps(list(options), ensure_ascii=False))


def xgrammar():
    """The xgrammar module; a ValueError saying how to install it when absent (a 400 on the server)."""
    try:
        import xgrammar as xgr  # noqa: PLC0415 - optional dependency, imported on first use (it imports torch)
    except ImportError:
        raise ValueError(f"structured outputs need xgrammar {XGRAMMAR_VERSION}, which is not installed: "
                         "pip install 'moejax[structured]'") from None
    return xgr


class Grammars:
    """One tokenizer's grammar compiler (a vocabulary of ``vocab_size`` ids: the model's, which may exceed the
    tokenizer's); ``compile`` raises a ValueError naming what is wrong with a constraint."""

    def __init__(self, tokenizer, vocab_size: int):
        xgr = xgrammar()
        from transformers import PreTrainedTokenizerFast  # noqa: PLC0415 - xgrammar's own dependency

        stop = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend)
        self.info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=stop)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1)  # it caches what it compiled
        self.vocab_size = vocab_size

    def compile(self, c: Constraint):
        try:
            if c.kind in ("json", "json_object"):
                spec = c.spec if c.kind == "json" else '{"type": "object"}'
                json.loads(spec)  # a clear error for text that is no JSON at all
                return self.compiler.compile_json_schema(spec, any_whitespace=c.any_whitespace)
            if c.kind == "regex":
                return self.compiler.compile_regex(c.spec)
            if c.kind == "choice":
                options = json.loads(c.spec)
                # each option a literal of the grammar: JSON's string escapes are EBNF's
                return self.compiler.compile_grammar(
                    "root ::= " + " | ".join(json.dumps(o, ensure_ascii=False) for o in options))
            return self.compiler.compile_grammar(c.spec)
        except (RuntimeError, ValueError, TypeError) as e:  # xgrammar raises RuntimeError on a bad spec
            why = _XGR_PREFIX.sub("", str(e).strip())  # "[time] file.cc:line: " of its C++ checks
            raise ValueError(f"the {c.kind} constraint cannot be compiled: {why[:300]}") from None


_XGR_PREFIX = re.compile(r"^\[[^\]]*\] \S+: ")


@functools.lru_cache(maxsize=8)
def grammars_for(tokenizer, vocab_size: int) -> Grammars:
    """The process's Grammars of this tokenizer (the server's request checks and the engine share it)."""
    return Grammars(tokenizer, vocab_size)


def check_request(params) -> None:
    """A ValueError naming the field that cannot go with a constraint (module docstring says why)."""
    if params.ignore_eos:
        raise ValueError("ignore_eos: a structured output ends with EOS once its grammar is complete")
    if params.min_tokens:
        raise ValueError("min_tokens: it masks EOS, which ends a structured output once its grammar is complete")


# The matchers of the sequences alive in this process (a sequence's goes with it): with none, a decode step's
# peek_pending returns at once instead of looking at every sequence of the batch.
_LIVE: weakref.WeakSet = weakref.WeakSet()


class SequenceGrammar:
    """One sequence's matcher, following its output tokens (``mask_rows`` catches up on the tokens it has not
    seen, and rolls back those a dropped step took away)."""

    def __init__(self, grammars: Grammars, constraint: Constraint, stop_token_ids, tokenizer=None):
        xgr = xgrammar()
        self.after, self.tokenizer = constraint.after, tokenizer  # the thinking's end, found in the decoded text
        self.start = 0 if not self.after else None  # the output index the grammar starts at (None: not yet)
        self.scanned = 0  # output tokens looked at for the marker
        self.stop = [int(t) for t in stop_token_ids]
        self.matcher = xgr.GrammarMatcher(grammars.compile(constraint), override_stop_tokens=self.stop)
        self.words = xgr.get_bitmask_shape(1, grammars.vocab_size)[1]
        self.accepted: list[int] = []
        self.pending: tuple[int, list[int]] | None = None  # (output index, tokens) sampled in the step in flight
        self.drafts: list[int] | None = None  # the drafts the verify being built checks (peek_drafts)
        _LIVE.add(self)

    def mask_row(self, output_ids: list[int]) -> np.ndarray:
        """int32 [W]: the tokens the grammar allows after ``output_ids`` (and the pending tokens)."""
        return self.mask_rows(output_ids, 1)[0]

    def mask_rows(self, output_ids: list[int], rows: int) -> np.ndarray:
        """int32 [rows, W]: row 0 what the grammar allows after ``output_ids`` (and the pending tokens), row j
        after them and the first j of ``drafts`` (a speculative verify's rows); rows past a draft the grammar
        rejects, or past the drafts, allow every token (their samples are dropped). Pending tokens and drafts
        are used once."""
        tokens = list(output_ids)
        if self.pending is not None and self.pending[0] == len(tokens):
            tokens += self.pending[1]
        drafts = [int(t) for t in (self.drafts or ())][:rows - 1]
        self.pending = self.drafts = None
        out = np.full((rows, self.words), -1, np.int32)
        if self._advance(tokens, strict=True):
            self._fill(out, 0)
        if not drafts:
            return out
        saved = len(self.accepted), self.start, self.scanned  # the real tokens' state, back after the drafts
        for j in range(1, len(drafts) + 1):
            took = self._advance(tokens + drafts[:j], strict=False)
            if took is False:
                break
            if took:
                self._fill(out, j)
        if len(self.accepted) > saved[0]:
            self.matcher.rollback(len(self.accepted) - saved[0])
            del self.accepted[saved[0]:]
        self.start, self.scanned = saved[1:]
        return out

    def _advance(self, tokens: list[int], strict: bool) -> bool | None:
        """The matcher moved to the state after ``tokens`` (the output's, rolled back to where they part). None:
        still thinking (nothing constrained). ``strict`` (sampled tokens): one the grammar rejects is an error,
        and those after its stop token are ignored (the engine ends the sequence there); else (drafts) False
        when the last is rejected, the matcher then after the others."""
        if self.after:
            tokens = self._after_thinking(tokens)
            if tokens is None:
                return None
        keep = len(self.accepted)
        if tokens[:keep] != self.accepted:
            keep = 0
            while keep < min(len(self.accepted), len(tokens)) and self.accepted[keep] == tokens[keep]:
                keep += 1
        if keep < len(self.accepted):
            self.matcher.rollback(len(self.accepted) - keep)
            del self.accepted[keep:]
        for t in tokens[keep:]:
            if self.matcher.is_terminated():
                return strict
            if not self.matcher.accept_token(int(t)):
                if strict:
                    raise RuntimeError(f"token {t} was sampled against the grammar's mask")
                return False
            self.accepted.append(int(t))
        return True

    def _fill(self, out: np.ndarray, j: int) -> None:
        """Row j of ``out``: the matcher's next-token mask; once it is terminated (its stop token taken, that
        row's sample dropped: the engine ends the sequence there) the stop tokens, never an empty row."""
        if self.matcher.is_terminated():
            stop = np.asarray(self.stop)
            out[j] = 0
            np.bitwise_or.at(out[j], stop // 32, (1 << (stop % 32)).astype(np.int32))
        else:
            self.matcher.fill_next_token_bitmask(out, j)

    def _after_thinking(self, tokens: list[int]) -> list[int] | None:
        """The tokens after the one that completes ``after`` (None while it has not come); a dropped step that
        took the marker away starts the search again."""
        if self.start is not None and len(tokens) < self.start:
            self.matcher.reset()
            self.accepted, self.start, self.scanned = [], None, 0
        self.scanned = min(self.scanned, len(tokens))
        window = 4 * len(self.after)  # tokens enough to hold the marker's text (each gives a character or more)
        while self.start is None and self.scanned < len(tokens):
            self.scanned += 1
            tail = self.tokenizer.decode(tokens[max(0, self.scanned - window):self.scanned], skip_special_tokens=False)
            if self.after in tail:
                self.start = self.scanned
        return None if self.start is None else tokens[self.start:]


def sequence_grammar(params, tokenizer, vocab_size: int, eos_token_ids):
    """The SequenceGrammar of a new sequence with these SamplingParams (None without a constraint); a
    ValueError naming the field for what cannot be served."""
    c = params.structured_outputs
    if c is None:
        return None
    check_request(params)
    if not eos_token_ids:
        raise ValueError("structured_outputs: this model has no EOS token to end a structured output with")
    return SequenceGrammar(grammars_for(tokenizer, vocab_size), c, eos_token_ids, tokenizer)


def peek_pending(seqs, prev) -> None:
    """Before a step's mask is built: each constrained sequence's token in ``prev`` (the step in flight) read
    from the device, so its matcher can take it (one copy for the batch; the engine reads the step after)."""
    if not _LIVE or prev is None:
        return
    waiting = [s for s in seqs if s.grammar is not None and s.num_pending_tokens]
    if not waiting:
        return
    toks = to_host(prev.sampled[0])
    for s in waiting:
        r, i = prev.index[s.seq_id]
        s.grammar.pending = (s.num_output_tokens, [int(toks[r, i])])


def peek_drafts(seqs, prev, host_drafts) -> None:
    """Before a speculative verify's masks are built (engine/speculative.py): each constrained sequence's
    drafts, with its tokens in ``prev`` (the step in flight: its accepted drafts and one more) when it has
    some there, all read from the device in one copy, which waits for ``prev``; ``host_drafts(seq)``: the
    drafts of a sequence with nothing in flight (the host's)."""
    if not _LIVE:
        return
    mine = [s for s in seqs if s.grammar is not None]
    if any(s.num_pending_tokens for s in mine):
        toks, accepted, drafts = (np.asarray(a) for a in to_host((prev.sampled[0], prev.accepted, prev.drafts)))
        R = drafts.shape[-1] + 1  # rows a sequence: t_P and the k drafts
    for s in mine:
        if s.num_pending_tokens:
            q, i = prev.index[s.seq_id]
            n = int(accepted[q, i])
            s.grammar.pending = (s.num_output_tokens, toks[q, i * R:i * R + n + 1].astype(int).tolist())
            s.grammar.drafts = drafts[q, i].astype(int).tolist()
        else:
            s.grammar.drafts = [int(t) for t in host_drafts(s)]
