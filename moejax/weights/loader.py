"""Load an HF checkpoint directory of any registered family into a parameter pytree.

The family's name table (moejax/models/<family>.py) says where each HF tensor goes;
this loader checks every tensor against the shapes the Flax model declares: missing,
unexpected, duplicated or mis-shaped tensors raise a ValueError naming the HF tensor.
Routed experts arrive one [out, in] tensor per expert (DeepSeek) or one [E, out, in]
tensor (Step3) and are stored [E, in, out], or as they are ([E, out, in]) when FP8.

FP8: where the model declares a float8 leaf (moejax/layers/fp8_policy.py), an FP8 tensor
stays FP8 and its ``weight_scale_inv`` goes beside it (``<leaf>_scale_inv``; stacked experts
[E, out/128, in/128]); a bf16/f32 tensor is quantised
to the same 128x128 block format. Where the model declares the model dtype, FP8 tensors
are dequantised. One matrix at a time: never a whole stacked tensor in float32.

The device format is 128x128 blocks only (the FP8 kernels). A checkpoint with other blocks (32x32,
or any [rows, cols]) is re-blocked: each kept-FP8 matrix is dequantised with the checkpoint's scales
and re-quantised per 128x128 block (moejax/weights/fp8.py ``reblock_fp8``). Its error against the
checkpoint's own weights is measured matrix by matrix (``ReblockStats``) and reported once at the
end of the load, as a UserWarning and a line on stderr.

A tensor the family shares with another (``shared_tensor``: DeepSeek-V3's MTP layer's
``embed_tokens``, the main embedding) is not stored: it is checked equal to that other, or refused.

Fused leaves (the family's ``fused_parts``: DeepSeek MLA's ``qkv_a_proj``) are the rows of
several HF tensors, each converted as above and concatenated along ``out`` once all have
arrived; FP8 scales stack the same way (the model fuses only where the split falls on a block
boundary, moejax/layers/mla.py).

Streaming: each finished leaf is handed to ``place`` (e.g. a device_put with its sharding)
at once, so host memory holds the memory map plus the leaves still being assembled (a
routed-expert stack until all its experts have arrived), not the whole model.
"""

from __future__ import annotations

import dataclasses
import sys
import warnings
from typing import Callable

import ml_dtypes
import numpy as np

from moejax.layers.linear import SCALE_SUFFIX
from moejax.weights.checked_tensors import CheckedTensors, np_dtype
from moejax.weights.fp8 import ReblockStats, dequantize_block_fp8, quantize_block_fp8, reblock_fp8
from moejax.weights.param_tree import flatten, is_stacked_expert, unflatten

FP8 = np.dtype(ml_dtypes.float8_e4m3fn)


def _matrix(name: str, arr, scale, block) -> np.ndarray:
    """One [out, in] matrix in float32 (dequantised when it comes with block scales)."""
    if scale is None:
        return np.asarray(arr, np.float32)
    if arr.ndim != 2:
        raise ValueError(f"checkpoint tensor {name!r} is float8 but not a matrix")
    try:
        return dequantize_block_fp8(arr, scale, block)
    except ValueError as e:
        raise ValueError(f"checkpoint tensor {name!r}: {e}") from None


