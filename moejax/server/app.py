"""The aiohttp application: OpenAI-compatible routes over an AsyncEngine.

Routes: POST /v1/completions, POST /v1/chat/completions (both streaming over SSE,
with stream_options.include_usage), GET /v1/models, GET /health (503 once the
engine thread died), GET /metrics (Prometheus text, vLLM metric names).
Every error is an OpenAI-style JSON body; no request can take the server down.
A streaming client that disconnects has its sequence aborted (KV blocks freed);
a stream that fails (its engine step raised, the engine died, shutdown) gets an
error event, then ``data: [DONE]``.

Request bodies are validated and tokenised in a worker thread (access.py and
protocol.py), so a large prompt never freezes the event loop; access checks
(API key, Host, CORS, Content-Type) are in access.py, start/drain/exit in lifecycle.py.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import inspect
import json
import os
import socket
import threading
import time
import traceback

from aiohttp import web

import moejax
from moejax.engine import parallel_sampling
from moejax.server import protocol, responses
from moejax.server.incremental_text import IncrementalText
from moejax.server.parsed_request import ParsedRequest
from moejax.server.access import AccessPolicy, access_middleware, add_cors_headers
from moejax.server.app_keys import CTX_KEY, ENGINE_KEY, STATE_KEY
from moejax.server.async_engine import AsyncEngine, EngineDeadError, TokenEvent
from moejax.server.lifecycle import Server
from moejax.server.metrics import CONTENT_TYPE
from moejax.server.protocol import APIError

POLL_S = 0.5  # how often a waiting handler checks for a gone client / dead engine
MAX_BODY_BYTES = 32 << 20  # 413 above this


@dataclasses.dataclass
class ServerState:
    """What the lifecycle (lifecycle.py) needs from the app: the requests in flight, and draining."""
    pool: concurrent.futures.ThreadPoolExecutor
    inflight: set = dataclasses.field(default_factory=set)  # RequestStreams being served
    draining: bool = False

    def fail_inflight(self, message: str, status: int = 503) -> None:
        """Ends every request in flight with an error event (event-loop side); frees their sequences."""
        for stream in list(self.inflight):
            stream.queue.put_nowait(TokenEvent(error=message, status=status))
            stream.owner.abort(stream)


def _json_error(e: APIError) -> web.Response:
    return web.json_response(e.body(), status=e.status)


@web.middleware
async def error_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except APIError as e:
        return _json_error(e)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        typ = "invalid_request_error" if e.status < 500 else "internal_server_error"
        headers = {k: v for k, v in e.headers.items() if k.lower() in ("allow", "www-authenticate")}
        return web.json_response(protocol.error_body(e.reason, typ, None, e.status), status=e.status,
                                 headers=headers)
    except (asyncio.CancelledError, ConnectionError):
        raise
    except Exception as e:  # noqa: BLE001 - the server never dies from a request
        traceback.print_exc()
        return web.json_response(protocol.error_body(f"internal error: {type(e).__name__}: {e}"[:500],
                                                     "internal_server_error", None, 500), status=500)


def _client_gone(request: web.Request) -> bool:
    t = request.transport
    return t is None or t.is_closing()


async def _submit(aengine: AsyncEngine, req: ParsedRequest, prompt_ids: list[int], params, after=None):
    """One sequence; ``after``: the stream of its prompt's first sample, whose cached prompt it shares (an engine
    whose add_request takes no ``after`` prefills each sample's prompt itself)."""
    kw = {"after": after} if after is not None and _shares_prompts(aengine) else {}
    try:
        return await aengine.add_request(prompt_ids, params, **kw)
    except ValueError as e:
        raise APIError(str(e), param="messages" if req.chat else "prompt") from None
    except EngineDeadError as e:
        raise APIError(f"the engine is not running: {e}", status=503, type_="internal_server_error") from None


def _shares_prompts(aengine) -> bool:
    return "after" in inspect.signature(aengine.add_request).parameters


def _error_type(status: int) -> str:
    return "invalid_request_error" if status < 500 else "internal_server_error"


async def _parse(request: web.Request, chat: bool) -> ParsedRequest:
    """Reads the body (413 above the app's client_max_size), then validates and tokenises it in the
    worker pool: the event loop keeps serving every other stream meanwhile."""
    state = request.app[STATE_KEY]
    if state.draining:
        raise APIError("the server is shutting down", 503, type_="internal_server_error")
    aengine = request.app[ENGINE_KEY]
    if aengine.is_alive and _starting(aengine):
        raise APIError("the server is starting (compiling its programs); retry when /health answers 200", 503,
                       type_="internal_server_error")
    raw = await request.read()
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(state.pool, protocol.parse_request, raw, request.app[CTX_KEY], chat)


