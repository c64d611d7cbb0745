"""A disaggregated-serving worker: the colocated server's app (app.py: OpenAI routes, /health,
/metrics) plus the internal routes its router (router.py) calls.

  GET  /internal/info     role, max_model_len, vocab size, the transfer server's address, KV cache
                          capacity in tokens (the router's measure of a decode worker's room), its
                          speculative_config and cache layers (serve.py refuses a speculative decode
                          worker beside a prefill worker without it: engine/kv_handoff.py's rule)
  GET  /internal/load     requests in flight, free KV blocks (for operators: the router balances on
                          its own counts, no round trip per request)
  POST /internal/prefill  (prefill role) {"prompt_ids", "params"} -> the first token's event and, unless
                          it ended the request, the prefilled request's metadata (kv_handoff.py), its
                          cache rows offered for one pull (kv_transfer.py)
  POST /internal/decode   (decode role) {"prefilled": metadata} -> pulls the rows, adds the request to
                          the engine and streams NDJSON: {"transfer": {"seconds", "bytes"}}, then one
                          token event a line (the first token came from the prefill worker). A failed
                          pull answers 502 with code "kv_transfer_failed": the router prefills again.

Token events travel as JSON objects with TokenEvent's fields (``event_json``); errors as the
OpenAI-style error body.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json

from aiohttp import web

from moejax.engine.kv_transfer import DEFAULT_PULL_TIMEOUT_S, KVTransfer, KVTransferFailed
from moejax.engine.sampling_params import SamplingParams
from moejax.server.app_keys import ENGINE_KEY, STATE_KEY
from moejax.server.async_engine import AsyncEngine, EngineDeadError, TokenEvent
from moejax.server.protocol import APIError

ROLES = ("prefill", "decode")
POLL_S = 0.5


def event_json(ev: TokenEvent) -> dict:
    d = {f.name: getattr(ev, f.name) for f in dataclasses.fields(ev) if f.name != "handoff"}
    if ev.top_logprobs is not None:
        d["top_logprobs"] = [list(t) for t in ev.top_logprobs]
    return d


def event_from_json(d: dict) -> TokenEvent:
    ev = TokenEvent(**{k: v for k, v in d.items() if k in TokenEvent.__dataclass_fields__ and k != "handoff"})
    if ev.top_logprobs is not None:
        ev.top_logprobs = [(int(i), float(lp)) for i, lp in ev.top_logprobs]
    return ev


@dataclasses.dataclass
class WorkerConfig:
    role: str
    pull_timeout_s: float = DEFAULT_PULL_TIMEOUT_S
    inject_transfer_failures: int = 0  # tests: the first N pulls ask for a uuid never offered (deadline 1 s)


async def _body(request: web.Request) -> dict:
    try:
        body = json.loads(await request.read())
    except ValueError:
        raise APIError("the body is not valid JSON") from None
    if not isinstance(body, dict):
        raise APIError("the body must be a JSON object")
    return body


async def _next_event(request: web.Request, stream, aengine: AsyncEngine) -> TokenEvent | None:
    """The stream's next event; None once the caller is gone. A dead engine is a 503 error event."""
    while True:
        ev = await stream.get(POLL_S)
        if ev is not None:
            return ev
        if request.transport is None or request.transport.is_closing():
            return None
        if not aengine.is_alive:
            return TokenEvent(error=f"the engine died: {aengine.error}", status=503)


async def _add(aengine: AsyncEngine, *args, **kw):
    try:
        return await aengine.add_request(*args, **kw)
    except ValueError as e:
        raise APIError(str(e), param="prompt_ids") from None
    except EngineDeadError as e:
        raise APIError(f"the engine is not running: {e}", 503, type_="internal_server_error") from None


