"""Paths enter jdp here: every local path a config names is made absolute once, at the edge,
so nothing below sees a relative path (Orbax, for one, refuses them) and a run behaves the
same whatever directory it was started from. Bucket URLs (`gs://`) pass through unchanged.

Three shapes of value hold paths: a plain path (`checkpoint.init_from`), a comma-separated
list of paths or globs (`data.text_files`), and a spec `KIND:PATH` whose kind names a file
(`data.tokenizer=sentencepiece:m.model`, `checkpoint.init_from=hf:DIR`). Words that are not
paths (`stdlib`, `bytes`, `bpe:2048`, `none`) are left as they are.
"""

from __future__ import annotations

import os

# KIND:PATH specs whose PATH is a local file or directory (or a bucket URL).
PATH_KINDS = ("sentencepiece", "hf", "hf_dir", "hf_disk")
# Values of path keys that name no file.
WORDS = frozenset({"", "stdlib", "none", "bytes"})

# Keys of jdp's own config that hold paths, by the shape of their value.
PLAIN = ("data.data_dir", "data.token_dir", "compile_cache_dir", "tune")
LISTS = ("data.train_files", "data.eval_files", "data.text_files", "data.eval_text_files")
SPECS = ("data.tokenizer", "checkpoint.init_from")


def absolute(path: str | os.PathLike) -> str:
    """A local path made absolute (`~` expanded); a bucket URL or a word as it is."""
    path = os.fspath(path)
    if path in WORDS or "://" in path:
        return path
    return os.path.abspath(os.path.expanduser(path))


def absolute_spec(value: str) -> str:
    """`KIND:PATH` with PATH made absolute where KIND names a file; else `absolute(value)`
    for a plain path, or the value itself for a word such as `bpe:2048`."""
    kind, colon, rest = value.partition(":")
    if colon and kind in PATH_KINDS:
        return f"{kind}:{absolute(rest)}"
    if colon and not rest.startswith("//"):  # e.g. bpe:2048
        return value
    return absolute(value)


def absolute_list(value: str) -> str:
    """Each comma-separated entry made absolute (globs stay globs)."""
    parts = [part.strip() for part in str(value).split(",")]
    return ",".join(absolute_spec(part) if part else part for part in parts)


def make_absolute(config) -> None:
    """Makes the local paths of jdp's own path keys absolute, in place (keys the config
    does not have are skipped). Idempotent."""
    for keys, convert in ((PLAIN, absolute), (LISTS, absolute_list), (SPECS, absolute_spec)):
        for key in keys:
            section, _, name = key.rpartition(".")
            holder = config[section] if section else config
            if section and section not in config or name not in holder:
                continue
            value = holder[name]
            if isinstance(value, str) and value:
                holder[name] = convert(value)