async def _generate(request: web.Request, chat: bool) -> web.StreamResponse:
    aengine, ctx, state = request.app[ENGINE_KEY], request.app[CTX_KEY], request.app[STATE_KEY]
    req = await _parse(request, chat)
    streams = []
    try:
        for ids in req.prompts:  # a list of prompts: best_of sequences each (n > 1, best_of), served together
            first = None
            for j in range(req.best_of):
                stream = await _submit(aengine, req, ids, parallel_sampling.sample_params(req.params, j), first)
                streams.append(stream)
                state.inflight.add(stream)
                first = first or stream
        if req.stream:
            return await _stream(request, req, streams, aengine, ctx)
        outputs = await asyncio.gather(*(_collect(request, s, aengine) for s in streams))
        outputs = protocol.sample_outputs(req, list(outputs))
        body = responses.full_response(req, _response_id(request, req), outputs, ctx.tokenizer)
        return web.json_response(body)
    finally:
        for stream in streams:
            state.inflight.discard(stream)
            if not stream.finished:
                stream.abort()  # the client went away (or the handler failed): free the sequence


async def _collect(request, stream, aengine) -> responses.Output:
    """One sequence's tokens until it finishes (a gone client or a dead engine raise)."""
    ids, lps, tops, prompt_lps = [], [], [], None
    while True:
        ev = await stream.get(POLL_S)
        # Checked at every event too: while tokens keep coming the wait never times out, and a gone client's
        # sequence would run to its end (aiohttp does not cancel the handler).
        if _client_gone(request):
            raise ConnectionResetError("client disconnected")
        if ev is None:
            if not aengine.is_alive:
                raise APIError(f"the engine died: {aengine.error}", 503, type_="internal_server_error")
            continue
        if ev.error is not None:
            raise APIError(ev.error, ev.status, type_=_error_type(ev.status))
        if ev.token_id is not None:
            ids.append(ev.token_id)
            lps.append(ev.logprob)
            tops.append(ev.top_logprobs)
        if ev.prompt_logprobs is not None:
            prompt_lps = ev.prompt_logprobs
        if ev.finish_reason is not None:
            if ev.finish_reason == "abort":
                raise APIError("the request was aborted", 500, type_="internal_server_error")
            return responses.Output(ev.text, ids, lps, tops, ev.finish_reason, ev.cumulative_logprob, prompt_lps)


def _response_id(request: web.Request, req: ParsedRequest) -> str:
    return responses.new_id(req.chat, req.request_id or request.headers.get("X-Request-Id"))


def _sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


async def _stream(request, req, streams, aengine, ctx) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    try:
        await resp.prepare(request)
        await _stream_body(request, resp, req, streams, aengine, ctx)
    except ConnectionError:
        pass  # the client disconnected mid-stream: _generate aborts the sequence
    return resp


async def _end_with_error(resp, message: str, status: int) -> None:
    """A failed stream: an OpenAI error object as its last event, then [DONE] (clients stop cleanly)."""
    await resp.write(_sse(protocol.error_body(message, _error_type(status), None, status)))
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()


@dataclasses.dataclass
class _StreamChoice:
    """One choice of a stream (n > 1: several, each its own sequence, text and parser)."""
    index: int
    stream: object
    detok: IncrementalText
    parser: object  # reasoning / tool calls out of the deltas (chat_output.py), or None
    started: bool = False  # its first events came (a completion's echo chunk sent, prompt logprobs taken)

    def next(self) -> asyncio.Future:
        return asyncio.ensure_future(self.stream.get(POLL_S))