class WorkerRoutes:
    """The internal routes of a prefill or decode worker (the router's side: server/router.py)."""

    def __init__(self, cfg: WorkerConfig, xfer: KVTransfer, max_model_len: int, vocab_size: int):
        self.cfg, self.xfer, self.max_model_len, self.vocab_size = cfg, xfer, max_model_len, vocab_size
        self.injected_left = cfg.inject_transfer_failures

    async def info(self, request):
        if not request.app[ENGINE_KEY].ready.is_set():  # the router waits for this answer: not before the compiles
            return web.json_response({"error": "starting"}, status=503)
        eng = request.app[ENGINE_KEY].engine
        blocks, spec = eng.blocks, eng.config.speculative
        return web.json_response({"role": self.cfg.role, "max_model_len": self.max_model_len,
                                  "vocab_size": self.vocab_size, "transfer_address": self.xfer.address,
                                  "kv_tokens": blocks.num_blocks * blocks.block_size,
                                  "speculative_config": None if spec is None else dataclasses.asdict(spec),
                                  "num_cache_layers": int(eng.runner.cache.shape[1])})

    async def load(self, request):
        aengine = request.app[ENGINE_KEY]
        eng = aengine.engine
        return web.json_response({"inflight": len(request.app[STATE_KEY].inflight),
                                  "free_blocks": eng.blocks.num_free, "num_blocks": eng.blocks.num_blocks})

    async def prefill(self, request):
        aengine, state = request.app[ENGINE_KEY], request.app[STATE_KEY]
        body = await _body(request)
        try:
            prompt_ids, params = body["prompt_ids"], SamplingParams(**body["params"])
        except KeyError as e:
            raise APIError(f"missing field {e.args[0]!r}", param=e.args[0]) from None
        except (TypeError, ValueError) as e:
            raise APIError(str(e), param="params") from None
        stream = await _add(aengine, prompt_ids, params, handoff=True)
        state.inflight.add(stream)
        try:
            ev = await _next_event(request, stream, aengine)
            if ev is None:
                raise ConnectionResetError("the router went away")
            if ev.error is not None:
                raise APIError(ev.error, ev.status, type_="internal_server_error")
            out = {"event": event_json(ev)}
            if ev.handoff is not None:
                out["prefilled"] = self.xfer.offer_request(ev.handoff)
            return web.json_response(out)
        finally:
            state.inflight.discard(stream)
            if not stream.finished:
                stream.abort()

    async def decode(self, request):
        aengine, state = request.app[ENGINE_KEY], request.app[STATE_KEY]
        body = await _body(request)
        meta = body.get("prefilled")
        if not isinstance(meta, dict):
            raise APIError("missing field 'prefilled'", param="prefilled")
        if self.injected_left > 0 and isinstance(meta.get("transfer"), dict):  # injected: rows never offered
            self.injected_left -= 1
            meta = {**meta, "transfer": {**meta["transfer"], "uuid": int(meta["transfer"].get("uuid", 0)) ^ 1}}
            timeout = 1.0
        else:
            timeout = self.cfg.pull_timeout_s
        loop = asyncio.get_running_loop()
        try:
            # blocking: in a worker thread, the event loop keeps serving the other streams
            req, stats = await loop.run_in_executor(None, self.xfer.pull_request, meta, timeout)
        except ValueError as e:
            raise APIError(str(e), param="prefilled") from None
        except KVTransferFailed as e:
            raise APIError(str(e), 502, type_="internal_server_error", code="kv_transfer_failed") from None
        stream = await _add(aengine, req.token_ids, req.params, prefilled=req)
        state.inflight.add(stream)
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        try:
            await resp.prepare(request)
            await resp.write(json.dumps({"transfer": stats}).encode() + b"\n")
            while True:
                ev = await _next_event(request, stream, aengine)
                if ev is None:
                    break
                await resp.write(json.dumps(event_json(ev)).encode() + b"\n")
                if ev.finish_reason is not None or ev.error is not None:
                    break
            await resp.write_eof()
        except ConnectionError:
            pass  # the router went away: the finally aborts the sequence
        finally:
            state.inflight.discard(stream)
            if not stream.finished:
                stream.abort()
        return resp


def add_worker_routes(app: web.Application, cfg: WorkerConfig, xfer: KVTransfer, max_model_len: int,
                      vocab_size: int) -> None:
    """Adds the internal routes to an app built by app.build_app / make_app over the worker's engine."""
    if cfg.role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {cfg.role!r}")
    routes = WorkerRoutes(cfg, xfer, max_model_len, vocab_size)
    app.router.add_get("/internal/info", routes.info)
    app.router.add_get("/internal/load", routes.load)
    if cfg.role == "prefill":
        app.router.add_post("/internal/prefill", routes.prefill)
    else:
        app.router.add_post("/internal/decode", routes.decode)

