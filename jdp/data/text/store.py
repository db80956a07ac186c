"""The token store: a corpus tokenized once, on disk, memory-mapped by every reader.

A store is a directory with `tokens.bin` (one flat uint16 array, uint32 for
vocabularies over 65,536), `documents.npy` and `manifest.json`. Layout: the
tokens begin with one eos, then every document's tokens each followed by an eos:

    eos d0 ... eos d1 ... eos ... d(n-1) ... eos

so every document is both preceded and ended by an eos, and every token of every
document is some position's next-token target. `documents.npy` (int64, n + 1
entries) holds where each document starts: document i is tokens[s[i] : s[i+1] - 1]
and its eos is tokens[s[i+1] - 1]; s[0] == 1 and s[n] == the number of tokens. The
manifest records the input files (size, mtime_ns), the tokenizer's identity, the
counts (documents, tokens, UTF-8 bytes of the text) and the dtype, and is written
last. `prepare` builds a store in a temporary sibling directory and renames it in,
so a directory named by a config is either absent or complete.
"""

from __future__ import annotations

import array
import errno
import hashlib
import json
import os
import re
import secrets
import shutil
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from absl import logging

from jdp.errors import ConfigError
from jdp.runtime import leftovers

FORMAT = "jdp.text.token_store"
VERSION = 1
MANIFEST = "manifest.json"
TOKENS = "tokens.bin"
DOCUMENTS = "documents.npy"
SPLITS = ("train", "eval")
HOLDOUT_RULE = ("a document is held out iff the first 8 bytes of blake2b(its UTF-8 text), "
                "read as a little-endian integer, are below eval_fraction * 2**64")

_CORRUPT_FIX = "Fix: delete it or pass --config.data.rebuild_tokens=true"
_OTHER_INPUTS_FIX = ("Fix: pass --config.data.rebuild_tokens=true to rebuild it, or another "
                     "--config.data.token_dir")
# Documents are tokenized in batches of about this much text (the batch is the most
# text held in memory, besides the largest single document).
_BATCH_CHARS = 8 << 20
_BATCH_DOCUMENTS = 4096
_PROGRESS_EVERY_S = 5.0

Progress = Callable[[int, int], None]  # (bytes done, bytes in all) of the input files


class TokenStore:
    """An opened store (see the module docstring); use `open_store` or `prepare`.

    `tokens` is a read-only memory map, opened on first use; a pickled store carries
    only its directory and manifest and maps the file again where it is unpickled.
    """

    def __init__(self, directory: str, manifest: dict) -> None:
        self.directory = directory
        self.manifest = manifest
        self._tokens: np.memmap | None = None
        self._starts: np.ndarray | None = None

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.manifest["dtype"])

    @property
    def num_tokens(self) -> int:
        return int(self.manifest["tokens"])

    @property
    def num_documents(self) -> int:
        return int(self.manifest["documents"])

    @property
    def num_bytes(self) -> int:
        """UTF-8 bytes of the stored documents' text (eos tokens have none)."""
        return int(self.manifest["bytes"])

    @property
    def eos_id(self) -> int:
        return int(self.manifest["tokenizer"]["eos_id"])

    @property
    def vocab_size(self) -> int:
        return int(self.manifest["tokenizer"]["vocab_size"])

    @property
    def tokens(self) -> np.memmap:
        if self._tokens is None:
            self._tokens = np.memmap(os.path.join(self.directory, TOKENS), self.dtype, mode="r",
                                     shape=(self.num_tokens,))
        return self._tokens

    @property
    def document_starts(self) -> np.ndarray:
        if self._starts is None:
            self._starts = np.load(os.path.join(self.directory, DOCUMENTS), mmap_mode="r",
                                   allow_pickle=False)
        return self._starts

    def document(self, index: int) -> np.ndarray:
        """The tokens of document `index`, without its eos."""
        starts = self.document_starts
        return np.asarray(self.tokens[starts[index]:starts[index + 1] - 1])

    def __getstate__(self) -> dict[str, Any]:
        return {"directory": self.directory, "manifest": self.manifest}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["directory"], state["manifest"])

    def __repr__(self) -> str:
        return (f"TokenStore({self.directory!r}, documents={self.num_documents}, "
                f"tokens={self.num_tokens}, bytes={self.num_bytes})")


