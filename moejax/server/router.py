"""The disaggregated server's front end: one OpenAI app (app.py, unchanged) over a Router that sends
each request to a prefill worker, then to a decode worker, and streams its tokens back.

The Router stands where the colocated server has its AsyncEngine: ``add_request`` returns a
RequestStream of TokenEvents, and ``is_alive`` / ``error`` / ``metrics`` / ``shutdown`` / ``abort``
mean what they mean there, so streaming, usage, errors and the drain on shutdown are the
colocated server's own code.

A request: (1) the least-loaded live prefill worker (fewest requests in flight from this router)
prefills it and answers its first token and, unless that token ended it, the prefilled request's
metadata, its cache rows offered through jax.experimental.transfer (worker.py, kv_transfer.py);
(2) the decode worker with the most room (the smallest share of its KV cache claimed by this
router's requests on it, prompt + max_tokens each) pulls the rows into its own cache (a worker with
no room parks the request until it has) and streams the rest of the tokens. The first token goes to the client
once the pull succeeded: a re-queued request's new prefill may sample another first token (a
prefix-cache hit computes the prompt from cached, maybe FP8, rows), and the one sent must be the
one its decode continues from. A failed or late pull (502 ``kv_transfer_failed``) or a worker that
cannot be reached before the decode began re-queues the request: it is prefilled again (its seed is
fixed here, when the client gives none, so the tokens do not change), up to MAX_ATTEMPTS times.

Several samples of one prompt (n > 1, best_of; app.py passes ``after``, the first sample's stream): the
others are accepted at once (the prompt was), wait for the first's prefill to answer and go to the same
prefill worker, whose prefix cache holds the prompt's full blocks then; each computes only the last partial
block and hands its own rows off (LLMEngine.add_request's ``after`` ordering, the prompt prefilled once).

A worker process that exits (or, for a worker started elsewhere and known by its URL only, fails
HEALTH_FAILURES health checks in a row) is reported: /health answers 503 naming it, every request
it held gets a 503 error event, and the router process exits non-zero (lifecycle.py), as a
colocated server whose engine died.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import subprocess
import time
import traceback

import aiohttp

from moejax.engine.sampling_params import SamplingParams
from moejax.server.async_engine import EngineDeadError, RequestStream, TokenEvent
from moejax.server.metrics import Metrics
from moejax.server.worker import event_from_json

MAX_ATTEMPTS = 3  # prefills of one request (the first and two re-queues) before it fails with 503
MONITOR_S = 0.5  # how often worker processes are checked
HEALTH_TIMEOUT_S = 2.0  # a worker known by its URL only: its /health must answer within this ...
HEALTH_FAILURES = 3  # ... or, after this many failed checks in a row, it is dead


class WorkerGone(RuntimeError):
    """The worker could not be reached, or its process exited."""


@dataclasses.dataclass(eq=False)
class WorkerHandle:
    role: str
    index: int
    url: str
    proc: subprocess.Popen | None = None  # None: started elsewhere (only its URL is known: /health is polled)
    inflight: int = 0  # requests of this router on it now
    kv_tokens: int = 0  # its KV cache's capacity in tokens (/internal/info); 0: unknown
    reserved_tokens: int = 0  # tokens its in-flight requests may grow to (prompt + max_tokens): its cache's claim
    dead: str | None = None
    failed_checks: int = 0  # consecutive failed /health checks (a worker known by its URL only)

    @property
    def name(self) -> str:
        pid = f" (pid {self.proc.pid})" if self.proc is not None else ""
        return f"{self.role} worker {self.index} at {self.url}{pid}"

    def check(self) -> str | None:
        """Why it is dead (its process exited), or None."""
        if self.dead is None and self.proc is not None and self.proc.poll() is not None:
            self.dead = f"{self.name} exited with code {self.proc.returncode}"
        return self.dead


def kv_usage(loads: list[dict]) -> float | None:
    """KV blocks in use over all blocks, summed over the decode workers' /internal/load answers (their
    caches may differ in size); None without any answer."""
    total = sum(x["num_blocks"] for x in loads)
    return sum(x["num_blocks"] - x["free_blocks"] for x in loads) / total if total else None


class _Rejected(Exception):
    """The prefill worker refused the request (400: bad prompt or params); not retried."""

    def __init__(self, message: str):
        super().__init__(message)


class Router:
    def __init__(self, prefill: list[WorkerHandle], decode: list[WorkerHandle], model_name: str = "moejax",
                 metrics: Metrics | None = None, max_attempts: int = MAX_ATTEMPTS):
        if not prefill or not decode:
            raise ValueError("a disaggregated server needs at least one prefill and one decode worker")
        self.prefill, self.decode = prefill, decode
        self.metrics = metrics or Metrics(model_name)
        self.max_attempts = max_attempts
        self.error: str | None = None
        self.num_requeued = 0
        self._rng = random.Random()
        self._session: aiohttp.ClientSession | None = None
        self._tasks: dict[RequestStream, asyncio.Task] = {}
        self._monitor: asyncio.Task | None = None
        self._stopped = False

    # ----- the AsyncEngine interface app.py and lifecycle.py use ------------------------
    def start(self) -> Router:
        return self

    async def on_startup(self, _app=None) -> None:
        """The app's startup: the HTTP client and the worker monitor start with the event loop."""
        self._ensure_started()

    @property
    def is_alive(self) -> bool:
        self._check_workers()
        return self.error is None and not self._stopped

    def fail(self, message: str) -> None:
        if self.error is None:
            self.error = message

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopped = True
        for t in list(self._tasks.values()):
            t.cancel()
        if self._monitor is not None:
            self._monitor.cancel()

    async def aclose(self) -> None:
        """The app's cleanup: shutdown, then the HTTP client's connections closed."""
        self.shutdown()
        if self._session is not None and not self._session.closed:
            await self._session.close()

    async def add_request(self, prompt_ids: list[int], params: SamplingParams,
                          after: RequestStream | None = None) -> RequestStream:
        """Prefills the request (its first try) and returns its stream; ValueError when the prefill worker
        refuses it (the colocated engine's message), EngineDeadError when a worker is dead. ``after``: an
        earlier stream of this router with the same prompt (n > 1, best_of): accepted at once, prefilled once
        ``after``'s prefill answered, on its prefill worker (the prompt's cached blocks shared)."""
        if not self.is_alive:
            raise EngineDeadError(self.error or "the router is not running")
        self._ensure_started()
        if params.seed is None:  # fixed here: a re-queued request is sampled again with the same seed
            params = dataclasses.replace(params, seed=self._rng.getrandbits(32))
        loop = asyncio.get_running_loop()
        stream = RequestStream(self, list(prompt_ids), params, loop)
        stream.after = after
        stream.prompt_worker = loop.create_future()  # the prefill worker that answered it (None: none did)
        self._tasks[stream] = task = asyncio.ensure_future(self._serve(stream))
        task.add_done_callback(lambda _t: self._tasks.pop(stream, None))
        if after is not None:  # no wait: its prompt was accepted with after's (and so the samples' prefills overlap)
            stream.accepted.set_result(True)
            return stream
        await asyncio.wait({stream.accepted, task}, return_when=asyncio.FIRST_COMPLETED)
        if not stream.accepted.done():
            stream.accepted.set_exception(EngineDeadError(self.error or "the request could not be started"))
        stream.accepted.result()
        return stream

    def abort(self, stream: RequestStream) -> None:
        task = self._tasks.get(stream)
        if task is not None:
            task.cancel()  # its HTTP calls close: the workers abort the sequence
        if not stream.finished:
            self.metrics.on_finish("abort", time.perf_counter() - stream.arrival, None, stream.num_output)

    # ----- workers --------------------------------------------------------------------------
    def _ensure_started(self) -> None:
        if self._session is None:
            # no total timeout: a stream lasts as long as its generation; connecting is bounded
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=10))
            self._monitor = asyncio.ensure_future(self._watch())

    def _check_workers(self) -> None:
        for w in [*self.prefill, *self.decode]:
            why = w.check()
            if why is not None and self.error is None:
                self.error = why

    async def _probe(self, w: WorkerHandle) -> None:
        """One /health check of a worker known by its URL only."""
        try:
            timeout = aiohttp.ClientTimeout(total=HEALTH_TIMEOUT_S)
            async with self._session.get(w.url + "/health", timeout=timeout) as r:
                ok, why = r.status == 200, f"/health answered {r.status}"
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            ok, why = False, f"{type(e).__name__}: {e}"
        w.failed_checks = 0 if ok else w.failed_checks + 1
        if w.failed_checks >= HEALTH_FAILURES and w.dead is None:
            w.dead = f"{w.name} failed {w.failed_checks} health checks in a row ({why})"[:500]

    async def _load(self, w: WorkerHandle) -> dict | None:
        """A decode worker's /internal/load, or None when it does not answer in time."""
        try:
            async with self._session.get(w.url + "/internal/load",
                                         timeout=aiohttp.ClientTimeout(total=HEALTH_TIMEOUT_S)) as r:
                return await r.json(content_type=None) if r.status == 200 else None
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            return None

    async def _watch(self) -> None:
        """Fails every stream held by a worker whose process exited (their HTTP calls may never end);
        keeps vllm:kv_cache_usage_perc as the decode workers' KV blocks in use over their total."""
        while not self._stopped:
            remote = [w for w in [*self.prefill, *self.decode] if w.proc is None and w.dead is None]
            if remote:
                await asyncio.gather(*(self._probe(w) for w in remote))
            loads = await asyncio.gather(*(self._load(w) for w in self.decode if w.dead is None))
            usage = kv_usage([x for x in loads if x is not None])
            if usage is not None:
                with self.metrics.lock:
                    self.metrics.kv_usage = usage
            self._check_workers()
            if self.error is not None:
                for stream, task in list(self._tasks.items()):
                    task.cancel()
                    if not stream.finished:
                        stream.queue.put_nowait(TokenEvent(error=f"a worker died: {self.error}", status=503))
                        self.metrics.on_error()
                return
            await asyncio.sleep(MONITOR_S)

    def _gauges(self) -> None:
        """vllm:num_requests_running / _waiting: requests being decoded / prefilled (or transferred)."""
        with self.metrics.lock:
            self.metrics.running = sum(w.inflight for w in self.decode)
            self.metrics.waiting = sum(w.inflight for w in self.prefill)

    def _pick(self, workers: list[WorkerHandle]) -> WorkerHandle:
        """Prefill: the fewest requests in flight. Decode: the most room, i.e. the smallest share of its KV
        cache its requests may grow to (workers may differ in cache size), then the fewest requests."""
        live = [w for w in workers if w.check() is None]
        if not live:
            raise WorkerGone(f"no live {workers[0].role} worker")
        if live[0].role == "decode":
            return min(live, key=lambda w: (w.reserved_tokens / w.kv_tokens if w.kv_tokens else 0.0,
                                            w.inflight, w.index))
        return min(live, key=lambda w: (w.inflight, w.index))

    # ----- one request ------------------------------------------------------------------
    def _emit(self, stream: RequestStream, ev: TokenEvent) -> None:
        now = time.perf_counter()
        if ev.token_id is not None:
            stream.num_output += 1
            if stream.first_token_time is None:
                stream.first_token_time = now
                self.metrics.on_first_token(now - stream.arrival, len(stream.prompt_ids))
            else:
                self.metrics.on_token(now - stream.last_token_time)
            stream.last_token_time = now
        if ev.finish_reason is not None:
            ttft = None if stream.first_token_time is None else stream.first_token_time - stream.arrival
            self.metrics.on_finish(ev.finish_reason, now - stream.arrival, ttft, stream.num_output)
        elif ev.error is not None:
            self.metrics.on_error()
        stream.queue.put_nowait(ev)

    async def _prefill_worker(self, stream: RequestStream) -> WorkerHandle:
        """A sample with ``after`` waits for its first sample's prefill and goes to the worker that answered it
        (its prefix cache holds the prompt) while that one lives; any other request to _pick's."""
        if stream.after is not None:
            w = await asyncio.shield(stream.after.prompt_worker)  # shielded: an abort cancels this wait only
            if w is not None and w.check() is None:
                return w
        return self._pick(self.prefill)

    async def _prefill(self, stream: RequestStream) -> dict:
        w = await self._prefill_worker(stream)
        w.inflight += 1
        self._gauges()
        body = {"prompt_ids": stream.prompt_ids, "params": dataclasses.asdict(stream.params)}
        try:
            async with self._session.post(w.url + "/internal/prefill", json=body) as r:
                data = await r.json(content_type=None)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
            raise WorkerGone(f"{w.name}: {type(e).__name__}: {e}") from None
        finally:
            w.inflight -= 1
            self._gauges()
        if r.status == 400:
            raise _Rejected(data.get("error", {}).get("message", "rejected"))
        if r.status != 200:
            raise WorkerGone(f"{w.name} answered {r.status}: {data.get('error', {}).get('message')}")
        if not stream.prompt_worker.done():
            stream.prompt_worker.set_result(w)  # its prompt is in w's prefix cache now: its samples go there
        return data

    async def _decode(self, stream: RequestStream, prefilled: dict, first: TokenEvent) -> bool:
        """Streams ``first`` (the prefill's token, once the rows are pulled) and the decode worker's events
        into ``stream``. False when the request must be re-queued (the pull failed, or the worker could
        not be reached before the pull was done): nothing was sent then."""
        w = self._pick(self.decode)
        claim = len(prefilled["token_ids"]) + stream.params.max_new_tokens - 1  # the most it can hold
        w.inflight += 1
        w.reserved_tokens += claim
        self._gauges()
        started = False
        try:
            async with self._session.post(w.url + "/internal/decode", json={"prefilled": prefilled}) as r:
                if r.status != 200:
                    data = await r.json(content_type=None)
                    err = data.get("error", {})
                    if err.get("code") == "kv_transfer_failed":
                        self.metrics.on_kv_transfer_failed()
                    if err.get("code") == "kv_transfer_failed" or r.status >= 500:
                        return False  # re-queued: nothing was sent for this try
                    self._emit(stream, TokenEvent(error=f"{w.name}: {err.get('message')}", status=r.status))
                    return True
                async for line in r.content:
                    if not line.strip():
                        continue
                    d = json.loads(line)
                    if "transfer" in d:
                        self.metrics.on_kv_transfer(d["transfer"]["seconds"], d["transfer"]["bytes"])
                        started = True
                        self._emit(stream, first)
                        continue
                    ev = event_from_json(d)
                    self._emit(stream, ev)
                    if ev.finish_reason is not None or ev.error is not None:
                        return True
            raise WorkerGone(f"{w.name} ended the stream before the request finished")
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, WorkerGone) as e:
            if not started:
                return False
            self._emit(stream, TokenEvent(error=f"the decode worker failed mid-request: {e}"[:500], status=503))
            return True
        finally:
            w.inflight -= 1
            w.reserved_tokens -= claim
            self._gauges()

    async def _serve(self, stream: RequestStream) -> None:
        try:
            await self._serve_tries(stream)
        finally:
            if not stream.prompt_worker.done():
                stream.prompt_worker.set_result(None)  # never prefilled: its samples go to any worker

    async def _serve_tries(self, stream: RequestStream) -> None:
        try:
            for attempt in range(self.max_attempts):
                if attempt:
                    self.num_requeued += 1
                try:
                    data = await self._prefill(stream)
                except _Rejected as e:
                    if not stream.accepted.done():
                        stream.accepted.set_exception(ValueError(str(e)))
                    else:  # a sample accepted with its first one's prompt (``after``)
                        self._emit(stream, TokenEvent(error=str(e), status=400))
                    return
                except WorkerGone:
                    if self.error is not None:
                        raise
                    continue
                if not stream.accepted.done():
                    stream.accepted.set_result(True)
                first = event_from_json(data["event"])
                if "prefilled" not in data:
                    self._emit(stream, first)
                    return  # its first token finished it
                if await self._decode(stream, data["prefilled"], first):
                    return
            msg = f"the request failed {self.max_attempts} times (KV transfer or worker failure)"
            if not stream.accepted.done():
                stream.accepted.set_exception(EngineDeadError(msg))
            else:
                self._emit(stream, TokenEvent(error=msg, status=503))
        except WorkerGone as e:
            if not stream.accepted.done():
                stream.accepted.set_exception(EngineDeadError(str(e)))
            else:
                self._emit(stream, TokenEvent(error=str(e), status=503))
        except Exception as e:  # noqa: BLE001 - a router bug fails this request, never hangs it
            traceback.print_exc()
            msg = f"the router failed on this request: {type(e).__name__}: {e}"[:500]
            if not stream.accepted.done():
                stream.accepted.set_exception(EngineDeadError(msg))
            else:
                self._emit(stream, TokenEvent(error=msg, status=500))

