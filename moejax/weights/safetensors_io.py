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

from moejax.json_file import load_json_file

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
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ValueError(f"safetensors file {path} is corrupt: {size} bytes, too short for a header")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise ValueError(f"safetensors file {path} is corrupt: its header length {n} exceeds the file "
                                 f"({size} bytes; truncated?)")
            try:
                header = json.loads(f.read(n))
            except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
                raise ValueError(f"safetensors file {path} is corrupt: its header is not valid JSON ({e})") from None
        if not isinstance(header, dict):
            raise ValueError(f"safetensors file {path} is corrupt: its header is not a JSON object")
        header.pop("__metadata__", None)
        data = size - 8 - n
        for name, info in header.items():
            try:
                b, e = info["data_offsets"]
                ok = 0 <= b <= e <= data and isinstance(info["shape"], list) and isinstance(info["dtype"], str)
            except (KeyError, TypeError, ValueError):
                ok = False
            if not ok:
                raise ValueError(f"safetensors file {path} is corrupt: tensor {name!r} has a bad header entry "
                                 f"or lies past the end of the file ({size} bytes)")
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
        try:
            return raw.view(_DTYPES[info["dtype"]]).reshape(info["shape"])
        except ValueError:
            raise ValueError(f"safetensors file {self.path} is corrupt: tensor {name!r} has {e - b} bytes, "
                             f"not those of shape {info['shape']} {info['dtype']}") from None


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
        index_json = load_json_file(index, "checkpoint index")
        weight_map = index_json.get("weight_map") if isinstance(index_json, dict) else None
        if not isinstance(weight_map, dict):
            raise ValueError(f"checkpoint index {index} is corrupt: no 'weight_map' object")
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