# --- Opening and validating --------------------------------------------------------------


def _corrupt(directory: str, why: str) -> ConfigError:
    return ConfigError(f"token store {directory} is corrupt ({why}). {_CORRUPT_FIX}.")


def _check_manifest(directory: str, manifest: Any) -> None:
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise _corrupt(directory, f"{MANIFEST} is not a {FORMAT} manifest")
    if manifest.get("version") != VERSION:
        raise _corrupt(directory, f"format version {manifest.get('version')!r}, this jdp reads "
                                  f"version {VERSION}")
    for key in ("documents", "tokens", "bytes"):
        if not isinstance(manifest.get(key), int) or manifest[key] < 0:
            raise _corrupt(directory, f"{MANIFEST} has no count {key!r}")
    if manifest.get("dtype") not in ("uint16", "uint32"):
        raise _corrupt(directory, f"{MANIFEST} has dtype {manifest.get('dtype')!r}")
    tokenizer = manifest.get("tokenizer")
    if not (isinstance(tokenizer, dict) and isinstance(tokenizer.get("eos_id"), int)
            and isinstance(tokenizer.get("vocab_size"), int)):
        raise _corrupt(directory, f"{MANIFEST} has no tokenizer eos_id and vocab_size")
    if not isinstance(manifest.get("files"), list):
        raise _corrupt(directory, f"{MANIFEST} lists no input files")


def open_store(directory: str) -> TokenStore:
    """The store in `directory`, after checking that its files agree with its manifest.

    A missing or unparseable manifest, an unknown format version, a tokens.bin of the
    wrong size or a documents.npy that does not match is a ConfigError "token store
    DIR is corrupt (...). Fix: ...".
    """
    directory = os.path.abspath(os.path.expanduser(directory))
    if not os.path.isdir(directory):
        raise ConfigError(f"token store {directory} does not exist. Fix: prepare it first "
                          "(jdp.data.text.store.prepare), or point --config.data.token_dir at "
                          "a prepared one.")
    try:
        with open(os.path.join(directory, MANIFEST), encoding="utf-8") as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise _corrupt(directory, f"no {MANIFEST}: it was not written completely") from None
    except (OSError, ValueError) as e:
        raise _corrupt(directory, f"{MANIFEST} unreadable: {' '.join(str(e).split())}") from e
    _check_manifest(directory, manifest)
    store = TokenStore(directory, manifest)
    tokens_path = os.path.join(directory, TOKENS)
    size = os.path.getsize(tokens_path) if os.path.isfile(tokens_path) else None
    expected = store.num_tokens * store.dtype.itemsize
    if size != expected:
        raise _corrupt(directory, f"{TOKENS} has {size} bytes, the manifest's "
                                  f"{store.num_tokens} tokens need {expected}")
    try:
        starts = store.document_starts
    except (OSError, ValueError) as e:
        raise _corrupt(directory, f"{DOCUMENTS} unreadable: {' '.join(str(e).split())}") from e
    if (starts.ndim != 1 or starts.dtype != np.int64 or len(starts) != store.num_documents + 1
            or store.num_documents < 1 or starts[0] != 1 or starts[-1] != store.num_tokens
            or np.any(np.diff(starts) < 2)):
        raise _corrupt(directory, f"{DOCUMENTS} does not hold the starts of the manifest's "
                                  f"{store.num_documents} documents in {store.num_tokens} tokens")
    if store.tokens[0] != store.eos_id or store.tokens[-1] != store.eos_id:
        raise _corrupt(directory, f"{TOKENS} does not begin and end with eos {store.eos_id}")
    return store


def open_split(directory: str) -> tuple[TokenStore, TokenStore]:
    """The (train, eval) stores of a directory made by `prepare_split`."""
    return tuple(open_store(os.path.join(directory, name)) for name in SPLITS)  # type: ignore


def wait_for_store(directory: str, timeout_s: float = 600.0, poll_s: float = 1.0) -> TokenStore:
    """The store in `directory` once another process has prepared it.

    For processes that do not prepare: polls for `directory`/manifest.json and opens
    the store. Temporary directories are never looked at; the finished directory
    appears complete in one rename, so a corrupt one raises at once rather than
    waiting. For a `prepare_split` directory, wait for DIR/train (DIR/eval appears
    with it). TimeoutError (one line) after `timeout_s`.
    """
    directory = os.path.abspath(os.path.expanduser(directory))
    wait_for_file(os.path.join(directory, MANIFEST), f"token store {directory}", timeout_s,
                  poll_s)
    return open_store(directory)


