"""Start, drain and exit: the server's life, and the exit code a supervisor acts on.

``Server.run`` listens until SIGTERM / SIGINT (or ``request_stop``), or until the engine dies:

- stop: the listening socket closes (no new connections), new requests on open connections get
  503, requests in flight may finish for up to ``shutdown_timeout`` seconds; what is left then
  gets an error event (streams: then ``[DONE]``) or a 503, and run returns 0 at most
  ``EXIT_AFTER_DRAIN_S`` later (the engine's step in progress aside). With the default
  ``shutdown_timeout`` the process exits within 25 s of SIGTERM: inside Kubernetes' default 30 s
  terminationGracePeriodSeconds, before its SIGKILL;
- engine dead: every request in flight gets its error (async_engine.py; here, when the engine was
  declared dead from outside its thread: another process of a multi-process server died), /health
  answers 503 (for DEAD_REPORT_S before the listener closes); run returns 1 within seconds, so the
  process exits non-zero and a supervisor restarts it (vLLM's behaviour), instead of serving 503s forever.
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time

from aiohttp import web

from moejax.server.app_keys import ENGINE_KEY, STATE_KEY

FLUSH_S = 2.0  # after the drain: time given to handlers to write their last events (an error event, [DONE])
# Then the connections close, all together (aiohttp's shutdown_timeout): a handler still running gets this
# long to finish, then is cancelled and gets this long again.
CLOSE_S = 0.5
EXIT_AFTER_DRAIN_S = FLUSH_S + 2 * CLOSE_S  # the most run() takes after the drain deadline (engine's last step aside)
# The drain's default (scripts/serve.py --shutdown-timeout): with EXIT_AFTER_DRAIN_S, the last engine step and
# the interpreter's exit, the process is gone within 25 s of SIGTERM (Kubernetes kills it at 30 s by default).
DEFAULT_SHUTDOWN_TIMEOUT_S = 20.0
ENGINE_POLL_S = 0.2
DEAD_REPORT_S = 1.0  # /health answers 503 (engine dead) this long before the listener closes


class Server:
    def __init__(self, app: web.Application, host: str, port: int, shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S,
                 exit_on_engine_death: bool = True):
        """exit_on_engine_death=False keeps serving 503s after the engine died (embedded servers, tests)."""
        if not shutdown_timeout >= 0:
            raise ValueError(f"shutdown_timeout must be >= 0 seconds, got {shutdown_timeout!r}")
        self.app, self.host, self.port, self.shutdown_timeout = app, host, port, shutdown_timeout
        self.aengine, self.state = app[ENGINE_KEY], app[STATE_KEY]
        self.exit_on_engine_death = exit_on_engine_death
        self.ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self.stop_reason: str | None = None

    def request_stop(self) -> None:
        """Thread-safe: begins the graceful shutdown (what SIGTERM does)."""
        if self._loop is not None and self._stop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._stop.set)

    async def _engine_dead(self) -> None:
        while self.aengine.is_alive:
            await asyncio.sleep(ENGINE_POLL_S)

    async def _wait_inflight(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while self.state.inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return not self.state.inflight

    async def run(self, handle_signals: bool = True) -> int:
        """Serves until stopped (returns 0) or until the engine dies (returns 1)."""
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        if handle_signals:
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._loop.add_signal_handler(sig, self._stop.set)
        runner = web.AppRunner(self.app, access_log=None, shutdown_timeout=CLOSE_S)
        await runner.setup()
        site = web.TCPSite(runner, self.host, self.port)
        await site.start()
        self.ready.set()
        stop_task = asyncio.ensure_future(self._stop.wait())
        dead_task = asyncio.ensure_future(self._engine_dead() if self.exit_on_engine_death else asyncio.Event().wait())
        try:
            await asyncio.wait({stop_task, dead_task}, return_when=asyncio.FIRST_COMPLETED)
            code = 0 if stop_task.done() else 1
            self.stop_reason = "signal" if code == 0 else f"engine died: {self.aengine.error}"
            print(f"moejax server: {'shutting down' if code == 0 else self.stop_reason}", flush=True)
            if code == 1:  # a health check polling now sees why (503, the engine's error) before the port closes
                await asyncio.sleep(DEAD_REPORT_S)
            self.state.draining = True
            await site.stop()  # no new connections
            if code == 0 and not await self._wait_inflight(self.shutdown_timeout):
                self.state.fail_inflight(f"the server is shutting down (requests still running after the "
                                         f"{self.shutdown_timeout:g} s grace period were aborted)", 503)
            if code == 1 and self.state.inflight:  # the engine was declared dead from outside its thread
                self.state.fail_inflight(f"the engine died: {self.aengine.error}", 503)
            await self._wait_inflight(FLUSH_S)
        finally:
            for t in (stop_task, dead_task):
                t.cancel()
            await runner.cleanup()  # closes connections, then the app's cleanup (engine, worker pool)
            if handle_signals:
                for sig in (signal.SIGTERM, signal.SIGINT):
                    self._loop.remove_signal_handler(sig)
        return code
