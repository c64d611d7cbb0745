"""The aiohttp application: OpenAI-compatible routes over an AsyncEngine.

Routes: POST /v1/completions, POST /v1/chat/completions (both streaming over SSE,
with stream_options.include_usage), GET /v1/models, GET /health (503 once the
engine thread died), GET /metrics (Prometheus text, vLLM metric names).
Every error is an OpenAI-style JSON body; no request can take the server down.
A streaming client that disconnects has its sequence aborted (KV blocks freed).
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import traceback

from aiohttp import web

import moejax
from moejax.server import protocol
from moejax.server.async_engine import AsyncEngine, EngineDeadError
from moejax.server.protocol import APIError

ENGINE_KEY = web.AppKey("engine", AsyncEngine)
CTX_KEY = web.AppKey("ctx", protocol.ServingContext)
POLL_S = 0.5  # how often a waiting handler checks for a gone client / dead engine


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
        return web.json_response(protocol.error_body(e.reason, typ, None, e.status), status=e.status)
    except (asyncio.CancelledError, ConnectionError):
        raise
    except Exception as e:  # noqa: BLE001 - the server never dies from a request
        traceback.print_exc()
        return web.json_response(protocol.error_body(f"internal error: {type(e).__name__}: {e}",
                                                     "internal_server_error", None, 500), status=500)


async def _read_json(request: web.Request):
    raw = await request.read()
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise APIError(f"malformed JSON body: {e}") from None


def _client_gone(request: web.Request) -> bool:
    t = request.transport
    return t is None or t.is_closing()


async def _submit(aengine: AsyncEngine, req: protocol.ParsedRequest):
    try:
        return await aengine.add_request(req.prompt_ids, req.params)
    except ValueError as e:
        raise APIError(str(e), param="messages" if req.chat else "prompt") from None
    except EngineDeadError as e:
        raise APIError(f"the engine is not running: {e}", status=503, type_="internal_server_error") from None


async def _generate(request: web.Request, chat: bool) -> web.StreamResponse:
    aengine, ctx = request.app[ENGINE_KEY], request.app[CTX_KEY]
    req = protocol.parse_request(await _read_json(request), ctx, chat)
    stream = await _submit(aengine, req)
    try:
        if req.stream:
            return await _stream(request, req, stream, aengine, ctx)
        return await _full(request, req, stream, aengine, ctx)
    finally:
        if not stream.finished:
            stream.abort()  # the client went away (or the handler failed): free the sequence


async def _full(request, req, stream, aengine, ctx) -> web.Response:
    ids, lps = [], []
    while True:
        ev = await stream.get(POLL_S)
        if ev is None:
            if _client_gone(request):
                raise ConnectionResetError("client disconnected")
            if not aengine.is_alive:
                raise APIError(f"the engine died: {aengine.error}", 503, type_="internal_server_error")
            continue
        if ev.error is not None:
            raise APIError(f"the engine died: {ev.error}", 503, type_="internal_server_error")
        if ev.token_id is not None:
            ids.append(ev.token_id)
            lps.append(ev.logprob)
        if ev.finish_reason is not None:
            if ev.finish_reason == "abort":
                raise APIError("the request was aborted", 500, type_="internal_server_error")
            body = protocol.full_response(req, protocol.new_id(req.chat), ev.text, ids, lps, ev.finish_reason,
                                          ctx.tokenizer)
            return web.json_response(body)


def _sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


async def _stream(request, req, stream, aengine, ctx) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    try:
        await resp.prepare(request)
        await _stream_body(request, resp, req, stream, aengine, ctx)
    except ConnectionError:
        pass  # the client disconnected mid-stream: _generate aborts the sequence
    return resp


async def _stream_body(request, resp, req, stream, aengine, ctx) -> None:
    rid, created = protocol.new_id(req.chat), int(time.time())
    detok = protocol.IncrementalText(ctx.tokenizer, req.params.stop)
    n_out = 0
    if req.chat:
        await resp.write(_sse(protocol.stream_chunk(req, rid, created, None, [], None, None, ctx.tokenizer,
                                                    first=True)))
    while True:
        ev = await stream.get(POLL_S)
        if ev is None:
            if _client_gone(request):
                return  # the finally of _generate aborts it
            if not aengine.is_alive:
                await resp.write(_sse(protocol.error_body(f"the engine died: {aengine.error}",
                                                          "internal_server_error", None, 503)))
                return
            continue
        if ev.error is not None:
            await resp.write(_sse(protocol.error_body(f"the engine died: {ev.error}", "internal_server_error",
                                                      None, 503)))
            return
        events = [ev]  # take whatever else is queued too: one chunk for all of it (adapts to a slow client)
        while ev.finish_reason is None and ev.error is None:
            nxt = stream.get_nowait()
            if nxt is None:
                break
            ev = nxt
            events.append(ev)
        if ev.error is not None or ev.finish_reason == "abort":
            return
        offset = len(detok.sent)
        ids = [e.token_id for e in events if e.token_id is not None]
        lps = [e.logprob for e in events if e.token_id is not None]
        n_out += len(ids)
        delta = "".join(detok.add(t) for t in ids)
        if ev.finish_reason is not None:
            delta += detok.finish(ev.text)  # the engine's final text: stop strings already cut
        chunk = protocol.stream_chunk(req, rid, created, delta, ids, lps if ids else None,
                                      ev.finish_reason, ctx.tokenizer, text_offset=offset)
        await resp.write(_sse(chunk))
        if ev.finish_reason is not None:
            break
    if req.include_usage:
        await resp.write(_sse(protocol.usage_chunk(req, rid, created, n_out)))
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return


async def completions(request: web.Request):
    return await _generate(request, chat=False)


async def chat_completions(request: web.Request):
    return await _generate(request, chat=True)


async def models(request: web.Request):
    ctx = request.app[CTX_KEY]
    return web.json_response({"object": "list", "data": [
        {"id": ctx.model_names[0], "object": "model", "created": int(time.time()), "owned_by": "moejax",
         "root": ctx.model_names[-1], "max_model_len": ctx.max_model_len}]})


async def health(request: web.Request):
    aengine = request.app[ENGINE_KEY]
    if aengine.is_alive:
        return web.Response(status=200)
    return web.json_response(protocol.error_body(f"the engine is dead: {aengine.error}", "internal_server_error",
                                                 None, 503), status=503)


async def metrics(request: web.Request):
    return web.Response(text=request.app[ENGINE_KEY].metrics.render(),
                        content_type="text/plain", charset="utf-8",
                        headers={"X-Prometheus-Version": "0.0.4"})


async def version(request: web.Request):
    return web.json_response({"version": moejax.__version__})


def build_app(aengine: AsyncEngine, ctx: protocol.ServingContext) -> web.Application:
    app = web.Application(middlewares=[error_middleware], client_max_size=64 << 20)
    app[ENGINE_KEY], app[CTX_KEY] = aengine, ctx
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/version", version)
    return app


def make_app(model, model_name: str | None = None, extra_names=()) -> tuple[web.Application, AsyncEngine]:
    """The app and its (started) AsyncEngine for a loaded moejax Model."""
    name = model_name or model.source_dir
    names = tuple(dict.fromkeys([name, *extra_names, model.source_dir]))
    aengine = AsyncEngine(model.engine, name).start()
    ctx = protocol.ServingContext(names, model.tokenizer, model.max_model_len, model.config.model.vocab_size)
    app = build_app(aengine, ctx)

    async def _cleanup(_app):
        aengine.shutdown()

    app.on_cleanup.append(_cleanup)
    return app, aengine


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerThread:
    """Runs the server on its own event loop in a background thread (tests, sweeps)."""

    def __init__(self, model=None, host: str = "127.0.0.1", port: int | None = None, model_name: str | None = None,
                 app: web.Application | None = None):
        """Serves `model`, or a ready-made `app` (from build_app / make_app)."""
        self.host, self.port = host, port or free_port(host)
        if app is None:
            app, _ = make_app(model, model_name)
        self.app, self.aengine = app, app[ENGINE_KEY]
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="moejax-http", daemon=True)
        self._runner = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _run(self):
        asyncio.set_event_loop(self.loop)
        self._runner = web.AppRunner(self.app, access_log=None)
        self.loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, self.host, self.port)
        self.loop.run_until_complete(site.start())
        self._ready.set()
        self.loop.run_forever()
        self.loop.run_until_complete(self._runner.cleanup())
        self.loop.close()

    def start(self) -> ServerThread:
        self._thread.start()
        if not self._ready.wait(60):
            raise RuntimeError("server did not start")
        return self

    def stop(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(30)
