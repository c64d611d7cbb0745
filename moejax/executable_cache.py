"""Compiled executables kept on disk, so that a restart neither traces nor compiles its programs.

JAX's persistent compilation cache (moejax/compilation.py) skips XLA's compile, but the engine still
traces and lowers every program to find its key (~0.4 s a program on a 2-core CPU, ~0.7 s on the
H100's host). Here each executable of the precompiled set is serialized
(``jax.experimental.serialize_executable``) under a key of everything it depends on, and a restart
whose key is unchanged loads the whole set from a manifest (the labels and call signatures of the set)
without running any Python trace.

- The key of an entry: this environment (``environment_key``: the entry format, jax/jaxlib versions,
  platform and its version, device kind and count, XLA_FLAGS) and what the program itself depends on,
  given by its caller (``depends``: e.g. the model config for a model step, the vocabulary and rows for
  a sampler). A key that changed is rebuilt, with an INFO line naming the fields that changed.
- An entry that is truncated, corrupt, written for another label ("foreign") or that fails to load is
  rebuilt with a WARNING, never run.
- On CPU an executable is kept only if its serialized form is complete (moejax/executable_check.py: XLA:CPU
  can lose a part of a program in it, which would fail at run time once loaded), and checked again when
  loaded; one that is not is refused with a WARNING (kept in memory for this process, built again at the
  next start).
- Entries are written atomically (a temporary file, then a rename): a process killed mid-write leaves
  the old entry or none.

The folder (``resolve_dir``): the engine setting ``executable_cache_dir`` (moejax/engine_args.py); ``auto``
(``moejax serve``'s default): ``$MOEJAX_EXECUTABLE_CACHE_DIR``, else ``$XDG_CACHE_HOME/moejax/executables``
(``~/.cache/moejax/executables``, beside vLLM's and JAX's caches); ``env`` (the default, a library
load): ``$MOEJAX_EXECUTABLE_CACHE_DIR``, else off; ``off`` (or empty): no cache.
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging
import os
import pickle
import struct
import tempfile
import threading

import jax
import jaxlib
from jax.experimental import serialize_executable

from moejax import executable_check

ENV_VAR = "MOEJAX_EXECUTABLE_CACHE_DIR"
OFF = ("", "off", "none", "0", "false")
MAGIC = b"MOEJAXEX"
FORMAT = 2  # bump when the entry layout changes: every entry is then rebuilt (2: static arguments by repr)

log = logging.getLogger("moejax.precompile")


AUTO, ENV = "auto", "env"


def default_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "moejax", "executables")


def resolve_dir(path: str | None = None) -> str | None:
    """The cache folder from the setting (module docstring); None: off."""
    if path is None or path.strip().lower() == ENV:
        path = os.environ.get(ENV_VAR, "")
    elif path.strip().lower() == AUTO:
        path = os.environ.get(ENV_VAR) or default_dir()
    return None if path.strip().lower() in OFF else os.path.abspath(os.path.expanduser(path))


def environment_key() -> dict:
    """What every executable depends on beyond its own program: where and by what it was compiled."""
    dev = jax.devices()[0]
    return {"format": FORMAT, "jax": jax.__version__, "jaxlib": jaxlib.__version__, "platform": dev.platform,
            "platform_version": dev.client.platform_version, "device_kind": dev.device_kind,
            "devices": jax.device_count(), "xla_flags": os.environ.get("XLA_FLAGS", "")}


def signature(args: tuple, static: frozenset[int] = frozenset()) -> tuple:
    """A call's top-level arguments as the executable table is keyed: the static arguments (positions
    ``static``: a sampler's SampleMode, a NamedTuple) by repr, arrays (and abstract arrays) by shape and
    dtype, other containers as "tree" (parameters, routing: their shapes are fixed for a runner; no two
    programs of the set may differ in a tree alone: tests/test_precompile_programs.py), other values by repr."""
    out = []
    for i, a in enumerate(args):
        if i in static:
            out.append(("static", repr(a)))
        elif hasattr(a, "shape") and hasattr(a, "dtype"):
            out.append(("array", tuple(int(d) for d in a.shape), str(a.dtype)))
        elif isinstance(a, (dict, list, tuple)):
            out.append(("tree",))
        else:
            out.append(("static", repr(a)))
    return tuple(out)


def _jsonable(sig) -> list:
    return json.loads(json.dumps(sig))


def signature_from_json(sig: list) -> tuple:
    """``signature``'s value back from its JSON form (lists to tuples)."""
    return tuple(tuple(tuple(x) if isinstance(x, list) else x for x in s) for s in sig)


