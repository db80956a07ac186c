"""The user's text: which files a config names, in which order, and the documents in each.

`expand_files` turns a config value (a glob, a comma-separated list of globs,
"stdlib", or "hf_disk:DIR[:split]") into the ordered list of files of one corpus;
`iter_documents` reads the documents of one file (`formats` knows each kind);
`check_files` opens each cheaply, so that bad input is named before anything is
written. "stdlib" is the built-in corpus every machine has without a network: the
Python standard library's own sources (`stdlib_files`). "hf_disk:DIR[:split]" is a
Hugging Face dataset saved with `save_to_disk` (a `Dataset`, or one split of a
`DatasetDict`): the Arrow files its state.json lists, read with pyarrow alone.

The document order (`DOCUMENT_ORDER`, recorded in each token store's manifest) is a
function of the file names alone, so the packed stream over the store is the same
whatever the formats, the globs' order or the machine.
"""

from __future__ import annotations

import json
import os
import sysconfig
from collections.abc import Iterator

from jdp.data.text import formats
from jdp.errors import ConfigError
from jdp.runtime import storage

SUFFIXES = formats.SUFFIXES
STDLIB = "stdlib"
HF_DISK = "hf_disk:"
DOCUMENT_ORDER = ("files in the order of their paths (sorted as strings, a saved dataset's "
                  "Arrow files in the dataset's own order at its directory's place); within "
                  "a file, its documents in order (a .txt/.md/.py file is one, a .jsonl one "
                  "per line, Parquet and Arrow one per row); empty texts are no documents")
# Directories of the standard library left out of the built-in corpus: installed
# packages, test suites and their data, and generated tables (codecs, pydoc topics).
_STDLIB_EXCLUDED_DIRS = frozenset({
    "site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test",
    "idlelib", "lib2to3", "ensurepip", "encodings", "pydoc_data",
})


def stdlib_files() -> list[str]:
    """The `.py` files of the running interpreter's standard library, sorted, without
    site-packages, test suites (test/, tests/, test_*.py), idlelib, lib2to3 and
    generated tables. About 8 MB on CPython 3.11."""
    root = sysconfig.get_paths()["stdlib"]
    found = []
    for directory, subdirectories, names in os.walk(root):
        subdirectories[:] = [d for d in subdirectories if d not in _STDLIB_EXCLUDED_DIRS
                             and not d.startswith(("config-", "test_"))]
        found.extend(os.path.join(directory, name) for name in names
                     if name.endswith(".py") and not name.startswith("test_"))
    return sorted(found)


def _check_suffix(path: str, field: str, pattern: str) -> None:
    if not path.lower().endswith(SUFFIXES):
        raise ConfigError(
            f"config.{field}={pattern!r}: {path} is not a text file jdp reads. Fix: match only "
            ".txt, .md, .py, .jsonl (also .gz or .zst compressed), .parquet or .arrow files, or "
            "name a saved Hugging Face dataset as hf_disk:DIR[:split].")


def _saved_dataset(spec: str, field: str, pattern: str) -> tuple[str, list[str]]:
    """(directory, Arrow files in the dataset's order) of "hf_disk:DIR[:split]"."""
    rest = os.path.expanduser(spec[len(HF_DISK):])
    directory, split = rest, None
    if not os.path.isdir(rest) and ":" in rest:
        directory, split = rest.rsplit(":", 1)
    directory = os.path.abspath(directory)
    where = f"config.{field}={pattern!r}: {spec}"
    fix = ("Fix: name a directory written by datasets' save_to_disk (it holds state.json, or "
           "dataset_dict.json and a directory per split)")
    dictionary = os.path.join(directory, "dataset_dict.json")
    if os.path.isfile(dictionary):
        try:
            with open(dictionary, encoding="utf-8") as f:
                splits = list(json.load(f)["splits"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"{where}: unreadable {dictionary} ({type(e).__name__}). {fix}.") \
                from e
        if split is None and len(splits) == 1:
            split = splits[0]
        if split not in splits:
            raise ConfigError(
                f"{where}: {'no split given' if split is None else f'no split {split!r}'}; the "
                f"saved DatasetDict has splits {splits}. Fix: name one, e.g. "
                f"'{HF_DISK}{directory}:{splits[0] if splits else 'train'}'.")
        directory = os.path.join(directory, split)
    elif split is not None and os.path.isdir(directory):
        raise ConfigError(f"{where}: {directory} is not a saved DatasetDict (no "
                          "dataset_dict.json), so it has no splits. Fix: leave out ':" + split
                          + "'.")
    state = os.path.join(directory, "state.json")
    try:
        with open(state, encoding="utf-8") as f:
            names = [entry["filename"] for entry in json.load(f)["_data_files"]]
    except FileNotFoundError:
        what = "does not exist" if not os.path.isdir(directory) else "has no state.json"
        raise ConfigError(f"{where}: {directory} {what}, so it is not a dataset saved with "
                          f"save_to_disk. {fix}.") from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{where}: {state} does not list the dataset's Arrow files "
                          f"({type(e).__name__}: {e}). {fix}.") from e
    files = [os.path.join(directory, name) for name in names]
    missing = [path for path in files if not os.path.isfile(path)]
    if missing or not files:
        raise ConfigError(f"{where}: {missing[0] + ' is missing' if missing else 'no Arrow files'}"
                          f" (listed in {state}). {fix}.")
    return directory, files


