"""The Triton language (not Pallas) from JAX, through ``jax-triton``: import guard and one call helper.

Why a second route beside Pallas-Triton: on Hopper, Pallas-Triton's W8A8 GEMMs ran at 200-300 TFLOP/s
where the same block-FP8 GEMM written in Triton and run through torch ran 2.4-4x faster (H100,
BENCHMARKS.md "FP8 GEMM kernels on wgmma"); vLLM's and SGLang's block-FP8 fused MoE are Triton kernels,
and Triton runs on NVIDIA and ROCm alike. ``jax-triton`` compiles a ``@triton.jit`` kernel with the
installed ``triton`` at lowering time and calls it through jaxlib's ``triton_kernel_call`` custom call,
so it lives inside a jitted step like any other op (and in JAX's persistent compilation cache).

Optional dependency (pyproject extra ``triton``): ``jax-triton==0.3.1`` (the newest release that takes
Python 3.11 and ``triton>=3.6``; 0.4.x needs triton 3.7 and Python 3.12) with ``triton>=3.6`` (the
CUDA image's torch ships triton 3.6.0). Absent, ``available()`` is False with the reason, kernel
selection keeps the Pallas kernels, and calling a Triton kernel raises ImportError naming the install.
"""

from __future__ import annotations

import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.compat import interpret_mode

INSTALL_HINT = "pip install 'moejax[triton]' (jax-triton==0.3.1, triton>=3.6)"


def _import(interpret: bool):
    """(triton, jax_triton or None), imported on first use: Triton's interpreter is chosen by
    TRITON_INTERPRET when triton.language is first imported (its library functions, tl.cdiv and the
    reductions, are interpreted only then), and whether we interpret is known only once JAX's backend
    is (this module is imported before ``jax.distributed.initialize`` may run)."""
    if interpret and "triton.language" not in sys.modules:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import triton
    import triton.language  # noqa: F401

    if interpret and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("Triton was imported before moejax could select its interpreter: set "
                           "TRITON_INTERPRET=1 to run Triton kernels on CPU")
    if interpret:
        _fix_interpreter()
    try:
        import jax_triton
    except Exception:  # ImportError, or a triton / jax-triton version mismatch raising at import
        jax_triton = None
    return triton, jax_triton


