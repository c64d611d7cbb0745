"""Process 0 notices another process of the job dying, within ``dead_after_s``.

Every other process beats (a counter under ``moejax/alive/<process id>`` in the coordination
service's key-value store, every BEAT_S); process 0 watches the counters and calls ``on_dead`` once
one stops moving. A collective with a dead peer blocks forever, so the server cannot learn it from
its own step: this is how it reports unhealthy and stops (lifecycle.py) instead of hanging.
JAX's heartbeat timeout (MOEJAX_HEARTBEAT_TIMEOUT_S, processes.py) aborts whatever is left later.
"""

from __future__ import annotations

import threading
import time

import jax

from moejax.parallel.step_channel import _client

PREFIX = "moejax/alive/"
BEAT_S = 0.5
DEFAULT_DEAD_AFTER_S = 10.0
JOIN_S = 5.0  # a key-value call in flight returns within the coordination service's own timeouts


class Stoppable:
    """A daemon thread and the event that stops it. ``stop`` sets the event and joins the thread: a thread
    still inside a key-value call when the interpreter finalises is unwound by force through C++ frames and
    aborts the process ("FATAL: exception not rethrown", signal 6), so the caller stops it before exiting."""

    def __init__(self, target, name: str):
        self.event = threading.Event()
        self.thread = threading.Thread(target=target, args=(self.event,), name=name, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.event.set()
        self.thread.join(JOIN_S)


def start_beating() -> Stoppable:
    """A process other than 0: beats from a daemon thread until it is stopped."""
    client, key = _client(), f"{PREFIX}{jax.process_index()}"

    def beat(stop):
        n = 0
        while not stop.is_set():
            try:
                client.key_value_set(key, str(n), allow_overwrite=True)
            except Exception:  # noqa: BLE001 - process 0 (the store) is gone: nothing to tell
                return
            n += 1
            stop.wait(BEAT_S)
    return Stoppable(beat, "moejax-beat")


def watch(on_dead, dead_after_s: float = DEFAULT_DEAD_AFTER_S) -> Stoppable:
    """Process 0: calls ``on_dead(message)`` (once, from a daemon thread) when a process has not beaten
    for ``dead_after_s``, until it is stopped."""
    if not dead_after_s > 0:
        raise ValueError(f"dead_after_s must be > 0 seconds, got {dead_after_s!r}")
    client = _client()
    peers = range(1, jax.process_count())

    def read(p):
        try:
            return client.key_value_try_get(f"{PREFIX}{p}")
        except Exception:  # noqa: BLE001 - not beaten yet (NOT_FOUND)
            return None

    def run(stop):
        last = {p: (read(p), time.monotonic()) for p in peers}
        while not stop.wait(BEAT_S):
            now = time.monotonic()
            for p in peers:
                v = read(p)
                if v != last[p][0]:
                    last[p] = (v, now)
                elif now - last[p][1] > dead_after_s:
                    on_dead(f"process {p} of {jax.process_count()} stopped responding (no heartbeat for "
                            f"{dead_after_s:g} s): it died or hangs")
                    return
    return Stoppable(run, "moejax-peer-watch")
