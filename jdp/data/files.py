"""Random-access sources over a user's own files, so training needs no TFDS builder.

`open_files` turns a config glob into an `NpzSource` (`.npz` archives, one array per
feature) or an `ArrayRecordSource` (one msgpack-encoded dict of arrays per record, as
`write_array_records` writes them). Both are sources: `len(source)` examples, and
`source[i]` is a dict of feature name to numpy array or scalar, by global index `i`.
"""

from __future__ import annotations

import bisect
import dataclasses
import io
import itertools
import operator
import os
import zipfile
import zlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, SupportsIndex

import numpy as np
from array_record.python import array_record_data_source, array_record_module
from flax import serialization

from jdp.errors import ConfigError, first_line
from jdp.runtime import storage

Example = dict[str, np.ndarray]

NPZ_SUFFIX = ".npz"
ARRAY_RECORD_SUFFIXES = (".array_record", ".arrayrecord")
TFDS_SHARD_MARK = ".array_record-"  # TFDS names shards e.g. mnist-train.array_record-00000-of-00001

# group_size:1 puts every record in its own chunk, so reading record i decodes only record i.
_WRITER_OPTIONS = "group_size:1"
# No readahead: training reads records in shuffled order, so prefetched bytes are wasted.
_READER_OPTIONS = "readahead_buffer_size:0"
# msgpack/flax cannot round-trip these dtype kinds (object, str, bytes, void).
_UNSUPPORTED_DTYPE_KINDS = "OSUV"
_NPZ_FIX = "write each file with np.savez(path, image=images, label=labels), numeric arrays only."
_ARRAY_RECORD_FIX = "write the files with jdp.data.files.write_array_records(path, examples)."


class _FilesError(ValueError):
    """What is wrong with the files and how to fix it; `open_files` prefixes the config field."""

    def __init__(self, found: str, fix: str):
        super().__init__(f"{found}. Fix: {fix}")
        self.found = found
        self.fix = fix


def _some(items: Sequence[str], limit: int = 3) -> str:
    """The first few items, so a message about 1,000 shards stays one readable line."""
    shown = ", ".join(items[:limit])
    return shown if len(items) <= limit else f"{shown} and {len(items) - limit} more"


def _checked_index(index: SupportsIndex, length: int) -> int:
    i = operator.index(index)
    if not 0 <= i < length:
        raise IndexError(f"index {i} is out of range for a source of {length} examples "
                         f"(valid: 0 to {length - 1})")
    return i


def _check_same_features(paths: Sequence[str], names: Sequence[tuple[str, ...]]) -> None:
    for path, file_names in zip(paths[1:], names[1:], strict=True):
        if set(file_names) != set(names[0]):
            raise _FilesError(f"{path} has features {sorted(file_names)} but {paths[0]} has "
                              f"{sorted(names[0])}", "give every file the same feature names.")


