"""Minimal safetensors reader/writer on NumPy memory maps.

The ``safetensors`` NumPy backend cannot return bfloat16 or float8 tensors
(NumPy has neither); DeepSeek-V3 checkpoints are float8 e4m3 with bfloat16
scales, so we read the (simple, documented) format ourselves with ml_dtypes.
"""

from __future__ import annotations

import json
import os
import struct

import ml_dtypes
import numpy as np

_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}
_NAMES = {np.dtype(v): k for k, v in _DTYPES.items()}


class SafetensorsFile:
    """Lazy, zero-copy access to the tensors of one .safetensors file."""

    def __init__(self, path: str):
        self.path = path
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        header.pop("__metadata__", None)
        self._header = header
        self._data_start = 8 + n
        self._mmap = None

    def keys(self):
        return list(self._header)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._header[name]["shape"])

    def get(self, name: str) -> np.ndarray:
        info = self._header[name]
        if info["dtype"] not in _DTYPES:
            raise ValueError(f"{self.path}: tensor {name!r} has unsupported dtype {info['dtype']}")
        if self._mmap is None:
            self._mmap = np.memmap(self.path, dtype=np.uint8, mode="r")
        b, e = info["data_offsets"]
        raw = self._mmap[self._data_start + b:self._data_start + e]
        return raw.view(_DTYPES[info["dtype"]]).reshape(info["shape"])


def save_safetensors(tensors: dict[str, np.ndarray], path: str, metadata: dict[str, str] | None = None):
    header, offset = {}, 0
    arrays = []
    for name, arr in tensors.items():
        arr = np.ascontiguousarray(arr)
        if arr.dtype not in _NAMES:
            raise ValueError(f"tensor {name!r}: dtype {arr.dtype} cannot be stored in safetensors")
        header[name] = {"dtype": _NAMES[arr.dtype], "shape": list(arr.shape),
                        "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
        arrays.append(arr)
    if metadata:
        header["__metadata__"] = metadata
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # align the data section
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for arr in arrays:
            f.write(arr.tobytes())


def list_checkpoint_files(directory: str) -> dict[str, str]:
    """tensor name -> file, from model.safetensors.index.json or the .safetensors files present."""
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        missing = sorted({f for f in weight_map.values() if not os.path.exists(os.path.join(directory, f))})
        if missing:
            raise ValueError(f"{index} names shard file(s) that do not exist: {missing}")
        return {k: os.path.join(directory, v) for k, v in weight_map.items()}
    files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
    if not files:
        raise ValueError(f"no .safetensors files in {directory}")
    out = {}
    for fn in files:
        path = os.path.join(directory, fn)
        for k in SafetensorsFile(path).keys():
            out[k] = path
    return out


class CheckpointReader:
    """All tensors of an HF checkpoint directory (sharded or not), opened lazily by name."""

    def __init__(self, directory: str):
        self.files = list_checkpoint_files(directory)
        self._opened: dict[str, SafetensorsFile] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def __iter__(self):
        return iter(self.files)

    def get(self, name: str) -> np.ndarray:
        path = self.files[name]
        if path not in self._opened:
            self._opened[path] = SafetensorsFile(path)
        return self._opened[path].get(name)
