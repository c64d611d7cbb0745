"""The engine loop: admit requests, run prefill or decode steps, detect finished sequences.

Decode-only time and tokens are accumulated separately from prefill, so decode
throughput can be reported without prefill time (as the reference numbers are).

With ``async_scheduling`` (the default; vLLM's ``--async-scheduling``, SGLang's overlap scheduler) decode steps overlap
the host's work: ``step()`` schedules and dispatches decode step t+1 before it reads step t's
tokens, so the device never waits for the host to build its next inputs. Step t+1's input
tokens are step t's sampled tokens, gathered on the device into t+1's batch order
(ModelRunner.dispatch_decode); positions, slots and block tables are known on the host, since
a step grows each sequence by one token. The host then reads step t (one device-to-host copy),
appends its tokens and checks EOS, stop strings, lengths and aborts, one step late: a sequence
that finished at step t was already scheduled into t+1, where its token is discarded (its
blocks are freed at once: every later write to them is dispatched after t+1's). A sequence
whose in-flight token must end it by length is not scheduled again. Each call returns one
decode step's sequences, exactly those and the tokens the synchronous loop gives.

Speculative decode steps (engine/speculative.py) overlap the same way: step t+1's verify inputs are
built on the device from step t's accepted counts and drafts, and each sequence in flight counts
k + 1 tokens pending (the most a step gains) until it is read.

The loop synchronises (reads the step in flight before scheduling) when a prefill could
come next: a prefill is built from the host's tokens (a preempted sequence's included) and
runs synchronously, as with async scheduling off.
"""

from __future__ import annotations

import dataclasses
import random
import time

from tqdm.auto import tqdm

from moejax.config import EngineConfig
from moejax.engine.block_manager import BlockManager
from moejax.engine.model_runner import DecodeStep, ModelRunner
from moejax.engine import sample_controls
from moejax.engine.sampling_params import SamplingParams
from moejax.engine.scheduler import Scheduler
from moejax.engine.sequence import Sequence, Status
from moejax.engine.speculative import SpecStep
from moejax.eplb.balancer import ExpertLoadBalancer
from moejax.parallel.processes import shared_seed
from moejax.structured_output import sequence_grammar


@dataclasses.dataclass
class EngineStats:
    prefill_steps: int = 0
    prefill_tokens: int = 0
    prefill_time: float = 0.0
    decode_steps: int = 0
    decode_tokens: int = 0
    decode_time: float = 0.0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # ... found there (not recomputed)
    # Speculative decoding (vLLM's spec_decode counters): sequences with drafts verified, draft tokens
    # verified, drafts accepted, and drafts accepted at each draft position (empty without speculation).
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple = ()

    @property
    def decode_throughput(self) -> float:
        """Output tokens per second of decode steps alone."""
        return self.decode_tokens / self.decode_time if self.decode_time else 0.0


def check_cache_capacity(max_model_len: int, num_blocks: int, block_size: int) -> None:
    """Refuses an engine whose one sequence of max_model_len tokens cannot fit in a rank's KV cache (a
    sequence lives on one rank): it would be preempted and recomputed forever once it grew that long."""
    capacity = num_blocks * block_size
    if max_model_len > capacity:
        raise ValueError(f"max_model_len {max_model_len} is larger than the KV cache holds ({capacity} tokens: "
                         f"{num_blocks} blocks x {block_size} per rank); lower max_model_len (--max-model-len) "
                         f"or raise num_kv_blocks (--num-kv-blocks) to at least {-(-max_model_len // block_size)}")


