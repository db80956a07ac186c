"""The safetensors format, one tensor at a time: `write` streams tensors into a file whose
header is known up front, `TensorFile` reads them back one by one.

Why not the `safetensors` package: its writers take every tensor at once (the whole
model in host memory, twice over with the converted copies), and its numpy reader has
no bfloat16. The format is small: 8 bytes (little-endian u64) of header length, a JSON
header {name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}},
padded with spaces to a multiple of 8, then the tensors' bytes, C order, little-endian.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable, Iterable, Sequence

import ml_dtypes
import numpy as np

_DTYPES = {"F32": np.dtype(np.float32), "BF16": np.dtype(ml_dtypes.bfloat16),
           "F16": np.dtype(np.float16), "F64": np.dtype(np.float64),
           "I64": np.dtype(np.int64), "I32": np.dtype(np.int32)}
_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


def dtype_name(dtype) -> str:
    """The safetensors name of a numpy dtype (F32, BF16, ...)."""
    return _NAMES[np.dtype(dtype)]


def write(path: str, tensors: Sequence[tuple[str, tuple[int, ...]]], dtype,
          make: Callable[[int], np.ndarray], metadata: dict[str, str] | None = None) -> int:
    """Writes tensors `(name, shape)` of `dtype` to `path`, tensor i's values from
    `make(i)` (called once each, in order, so only one is in memory at a time); returns
    the bytes of tensor data written."""
    dtype = np.dtype(dtype)
    header: dict = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    for name, shape in tensors:
        size = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": dtype_name(dtype), "shape": list(shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)) + encoded)
        for i, (name, shape) in enumerate(tensors):
            value = np.ascontiguousarray(make(i), dtype=dtype.newbyteorder("<"))
            if value.shape != tuple(shape):
                raise ValueError(f"{name}: made shape {value.shape}, the header says {shape}")
            f.write(value.tobytes())  # one tensor at a time: the copy is bounded by it
    return offset


class TensorFile:
    """A safetensors file's tensors, each read on demand (`read`) as numpy.

    Read with pread, not memory-mapped: the mapped pages of a file would count in the
    process's resident memory once read, on top of the copy the caller keeps."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd = os.open(path, os.O_RDONLY)
        try:
            (length,) = struct.unpack("<Q", os.pread(self._fd, 8, 0))
            header = json.loads(os.pread(self._fd, length, 8))
        except (struct.error, ValueError) as error:
            self.close()
            raise ValueError(f"{path} is not a safetensors file ({error})") from error
        self.metadata = header.pop("__metadata__", {})
        self._entries = header
        self._start = 8 + length

    def names(self) -> list[str]:
        return list(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entries[name]["shape"])

    def read(self, name: str) -> np.ndarray:
        """Tensor `name`, in memory of its own."""
        entry = self._entries[name]
        if entry["dtype"] not in _DTYPES:
            raise ValueError(f"{self.path}: {name} has dtype {entry['dtype']}; jdp reads "
                             f"{', '.join(_DTYPES)}")
        begin, end = entry["data_offsets"]
        value = np.empty(entry["shape"], _DTYPES[entry["dtype"]].newbyteorder("<"))
        view = memoryview(value.reshape(-1).view(np.uint8))
        done = 0
        while done < end - begin:  # pread may return less than asked
            read = os.preadv(self._fd, [view[done:]], self._start + begin + done)
            if read == 0:
                raise ValueError(f"{self.path} is truncated in {name}")
            done += read
        return value

    def close(self) -> None:
        os.close(self._fd)


def shard_names(count: int) -> list[str]:
    """transformers' names of the `count` shards of a model: model.safetensors alone, or
    model-00001-of-0000N.safetensors ... with an index."""
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


INDEX = "model.safetensors.index.json"


def split_into_shards(sizes: Iterable[int], max_shard_bytes: int) -> list[list[int]]:
    """Consecutive tensors (by byte size) grouped into shards of at most
    `max_shard_bytes` (a bigger tensor is a shard of its own)."""
    shards: list[list[int]] = [[]]
    total = 0
    for i, size in enumerate(sizes):
        if shards[-1] and total + size > max_shard_bytes:
            shards.append([])
            total = 0
        shards[-1].append(i)
        total += size
    return shards


def open_directory(directory: str) -> dict[str, TensorFile]:
    """Every tensor of a model directory (model.safetensors, or the shards its index
    names) -> the open file holding it."""
    index = os.path.join(directory, INDEX)
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    holders: dict[str, TensorFile] = {}
    for name in files:
        opened = TensorFile(os.path.join(directory, name))
        holders.update(dict.fromkeys(opened.names(), opened))
    return holders