def _fix_interpreter():
    """Three faults of Triton 3.6's interpreter, mended in place (the compiled path is untouched):
    it holds a loaded scalar as a one-element 1-d array and turns it into a Python int with
    ``int(array)``, which NumPy 2 refuses (a loop bounded by a sequence's loaded length fails); and its
    dot multiplies bfloat16 operands as their raw uint16 bits (it widens only FP8). Its scalar
    ``__index__`` takes the single element; bf16 dot operands are widened to float32 (exact). And its
    float32 -> bfloat16 cast truncates where the GPU rounds to nearest even: it rounds to nearest even."""
    from triton.runtime import interpreter

    orig = interpreter._patch_lang_tensor
    if getattr(orig, "moejax_fixed", False):
        return

    def patch(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    patch.moejax_fixed = True
    interpreter._patch_lang_tensor = patch

    builder = interpreter.InterpreterBuilder
    dot = builder.create_dot
    tl = interpreter.tl

    def widen(h):
        if h.dtype != tl.bfloat16:
            return h
        bits = np.ascontiguousarray(h.data).view(np.uint16).astype(np.uint32) << 16
        return interpreter.TensorHandle(bits.view(np.float32), tl.float32)

    builder.create_dot = lambda self, a, b, *rest: dot(self, widen(a), widen(b), *rest)

    cast = builder.cast_impl

    def cast_rne(self, src, dst_type):
        if src.dtype.scalar != tl.float32 or dst_type.scalar != tl.bfloat16:
            return cast(self, src, dst_type)
        bits = np.ascontiguousarray(src.data, np.float32).view(np.uint32).astype(np.uint64)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # to nearest even, as the GPU's cvt.rn
        nan = np.isnan(src.data)
        out = np.where(nan, np.uint64(0x7FC0), bits).astype(np.uint16)
        return interpreter.TensorHandle(out, tl.bfloat16)

    builder.cast_impl = cast_rne


@functools.lru_cache(maxsize=None)
def available() -> tuple[bool, str]:
    """(jax-triton and triton importable here, why not). Imports them (compiled mode): asked only where a
    GPU route is chosen (kernel selection on CUDA), never before the interpreter would be."""
    try:
        import jax_triton  # noqa: F401
        import triton  # noqa: F401
    except Exception as e:
        return False, f"jax-triton / triton not importable ({e!r}); {INSTALL_HINT}"
    return True, ""


class Kernel:
    """A Triton kernel written as a plain function in a module with ``from __future__ import annotations``
    (its ``tl.constexpr`` annotations stay strings until Triton reads them: Triton may be absent), put
    through ``triton.jit`` on first launch, when ``tl`` is put in the module's globals, and the module's
    ``helper`` functions are bound there under their names as Triton functions (kernels call them)."""

    def __init__(self, fn):
        self.fn = fn
        self._jitted = {}

    def get(self, interpret: bool):
        if interpret not in self._jitted:
            triton, _ = _import(interpret)
            g = self.fn.__globals__
            g["tl"] = triton.language
            for h in _HELPERS:
                if h is not self and h.fn.__globals__ is g:
                    g[h.fn.__name__] = h.get(interpret)
            self._jitted[interpret] = triton.jit(self.fn)
        return self._jitted[interpret]


_HELPERS: list[Kernel] = []


def jit(fn) -> Kernel:
    return Kernel(fn)


def helper(fn) -> Kernel:
    """A ``@triton.jit`` function kernels call (written as ``jit``'s kernels are)."""
    _HELPERS.append(Kernel(fn))
    return _HELPERS[-1]


def triton_call(*args, kernel, out_shape, grid, interpret: bool | None = None, zeroed_outputs=(), **kwargs):
    """``jax_triton.triton_call`` on a GPU; on CPU (or with ``interpret=True`` /
    ``MOEJAX_PALLAS_INTERPRET=1``) the same kernel in Triton's interpreter through ``jax.pure_callback``
    (torch CPU tensors; tests only, as Pallas' ``interpret=True``)."""
    if interpret is None:
        interpret = interpret_mode()
    if interpret:
        return _interpret(args, kernel, out_shape, grid, zeroed_outputs, kwargs)
    ok, why = available()
    if not ok:
        raise ImportError(f"this kernel is written in Triton and needs jax-triton: {why}")
    _, jt = _import(False)
    return jt.triton_call(*args, kernel=kernel.get(False), out_shape=out_shape, grid=grid, zeroed_outputs=zeroed_outputs,
                           **kwargs)


_LAUNCH_ONLY = ("name", "num_warps", "num_stages", "num_ctas", "debug", "input_output_aliases")


def _interpret(args, kernel, out_shape, grid, zeroed_outputs, kwargs):
    try:
        import torch

        fn = kernel.get(True)
    except ImportError as e:
        raise ImportError(f"running a Triton kernel off the GPU needs triton and torch (CPU) for Triton's "
                          f"interpreter: {e!r}") from e
    meta = {k: v for k, v in kwargs.items() if k not in _LAUNCH_ONLY}
    single = not isinstance(out_shape, (tuple, list))
    outs = [out_shape] if single else list(out_shape)

    def to_torch(a):
        a = np.ascontiguousarray(a)
        if a.dtype.kind not in "iubfc":  # float8 / bfloat16 (ml_dtypes): through their bits
            bits = {1: (np.uint8, torch.uint8), 2: (np.int16, torch.int16)}[a.dtype.itemsize]
            return torch.from_numpy(a.view(bits[0]).copy()).view(getattr(torch, a.dtype.name))
        return torch.from_numpy(a.copy())

    def from_torch(t, dtype):
        if t.dtype.is_floating_point and t.dtype.itemsize <= 2 and t.dtype != torch.float16:
            return t.view(torch.uint8 if t.dtype.itemsize == 1 else torch.int16).numpy().view(dtype)
        return t.numpy().astype(dtype, copy=False)

    def host(*arrays):
        ins = [to_torch(a) if hasattr(a, "dtype") else a for a in arrays]
        res = [to_torch(np.full(o.shape, 0 if i in zeroed_outputs else 0x55, np.uint8).view(o.dtype)
                        if jnp.dtype(o.dtype).itemsize == 1 else
                        np.zeros(o.shape, o.dtype) if i in zeroed_outputs else
                        np.full(o.shape, np.nan if jnp.issubdtype(o.dtype, jnp.floating) else -7, o.dtype))
               for i, o in enumerate(outs)]
        g = grid(meta) if callable(grid) else (grid if isinstance(grid, tuple) else (grid,))
        fn[g](*ins, *res, **meta)
        return tuple(from_torch(r, o.dtype) for r, o in zip(res, outs))

    arrays = [a for a in args if not isinstance(a, (bool, int, float))]
    if len(arrays) != len(args):
        raise NotImplementedError("scalar kernel arguments: pass them as constexpr keywords")
    shapes = tuple(jax.ShapeDtypeStruct(o.shape, o.dtype) for o in outs)
    res = jax.pure_callback(host, shapes, *arrays)
    return res[0] if single else tuple(res)
