"""Process 0 -> every other process: one message per engine step, through the key-value store of
JAX's coordination service (the one jax.distributed runs in process 0; nothing else to set up).

Message i sits under key ``moejax/steps/<i>`` until message i + 2 is sent: by then every process
has read it, since each stepped message i + 1's step, a collective all of them join.
"""

from __future__ import annotations

import pickle

from jax._src import distributed  # the coordination service's key-value store (no public API)

PREFIX = "moejax/steps/"
POLL_MS = 1000  # a follower's wait for the next message is cut in slices this long


def _client():
    # The coordination service's client: jax.distributed's own (public API has no key-value store).
    if distributed.global_state.client is None:
        raise RuntimeError("jax.distributed is not initialised: a step channel needs a multi-process job")
    return distributed.global_state.client


class StepChannel:
    def __init__(self):
        self.client = _client()
        self.sent = self.received = 0

    def send(self, message) -> None:
        """Process 0: publishes the next message (any picklable value)."""
        self.client.key_value_set_bytes(f"{PREFIX}{self.sent}", pickle.dumps(message))
        if self.sent >= 2:
            self.client.key_value_delete(f"{PREFIX}{self.sent - 2}")
        self.sent += 1

    def receive(self):
        """Another process: the next message, however long process 0 is idle. Raises if process 0 (the
        store) is gone. The job's messages come from process 0 only, so unpickling them trusts no one else."""
        key = f"{PREFIX}{self.received}"
        while True:
            try:
                data = self.client.blocking_key_value_get_bytes(key, POLL_MS)
                break
            except Exception as e:  # the client raises its own XlaRuntimeError
                if "DEADLINE_EXCEEDED" not in str(e):
                    raise
        self.received += 1
        return pickle.loads(data)
