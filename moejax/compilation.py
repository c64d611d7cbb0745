"""XLA compilation: JAX's persistent compilation cache (on by default) and a count of the compiles.

The cache directory: an explicit argument, else ``$MOEJAX_COMPILATION_CACHE_DIR``, else the one
JAX was given (``JAX_COMPILATION_CACHE_DIR``), else, on a GPU, ``$XDG_CACHE_HOME/moejax/jax``
(``~/.cache/moejax/jax``); on CPU the default is off (see ``resolve_cache_dir``). The value ``off`` (or an
empty string) disables it. A restart of the same configuration then loads its programs from the cache instead
of compiling them (the engine still traces and lowers each program to find its cache key).

``COUNTER`` counts, for the whole process, every program XLA built (``/jax/core/compile/backend_compile_duration``,
JAX's event around its compile-or-load) and how many of those came from the persistent cache
(``/jax/compilation_cache/cache_hits``): the difference is the number compiled from scratch.
The server reads it before and after start-up; a compile after start-up is a program the
precompiled set missed (moejax:compiles_after_startup_total, which stays 0 in steady serving).
"""

from __future__ import annotations

import os
import threading

import jax
from jax.experimental.compilation_cache import compilation_cache as jax_compilation_cache

from moejax.xla_flags import cpu_only

ENV_VAR = "MOEJAX_COMPILATION_CACHE_DIR"
OFF = ("", "off", "none", "0", "false")

_BUILD_EVENT = "/jax/core/compile/backend_compile_duration"
_HIT_EVENT = "/jax/compilation_cache/cache_hits"


def default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "moejax", "jax")


def resolve_cache_dir(path: str | None = None) -> str | None:
    """The directory the cache should use (None: disabled), from the argument, the environment or the default."""
    if path is None:
        path = os.environ.get(ENV_VAR)
    if path is None:  # a cache JAX was already given (JAX_COMPILATION_CACHE_DIR) is kept
        path = jax.config.jax_compilation_cache_dir
    if path is None:
        # The default is for GPUs, where a program takes seconds to minutes to compile. CPU programs
        # compile fast and XLA:CPU's executable loading is fragile upstream (jax issues 28908, 38445):
        # off there unless asked.
        path = "off" if cpu_only() else default_cache_dir()
    return None if path.strip().lower() in OFF else os.path.abspath(os.path.expanduser(path))


_enabled_dir: str | None = None


def _apply(enabled: bool, d: str | None) -> None:
    """JAX decides once whether its cache is used (on the first compile) and keeps that answer: a change
    takes effect only through a reset (public API)."""
    if (jax.config.jax_enable_compilation_cache, jax.config.jax_compilation_cache_dir) != (enabled, d):
        jax_compilation_cache.reset_cache()
    jax.config.update("jax_enable_compilation_cache", enabled)
    if d is not None:
        jax.config.update("jax_compilation_cache_dir", d)


def enable_persistent_cache(path: str | None = None) -> str | None:
    """Points JAX's persistent compilation cache at ``resolve_cache_dir(path)`` (every program, however
    fast it compiled); returns the directory, or None when disabled. Call before the first compile."""
    global _enabled_dir
    d = resolve_cache_dir(path)
    if d is None:
        _apply(False, jax.config.jax_compilation_cache_dir)
        _enabled_dir = None
        return None
    try:
        os.makedirs(d, exist_ok=True)
    except OSError as e:
        raise ValueError(f"compilation_cache_dir {d!r} cannot be created: {e}") from None
    _apply(True, d)
    # JAX's defaults skip programs that compiled in under a second: a restart should compile nothing.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    _enabled_dir = d
    return d


def keeps_object_code() -> bool:
    """Whether an executable JAX's persistent cache hands back can be serialized again whole. Not on
    XLA:CPU: an executable loaded from its serialized form keeps no object files or compiled-symbol list,
    so serialized again it holds no code and, loaded, fails at run time ("Function ... not found";
    moejax/executable_check.py refuses such an entry). The executable cache turns JAX's cache off there
    (``exclusive_of_executable_cache``)."""
    return not cpu_only()


def exclusive_of_executable_cache() -> bool:
    """Turns JAX's persistent cache off for this process where its hits could not be kept by the executable
    cache (``keeps_object_code``); True if it was on."""
    global _enabled_dir
    if keeps_object_code() or not jax.config.jax_enable_compilation_cache \
            or not jax.config.jax_compilation_cache_dir:
        return False
    _apply(False, jax.config.jax_compilation_cache_dir)
    _enabled_dir = None
    return True


def cache_dir() -> str | None:
    """The directory enabled by ``enable_persistent_cache`` (None: not enabled by moejax)."""
    return _enabled_dir


class CompileCounter:
    """Programs XLA built in this process since it started: ``built`` (compiled or loaded from the
    persistent cache), ``cache_hits`` (loaded) and ``compiled`` (from scratch)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.built = 0
        self.cache_hits = 0
        self.seconds = 0.0  # wall time spent building them
        self._registered = False

    def register(self) -> "CompileCounter":
        with self._lock:
            if not self._registered:
                jax.monitoring.register_event_duration_secs_listener(self._on_duration)
                jax.monitoring.register_event_listener(self._on_event)
                self._registered = True
        return self

    def _on_duration(self, event: str, duration: float, **_) -> None:
        if event == _BUILD_EVENT:
            with self._lock:
                self.built += 1
                self.seconds += duration

    def _on_event(self, event: str, **_) -> None:
        if event == _HIT_EVENT:
            with self._lock:
                self.cache_hits += 1

    @property
    def compiled(self) -> int:
        return self.built - self.cache_hits

    def snapshot(self) -> tuple[int, int]:
        """(built, cache_hits) now."""
        with self._lock:
            return self.built, self.cache_hits


COUNTER = CompileCounter().register()
