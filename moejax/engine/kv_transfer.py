"""Moving a prefilled request's cache rows between processes with JAX's own transfer library.

The prefill side ``offer``s a PrefilledRequest (kv_handoff.py): its rows are registered with this
process's ``jax.experimental.transfer`` server under a random uuid (``await_pull``, which returns at
once), and its metadata (tokens, sampling state, row shape and dtype, the server's address and the
uuid) goes to the decode side over the control channel (HTTP/JSON). The decode side ``pull``s the
rows (``connect(address).pull(uuid, specs)``) onto its own device and adds the request to its
engine. Only the cache tensors go through the transfer library; device to device where the
platform has it (GPU), through sockets on CPU.

A pull that fails or does not finish within its deadline raises KVTransferFailed: the caller
re-queues the request (prefilled again), so nothing is lost. The transfer library's own timeout
argument is not honoured on CPU (jax 0.10.2: a pull of an unknown uuid waits until the peer
closes), so the deadline is kept here, by waiting for the pull in a helper thread; a timed-out
pull's thread is left behind (daemon) until its connection closes.
"""

from __future__ import annotations

import datetime
import secrets
import threading
import time

import jax
import jax.numpy as jnp
from jax.experimental import transfer
from jax.sharding import SingleDeviceSharding

from moejax.engine.kv_handoff import PrefilledRequest

DEFAULT_PULL_TIMEOUT_S = 30.0
# Rows offered and never pulled (the request was aborted, or its pull failed) are dropped after this.
DEFAULT_OFFER_TTL_S = 300.0


class KVTransferFailed(RuntimeError):
    """The rows could not be pulled (peer gone, unknown uuid, deadline passed): re-queue the request."""


class KVTransfer:
    """This process's transfer endpoint: offers rows to peers and pulls theirs."""

    def __init__(self, host: str = "127.0.0.1", device=None):
        self.device = device or jax.local_devices()[0]
        self.server = transfer.start_transfer_server(self.device.client, f"{host}:0", [f"{host}:0"])
        self.address = self.server.address()
        self._conns: dict[str, object] = {}
        self._lock = threading.Lock()
        self.num_offered = 0

    def offer(self, rows: jax.Array, ttl_s: float = DEFAULT_OFFER_TTL_S) -> int:
        """Registers ``rows`` for one pull; returns its uuid. The rows are held until pulled, or for ``ttl_s``
        seconds (then a pull of the uuid finds nothing: KVTransferFailed at the puller's deadline)."""
        uuid = secrets.randbits(62)
        if len(rows.sharding.device_set) != 1:  # a mesh engine's rows: one device's copy is what is pulled
            rows = jax.device_put(rows, SingleDeviceSharding(self.device))
        self.server.await_pull(uuid, [rows], timeout=datetime.datetime.now() + datetime.timedelta(seconds=ttl_s))
        self.num_offered += 1
        return uuid

    def offer_request(self, req: PrefilledRequest) -> dict:
        """The request's metadata for the control channel, its rows offered under ``transfer.uuid``."""
        meta = req.meta()
        meta["transfer"] = {"address": self.address, "uuid": self.offer(req.rows)}
        return meta

    def _connect(self, address: str):
        with self._lock:
            conn = self._conns.get(address)
            if conn is None:
                conn = self._conns[address] = self.server.connect(address)
            return conn

    def pull(self, address: str, uuid: int, shape, dtype, timeout_s: float = DEFAULT_PULL_TIMEOUT_S) -> jax.Array:
        """Pulls the rows offered under ``uuid`` at ``address`` onto this process's device, or raises
        KVTransferFailed (any failure, or not done within ``timeout_s``)."""
        spec = jax.ShapeDtypeStruct(tuple(int(d) for d in shape), jnp.dtype(dtype),
                                    sharding=SingleDeviceSharding(self.device))
        box: dict = {}
        done = threading.Event()

        def work():
            try:
                out = self._connect(address).pull(int(uuid), [spec])[0]
                box["rows"] = out.block_until_ready()  # a failed pull raises here, not at pull()
            except Exception as e:  # noqa: BLE001 - reported to the caller as KVTransferFailed
                box["error"] = e
            finally:
                done.set()

        threading.Thread(target=work, name="moejax-kv-pull", daemon=True).start()
        if not done.wait(timeout_s):
            with self._lock:  # the connection may be wedged: a later pull opens a new one
                self._conns.pop(address, None)
            raise KVTransferFailed(f"pulling KV rows {uuid} from {address} took more than {timeout_s:g} s")
        if "error" in box:
            e = box["error"]
            raise KVTransferFailed(f"pulling KV rows {uuid} from {address} failed: {type(e).__name__}: {e}"[:500])
        return box["rows"]

    def pull_request(self, meta: dict, timeout_s: float = DEFAULT_PULL_TIMEOUT_S) -> tuple[PrefilledRequest, dict]:
        """The PrefilledRequest ``meta`` describes, its rows pulled; and {"seconds", "bytes"} of the pull.
        ValueError naming the field on bad metadata; KVTransferFailed when the pull fails."""
        try:
            t = meta["transfer"]
            address, uuid, shape, dtype = t["address"], t["uuid"], meta["row_shape"], meta["row_dtype"]
        except (KeyError, TypeError) as e:
            raise ValueError(f"prefilled request metadata lacks the field {e.args[0]!r}") from None
        req = PrefilledRequest.from_meta(meta)  # validates the rest before any transfer
        t0 = time.perf_counter()
        req.rows = self.pull(address, uuid, shape, dtype, timeout_s)
        return req, {"seconds": time.perf_counter() - t0, "bytes": int(req.rows.nbytes)}