async def _stream_body(request, resp, req, streams, aengine, ctx) -> None:
    """The choices' chunks as their tokens come (each with its index), then the usage of all of them."""
    rid, created = _response_id(request, req), int(time.time())
    p = req.params
    choices = [_StreamChoice(i, s, IncrementalText(ctx.tokenizer, p.stop, p.include_stop_str_in_output,
                                                            p.skip_special_tokens),
                             req.parsing.new() if req.parsing is not None else None) for i, s in enumerate(streams)]
    n_out = 0
    if req.chat:
        for c in choices:
            await resp.write(_sse(responses.stream_chunk(req, rid, created, None, [], None, None, ctx.tokenizer,
                                                        first=True, completion_tokens=0, index=c.index)))
            if req.echo and req.prompt_texts[0]:  # vLLM's: the last message's content, when there is some
                await resp.write(_sse(responses.echo_chunk(req, rid, created, ctx.tokenizer, None, c.index)))
    waiting = {c.next(): c for c in choices}
    prompt_lps = None
    # an echo's completion offsets follow its prompt tokens' strings (the whole response's text_offset rule)
    echo_offset = sum(len(responses.token_str(ctx.tokenizer, t, req.tokens_as_ids)) for t in req.prompt_ids) \
        if req.echo else 0
    try:
        while waiting:
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            for fut in sorted(done, key=lambda f: waiting[f].index):
                c = waiting.pop(fut)
                ev = fut.result()
                if ev is None:
                    if _client_gone(request):
                        return  # the finally of _generate aborts them
                    if not aengine.is_alive:
                        return await _end_with_error(resp, f"the engine died: {aengine.error}", 503)
                    waiting[c.next()] = c
                    continue
                events = [ev]  # whatever else is queued too: one chunk for all of it (adapts to a slow client)
                while ev.finish_reason is None and ev.error is None:
                    nxt = c.stream.get_nowait()
                    if nxt is None:
                        break
                    ev = nxt
                    events.append(ev)
                if ev.error is not None:
                    return await _end_with_error(resp, ev.error, ev.status)
                if ev.finish_reason == "abort":
                    return await _end_with_error(resp, "the request was aborted", 500)
                first_plp = None  # the prompt logprobs the choice's first chunk of tokens carries
                if not c.started:  # the prompt's logprobs came with its first sample's token
                    c.started = True
                    plp = next((e.prompt_logprobs for e in events if e.prompt_logprobs is not None), prompt_lps)
                    prompt_lps = plp  # the later samples (their prefill came after the first's) have none
                    if req.params.prompt_logprobs is not None and plp is None:
                        return await _end_with_error(resp, "prompt logprobs are not served by this server's engine",
                                                     400)
                    if req.echo and not req.chat:  # the prompt first, its logprobs with it
                        await resp.write(_sse(responses.echo_chunk(req, rid, created, ctx.tokenizer, plp, c.index)))
                    else:
                        first_plp = plp
                offset = len(c.detok.sent) + echo_offset
                # echo with max_tokens 0: the token the prefill sampled is not part of the answer
                toks = [] if req.echo_only else [e for e in events if e.token_id is not None]
                ids, lps, tops = [e.token_id for e in toks], [e.logprob for e in toks], [e.top_logprobs for e in toks]
                n_out += len(ids)
                delta = "".join(c.detok.add(t) for t in ids)
                if ev.finish_reason is not None and not req.echo_only:
                    delta += c.detok.finish(ev.text)  # the engine's final text: stop strings already cut
                finish = "length" if req.echo_only and ev.finish_reason else ev.finish_reason  # max_tokens 0
                chunk = responses.stream_chunk(req, rid, created, delta, ids, lps if ids else None,
                                              finish, ctx.tokenizer, text_offset=offset, tops=tops,
                                              completion_tokens=n_out, parser=c.parser, index=c.index,
                                              prompt_logprobs=first_plp)
                await resp.write(_sse(chunk))
                if ev.finish_reason is None:
                    waiting[c.next()] = c
    finally:
        for fut in waiting:
            fut.cancel()
    if req.include_usage:
        await resp.write(_sse(responses.usage_chunk(req, rid, created, n_out)))
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()


async def completions(request: web.Request):
    return await _generate(request, chat=False)


async def chat_completions(request: web.Request):
    return await _generate(request, chat=True)


async def models(request: web.Request):
    return web.json_response({"object": "list", "data": [protocol.model_card(request.app[CTX_KEY])]})


async def model(request: web.Request):
    ctx = request.app[CTX_KEY]
    protocol.check_model(request.match_info["model_id"], ctx)  # 404 model_not_found otherwise
    return web.json_response(protocol.model_card(ctx))


async def _tokenizer_call(request: web.Request, fn) -> web.Response:
    """/tokenize and /detokenize: the body parsed and run in the worker pool, as the generation routes'."""
    raw = await request.read()
    loop = asyncio.get_running_loop()
    return web.json_response(await loop.run_in_executor(request.app[STATE_KEY].pool, fn, raw, request.app[CTX_KEY]))


async def tokenize(request: web.Request):
    return await _tokenizer_call(request, protocol.tokenize)


async def detokenize(request: web.Request):
    return await _tokenizer_call(request, protocol.detokenize)


async def tokenizer_info(request: web.Request):
    return web.json_response(protocol.tokenizer_info(request.app[CTX_KEY]))


async def _echo_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """A client's X-Request-Id comes back on its response (vLLM's --enable-request-id-headers, always on)."""
    rid = request.headers.get("X-Request-Id")
    if rid is not None:
        response.headers["X-Request-Id"] = rid


def _starting(aengine) -> bool:
    """Still compiling its programs (an AsyncEngine with precompile; a router has no start-up of its own)."""
    ready = getattr(aengine, "ready", None)
    return ready is not None and not ready.is_set()