def expand_files(pattern: str, field: str) -> list[str]:
    """The files of `pattern`, in the corpus's document order (`DOCUMENT_ORDER`): a glob
    (`**` matches directories recursively; gs:// globs too), "stdlib", or
    "hf_disk:DIR[:split]", or a comma-separated list of those; each file once.
    Directories a glob matches are skipped; any other file that is not of a kind jdp
    reads (`formats.SUFFIXES`), or a glob that matches nothing, is a ConfigError."""
    runs: dict[str, list[str]] = {}  # sort key -> files, in order
    parts = [part.strip() for part in str(pattern).split(",") if part.strip()]
    if not parts:
        raise ConfigError(f"config.{field}={pattern!r}: no files given. Fix: pass a glob such "
                          f"as 'data/**/*.txt', a comma-separated list of globs, or '{STDLIB}'.")
    for part in parts:
        if part == STDLIB:
            runs.update((path, [path]) for path in stdlib_files())
            continue
        if part.startswith(HF_DISK):
            directory, files = _saved_dataset(part, field, pattern)
            runs[directory] = files
            continue
        storage.check_supported(part, f"config.{field}")
        expanded = os.path.expanduser(part)
        if not storage.is_bucket(part) and os.path.isdir(expanded):
            raise ConfigError(f"config.{field}={pattern!r}: {part} is a directory. Fix: name its "
                              f"files, e.g. '{os.path.join(part, '**', '*.txt')}'.")
        matches = storage.glob(part)
        if not matches:
            raise ConfigError(f"config.{field}={pattern!r}: no file matches {part!r}. Fix: check "
                              "the path (globs are relative to the working directory, "
                              f"{os.getcwd()}), or use '{STDLIB}' for the built-in corpus.")
        for path in matches:
            _check_suffix(path, field, pattern)
        runs.update((path, [path]) for path in map(storage.absolute, matches))
    seen: set[str] = set()
    ordered = []
    for key in sorted(runs):
        for path in runs[key]:
            if path not in seen:
                seen.add(path)
                ordered.append(path)
    return ordered


def check_files(files: list[str], text_field: str = "text",
                field: str = "data.text_files") -> None:
    """Each file opened as cheaply as its kind allows (`formats.check`): one that cannot be
    read as its name says, or that lacks `text_field`, is a one-line ConfigError."""
    for path in files:
        formats.check(path, text_field, field)


def iter_documents(path: str, field: str = "data.text_files",
                   text_field: str = "text") -> Iterator[str]:
    """The non-empty documents of one file, as text (see `formats` for each kind).

    A .txt, .md or .py file is one document, exactly as written (line ends are not
    translated); a .jsonl file is one document per line, its `text_field` (blank lines
    are skipped); Parquet and Arrow files one per row of the `text_field` column.
    Bytes that are not UTF-8 become U+FFFD, so every document has an exact UTF-8 form
    (its byte count is len(document.encode())).
    """
    return formats.documents(path, text_field=text_field, field=field)