def _fp8_matrix(name: str, arr, scale, block, want_block, stats: ReblockStats) -> tuple[np.ndarray, np.ndarray]:
    """One [out, in] matrix as (float8 weight, float32 block scales) in ``want_block`` blocks:
    kept as it is when the checkpoint has it so, re-blocked (its error added to ``stats``) when the
    checkpoint has other blocks, quantised when it is not FP8."""
    if scale is not None and tuple(block) == tuple(want_block) and arr.ndim == 2:
        expect = (-(-arr.shape[0] // block[0]), -(-arr.shape[1] // block[1]))
        if tuple(scale.shape) != expect:
            raise ValueError(f"checkpoint tensor {name + SCALE_SUFFIX!r} has shape {tuple(scale.shape)}, "
                             f"expected {expect} for blocks {list(block)}")
        return np.asarray(arr), np.asarray(scale, np.float32)
    if scale is not None and arr.ndim == 2:
        try:
            q, s, err = reblock_fp8(arr, scale, block, want_block)
        except ValueError as e:
            raise ValueError(f"checkpoint tensor {name!r}: {e}") from None
        stats.add(name, block, want_block, err)
        return q, s
    return quantize_block_fp8(_matrix(name, arr, scale, block), want_block)


def _check_shape(name: str, arr, want: tuple) -> None:
    if tuple(arr.shape) != tuple(want):
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(arr.shape)}, expected {tuple(want)}")


def load_hf_params(directory: str, cfg, family, abstract, progress: bool = True,
                   want_block: tuple[int, int] = (128, 128),
                   place: Callable[[tuple[str, ...], np.ndarray], object] | None = None,
                   experts_needed: Callable[[tuple[str, ...]], set[int] | None] | None = None,
                   reblock: ReblockStats | None = None):
    """The parameter pytree: NumPy arrays, or whatever ``place(path, array)`` returns for each leaf.
    ``family``: the model's ``ModelFamily`` (its name table) and ``abstract``: the ShapeDtypeStruct tree
    the model declares (``moejax.models.registry.family_of`` and ``abstract_params``; passed in, so the
    loader knows no model). ``want_block``: the device's FP8 weight blocks (the engine's ``Fp8Policy.block``).
    ``experts_needed(experts module path)``: the routed experts to convert (None: all); the rows of the
    others are left unset, for a ``place`` that never reads them (one process of several: its own
    shards only). Every tensor is still checked for presence and shape. ``reblock``: filled with the
    re-blocking error of an FP8 checkpoint whose blocks are not the device's (``summary()`` None when
    nothing was re-blocked); reported either way (a UserWarning and a line on stderr)."""
    load = _Assembly(cfg, family, abstract, want_block, place or (lambda path, a: a),
                     experts_needed or (lambda module: None), ReblockStats() if reblock is None else reblock)
    tensors = CheckedTensors(directory, cfg)
    for name in tensors.names(progress):
        load.add(tensors, name)
    tensors.finish()
    load.check_complete()
    load.report_reblock()
    return unflatten(load.out)


def _scale_path(path: tuple[str, ...]) -> tuple[str, ...]:
    """The path of a float8 leaf's block scales: ``<leaf>_scale_inv`` beside it."""
    return path[:-1] + (path[-1] + SCALE_SUFFIX,)


@dataclasses.dataclass(frozen=True)
class _Target:
    """Where one HF tensor goes: the leaf (a fused leaf where the tensor is one of its parts), its declared
    shape and dtype, and how an [out, in] matrix is converted to it."""
    leaf: tuple[str, ...]
    part: int | None  # the tensor's index among the fused leaf's parts
    want: object  # the leaf's ShapeDtypeStruct
    keep_fp8: bool
    dtype: np.dtype  # what the leaf holds

    def in_out(self):
        """(E, in, out) of a stacked expert leaf ([E, in, out]; FP8 kept [E, out, in])."""
        shape = self.want.shape
        return (shape[0], shape[2], shape[1]) if self.keep_fp8 else tuple(shape)


class _Assembly:
    """One load's state: the leaves finished (``out``, each already ``place``d), the stacked expert leaves
    and fused leaves still being assembled, and which HF tensor filled what (duplicates refused)."""

    def __init__(self, cfg, family, abstract, want_block, place, needed, reblock: ReblockStats):
        self.cfg, self.family, self.block = cfg, family, cfg.fp8_block_size
        self.expected = flatten(abstract)
        self.want_block, self.place, self.needed, self.reblock = want_block, place, needed, reblock
        self.out: dict[tuple[str, ...], object] = {}
        self.pending: dict[tuple[str, ...], np.ndarray] = {}  # stacked leaves still missing experts
        self.source: dict[tuple, str] = {}  # (path, expert) -> the HF name that filled it
        self.experts_seen: dict[tuple[str, ...], set] = {}
        self.fused_of: dict[tuple[str, ...], tuple[tuple[str, ...], int]] = {}  # HF tensor's path -> (leaf, part)
        for path in self.expected:
            for i, (part, _) in enumerate(self.family.fused_parts(cfg, path) or ()):
                self.fused_of[part] = (path, i)
        self.parts_seen: dict[tuple[str, ...], dict[int, tuple]] = {}  # fused leaf -> part -> (weight, scales)

    # ------------------------------------------------------------------ one tensor
    def add(self, tensors: CheckedTensors, name: str) -> None:
        ref = self._parameter_of(tensors, name)
        if ref is None:
            return
        arr, scale = tensors.get(name)
        t = self._target(ref)
        if ref.expert is not None:
            self._add_one_expert(name, ref, t, arr, scale)
        elif ref.stacked:
            self._add_stacked_experts(name, t, arr, scale)
        else:
            self._add_matrix(name, t, arr, scale)

    def _parameter_of(self, tensors: CheckedTensors, name: str):
        """The parameter ``name`` fills (the family's reference), or None for a tensor not stored (ignored,
        or shared with another and checked equal to it); a ValueError for a tensor of no parameter or a
        second tensor of one already filled."""
        family, cfg = self.family, self.cfg
        if family.ignores(name, cfg):
            tensors.skip(name)
            return None
        same_as = family.shared_tensor(name, cfg)
        if same_as is not None:  # not stored; refused unless equal to the tensor it shares (its absence: below)
            tensors.skip(name)
            if same_as in tensors.files and not tensors.equal(name, same_as):
                raise ValueError(f"checkpoint tensor {name!r} differs from {same_as!r}: this model shares one "
                                 "tensor for both (DeepSeek-V3's MTP layer's embedding is the main embedding)")
            return None
        ref = family.hf_to_param(name)
        if ref is None or (ref.path not in self.expected and ref.path not in self.fused_of) \
                or ref.path[-1].endswith(SCALE_SUFFIX):
            raise ValueError(f"checkpoint tensor {name!r} is not a parameter of this {cfg.model_type} model")
        if (ref.path, ref.expert) in self.source:
            raise ValueError(f"checkpoint tensors {self.source[ref.path, ref.expert]!r} and {name!r} are the same "
                             "parameter")
        self.source[ref.path, ref.expert] = name
        return ref

    def _target(self, ref) -> _Target:
        leaf, part = self.fused_of.get(ref.path, (ref.path, None))
        want = self.expected[leaf]
        keep_fp8 = np.dtype(want.dtype) == FP8
        return _Target(leaf, part, want, keep_fp8, FP8 if keep_fp8 else np_dtype(want))

    def _convert(self, t: _Target, name: str, a, s):
        """HF [out, in] -> ([in, out] in the leaf's dtype, None), or FP8 kept [out, in] with its [out/b, in/b]
        scales."""
        if t.keep_fp8:
            return _fp8_matrix(name, a, s, self.block, self.want_block, self.reblock)
        return _matrix(name, a, s, self.block).T.astype(t.dtype), None

    def _finish(self, path, arr) -> None:
        self.out[path] = self.place(path, arr)

    def _finish_with_scales(self, t: _Target, w, s) -> None:
        self._finish(t.leaf, w)
        if t.keep_fp8:
            self._finish(_scale_path(t.leaf), s)

    # ------------------------------------------------------------------ by leaf kind
    def _add_one_expert(self, name, ref, t: _Target, arr, scale) -> None:
        """One expert: HF [out, in] -> row ref.expert of [E, in, out] ([E, out, in]); the leaf is finished once
        all its experts arrived."""
        E, n_in, n_out = t.in_out()
        _check_shape(name, arr, (n_out, n_in))
        if not 0 <= ref.expert < E:
            raise ValueError(f"checkpoint tensor {name!r}: expert index {ref.expert} >= n_routed_experts")
        sp = _scale_path(t.leaf)
        buf = self.pending.setdefault(ref.path, np.empty(t.want.shape, t.dtype))
        if t.keep_fp8:
            sbuf = self.pending.setdefault(sp, np.empty(self.expected[sp].shape, np.float32))
        wanted = self.needed(t.leaf[:-1])
        if wanted is None or ref.expert in wanted:
            w, s = self._convert(t, name, arr, scale)
            buf[ref.expert] = w
            if t.keep_fp8:
                sbuf[ref.expert] = s
        seen = self.experts_seen.setdefault(ref.path, set())
        seen.add(ref.expert)
        if len(seen) == E:
            self._finish_with_scales(t, self.pending.pop(ref.path), self.pending.pop(sp) if t.keep_fp8 else None)

    def _add_stacked_experts(self, name, t: _Target, arr, scale) -> None:
        """All experts: HF [E, out, in] -> [E, in, out] (FP8: as it is)."""
        E, n_in, n_out = t.in_out()
        _check_shape(name, arr, (E, n_out, n_in))
        if scale is not None and (scale.ndim != 3 or scale.shape[0] != E):
            raise ValueError(f"checkpoint tensor {name + SCALE_SUFFIX!r} has shape {tuple(scale.shape)}: "
                             f"expected one [rows, cols] block-scale grid per expert ({E} experts)")
        buf = np.empty(t.want.shape, t.dtype)
        sbuf = np.empty(self.expected[_scale_path(t.leaf)].shape, np.float32) if t.keep_fp8 else None
        wanted = self.needed(t.leaf[:-1])
        for e in range(E) if wanted is None else sorted(wanted):
            w, s = self._convert(t, name, arr[e], None if scale is None else scale[e])
            buf[e] = w
            if t.keep_fp8:
                sbuf[e] = s
        self._finish_with_scales(t, buf, sbuf)

    def _add_matrix(self, name, t: _Target, arr, scale) -> None:
        """One [out, in] matrix: the whole leaf, or one part of a fused leaf's rows (the leaf finished, rows
        concatenated, once all its parts arrived)."""
        parts = self.family.fused_parts(self.cfg, t.leaf) if t.part is not None else None
        shape = (parts[t.part][1], t.want.shape[1]) if parts else t.want.shape
        if t.keep_fp8:
            _check_shape(name, arr, shape)
            w, s = _fp8_matrix(name, arr, scale, self.block, self.want_block, self.reblock)
        else:
            arr = _matrix(name, arr, scale, self.block) if scale is not None else arr
            _check_shape(name, arr, shape)
            w, s = np.asarray(arr).astype(t.dtype), None
        if parts:
            got = self.parts_seen.setdefault(t.leaf, {})
            got[t.part] = (w, s)
            if len(got) < len(parts):
                return
            w = np.concatenate([got[i][0] for i in range(len(parts))])
            s = np.concatenate([got[i][1] for i in range(len(parts))]) if t.keep_fp8 else None
            del self.parts_seen[t.leaf]
        self._finish_with_scales(t, w, s)

    # ------------------------------------------------------------------ at the end
    def check_complete(self) -> None:
        """Every declared leaf filled, or a ValueError naming the first HF tensor that did not arrive."""
        family, cfg = self.family, self.cfg
        for path, want in self.expected.items():
            if path[-1].endswith(SCALE_SUFFIX) and path[:-1] + (path[-1][:-len(SCALE_SUFFIX)],) in self.expected:
                continue  # filled with its weight
            per_expert = is_stacked_expert(path) and not family.experts_stacked_on_disk
            if per_expert and path in self.pending:  # some of its experts arrived, not all
                e = min(set(range(want.shape[0])) - self.experts_seen[path])
                raise ValueError(f"checkpoint is missing tensor {family.param_to_hf(path, e)!r}")
            parts = family.fused_parts(cfg, path)
            if parts and path not in self.out:  # name the first part that did not arrive
                i = min(set(range(len(parts))) - set(self.parts_seen.get(path, {})))
                raise ValueError(f"checkpoint is missing tensor {family.param_to_hf(parts[i][0], None)!r}")
            if path not in self.out:
                raise ValueError(f"checkpoint is missing tensor "
                                 f"{family.param_to_hf(path, 0 if per_expert else None)!r}")

    def report_reblock(self) -> None:
        if self.reblock.matrices:  # once a load, loudly: the weights are not the checkpoint's bit for bit
            print(f"moejax: {self.reblock.message()}", file=sys.stderr, flush=True)
            warnings.warn(self.reblock.message(), UserWarning, stacklevel=3)