async def health(request: web.Request):
    aengine = request.app[ENGINE_KEY]
    if request.app[STATE_KEY].draining:
        return web.json_response(protocol.error_body("the server is shutting down", "internal_server_error", None,
                                                     503), status=503)
    if aengine.is_alive and _starting(aengine):
        return web.json_response(protocol.error_body("starting: compiling the engine's programs",
                                                     "internal_server_error", None, 503), status=503)
    if aengine.is_alive:
        return web.Response(status=200)
    return web.json_response(protocol.error_body(f"the engine is dead: {aengine.error}", "internal_server_error",
                                                 None, 503), status=503)


async def metrics(request: web.Request):
    return web.Response(body=request.app[ENGINE_KEY].metrics.render().encode(),
                        headers={"Content-Type": CONTENT_TYPE})


async def version(request: web.Request):
    return web.json_response({"version": moejax.__version__})


def build_app(aengine: AsyncEngine, ctx: protocol.ServingContext, policy: AccessPolicy | None = None,
              max_body_bytes: int = MAX_BODY_BYTES) -> web.Application:
    """The routes over a started AsyncEngine; ``policy``: API key, allowed origins, bound host (access.py)."""
    policy = policy or AccessPolicy()
    app = web.Application(middlewares=[error_middleware, access_middleware(policy)], client_max_size=max_body_bytes)
    # two workers at least, so one huge prompt being tokenised does not hold up every other request
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(2, min(4, os.cpu_count() or 1)),
                                                 thread_name_prefix="moejax-parse")
    app[ENGINE_KEY], app[CTX_KEY], app[STATE_KEY] = aengine, ctx, ServerState(pool)
    app.on_response_prepare.append(add_cors_headers(policy))
    app.on_response_prepare.append(_echo_request_id)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model_id}", model)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/tokenizer_info", tokenizer_info)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/version", version)

    async def _close_pool(_app):
        pool.shutdown(wait=False, cancel_futures=True)

    app.on_cleanup.append(_close_pool)
    return app


def make_app(model, model_name: str | None = None, extra_names=(), policy: AccessPolicy | None = None,
             max_body_bytes: int = MAX_BODY_BYTES, engine=None,
             precompile: bool = False, generation_config: str = "auto",
             parsers: dict | None = None) -> tuple[web.Application, AsyncEngine]:
    """The app and its (started) AsyncEngine for a loaded moejax Model, driving ``engine`` (default:
    the model's; a multi-process server's process 0 passes its LeaderEngine). ``precompile``: the engine
    compiles every program before it serves (/health 503 "starting" until then). ``generation_config``:
    "auto" (the checkpoint's generation_config.json sampling defaults), "vllm" (none) or a directory.
    ``parsers``: the chat answer's parsers, ServingContext's fields (cli.serving_parsers)."""
    name = model_name or model.source_dir
    names = tuple(dict.fromkeys([name, *extra_names, model.source_dir]))
    defaults = protocol.generation_defaults(model.source_dir if generation_config == "auto" else generation_config)
    aengine = AsyncEngine(engine if engine is not None else model.engine, name, precompile=precompile).start()
    ctx = protocol.ServingContext(names, model.tokenizer, model.max_model_len, model.config.model.vocab_size,
                                  defaults, **(parsers or {}))
    app = build_app(aengine, ctx, policy, max_body_bytes)

    async def _cleanup(_app):
        aengine.shutdown()

    app.on_cleanup.append(_cleanup)
    return app, aengine


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerThread:
    """Runs the server (lifecycle.Server: graceful drain on stop) on its own event loop in a background
    thread (tests, sweeps). ``exit_code`` is what the server's run returned once it ended."""

    def __init__(self, model=None, host: str = "127.0.0.1", port: int | None = None, model_name: str | None = None,
                 app: web.Application | None = None, shutdown_timeout: float = 5.0,
                 exit_on_engine_death: bool = False):
        """Serves `model`, or a ready-made `app` (from build_app / make_app)."""
        self.host, self.port = host, port or free_port(host)
        if app is None:
            app, _ = make_app(model, model_name, policy=AccessPolicy(bind_host=host))
        self.app, self.aengine = app, app[ENGINE_KEY]
        self.server = Server(app, self.host, self.port, shutdown_timeout=shutdown_timeout,
                             exit_on_engine_death=exit_on_engine_death)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="moejax-http", daemon=True)
        self.exit_code: int | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _run(self):
        asyncio.set_event_loop(self.loop)
        try:
            self.exit_code = self.loop.run_until_complete(self.server.run(handle_signals=False))
        finally:
            self.loop.close()

    def start(self) -> ServerThread:
        self._thread.start()
        if not self.server.ready.wait(60):
            raise RuntimeError("server did not start")
        return self

    def stop(self, timeout: float = 60):
        """Graceful stop (drain, then abort what is left after the shutdown timeout); waits for the end."""
        self.server.request_stop()
        self._thread.join(timeout)