def _load_npz(path: str) -> dict[str, np.ndarray]:
    """All arrays of one archive; npz members cannot be memory-mapped, so they are read once."""
    try:
        if storage.is_bucket(path):  # read whole: npz members are read once anyway
            with storage.open_file(path, "rb") as f:
                path_or_bytes = io.BytesIO(f.read())
        else:
            path_or_bytes = path
        loaded = np.load(path_or_bytes, allow_pickle=False)
        if not isinstance(loaded, np.lib.npyio.NpzFile):
            raise ValueError(f"it holds a single {type(loaded).__name__}, not an npz archive")
        with loaded:
            arrays = {name: loaded[name] for name in loaded.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as e:
        raise _FilesError(f"cannot read {path}: {first_line(e)}", _NPZ_FIX) from e
    if not arrays:
        raise _FilesError(f"{path} holds no arrays", _NPZ_FIX)
    scalars = [name for name, array in arrays.items() if array.ndim == 0]
    if scalars:
        raise _FilesError(f"{path}: scalar arrays ({_some(scalars)}) have no first dimension "
                          "to index examples",
                          "store one row per example (shape [num_examples, ...]).")
    lengths = {name: len(array) for name, array in arrays.items()}
    if len(set(lengths.values())) > 1:
        found = ", ".join(f"{name} has {n}" for name, n in lengths.items())
        raise _FilesError(f"{path}: arrays differ in their first dimension: {found}",
                          "save arrays with one row per example, all of the same length.")
    return arrays


class _FileSource:
    """What both file sources share: the list of files, whose examples follow each other
    in the order given, and their feature names."""

    kind = ""
    feature_names: tuple[str, ...] = ()

    def __init__(self, paths: Sequence[str]):
        if not paths:
            raise _FilesError(f"no {self.kind} files given", "pass at least one path.")
        self.paths = list(paths)

    def __len__(self) -> int:
        raise NotImplementedError

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({len(self.paths)} files, {len(self)} examples, "
                f"features={list(self.feature_names)})")


class NpzSource(_FileSource):
    """Examples from `.npz` archives: each array is a feature whose first axis indexes examples."""

    kind = ".npz"

    def __init__(self, paths: Sequence[str]):
        super().__init__(paths)
        self._files = [_load_npz(path) for path in self.paths]
        _check_same_features(self.paths, [tuple(f) for f in self._files])
        self.feature_names = tuple(self._files[0])
        # _ends[k] = examples in files 0..k; a global index maps to a file by bisection.
        self._ends = list(itertools.accumulate(len(next(iter(f.values()))) for f in self._files))

    def __len__(self) -> int:
        return self._ends[-1]

    def __getitem__(self, index: SupportsIndex) -> Example:
        i = _checked_index(index, len(self))
        file = bisect.bisect_right(self._ends, i)
        row = i - (self._ends[file - 1] if file else 0)
        # Copies, so a caller's in-place preprocessing cannot change the dataset.
        return {name: array[row].copy() for name, array in self._files[file].items()}


@dataclasses.dataclass(frozen=True)
class _WholeFile:
    """A FileInstruction for ArrayRecordDataSource: with the count known it need not reopen."""

    filename: str
    take: int
    skip: int = 0

    @property
    def examples_in_shard(self) -> int:
        return self.take


def _decode(record: bytes) -> Example:
    example = serialization.msgpack_restore(record)
    if not isinstance(example, dict) or not all(isinstance(k, str) for k in example):
        raise ValueError(f"the record decodes to a {type(example).__name__}, not a dict of "
                         "feature name to array")
    # Restored arrays are read-only views of the record; copies let callers modify them.
    return {name: np.array(value) if isinstance(value, np.ndarray) else value
            for name, value in example.items()}


def _inspect_array_record(path: str) -> tuple[int, tuple[str, ...] | None]:
    """The file's record count and the feature names of its first record (None if empty)."""
    try:
        reader = array_record_module.ArrayRecordReader(path, _READER_OPTIONS)
        try:
            num_records = reader.num_records()
            first = reader.read([0])[0] if num_records else None
        finally:
            reader.close()
    except (OSError, RuntimeError, ValueError) as e:
        raise _FilesError(f"cannot read {path}: {first_line(e)}", _ARRAY_RECORD_FIX) from e
    if first is None:
        return 0, None
    try:
        return num_records, tuple(_decode(first))
    except (ValueError, TypeError) as e:
        # e.g. TFDS shards, whose records are tf.train.Example protos.
        raise _FilesError(f"{path}: record 0 is not a msgpack-encoded dict of arrays "
                          f"({first_line(e)})", _ARRAY_RECORD_FIX) from e


class ArrayRecordSource(_FileSource):
    """Examples from ArrayRecord files whose records `write_array_records` wrote."""

    kind = "ArrayRecord"

    def __init__(self, paths: Sequence[str]):
        # array_record reads local files only: bucket files are read from a local copy.
        super().__init__([storage.local_copy(p) if storage.is_bucket(p) else p for p in paths])
        counts, names = {}, {}
        for path in self.paths:
            counts[path], names[path] = _inspect_array_record(path)
        non_empty = [path for path in self.paths if names[path] is not None]
        _check_same_features(non_empty, [names[path] for path in non_empty])
        self.feature_names = names[non_empty[0]] if non_empty else ()
        self._num_examples = sum(counts.values())
        self._records = array_record_data_source.ArrayRecordDataSource(
            [_WholeFile(path, counts[path]) for path in self.paths])

    def __len__(self) -> int:
        return self._num_examples

    def __getitem__(self, index: SupportsIndex) -> Example:
        return _decode(self._records[_checked_index(index, len(self))])


def _as_arrays(example: Mapping[str, Any], index: int) -> dict[str, np.ndarray | np.generic]:
    arrays = {}
    for name, value in example.items():
        if not isinstance(name, str):
            raise TypeError(f"example {index}: feature name {name!r} is a "
                            f"{type(name).__name__}; feature names must be strings")
        # numpy scalars stay scalars (they round-trip); Python values become 0-d or n-d arrays.
        array = value if isinstance(value, np.ndarray | np.generic) else np.asarray(value)
        if array.dtype.kind in _UNSUPPORTED_DTYPE_KINDS:
            raise TypeError(f"example {index}, feature {name!r}: dtype {array.dtype} cannot be "
                            "stored; encode text or bytes as uint8 arrays, e.g. "
                            "np.frombuffer(data, np.uint8)")
        arrays[name] = array
    return arrays


def write_array_records(path: str, examples: Iterable[Mapping[str, Any]]) -> int:
    """Writes `examples` to one ArrayRecord file that `ArrayRecordSource` reads; returns the count.

    Each example is a dict of feature name to numpy array or scalar; every example must have
    the same feature names. Name the file `*.array_record` so `open_files` recognises it.
    """
    writer = array_record_module.ArrayRecordWriter(path, _WRITER_OPTIONS)
    if not writer.ok():
        reason = "the writer did not open"
        try:
            writer.close()  # raises with the reason the open failed
        except RuntimeError as e:
            reason = first_line(e)
        raise OSError(f"cannot write ArrayRecord file {path}: {reason}")
    count = 0
    feature_names: set[str] | None = None
    try:
        for example in examples:
            arrays = _as_arrays(example, count)
            if feature_names is None:
                feature_names = set(arrays)
            elif set(arrays) != feature_names:
                raise ValueError(f"example {count} has features {sorted(arrays)} but example 0 "
                                 f"has {sorted(feature_names)}; give every example the same "
                                 "features")
            writer.write(serialization.msgpack_serialize(arrays))
            count += 1
    finally:
        writer.close()
    return count


def _kind(path: str) -> str | None:
    name = os.path.basename(path)
    if name.endswith(NPZ_SUFFIX):
        return "npz"
    if name.endswith(ARRAY_RECORD_SUFFIXES) or TFDS_SHARD_MARK in name:
        return "array_record"
    return None


def _expand(pattern: str) -> list[str]:
    """Files matching a glob or a comma-separated list of globs (gs:// ones too), sorted,
    each once."""
    globs = [part.strip() for part in pattern.split(",") if part.strip()]
    return sorted({path for g in globs for path in storage.glob(g)})


def open_files(pattern: str, *, field: str) -> NpzSource | ArrayRecordSource:
    """The source over the files `pattern` matches (a glob, or comma-separated globs).

    Files are read in sorted order, as one source chosen by their extension. Every problem
    raises `ConfigError` naming `field` (e.g. "config.data.train_files"), the pattern and the fix.
    """
    prefix = f"{field}={pattern!r}"
    for part in pattern.split(","):
        storage.check_supported(part.strip(), field)
    storage.configure()
    paths = _expand(pattern)
    if not paths:
        raise ConfigError(f"{prefix}: no file matches. Fix: pass a glob that matches .npz or "
                          f".array_record files, e.g. --{field}=/data/train-*.npz.")
    kinds = {path: _kind(path) for path in paths}
    unknown = [path for path, kind in kinds.items() if kind is None]
    if unknown:
        raise ConfigError(
            f"{prefix}: matches {_some(unknown)}, which {'is' if len(unknown) == 1 else 'are'} "
            f"neither .npz nor ArrayRecord ({', '.join(ARRAY_RECORD_SUFFIXES)}, or TFDS "
            f"'*{TFDS_SHARD_MARK}NNNNN-of-NNNNN' shards). Fix: narrow the glob to your data files, "
            "or convert them with np.savez or jdp.data.files.write_array_records.")
    by_kind = {kind: [p for p in paths if kinds[p] == kind] for kind in set(kinds.values())}
    if len(by_kind) > 1:
        raise ConfigError(
            f"{prefix}: matches both .npz files ({_some(by_kind['npz'])}) and ArrayRecord files "
            f"({_some(by_kind['array_record'])}). Fix: match only one kind, e.g. "
            f"--{field}=/data/train-*.npz.")
    try:
        source = NpzSource(paths) if "npz" in by_kind else ArrayRecordSource(paths)
    except _FilesError as e:
        raise ConfigError(f"{prefix}: {e.found}. Fix: {e.fix}") from e
    if not len(source):
        raise ConfigError(f"{prefix}: the matching files ({_some(paths)}) hold no examples. "
                          "Fix: point the glob at files that contain data.")
    return source
