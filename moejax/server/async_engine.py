"""Drives the (single-threaded) LLMEngine from one background thread and streams
each request's tokens to asyncio.

JAX and the engine are driven from this one thread only. The event loop submits
requests and aborts through a thread-safe inbox; the engine thread adds them,
runs ``engine.step()`` in a loop (through a StepLog that records every step's
kind and where its sequences came from) and hands each new token to its
request's asyncio queue with ``loop.call_soon_threadsafe`` (one callback per
step).

Faults: an exception in a step fails only the requests of that step (those whose
sequences hold KV blocks: the batch being run), each with an error event (500);
the engine goes on with the others. It is declared dead (every open stream gets a
503 error event, /health answers 503, and the server process exits non-zero: see
lifecycle.py) when a step fails with no request to blame, when steps fail
MAX_CONSECUTIVE_FAILURES times in a row, or on anything that is not an Exception.
A request the engine gave up (preempted more than max_preemptions times: the cache
is too small for the load) gets an error event (503) too.

Disaggregated workers (router.py) use two more kinds of request. A ``handoff`` request (prefill
worker) ends after its first token: the engine thread takes its sequence out with its cache rows
(kv_handoff.take_prefilled) and its last event carries them (``TokenEvent.handoff``), unless that
token finished it. ``add_prefilled`` (decode worker) adds a sequence prefilled elsewhere; while
the engine has no room for it, it is parked and retried every loop, never dropped.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import queue
import threading
import time
import traceback

from moejax.engine.kv_handoff import (PrefilledRequest, add_prefilled, can_add, check_fits, check_role,
                                      take_prefilled)
from moejax.engine.sampling_params import SamplingParams
from moejax.engine.sequence import Status
from moejax.engine.step_log import StepLog
from moejax.server.metrics import Metrics


MAX_CONSECUTIVE_FAILURES = 3


class EngineDeadError(RuntimeError):
    pass


@dataclasses.dataclass
class TokenEvent:
    token_id: int | None = None
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None  # (token id, logprob), descending, when asked
    finish_reason: str | None = None  # set on the last event of a request
    text: str | None = None  # final text (stop strings cut) on the last event
    error: str | None = None  # the request failed (its step raised, or the engine died, or shutdown)
    status: int = 500  # the HTTP status of that error
    handoff: PrefilledRequest | None = None  # a handoff request's sequence, taken out after this token
    cumulative_logprob: float | None = None  # of the sequence's tokens, on the last event (best_of ranks by it)
    prompt_logprobs: list | None = None  # on the first event, when asked: engine/prompt_logprobs.PromptLogprob each


class RequestStream:
    """The asyncio side of one request: iterate it for TokenEvents."""

    def __init__(self, owner: AsyncEngine, prompt_ids: list[int], params: SamplingParams, loop):
        self.owner, self.prompt_ids, self.params, self.loop = owner, prompt_ids, params, loop
        self.queue: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self.seq = None  # set by the engine thread
        self.accepted: asyncio.Future = loop.create_future()
        self.finished = False
        self.arrival = time.perf_counter()
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.num_output = 0
        self.handoff = False  # end after the first token, the sequence taken out (prefill worker)
        self.prefilled: PrefilledRequest | None = None  # a sequence prefilled elsewhere (decode worker)
        self.after: RequestStream | None = None  # its prompt's first sample (n > 1): shares its cached prompt

    async def get(self, timeout: float | None = None) -> TokenEvent | None:
        """The next event, or None after `timeout` seconds without one."""
        try:
            ev = await asyncio.wait_for(self.queue.get(), timeout)
        except asyncio.TimeoutError:
            return None
        if ev.finish_reason is not None or ev.error is not None or ev.handoff is not None:
            self.finished = True
        return ev

    def get_nowait(self) -> TokenEvent | None:
        try:
            ev = self.queue.get_nowait()
        except asyncio.QueueEmpty:
            return None
        if ev.finish_reason is not None or ev.error is not None or ev.handoff is not None:
            self.finished = True
        return ev

    def abort(self) -> None:
        if not self.finished:
            self.owner.abort(self)


def _resolve(fut: asyncio.Future, exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is None:
        fut.set_result(True)
    else:
        fut.set_exception(exc)


def _deliver(items: list[tuple[RequestStream, TokenEvent]]) -> None:
    for stream, ev in items:
        stream.queue.put_nowait(ev)


class AsyncEngine:
    def __init__(self, engine, model_name: str = "moejax", metrics: Metrics | None = None, precompile: bool = False):
        """precompile: the engine thread compiles every program first (ModelRunner.precompile); until it
        is done ``ready`` is unset (/health 503 "starting", requests 503)."""
        self.engine = engine
        self.metrics = metrics or Metrics(model_name)
        self.precompile = precompile
        self.ready = threading.Event()
        self.startup: dict | None = None  # precompile's {"programs", "seconds"}
        if not precompile:  # ready at once (no window where a started engine answers "starting")
            self.metrics.on_ready(None)
            self.ready.set()
        self.step_log = StepLog()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[int, RequestStream] = {}  # seq_id -> stream (engine thread only)
        self._stop = threading.Event()
        self.error: str | None = None
        self._failures = 0  # consecutive failed steps
        self._parked: list[RequestStream] = []  # prefilled requests waiting for room (engine thread only)
        self.num_parked = 0  # prefilled requests that had to wait for room, ever
        self._thread = threading.Thread(target=self._run, name="moejax-engine", daemon=True)
        # LLMEngine shares a prompt's cached blocks between its samples; a multi-process leader replays calls
        # without it (each sample prefills its prompt)
        self._shares_prompts = "after" in inspect.signature(engine.add_request).parameters

    # ----- event-loop side ---------------------------------------------------------
    def start(self) -> AsyncEngine:
        self._thread.start()
        return self

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._inbox.put(("wake", None))
        if self._thread.is_alive() and self.error is None:  # a dead engine's thread may be stuck in a step
            self._thread.join(timeout)

    def fail(self, message: str) -> None:
        """Declares the engine dead from outside its thread (thread-safe): another process of a
        multi-process server died, so the step in flight never returns (moejax/parallel/peer_watch.py)."""
        if self.error is None:
            self.error = message

    @property
    def is_alive(self) -> bool:
        return self.error is None and self._thread.is_alive() and not self._stop.is_set()

    async def add_request(self, prompt_ids: list[int], params: SamplingParams, handoff: bool = False,
                          prefilled: PrefilledRequest | None = None,
                          after: RequestStream | None = None) -> RequestStream:
        """Queues a request; raises ValueError if the engine rejects it (e.g. prompt too long).
        ``handoff``: its last event hands its prefilled sequence over (unless its first token ends it);
        ``prefilled``: a sequence prefilled elsewhere, decoded here (prompt_ids/params are its own); ``after``:
        an earlier stream of the same prompt (LLMEngine.add_request's ``after``; an engine without it ignores
        the sharing only, never the sample)."""
        if not self.is_alive:
            raise EngineDeadError(self.error or "the engine is not running")
        stream = RequestStream(self, list(prompt_ids), params, asyncio.get_running_loop())
        stream.handoff, stream.prefilled, stream.after = handoff, prefilled, after
        self._inbox.put(("add", stream))
        while not stream.accepted.done():
            await asyncio.wait({stream.accepted}, timeout=1.0)
            if not stream.accepted.done() and not self.is_alive:
                raise EngineDeadError(self.error or "the engine is not running")
        stream.accepted.result()  # raises the engine's ValueError
        return stream

    def abort(self, stream: RequestStream) -> None:
        self._inbox.put(("abort", stream))

    # ----- engine thread -----------------------------------------------------------------
    def _handle(self, op: str, stream: RequestStream | None) -> None:
        if op == "add" and stream.prefilled is not None:
            try:
                check_fits(self.engine, stream.prefilled)  # before parking: a parked request must fit some day
            except ValueError as e:
                stream.loop.call_soon_threadsafe(_resolve, stream.accepted, ValueError(str(e)))
                return
            if not can_add(self.engine, stream.prefilled):
                self._parked.append(stream)  # accepted; added once there is room
                self.num_parked += 1
                stream.loop.call_soon_threadsafe(_resolve, stream.accepted, None)
                return
            try:
                stream.seq = add_prefilled(self.engine, stream.prefilled)
            except Exception as e:  # noqa: BLE001 - fails this request only (it may be accepted already)
                traceback.print_exc()
                stream.loop.call_soon_threadsafe(_resolve, stream.accepted, None)
                stream.loop.call_soon_threadsafe(_deliver, [(stream, TokenEvent(
                    error=f"adding the prefilled request failed: {type(e).__name__}: {e}"[:500]))])
                return
            stream.prefilled.rows = None  # in the cache now
            stream.arrival = stream.first_token_time = stream.last_token_time = time.perf_counter()
            stream.num_output = stream.seq.num_output_tokens
            self._streams[stream.seq.seq_id] = stream
            stream.loop.call_soon_threadsafe(_resolve, stream.accepted, None)
        elif op == "add":
            try:
                if stream.handoff:  # refused before its prefill runs: its rows could not be exported
                    check_role(self.engine.config, "export")
                kw = {"after": stream.after.seq} if stream.after is not None and self._shares_prompts else {}
                stream.seq = self.engine.add_request(stream.prompt_ids, stream.params, **kw)
            except ValueError as e:
                stream.loop.call_soon_threadsafe(_resolve, stream.accepted, ValueError(str(e)))
                return
            stream.arrival = time.perf_counter()
            self._streams[stream.seq.seq_id] = stream
            stream.loop.call_soon_threadsafe(_resolve, stream.accepted, None)
        elif op == "abort":
            seq = stream.seq
            if stream in self._parked:
                self._parked.remove(stream)
                return
            if seq is None or seq.seq_id not in self._streams:
                return  # never accepted, or already finished
            self.engine.abort(seq)
            del self._streams[seq.seq_id]
            self.metrics.on_finish("abort", time.perf_counter() - stream.arrival, None, stream.num_output)
            stream.loop.call_soon_threadsafe(_deliver, [(stream, TokenEvent(finish_reason="abort", text=""))])
            self.metrics.snapshot(self.engine, self.step_log.mixed_steps)

    def _drain(self, block: bool) -> None:
        try:
            op, s = self._inbox.get(timeout=0.05) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if op != "wake":
                self._handle(op, s)
            try:
                op, s = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _admit_parked(self) -> None:
        """Parked prefilled requests, in their order, while the engine has room for the first."""
        while self._parked and can_add(self.engine, self._parked[0].prefilled):
            stream = self._parked.pop(0)
            self._handle("add", stream)  # accepted already: resolving again does nothing

    def _start_up(self) -> None:
        """Compiles every program before the first request (engine thread: JAX is driven from here only)."""
        if self.precompile:
            self.startup = self.engine.precompile()
            print(f"Compiled {self.startup['programs']} programs in {self.startup['seconds']:.1f} s; ready.",
                  flush=True)
            self.metrics.on_ready(self.startup)
            self.ready.set()

    def _run(self) -> None:
        try:
            self._start_up()
            while not self._stop.is_set():
                self._drain(block=not self.engine.has_unfinished())
                self._admit_parked()
                if not self.engine.has_unfinished():
                    continue
                try:
                    kind, seqs = self.step_log.step(self.engine)
                except Exception as e:  # noqa: BLE001 - fail the step's requests; fatal ones re-raise
                    self._step_failed(e)
                    continue
                self._failures = 0
                now = time.perf_counter()
                out: dict[object, list] = {}
                self._report_given_up(out)
                for seq in seqs:
                    stream = self._streams.get(seq.seq_id)
                    if stream is None:
                        continue
                    p = seq.params
                    # One token a step, or several with speculative decoding (accepted drafts + one): an event each.
                    first, new = stream.num_output, max(seq.num_output_tokens - stream.num_output, 1)
                    events = [TokenEvent(token_id=seq.output_ids[i],
                                         logprob=seq.logprobs[i] if p.logprobs and len(seq.logprobs) > i else None,
                                         top_logprobs=seq.top_logprobs[i] if p.top_logprobs and
                                         len(seq.top_logprobs) > i else None)
                              for i in range(first, first + new)]
                    if first == 0 and p.prompt_logprobs is not None:  # computed by the prefill that gave this token
                        events[0].prompt_logprobs = seq.prompt_logprobs
                    stream.num_output += new
                    if stream.first_token_time is None:
                        stream.first_token_time = now
                        self.metrics.on_first_token(now - stream.arrival, seq.num_prompt_tokens)
                        if new > 1:
                            self.metrics.on_token(0.0, new - 1)
                    else:
                        self.metrics.on_token(now - stream.last_token_time, new)
                    stream.last_token_time = now
                    for early in events[:-1]:
                        out.setdefault(stream.loop, []).append((stream, early))
                    ev = events[-1]
                    if seq.is_finished:
                        ev.finish_reason, ev.text = seq.finish_reason, seq.text
                        ev.cumulative_logprob = seq.cumulative_logprob
                        del self._streams[seq.seq_id]
                        self.metrics.on_finish(seq.finish_reason, now - stream.arrival,
                                               stream.first_token_time - stream.arrival, seq.num_output_tokens)
                    elif stream.handoff:
                        del self._streams[seq.seq_id]
                        try:
                            ev.handoff = take_prefilled(self.engine, seq)
                        except Exception as e:  # noqa: BLE001 - fails this request only
                            traceback.print_exc()
                            ev = TokenEvent(error=f"taking the prefilled sequence out failed: {e}"[:500])
                    out.setdefault(stream.loop, []).append((stream, ev))
                self.metrics.snapshot(self.engine, self.step_log.mixed_steps)
                for loop, items in out.items():
                    loop.call_soon_threadsafe(_deliver, items)
        except BaseException as e:  # noqa: BLE001 - anything else kills the engine; report it
            self.error = f"{type(e).__name__}: {e}"
            traceback.print_exc()
            self._fail_all()
        finally:
            self.metrics.engine_alive = 0

    def _fail_stream(self, stream: RequestStream, message: str, out: dict, status: int = 500) -> None:
        """Finishes one request with an error event (engine thread)."""
        if stream.seq is not None:
            self.engine.abort(stream.seq)
            self._streams.pop(stream.seq.seq_id, None)
        self.metrics.on_error()
        out.setdefault(stream.loop, []).append((stream, TokenEvent(error=message, status=status)))

    def _step_failed(self, e: Exception) -> None:
        """A step raised: its requests (those holding KV blocks) fail, the others go on. Re-raises when
        there is no request to blame or steps keep failing: the engine is then dead."""
        self._failures += 1
        victims = [st for st in self._streams.values() if st.seq is not None and st.seq.status == Status.RUNNING]
        if not victims or self._failures >= MAX_CONSECUTIVE_FAILURES:
            raise e
        traceback.print_exc()
        msg = f"the engine failed on this request's step: {type(e).__name__}: {e}"[:500]
        out: dict[object, list] = {}
        self._report_given_up(out)
        for st in victims:
            self._fail_stream(st, msg, out)
        self.metrics.snapshot(self.engine, self.step_log.mixed_steps)
        for loop, items in out.items():
            loop.call_soon_threadsafe(_deliver, items)

    def _report_given_up(self, out: dict) -> None:
        """Error events (503: the server is overloaded; a retry may succeed) for the sequences the engine
        finished with an error: preempted more than max_preemptions times."""
        for seq in self.engine.pop_failed():
            stream = self._streams.get(seq.seq_id)
            if stream is not None:
                self._fail_stream(stream, f"{seq.error}; retry later, or raise --num-kv-blocks / lower "
                                          "--max-num-seqs", out, status=503)

    def _fail_all(self) -> None:
        by_loop: dict[object, list] = {}
        for stream in [*self._streams.values(), *self._parked]:
            by_loop.setdefault(stream.loop, []).append((stream, TokenEvent(error=f"the engine died: {self.error}",
                                                                           status=503)))
        self._streams.clear()
        self._parked.clear()
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:
                pass
        # requests still in the inbox: reject them
        while True:
            try:
                op, s = self._inbox.get_nowait()
            except queue.Empty:
                break
            if op == "add":
                try:
                    s.loop.call_soon_threadsafe(_resolve, s.accepted, EngineDeadError(self.error))
                except RuntimeError:
                    pass
