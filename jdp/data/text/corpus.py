"""The user's text files: which files a config names, and the documents in each.

`expand_files` turns a config value (a glob, a comma-separated list of globs, or
"stdlib") into a sorted list of files; `iter_documents` reads the documents of one
file. "stdlib" is the built-in corpus every machine has without a network: the
Python standard library's own sources (`stdlib_files`).
"""

from __future__ import annotations

import glob
import json
import os
import re
import sysconfig
from collections.abc import Iterator

from jdp.errors import ConfigError

SUFFIXES = (".txt", ".md", ".py", ".jsonl")
STDLIB = "stdlib"
# Directories of the standard library left out of the built-in corpus: installed
# packages, test suites and their data, and generated tables (codecs, pydoc topics).
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")
_STDLIB_EXCLUDED_DIRS = frozenset({
    "site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test",
    "idlelib", "lib2to3", "ensurepip", "encodings", "pydoc_data",
})


def _one_line(text: str) -> str:
    return " ".join(text.split())


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
        raise ConfigError(f"config.{field}={pattern!r}: {path} is not a text file jdp reads. "
                          f"Fix: match only {', '.join(SUFFIXES)} files (one document per "
                          ".txt/.md/.py file, one per line of a .jsonl with a \"text\" field).")


def expand_files(pattern: str, field: str) -> list[str]:
    """The files of `pattern`: a glob (`**` matches directories recursively), a
    comma-separated list of globs, or "stdlib" in place of a glob; sorted, without
    duplicates. Directories a glob matches are skipped; any other file that is not
    .txt, .md, .py or .jsonl, or a glob that matches nothing, is a ConfigError."""
    found: set[str] = set()
    parts = [part.strip() for part in str(pattern).split(",") if part.strip()]
    if not parts:
        raise ConfigError(f"config.{field}={pattern!r}: no files given. Fix: pass a glob such "
                          f"as 'data/**/*.txt', a comma-separated list of globs, or '{STDLIB}'.")
    for part in parts:
        if part == STDLIB:
            found.update(stdlib_files())
            continue
        expanded = os.path.expanduser(part)
        if os.path.isdir(expanded):
            raise ConfigError(f"config.{field}={pattern!r}: {part} is a directory. Fix: name its "
                              f"files, e.g. '{os.path.join(part, '**', '*.txt')}'.")
        matches = [path for path in glob.glob(expanded, recursive=True) if os.path.isfile(path)]
        if not matches:
            raise ConfigError(f"config.{field}={pattern!r}: no file matches {part!r}. Fix: check "
                              "the path (globs are relative to the working directory, "
                              f"{os.getcwd()}), or use '{STDLIB}' for the built-in corpus.")
        for path in matches:
            _check_suffix(path, field, pattern)
        found.update(os.path.abspath(path) for path in matches)
    return sorted(found)


def iter_documents(path: str, field: str = "data.text_files") -> Iterator[str]:
    """The non-empty documents of one file, as text.

    A .txt, .md or .py file is one document, exactly as written (line ends are not
    translated); a .jsonl file is one document per line, its "text" field (blank
    lines are skipped). Bytes that are not UTF-8 become U+FFFD, so every document
    has an exact UTF-8 form (its byte count is len(document.encode())).
    """
    if not path.lower().endswith(".jsonl"):
        with open(path, encoding="utf-8", errors="replace", newline="") as f:
            text = f.read()
        if text:
            yield text
        return
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            line = raw.decode("utf-8", "replace")
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"config.{field}: {path}:{number} is not JSON ({e.msg}). "
                                  "Fix: write one JSON object per line, e.g. "
                                  "{\"text\": \"...\"}.") from e
            text = record.get("text") if isinstance(record, dict) else None
            if not isinstance(text, str):
                found = (f"keys {sorted(record)[:5]}" if isinstance(record, dict)
                         else f"a {type(record).__name__}")
                raise ConfigError(_one_line(
                    f"config.{field}: {path}:{number} has no string \"text\" field (found "
                    f"{found}). Fix: write one JSON object per line with the document in "
                    "\"text\"."))
            if text:
                # JSON can escape lone surrogates, which have no UTF-8 form: U+FFFD, as above.
                yield _LONE_SURROGATE.sub("\ufffd", text)