class CorruptEntry(Exception):
    """An entry that cannot be read as one: truncated, bad magic, bad checksum."""


def _encode(header: dict, payload: bytes) -> bytes:
    header = dict(header, payload_sha256=hashlib.sha256(payload).hexdigest(), payload_len=len(payload))
    h = json.dumps(header, sort_keys=True).encode()
    return MAGIC + struct.pack("<Q", len(h)) + h + payload


def _decode(blob: bytes) -> tuple[dict, bytes]:
    if blob[:len(MAGIC)] != MAGIC:
        raise CorruptEntry("not a moejax executable entry (bad magic)")
    if len(blob) < len(MAGIC) + 8:
        raise CorruptEntry("truncated header")
    (n,) = struct.unpack("<Q", blob[len(MAGIC):len(MAGIC) + 8])
    start = len(MAGIC) + 8
    if len(blob) < start + n:
        raise CorruptEntry("truncated header")
    try:
        header = json.loads(blob[start:start + n])
    except ValueError as e:
        raise CorruptEntry(f"unreadable header ({e})") from None
    payload = blob[start + n:]
    if len(payload) != header.get("payload_len"):
        raise CorruptEntry(f"truncated: {len(payload)} of {header.get('payload_len')} payload bytes")
    if hashlib.sha256(payload).hexdigest() != header.get("payload_sha256"):
        raise CorruptEntry("payload checksum mismatch")
    return header, payload


