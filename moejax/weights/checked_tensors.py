"""The tensor bookkeeping of the checkpoint loader (loader.py).

Reads weights by HF name; a float8 weight comes with its ``<name>_scale_inv`` block scales (or a
ValueError naming what is missing); ``finish`` refuses scale tensors that scaled nothing.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
from tqdm.auto import tqdm

from moejax.weights.safetensors_io import CheckpointReader

_NP_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}
FP8_DTYPES = (ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2)
SCALE_SUFFIX = "_scale_inv"


def np_dtype(want) -> type:
    """Host dtype for a parameter declared with ``want.dtype`` (bf16 stays bf16, else float32)."""
    return _NP_DTYPES.get(str(want.dtype), np.float32)


class CheckedTensors:
    def __init__(self, directory: str, cfg):
        self.files = CheckpointReader(directory)
        self.cfg = cfg
        self._scales = {n for n in self.files if n.endswith(SCALE_SUFFIX)}
        self._used: set[str] = set()

    def names(self, progress: bool):
        """Weight names (not scales), with a progress bar."""
        names = [n for n in self.files if not n.endswith(SCALE_SUFFIX)]
        return tqdm(names, desc="Loading weights", unit="tensor", disable=not progress)

    def skip(self, name: str) -> None:
        """A tensor the model does not build (a vision tower) or shares with another (an MTP layer's
        embedding): its scale is accounted for."""
        self._used.add(name + SCALE_SUFFIX)

    def equal(self, a: str, b: str, rows: int = 4096) -> bool:
        """Whether two tensors hold the same shape and values (compared in float32, ``rows`` leading rows
        at a time: two vocabulary-sized embeddings are never both in memory)."""
        x, y = self.files.get(a), self.files.get(b)
        if x.shape != y.shape:
            return False
        if x.ndim == 0:
            return bool(np.asarray(x, np.float32) == np.asarray(y, np.float32))
        return all(np.array_equal(np.asarray(x[i:i + rows], np.float32), np.asarray(y[i:i + rows], np.float32))
                   for i in range(0, x.shape[0], rows))

    def get(self, name: str):
        """(array, block scales or None): scales exactly when the weight is float8."""
        arr = self.files.get(name)
        if arr.dtype not in FP8_DTYPES:
            return arr, None
        sname = name + SCALE_SUFFIX
        if sname not in self.files:
            raise ValueError(f"checkpoint tensor {name!r} is float8 but {sname!r} is missing")
        if self.cfg.fp8_block_size is None:
            raise ValueError(f"checkpoint tensor {name!r} is float8 but config.json has no quantization_config")
        self._used.add(sname)
        return arr, self.files.get(sname)

    def finish(self) -> None:
        unused = sorted(self._scales - self._used)
        if unused:
            raise ValueError(f"checkpoint tensor {unused[0]!r} scales a tensor that is not float8 or not present")