def wait_for_file(path: str, what: str, timeout_s: float, poll_s: float = 1.0) -> None:
    """Returns once `path` exists (another process writes it whole, by a rename);
    TimeoutError (one line naming `what`) after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not os.path.isfile(path):
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{what} did not appear within {timeout_s:g} s. Fix: check that "
                               "the process preparing it is running and can write there, or "
                               "allow a longer wait.")
        time.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))


# --- What a store was made from ---------------------------------------------------------


def _stat_inputs(files: Sequence[str], field: str) -> list[dict]:
    inputs = []
    for path in files:
        path = os.path.abspath(path)
        try:
            stat = os.stat(path)
        except OSError as e:
            raise ConfigError(f"config.{field}: cannot read {path} ({e.strerror}). Fix: check "
                              "the file exists and is readable.") from e
        inputs.append({"path": path, "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns})
    return inputs


def _tokenizer_key(identity: dict) -> dict:
    # The path is left out: a tokenizer file moved or copied elsewhere is the same tokenizer.
    return {key: identity.get(key) for key in ("kind", "sha256", "vocab_size", "eos_id")}


def _describe_tokenizer(identity: dict) -> str:
    sha = identity.get("sha256")
    return f"{identity.get('kind')}" + (f" sha256 {sha[:12]}" if sha else "")


def _differences(manifest: dict, wanted: dict) -> list[str]:
    """What differs between a store's manifest and the inputs wanted, in a few words."""
    differences = []
    have = {f.get("path"): f for f in manifest.get("files", []) if isinstance(f, dict)}
    want = {f["path"]: f for f in wanted["files"]}
    changed = [p for p in want if p in have and (have[p].get("bytes"), have[p].get("mtime_ns"))
               != (want[p]["bytes"], want[p]["mtime_ns"])]
    added = [p for p in want if p not in have]
    removed = [p for p in have if p not in want]
    for paths, what in ((changed, "changed"), (added, "added"), (removed, "removed")):
        if paths:
            differences.append(f"{len(paths)} file{'s' if len(paths) > 1 else ''} {what} "
                               f"(e.g. {paths[0]})")
    if _tokenizer_key(manifest.get("tokenizer", {})) != _tokenizer_key(wanted["tokenizer"]):
        differences.append(f"tokenizer differs (store: {_describe_tokenizer(manifest['tokenizer'])}"
                           f", now: {_describe_tokenizer(wanted['tokenizer'])})")
    if manifest.get("eval_fraction") != wanted["eval_fraction"]:
        differences.append(f"eval_fraction differs (store: {manifest.get('eval_fraction')}, "
                           f"now: {wanted['eval_fraction']})")
    return differences


def _open_layout(directory: str) -> list[TokenStore]:
    """[store] for a single store, [train, eval] for a split; ConfigError if corrupt."""
    if not os.path.exists(os.path.join(directory, MANIFEST)) and any(
            os.path.isdir(os.path.join(directory, name)) for name in SPLITS):
        return [open_store(os.path.join(directory, name)) for name in SPLITS]
    return [open_store(directory)]


def _all_differences(stores: list[TokenStore], wanted: dict) -> list[str]:
    differences: list[str] = []
    for store in stores:
        differences += [d for d in _differences(store.manifest, wanted) if d not in differences]
    return differences


# --- Building ---------------------------------------------------------------------------