class ExecutableCache:
    """Entries in ``directory``, one file a label, each keyed by ``environment_key()`` + its ``depends``."""

    def __init__(self, directory: str):
        self.dir = directory
        os.makedirs(directory, exist_ok=True)
        self.env = environment_key()
        self.loaded = 0  # executables loaded in this process (tests and the start-up line read it)
        self.stored = 0
        self.refused = 0  # executables not kept: their serialized form would not run (``_unsafe``)
        # Why entries were rebuilt (the start-up line): none on disk, a key changed (its fields), unusable.
        self.missing, self.stale, self.unusable = 0, 0, 0
        self.changed: collections.Counter[str] = collections.Counter()  # the fields that made entries stale
        self._lock = threading.Lock()  # the counters: entries load in a thread pool (engine/executable_set.py)

    @classmethod
    def open(cls, path: str | None = None) -> "ExecutableCache | None":
        d = resolve_dir(path)
        if d is None:
            return None
        try:
            return cls(d)
        except OSError as e:
            raise ValueError(f"executable_cache_dir {d!r} cannot be created: {e}") from None

    def _count(self, name: str) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + 1)

    def _path(self, label: str) -> str:
        return os.path.join(self.dir, hashlib.sha256(label.encode()).hexdigest()[:32] + ".exe")

    def _key(self, depends: dict) -> dict:
        return _jsonable({**self.env, **depends})

    # ----- raw entries
    def _read(self, label: str, depends: dict) -> tuple[dict, bytes] | None:
        """(header, payload) of the entry for ``label`` under its current key, or None (missing, changed:
        logged, rebuilt by the caller)."""
        path = self._path(label)
        try:
            with open(path, "rb") as f:
                blob = f.read()
        except FileNotFoundError:
            self._count("missing")
            return None
        try:
            header, payload = _decode(blob)
        except CorruptEntry as e:
            self._count("unusable")
            log.warning("executable cache: the entry for %s (%s) is unusable: %s; rebuilding it", label, path, e)
            return None
        if header.get("label") != label:
            self._count("unusable")
            log.warning("executable cache: %s holds a foreign entry (%r, not %r); rebuilding it",
                        path, header.get("label"), label)
            return None
        key, old = _flat(self._key(depends)), _flat(header.get("key", {}))
        if old != key:
            changed = sorted(k for k in set(key) | set(old) if key.get(k) != old.get(k))
            with self._lock:
                self.stale += 1
                self.changed.update(changed)
            log.info("executable cache: rebuilding %s: %s changed", label,
                     ", ".join(f"{k} ({_short(old.get(k))} -> {_short(key.get(k))})" for k in changed))
            return None
        return header, payload

    def _write(self, label: str, depends: dict, payload: bytes, **extra) -> None:
        blob = _encode({"label": label, "key": self._key(depends), **extra}, payload)
        fd, tmp = tempfile.mkstemp(dir=self.dir, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
            os.replace(tmp, self._path(label))
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise

    # ----- executables
    def load(self, label: str, depends: dict):
        """The executable of ``label`` as (compiled, signature), or None (rebuild it)."""
        entry = self._read(label, depends)
        if entry is None:
            return None
        header, payload = entry
        try:
            serialized, in_tree, out_tree = pickle.loads(payload)
            if (problem := self._unsafe(serialized)) is not None:
                self._count("unusable")
                log.warning("executable cache: the entry for %s is unsafe to run: %s; rebuilding it", label, problem)
                return None
            by_id = {d.id: d for d in jax.devices()}
            # The devices it was compiled for, in their order (by default it would load on every device).
            devices = [by_id[i] for i in header["devices"]]
            compiled = serialize_executable.deserialize_and_load(serialized, in_tree, out_tree,
                                                                 execution_devices=devices)
        except Exception as e:  # noqa: BLE001 - any failure to load is a rebuild, never a crash
            self._count("unusable")
            log.warning("executable cache: the entry for %s failed to load (%s: %s); rebuilding it",
                        label, type(e).__name__, e)
            return None
        self._count("loaded")
        return compiled, signature_from_json(header["signature"])

    def summary(self) -> str:
        """This process's hits and misses, and why entries were rebuilt (the start-up line)."""
        why = [f"{self.missing} not there"] if self.missing else []
        if self.stale:
            why.append(f"{self.stale} with a changed key: " + ", ".join(k for k, _ in self.changed.most_common(3)))
        if self.unusable:
            why.append(f"{self.unusable} unusable (see the warnings)")
        out = f"{self.loaded} loaded, {self.stored + self.refused} built"
        out += f" ({'; '.join(why)})" if why else ""
        return out + (f", {self.refused} not kept (unsafe to run once loaded)" if self.refused else "")

    def _unsafe(self, serialized: bytes) -> str | None:
        """Why a serialized executable must not be kept or run, or None: on CPU, moejax/executable_check.py."""
        return executable_check.cpu_problem(serialized) if self.env["platform"] == "cpu" else None

    def store(self, label: str, depends: dict, compiled, sig: tuple) -> bool:
        """Keeps ``compiled`` under ``label``; False (with a WARNING saying why) if its serialized form would
        not run once loaded."""
        serialized = serialize_executable.serialize(compiled)
        if (problem := self._unsafe(serialized[0])) is not None:
            log.warning("executable cache: not keeping %s: %s; it runs in this process and is built again at the "
                        "next start", label, problem)
            self._count("refused")
            return False
        devices = [d.id for d in compiled.runtime_executable().local_devices()]
        self._write(label, depends, pickle.dumps(serialized), signature=_jsonable(sig), devices=devices)
        self._count("stored")
        return True

    # ----- the set's manifest: its labels, so a restart knows the set without tracing it
    def load_manifest(self, depends: dict) -> list[dict] | None:
        entry = self._read("manifest", depends)
        if entry is None:
            return None
        try:
            return json.loads(entry[1])
        except ValueError as e:
            log.warning("executable cache: unreadable manifest (%s); rebuilding it", e)
            return None

    def store_manifest(self, depends: dict, programs: list[dict]) -> None:
        self._write("manifest", depends, json.dumps(programs).encode())


def _flat(d: dict, prefix: str = "") -> dict:
    """Nested keys as dotted names: a changed field is named down to its setting."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _short(v, n: int = 60) -> str:
    s = v if isinstance(v, str) else json.dumps(v, sort_keys=True)
    return s if len(s) <= n else s[:n - 3] + "..."


class PrecompiledFunction:
    """A jitted function and the executables loaded for it, called by signature: a call whose signature
    has an executable runs it (no trace), any other call goes to the jitted function (traced and
    compiled as before; after start-up, COUNTER counts it)."""

    def __init__(self, jitted, name: str, static_argnums: tuple[int, ...] = ()):
        self.jitted, self.name, self.static = jitted, name, frozenset(static_argnums)
        self.executables: dict[tuple, object] = {}

    def lower(self, *args):
        return self.jitted.lower(*args)

    def eval_shape(self, *args):
        return self.jitted.eval_shape(*args)

    def signature(self, args: tuple) -> tuple:
        return signature(args, self.static)

    def install(self, sig: tuple, compiled) -> None:
        self.executables[sig] = compiled

    def __call__(self, *args):
        if self.executables:
            c = self.executables.get(self.signature(args))
            if c is not None:  # static arguments are part of the executable: not passed
                return c(*(a for i, a in enumerate(args) if i not in self.static))
        return self.jitted(*args)