class LLMEngine:
    def __init__(self, config: EngineConfig, runner: ModelRunner, tokenizer, eos_token_ids: tuple[int, ...],
                 balancer: ExpertLoadBalancer):
        self.config = config
        self.runner = runner
        self.proposer = runner.proposer  # speculative decoding's seam beside the runner (engine/proposer.py)
        self.tokenizer = tokenizer
        self.eos_token_ids = set(eos_token_ids)
        self.balancer = balancer  # sees every step's expert counts; rebalances if the layout asks
        check_cache_capacity(runner.max_model_len, runner.num_blocks, runner.block_size)
        self.blocks = BlockManager(runner.num_blocks, runner.block_size, runner.num_ranks, runner.max_num_seqs,
                                   config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(self.blocks, runner.max_num_seqs * runner.num_ranks,
                                   config.scheduler.max_prefill_tokens, config.scheduler.max_preemptions,
                                   runner.max_model_len, config.scheduler.scheduling_policy,
                                   lookahead=config.num_speculative_tokens, overlaps=self.proposer.overlaps)
        self.stats = EngineStats(spec_accepted_per_pos=(0,) * config.num_speculative_tokens)
        # Seeds of requests that bring none: the same in every process of a multi-process job.
        self._rng = random.Random(shared_seed())
        self.async_scheduling = config.scheduler.async_scheduling
        # The decode step dispatched and not yet read, and the one being read (the next one dispatched already):
        # the runner's DecodeStep, or the proposer's own (a speculative step).
        self._in_flight: DecodeStep | SpecStep | None = None
        self._reading: DecodeStep | SpecStep | None = None
        # (first, sequence): samples of first's prompt (n > 1, best_of) held until first's prompt is cached
        self._held: list[tuple[Sequence, Sequence]] = []

    @property
    def max_model_len(self) -> int:
        return self.runner.max_model_len

    def precompile(self, progress: bool = True) -> dict:
        """Compiles every program the engine can run for its configuration (ModelRunner.precompile)."""
        return self.runner.precompile(progress)

    def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id=None,
                    after: Sequence | None = None) -> Sequence:
        """``after``: an earlier sequence of the same prompt (the samples of n > 1 or best_of): this one waits
        until that one's prompt is prefilled, then shares its cached blocks (the prefix cache) instead of
        computing the prompt again."""
        n = len(prompt_ids)
        if n == 0:
            raise ValueError("prompt must contain at least one token")
        vocab = self.runner.cfg.vocab_size
        if any((not isinstance(t, int)) or isinstance(t, bool) or t < 0 or t >= vocab for t in prompt_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        if n >= self.max_model_len:
            raise ValueError(f"prompt has {n} tokens; the maximum context length is {self.max_model_len}, "
                             "which must leave room for at least one new token")
        if self.blocks.blocks_needed(n + 1) > self.blocks.blocks_per_rank:
            raise ValueError(f"prompt has {n} tokens, more than the KV cache can hold")
        seed = params.seed if params.seed is not None else self._rng.getrandbits(32)
        seq = Sequence(prompt_ids, params, seed, request_id)
        seq.controls = sample_controls.prepare(params, self.tokenizer, vocab, self.eos_token_ids,
                                               speculative=not self.proposer.own_decode)
        seq.grammar = sequence_grammar(params, self.tokenizer, vocab, self.eos_token_ids)
        if after is not None and self.blocks.enable_prefix_caching and not self._prompt_cached(after):
            self._held.append((after, seq))
        else:
            self.scheduler.add(seq)
        return seq

    @staticmethod
    def _prompt_cached(seq: Sequence) -> bool:
        """Its prompt's blocks are in the prefix cache now (or it ended: nothing to wait for)."""
        return seq.is_finished or seq.num_cached_tokens >= seq.num_prompt_tokens

    def _release_held(self) -> None:
        """Held samples whose first sequence's prompt is cached go to the scheduler (they hit its blocks)."""
        if self._held:
            ready = [(a, s) for a, s in self._held if self._prompt_cached(a)]
            self._held = [(a, s) for a, s in self._held if not self._prompt_cached(a)]
            for _, s in ready:
                self.scheduler.add(s)

    def abort(self, seq: Sequence) -> None:
        held = [h for h in self._held if h[1] is seq]
        if held:
            self._held.remove(held[0])
            seq.finish_reason, seq.status = "abort", Status.FINISHED
        elif not seq.is_finished:
            self.scheduler.abort(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or bool(self._held)

    @property
    def num_held(self) -> int:
        """Samples waiting for their first sequence's prompt to be cached (``add_request``'s ``after``)."""
        return len(self._held)

    def pop_failed(self) -> list[Sequence]:
        """The sequences finished with an error (finish_reason "error", ``seq.error`` says why) since
        the last call: preempted more than max_preemptions times."""
        failed, self.scheduler.failed = self.scheduler.failed, []
        return failed

    def step(self) -> tuple[str, list[Sequence]]:
        """Runs one prefill or decode step. Returns (kind, sequences that got a token): a prefill
        step whose chunks complete no prompt returns ("prefill", []). With async scheduling the
        decode step returned is the one read in this call (the next one is already running)."""
        self._release_held()
        if not self.async_scheduling:
            kind, seqs = self.scheduler.schedule()
            if kind == "idle":
                return kind, []
            return self._run_sync(kind, seqs, time.perf_counter())
        try:
            return self._step_async()
        except BaseException:
            self._drop_in_flight()
            raise

    def _step_async(self) -> tuple[str, list[Sequence]]:
        t0 = time.perf_counter()
        if self._in_flight is not None and self.scheduler.prefill_ready():
            return self._finish_decode(self._take_in_flight(), t0)  # sync point: a prefill comes next
        if self._in_flight is None:
            kind, seqs = self.scheduler.schedule()
            if kind != "decode":
                return ("idle", []) if kind == "idle" else self._run_sync(kind, seqs, t0)
            self._in_flight = self._dispatch_decode(seqs)
            if self.scheduler.prefill_ready():  # its scheduling preempted a sequence that fits again
                return self._finish_decode(self._take_in_flight(), t0)
        # One decode step in flight: schedule and dispatch the next before reading it.
        prev = self._in_flight
        kind, seqs = self.scheduler.schedule()
        if kind == "prefill":  # prefill_ready() said no: schedule() must agree
            raise RuntimeError("the scheduler chose a prefill with a decode step in flight")
        self._in_flight = self._dispatch_decode(seqs, prev) if kind == "decode" else None
        return self._finish_decode(prev, t0)

    def _take_in_flight(self) -> DecodeStep:
        step, self._in_flight = self._in_flight, None
        return step

    def _drop_in_flight(self) -> None:
        """After a failed step: the steps dispatched and not read are abandoned; their sequences' tokens
        are recomputed (the same ones: a decode step is a function of the host's tokens, seeds and
        positions)."""
        for step in (self._reading, self._in_flight):
            for s in step.seqs if step is not None else ():
                s.num_pending_tokens = 0
        self._reading = self._in_flight = None

    def _dispatch_decode(self, seqs: list[Sequence], prev=None):
        step = (self.runner.dispatch_decode(seqs, prev) if self.proposer.own_decode else
                self.proposer.dispatch(seqs, prev))
        self.balancer.record()  # expert counts of this step, left on the device; may rebalance between steps
        return step

    def _finish_decode(self, step, t0: float) -> tuple[str, list[Sequence]]:
        """Reads a dispatched decode step and appends its tokens; a sequence finished (or aborted) since
        the step was scheduled gets nothing: its token is discarded."""
        self._reading = step  # until read: a failure abandons it (_drop_in_flight)
        out = self.runner.read(step) if self.proposer.own_decode else self.proposer.read(step)
        self._reading = None
        self.stats.decode_steps += 1
        self.stats.decode_time += time.perf_counter() - t0
        if not self.proposer.own_decode:
            return "decode", self._append_accepted(step.seqs, out)
        stepped = []
        for seq, t, lp, top in zip(step.seqs, out.tokens.tolist(), out.logprobs.tolist(), out.top_logprobs):
            if seq.is_finished:
                continue
            if seq.block_table:  # not preempted since: its full blocks become prefix-cache hits
                self.blocks.cache_computed(seq)
            self._append(seq, t, lp, top)
            stepped.append(seq)
        self.stats.decode_tokens += len(stepped)
        return "decode", stepped

    def _run_sync(self, kind: str, seqs: list[Sequence], t0: float) -> tuple[str, list[Sequence]]:
        """One step run and read at once (every step with async scheduling off; prefills with it on)."""
        if kind == "decode" and not self.proposer.own_decode:
            return self._run_proposer_decode(seqs, t0)
        new_tokens = sum(s.num_new_tokens for s in seqs)
        out = self.runner.prefill(seqs) if kind == "prefill" else self.runner.decode(seqs)
        dt = time.perf_counter() - t0
        self.balancer.record()  # expert counts of this step; may rebalance between steps
        if kind == "prefill":
            self.stats.prefill_steps += 1
            self.stats.prefill_tokens += new_tokens
            self.stats.prefill_time += dt
        else:
            self.stats.decode_steps += 1
            self.stats.decode_tokens += len(seqs)
            self.stats.decode_time += dt
        self.stats.prefix_cache_queries = self.scheduler.prefix_cache_queries
        self.stats.prefix_cache_hits = self.scheduler.prefix_cache_hits
        for seq in seqs:
            self.blocks.cache_computed(seq)  # full blocks become prefix-cache hits for later requests
        # A chunk that leaves part of its prompt uncomputed samples nothing.
        stepped = [s for s in seqs if kind == "decode" or s.prefill_done]
        by_id = {s.seq_id: sampled for s, sampled in zip(seqs, zip(out.tokens.tolist(), out.logprobs.tolist(),
                                                                 out.top_logprobs))}
        if kind == "prefill":
            self.scheduler.prefilled(stepped)
        for seq in stepped:
            self._append(seq, *by_id[seq.seq_id])
        return kind, stepped

    def _run_proposer_decode(self, seqs: list[Sequence], t0: float) -> tuple[str, list[Sequence]]:
        """The proposer's decode step (engine/speculative.py's verify), run and read at once."""
        out = self.proposer.decode(seqs)
        self.balancer.record()
        self.stats.decode_steps += 1
        self.stats.decode_time += time.perf_counter() - t0
        return "decode", self._append_accepted(seqs, out)

    def _append_accepted(self, seqs: list[Sequence], out) -> list[Sequence]:
        """A speculative step's tokens (each sequence's accepted drafts and one more), appended one by one, so
        EOS, stop strings and length limits cut an accepted run where they fall; a sequence finished (or
        aborted) since the step was dispatched gets nothing. Returns the sequences that got tokens."""
        st = self.stats
        st.spec_num_drafts += out.num_drafts
        st.spec_num_draft_tokens += out.num_draft_tokens
        st.spec_num_accepted_tokens += int(out.accepted_per_pos.sum())
        st.spec_accepted_per_pos = tuple(int(a + b) for a, b in zip(st.spec_accepted_per_pos, out.accepted_per_pos))
        stepped = []
        for seq, toks, lps, tops in zip(seqs, out.tokens, out.logprobs, out.top_logprobs):
            if seq.is_finished:
                continue
            stepped.append(seq)
            for t, lp, top in zip(toks, lps, tops):
                # Full blocks of computed tokens become prefix-cache hits, as a decode step per token registers them.
                if seq.block_table:  # not preempted since it was dispatched
                    self.blocks.cache_computed(seq)
                self._append(seq, t, lp, top)
                st.decode_tokens += 1
                if seq.is_finished:
                    break
        return stepped

    def _append(self, seq: Sequence, token: int, logprob: float, top: list[tuple[int, float]] | None) -> None:
        p = seq.params
        seq.token_ids.append(token)
        seq.cumulative_logprob += logprob
        if p.logprobs:
            seq.logprobs.append(logprob)
        if p.top_logprobs:
            seq.top_logprobs.append(top)
        reason = None
        if (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids:
            reason = "stop"
        elif seq.num_output_tokens >= p.max_new_tokens or len(seq) >= self.max_model_len:
            reason = "length"
        text = None
        if p.stop and reason != "stop":
            text = self.tokenizer.decode(seq.output_ids, skip_special_tokens=p.skip_special_tokens)
            hits = [(text.find(s), s) for s in p.stop if s in text]
            if hits:
                i, s = min(hits, key=lambda h: h[0])
                # the stop string itself is not returned unless asked (as in vLLM); may be ""
                text = text[:i + len(s) if p.include_stop_str_in_output else i]
                reason = "stop"
        if reason:
            seq.finish_reason = reason
            seq.text = (self.tokenizer.decode(seq.output_ids, skip_special_tokens=p.skip_special_tokens)
                        if text is None else text)
            self.scheduler.finish(seq)

    def run_to_completion(self, seqs: list[Sequence], progress: bool = False) -> None:
        total = sum(s.params.max_new_tokens for s in seqs)
        with tqdm(total=total, desc="Generating", unit="tok", disable=not progress) as bar:
            while any(not s.is_finished for s in seqs):
                kind, stepped = self.step()
                self.pop_failed()  # they are finished: their results carry the error
                if kind == "idle" and any(not s.is_finished for s in seqs):
                    raise RuntimeError("engine is idle with unfinished sequences")
                bar.update(len(stepped))