class _Writer:
    """Appends documents to one store's tokens.bin; `finish` writes the rest, manifest last."""

    def __init__(self, directory: str, dtype: np.dtype, eos_id: int) -> None:
        os.makedirs(directory, exist_ok=True)
        self.directory = directory
        self.dtype = dtype
        self.eos = np.array([eos_id], dtype)
        # Closed by finish or abandon.
        self.file = open(os.path.join(directory, TOKENS), "wb")
        self.file.write(self.eos.tobytes())
        self.starts = array.array("q", [1])
        self.num_tokens = 1
        self.num_bytes = 0

    def add(self, documents: list[np.ndarray], num_bytes: list[int]) -> None:
        if not documents:
            return
        parts = []
        for ids, size in zip(documents, num_bytes, strict=True):
            parts += [ids.astype(self.dtype), self.eos]
            self.num_tokens += len(ids) + 1
            self.starts.append(self.num_tokens)
            self.num_bytes += size
        self.file.write(np.concatenate(parts).tobytes())

    @property
    def num_documents(self) -> int:
        return len(self.starts) - 1

    def finish(self, manifest: dict) -> None:
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        with open(os.path.join(self.directory, DOCUMENTS), "wb") as f:
            np.save(f, np.frombuffer(self.starts, np.int64), allow_pickle=False)
            f.flush()
            os.fsync(f.fileno())
        manifest = dict(manifest, dtype=self.dtype.name, documents=self.num_documents,
                        tokens=self.num_tokens, bytes=self.num_bytes)
        with open(os.path.join(self.directory, MANIFEST), "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        _fsync_directory(self.directory)

    def abandon(self) -> None:
        self.file.close()


def _fsync_directory(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _held_out(data: bytes, eval_fraction: float) -> bool:
    digest = hashlib.blake2b(data, digest_size=8).digest()
    return int.from_bytes(digest, "little") < eval_fraction * 2**64


class _Progress:
    """Calls `progress` (or logs) at most every _PROGRESS_EVERY_S seconds, and at the end."""

    def __init__(self, progress: Progress | None, total: int, directory: str) -> None:
        self.progress = progress
        self.total = total
        self.directory = directory
        self.last = time.monotonic()

    def __call__(self, done: int, final: bool = False) -> None:
        now = time.monotonic()
        if not final and now - self.last < _PROGRESS_EVERY_S:
            return
        self.last = now
        if self.progress is not None:
            self.progress(done, self.total)
        else:
            logging.info("tokenizing into %s: %.1f of %.1f MB (%.0f%%)", self.directory,
                         done / 1e6, self.total / 1e6, 100 * done / max(self.total, 1))


def _build(inputs: list[dict], tokenizer, directory: str, eval_fraction: float,
           progress: Progress | None, field: str) -> None:
    from jdp.data.text.corpus import iter_documents

    dtype = np.dtype(np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32)
    names = SPLITS if eval_fraction > 0 else ("",)
    writers = [_Writer(os.path.join(directory, name), dtype, tokenizer.eos_id) for name in names]
    report = _Progress(progress, sum(f["bytes"] for f in inputs), directory)
    done = 0
    batch: list[tuple[str, int, int]] = []  # (text, UTF-8 bytes, writer)

    def flush() -> None:
        if not batch:
            return
        encoded = tokenizer.encode_batch([text for text, _, _ in batch])
        routed: list[tuple[list, list]] = [([], []) for _ in writers]
        for ids, (_, size, which) in zip(encoded, batch, strict=True):
            ids = np.asarray(ids)
            if ids.size == 0:
                continue  # text the tokenizer drops entirely: its bytes are not counted either
            if ids.min() < 0 or ids.max() >= tokenizer.vocab_size:
                raise ValueError(f"{tokenizer!r} returned ids outside [0, {tokenizer.vocab_size})")
            routed[which][0].append(ids)
            routed[which][1].append(size)
        for writer, (documents, sizes) in zip(writers, routed, strict=True):
            writer.add(documents, sizes)
        batch.clear()

    try:
        chars = 0  # in the batch
        for entry in inputs:
            in_file = 0
            for text in iter_documents(entry["path"], field):
                data = text.encode("utf-8")
                which = int(_held_out(data, eval_fraction)) if eval_fraction > 0 else 0
                batch.append((text, len(data), which))
                chars += len(text)
                in_file += len(data)
                if chars >= _BATCH_CHARS or len(batch) >= _BATCH_DOCUMENTS:
                    flush()
                    chars = 0
                    # Text bytes approximate file bytes (.jsonl has the JSON around them).
                    report(done + min(in_file, entry["bytes"]))
            # A batch may span files (small files are tokenized together, in parallel);
            # the file is read by now, so this is when to check it did not change.
            stat = os.stat(entry["path"])
            if (stat.st_size, stat.st_mtime_ns) != (entry["bytes"], entry["mtime_ns"]):
                raise ConfigError(f"config.{field}: {entry['path']} changed while it was being "
                                  "tokenized. Fix: prepare the token store when no one is "
                                  "writing the files.")
            done += entry["bytes"]
            report(done)
        flush()
        _check_counts(writers, len(inputs), eval_fraction, field)
        manifest = {"format": FORMAT, "version": VERSION, "eval_fraction": eval_fraction,
                    "holdout_rule": HOLDOUT_RULE if eval_fraction > 0 else None,
                    "files": inputs, "tokenizer": tokenizer.identity,
                    "created_unix_s": round(time.time(), 3)}
        for writer, name in zip(writers, names, strict=True):
            writer.finish(dict(manifest, split=name or "all"))
        _fsync_directory(directory)
        report(report.total, final=True)
    except BaseException:
        for writer in writers:
            writer.abandon()
        raise


def _check_counts(writers: list[_Writer], num_files: int, eval_fraction: float,
                  field: str) -> None:
    total = sum(writer.num_documents for writer in writers)
    if total == 0:
        raise ConfigError(f"config.{field}: the {num_files} file{'s' if num_files > 1 else ''} "
                          "hold no text (every document is empty). Fix: point it at files "
                          "with text.")
    for writer, name in zip(writers, SPLITS if len(writers) > 1 else ("",), strict=True):
        if writer.num_documents == 0:
            raise ConfigError(
                f"config.data.eval_fraction={eval_fraction}: the {name} split got none of the "
                f"{total} documents (documents, whole files or .jsonl lines, are held out, not "
                "parts of them). Fix: choose an eval_fraction that leaves documents on both "
                "sides, give more documents, or give separate eval files.")


# --- Publishing --------------------------------------------------------------------------

def _sibling(directory: str, kind: str) -> str:
    return f"{directory}.{kind}-{leftovers.tag()}-{secrets.token_hex(4)}"


def _remove_stale(directory: str) -> None:
    """Removes temporary and set-aside siblings left by dead processes of this host.

    Others' (on a shared filesystem, other hosts' pids mean nothing here) are left.
    """
    parent, base = os.path.split(directory)
    leftovers.remove_dead(parent, rf"{re.escape(base)}\.(?:tmp|old)", "[0-9a-f]+")


def _publish(temporary: str, directory: str, wanted: dict, replace: bool) -> list[TokenStore]:
    """Renames the finished `temporary` onto `directory`, replacing a store there if
    `replace`; the loser of a race with another process opens the winner's store."""
    aside = None
    if replace and os.path.lexists(directory):
        try:  # Another process may have rebuilt it already.
            stores = _open_layout(directory)
            if not _all_differences(stores, wanted):
                return stores
        except ConfigError:
            pass
        aside = _sibling(directory, "old")
        try:
            os.rename(directory, aside)
        except FileNotFoundError:
            aside = None
    try:
        os.rename(temporary, directory)
    except OSError as e:
        if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
            raise
        # Another process renamed its store in first: use it if it is of the same inputs.
        stores = _open_layout(directory)
        differences = _all_differences(stores, wanted)
        if differences:
            raise ConfigError(f"token store {directory} was just prepared by another process "
                              f"from other inputs ({'; '.join(differences)}). "
                              f"{_OTHER_INPUTS_FIX}.") from e
        return stores
    finally:
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)
    _fsync_directory(os.path.dirname(directory))
    return _open_layout(directory)


def _reusable(directory: str, wanted: dict, rebuild: bool) -> list[TokenStore] | None:
    """The stores in `directory` if they are of `wanted`; None if there are none or they
    are to be rebuilt; ConfigError if they are of other inputs (or corrupt) and not."""
    if not os.path.lexists(directory):
        return None
    if not os.path.isdir(directory):
        raise ConfigError(f"token store {directory} is a file, not a directory. Fix: pass "
                          "another --config.data.token_dir.")
    if not os.listdir(directory):
        return None
    try:
        stores = _open_layout(directory)
    except ConfigError:
        if rebuild:
            return None
        raise
    differences = _all_differences(stores, wanted)
    if not differences:
        return stores
    if rebuild:
        return None
    raise ConfigError(f"token store {directory} was made from other inputs "
                      f"({'; '.join(differences)}). {_OTHER_INPUTS_FIX}.")


def open_matching(files: Sequence[str], tokenizer, directory: str, *, eval_fraction: float = 0.0,
                  field: str = "data.text_files") -> list[TokenStore] | None:
    """The stores in `directory` ([store], or [train, eval] with `eval_fraction`) if their
    manifests name `files` as they are now, `tokenizer` and `eval_fraction`; None if there
    are none or any of those differ. Reads only; a corrupt store is a ConfigError."""
    directory = os.path.abspath(os.path.expanduser(directory))
    wanted = {"files": _stat_inputs(files, field), "tokenizer": tokenizer.identity,
              "eval_fraction": float(eval_fraction)}
    try:
        return _reusable(directory, wanted, rebuild=False)
    except ConfigError:
        if os.path.isdir(directory) and os.listdir(directory):
            _open_layout(directory)  # raises if it is corrupt, not just of other inputs
        return None


def same_tokenizer(opened: TokenStore, tokenizer) -> bool:
    """Whether `opened` was made by `tokenizer` (its kind and model file's hash)."""
    return _tokenizer_key(opened.manifest["tokenizer"]) == _tokenizer_key(tokenizer.identity)


def _prepare(files: Sequence[str], tokenizer, directory: str, eval_fraction: float,
             rebuild: bool, progress: Progress | None, field: str) -> list[TokenStore]:
    directory = os.path.abspath(os.path.expanduser(directory))
    wanted = {"files": _stat_inputs(files, field), "tokenizer": tokenizer.identity,
              "eval_fraction": eval_fraction}
    stores = _reusable(directory, wanted, rebuild)
    if stores is not None:
        return stores
    os.makedirs(os.path.dirname(directory), exist_ok=True)
    _remove_stale(directory)
    temporary = _sibling(directory, "tmp")
    os.mkdir(temporary)
    try:
        _build(wanted["files"], tokenizer, temporary, eval_fraction, progress, field)
        return _publish(temporary, directory, wanted, replace=rebuild)
    finally:
        shutil.rmtree(temporary, ignore_errors=True)  # nothing left there once renamed


def prepare(files: Sequence[str], tokenizer, directory: str, *, rebuild: bool = False,
            progress: Progress | None = None, field: str = "data.text_files") -> TokenStore:
    """The store of `files` tokenized by `tokenizer` in `directory`, built if need be.

    Reuses the store already there if its manifest names the same files (path, size,
    mtime_ns) and tokenizer (kind and file hash); a store of other inputs is a
    ConfigError saying what differs, unless `rebuild`, which replaces it (and a
    corrupt one) atomically. A matching store is reused even with `rebuild`, so a
    restart with the flag still set does not redo the work.

    The store is written file by file in batches (the corpus is never held in
    memory) into a sibling `DIR.tmp-HOST-PID-RANDOM`, fsync'd, manifest last, and
    renamed onto `directory`: a kill leaves only the temporary directory, which
    nothing reads and the next `prepare` on this host removes. Processes racing to
    prepare one directory all end with the same valid store. `progress(done, total)`
    gets input bytes every few seconds (absl logging without it). `field` is the
    config field named in errors about the files.
    """
    return _prepare(files, tokenizer, directory, 0.0, rebuild, progress, field)[0]


def prepare_split(files: Sequence[str], tokenizer, directory: str, *, eval_fraction: float,
                  rebuild: bool = False, progress: Progress | None = None,
                  field: str = "data.text_files") -> tuple[TokenStore, TokenStore]:
    """`prepare` with documents held out: (train, eval) stores in DIR/train and DIR/eval.

    A document is held out by its content alone (`HOLDOUT_RULE`: a hash of its UTF-8
    text below eval_fraction), so the split does not depend on file order, paths,
    the number of processes or anything else, and identical documents always land on
    the same side. About eval_fraction of the documents (not of the tokens) are held
    out. Each store's counts are exact for its own documents. Both appear at once.
    """
    if not 0 < eval_fraction < 1:
        raise ConfigError(f"config.data.eval_fraction={eval_fraction}: must be between 0 and 1 "
                          "(exclusive). Fix: pass e.g. 0.01, or use prepare without a split.")
    train, eval_ = _prepare(files, tokenizer, directory, float(eval_fraction), rebuild, progress,
                            field)
    return train, eval_
