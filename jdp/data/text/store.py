"""The token store: a corpus tokenized once, on disk, memory-mapped by every reader.

A store is a directory with `tokens.bin` (one flat uint16 array, uint32 for
vocabularies over 65,536), `documents.npy` and `manifest.json`. Layout: the
tokens begin with one eos, then every document's tokens each followed by an eos:

    eos d0 ... eos d1 ... eos ... d(n-1) ... eos

so every document is both preceded and ended by an eos, and every token of every
document is some position's next-token target. `documents.npy` (int64, n + 1
entries) holds where each document starts: document i is tokens[s[i] : s[i+1] - 1]
and its eos is tokens[s[i+1] - 1]; s[0] == 1 and s[n] == the number of tokens. The
manifest records the input files (size, mtime_ns) in document order and the rule of
that order, the tokenizer's identity, the text field, the counts (documents, tokens,
UTF-8 bytes of the text) and the dtype, and is written last.

`prepare` tokenizes the files in shards (`shards`: on every core given, resumable,
shared between hosts), concatenates them in a temporary sibling directory and
renames it in, so a directory named by a config is either absent or complete.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
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

from jdp.data.text import corpus, formats, shards
from jdp.errors import ConfigError
from jdp.runtime import leftovers, storage

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
WORK = "shards"  # DIR.shards: the shards of a build of DIR, kept until it is published
WAIT_FOR_STORE_S = 3600.0  # how long a process that does not merge waits for the store

Progress = Callable[[shards.Progress], None]


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
        path = storage.absolute(path)
        try:
            size, mtime_ns = storage.stat(path)
        except OSError as e:
            raise ConfigError(f"config.{field}: cannot read {path} "
                              f"({e.strerror or type(e).__name__}). Fix: check the file "
                              "exists and is readable.") from e
        inputs.append({"path": path, "bytes": size, "mtime_ns": mtime_ns})
    return inputs


def _text_field_used(files: Sequence[str], text_field: str) -> str | None:
    """The text field, where some file reads documents from a field (None: it matters not)."""
    return text_field if any(formats.reads_field(path) for path in files) else None


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
    paths = [f.get("path", "") for f in manifest.get("files", []) if isinstance(f, dict)]
    # Stores made before data.text_field existed read the "text" field.
    have_field = manifest.get("text_field", _text_field_used(paths, "text"))
    if have_field != wanted["text_field"]:
        differences.append(f"text_field differs (store: {have_field!r}, now: "
                           f"{wanted['text_field']!r})")
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


def _work_dir(directory: str, wanted: dict, planned: list) -> str:
    """DIR.shards holding the plan of this build: the one a killed build of the same
    inputs left (its finished shards are kept), else a new one."""
    work = f"{directory}.{WORK}"
    expected = {"format": f"{FORMAT}.shards", "version": VERSION, "wanted": wanted,
                "shards": planned}
    if _read_plan(work) == expected:
        leftovers.remove_dead(work, r"shard-\d+\.tmp", "[0-9a-f]+")
        return work
    if os.path.lexists(work):  # another build's: its shards are not of these inputs
        aside = _sibling(directory, "old")
        with contextlib.suppress(FileNotFoundError):
            os.rename(work, aside)
        shutil.rmtree(aside, ignore_errors=True)
    temporary = _sibling(directory, "tmp")
    os.mkdir(temporary)
    with open(os.path.join(temporary, shards.PLAN), "w", encoding="utf-8") as f:
        json.dump(expected, f)
        f.flush()
        os.fsync(f.fileno())
    try:
        os.rename(temporary, work)
    except OSError as e:  # another process made it first
        shutil.rmtree(temporary, ignore_errors=True)
        if e.errno not in (errno.EEXIST, errno.ENOTEMPTY) or _read_plan(work) != expected:
            raise
    return work


def _read_plan(work: str) -> Any:
    try:
        with open(os.path.join(work, shards.PLAN), encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _merge(job: shards.Job, temporary: str, manifest: dict) -> None:
    """Concatenates the shards into the finished store(s) in `temporary`, manifest last."""
    names = SPLITS if len(job.outputs) > 1 else ("",)
    parts = [[shards.read_shard(job.directory, k, output) for k in range(len(job.shards))]
             for output in job.outputs]
    _check_counts([sum(counts["documents"] for counts, _, _ in part) for part in parts],
                  len(job.files), job.eval_fraction, job.field)
    dtype = np.dtype(job.dtype)
    for name, part in zip(names, parts, strict=True):
        target = os.path.join(temporary, name)
        os.makedirs(target, exist_ok=True)
        num_documents = sum(counts["documents"] for counts, _, _ in part)
        with open(os.path.join(target, TOKENS), "wb") as out:
            out.write(np.array([job.tokenizer.eos_id], dtype).tobytes())
            for _, path, _ in part:
                with open(path, "rb") as f:
                    shutil.copyfileobj(f, out, 16 << 20)
            out.flush()
            os.fsync(out.fileno())
        starts = np.lib.format.open_memmap(os.path.join(target, DOCUMENTS), mode="w+",
                                           dtype=np.int64, shape=(num_documents + 1,))
        starts[0] = position = 1
        at = 1
        for _, _, lengths in part:
            starts[at:at + len(lengths)] = position + np.cumsum(lengths)
            at += len(lengths)
            position += int(lengths.sum())
        starts.flush()
        del starts
        _fsync_file(os.path.join(target, DOCUMENTS))
        counts = dict(manifest, split=name or "all", dtype=dtype.name, documents=num_documents,
                      tokens=position, bytes=sum(c["bytes"] for c, _, _ in part))
        with open(os.path.join(target, MANIFEST), "w", encoding="utf-8") as f:
            json.dump(counts, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        shards.fsync_directory(target)
    shards.fsync_directory(temporary)


def _fsync_file(path: str) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def _check_counts(documents: list[int], num_files: int, eval_fraction: float,
                  field: str) -> None:
    total = sum(documents)
    if total == 0:
        raise ConfigError(f"config.{field}: the {num_files} file{'s' if num_files > 1 else ''} "
                          "hold no text (every document is empty). Fix: point it at files "
                          "with text.")
    for count, name in zip(documents, SPLITS if len(documents) > 1 else ("",), strict=True):
        if count == 0:
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


def _publish(temporary: str, directory: str, wanted: dict,
             replace: bool) -> tuple[list[TokenStore], bool]:
    """Renames the finished `temporary` onto `directory`, replacing a store there if
    `replace`; the loser of a race with another process opens the winner's store.
    Returns the stores and whether this call renamed its own in."""
    aside = None
    if replace and os.path.lexists(directory):
        try:  # Another process may have rebuilt it already.
            stores = _open_layout(directory)
            if not _all_differences(stores, wanted):
                return stores, False
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
        return stores, False
    finally:
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)
    shards.fsync_directory(os.path.dirname(directory))
    return _open_layout(directory), True


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
                  field: str = "data.text_files",
                  text_field: str = "text") -> list[TokenStore] | None:
    """The stores in `directory` ([store], or [train, eval] with `eval_fraction`) if their
    manifests name `files` as they are now, `tokenizer`, `eval_fraction` and `text_field`;
    None if there are none or any of those differ. Reads only; a corrupt store is a
    ConfigError."""
    directory = os.path.abspath(os.path.expanduser(directory))
    wanted = {"files": _stat_inputs(files, field), "tokenizer": tokenizer.identity,
              "eval_fraction": float(eval_fraction),
              "text_field": _text_field_used(files, text_field)}
    try:
        return _reusable(directory, wanted, rebuild=False)
    except ConfigError:
        if os.path.isdir(directory) and os.listdir(directory):
            _open_layout(directory)  # raises if it is corrupt, not just of other inputs
        return None


def same_tokenizer(opened: TokenStore, tokenizer) -> bool:
    """Whether `opened` was made by `tokenizer` (its kind and model file's hash)."""
    return _tokenizer_key(opened.manifest["tokenizer"]) == _tokenizer_key(tokenizer.identity)


@dataclasses.dataclass(frozen=True)
class Options:
    """How `prepare` builds a store (the inputs aside).

    `processes`: tokenizing processes on this machine (None: one per core it may use).
    `share`: (i, n) for process i of n sharing the work (hosts of one job, the store's
    directory on a file system they share): each tokenizes its share of the shards
    first, then helps with the rest; process 0 merges them into the store and the
    others wait for it (`wait_s`). `progress` gets a `shards.Progress` every few
    seconds and at the end (absl logging without it). `field` is the config field
    named in errors about the files, `text_field` the field of .jsonl, Parquet and
    Arrow files that holds the documents.
    """

    rebuild: bool = False
    progress: Progress | None = None
    field: str = "data.text_files"
    text_field: str = "text"
    processes: int | None = None
    share: tuple[int, int] = (0, 1)
    wait_s: float = WAIT_FOR_STORE_S
    # False: a process other than 0 returns once the shards are tokenized, without waiting
    # for process 0 to merge them (its caller waits for what it publishes instead).
    wait_for_merge: bool = True


def _log_progress(directory: str) -> Progress:
    return lambda state: logging.info("%s", state.line(directory))


def _made_parents(directory: str) -> str | None:
    """Makes `directory`'s missing parents; the topmost it made (None: none)."""
    parent, made = os.path.dirname(directory), None
    while parent and not os.path.exists(parent):
        made, parent = parent, os.path.dirname(parent)
    os.makedirs(os.path.dirname(directory), exist_ok=True)
    return made


def _remove_made(directory: str, made: str | None) -> None:
    """Removes the now-empty directories `_made_parents` made, deepest first."""
    parent = os.path.dirname(directory)
    while made is not None and len(parent) >= len(made):
        try:
            os.rmdir(parent)
        except OSError:
            return
        parent = os.path.dirname(parent)


def _prepare(files: Sequence[str], tokenizer, directory: str, eval_fraction: float,
             options: Options) -> list[TokenStore]:
    directory = os.path.abspath(os.path.expanduser(directory))
    wanted = {"files": _stat_inputs(files, options.field), "tokenizer": tokenizer.identity,
              "eval_fraction": eval_fraction,
              "text_field": _text_field_used(files, options.text_field)}
    stores = _reusable(directory, wanted, options.rebuild)
    if stores is not None:
        return stores
    # Bad input is named here, before anything is written.
    corpus.check_files([f["path"] for f in wanted["files"]], options.text_field, options.field)
    made = _made_parents(directory)
    try:
        job = shards.Job(
            files=wanted["files"], shards=[], tokenizer=tokenizer, eval_fraction=eval_fraction,
            text_field=options.text_field, field=options.field, directory="",
            outputs=("train", "eval") if eval_fraction > 0 else ("all",),
            dtype="uint16" if tokenizer.vocab_size <= 1 << 16 else "uint32")
        planned = shards.plan(job.files, options.text_field)
        job = dataclasses.replace(job, shards=planned,
                                  directory=_work_dir(directory, wanted, planned))
        if options.share[0] != 0 and not options.rebuild:
            # Process 0 may have published the store since this process looked: then the
            # work directory is a new one of this process's, with nothing to do in it.
            stores = _reusable(directory, wanted, rebuild=False)
            if stores is not None:
                shutil.rmtree(job.directory, ignore_errors=True)
                return stores if options.wait_for_merge else []
        shards.tokenize(job, processes=options.processes or shards.available_cores(),
                        share=options.share,
                        progress=options.progress or _log_progress(directory))
        if options.share[0] != 0:
            return _wait_for(directory, wanted, options.wait_s) if options.wait_for_merge else []
        return _merge_and_publish(job, directory, wanted, options.rebuild)
    except ConfigError:  # bad input: nothing of this build is kept
        shutil.rmtree(f"{directory}.{WORK}", ignore_errors=True)
        _remove_made(directory, made)
        raise
    except FileNotFoundError:
        # Another process preparing the same store published it and removed the shards.
        stores = _reusable(directory, wanted, rebuild=True)
        if stores is None:
            raise
        return stores


def _merge_and_publish(job: shards.Job, directory: str, wanted: dict,
                       rebuild: bool) -> list[TokenStore]:
    _remove_stale(directory)
    temporary = _sibling(directory, "tmp")
    os.mkdir(temporary)
    try:
        manifest = {"format": FORMAT, "version": VERSION, "eval_fraction": job.eval_fraction,
                    "holdout_rule": HOLDOUT_RULE if job.eval_fraction > 0 else None,
                    "document_order": corpus.DOCUMENT_ORDER, "text_field": wanted["text_field"],
                    "files": wanted["files"], "tokenizer": job.tokenizer.identity,
                    "created_unix_s": round(time.time(), 3)}
        _merge(job, temporary, manifest)
        stores, published = _publish(temporary, directory, wanted, replace=rebuild)
    finally:
        shutil.rmtree(temporary, ignore_errors=True)  # nothing left there once renamed
    if published:  # the shards are in the store now
        shutil.rmtree(job.directory, ignore_errors=True)
    return stores


def _wait_for(directory: str, wanted: dict, timeout_s: float,
              poll_s: float = 1.0) -> list[TokenStore]:
    """The store of `wanted` in `directory`, once the process that merges has published it."""
    deadline = time.monotonic() + timeout_s
    while True:
        stores = _reusable(directory, wanted, rebuild=True)  # None while absent or other
        if stores is not None:
            return stores
        if time.monotonic() >= deadline:
            raise TimeoutError(f"token store {directory} did not appear within {timeout_s:g} s "
                               "(process 0 merges the shards into it). Fix: check that process "
                               "0 is running and can write there, or allow a longer wait.")
        time.sleep(poll_s)


def prepare(files: Sequence[str], tokenizer, directory: str, **options) -> TokenStore:
    """The store of `files` tokenized by `tokenizer` in `directory`, built if need be;
    `options` are those of `Options`.

    Reuses the store already there if its manifest names the same files (path, size,
    mtime_ns), tokenizer (kind and file hash) and text field; a store of other inputs
    is a ConfigError saying what differs, unless `rebuild`, which replaces it (and a
    corrupt one) atomically. A matching store is reused even with `rebuild`, so a
    restart with the flag still set does not redo the work.

    The files are tokenized in shards (`shards`: in parallel, in `DIR.shards`, which a
    killed build leaves for the next one to resume from), then concatenated into a
    sibling `DIR.tmp-HOST-PID-RANDOM`, fsync'd, manifest last, and renamed onto
    `directory`: a kill leaves no directory a reader trusts, and the next `prepare` on
    this host removes the temporary one. The store is the same bitwise whatever the
    number of processes. Processes racing to prepare one directory all end with the
    same valid store. A file that cannot be read, or lacks the text field, is a
    ConfigError before anything is written.
    """
    return _prepare(files, tokenizer, directory, 0.0, Options(**options))[0]


def tokenize_share(files: Sequence[str], tokenizer, directory: str, *,
                   eval_fraction: float = 0.0, **options) -> None:
    """A process other than 0's share of the shards of `prepare` (or `prepare_split`, with
    `eval_fraction`) of the same arguments, returning once the shards are tokenized:
    process 0 merges them, and publishes the store where its caller decides."""
    _prepare(files, tokenizer, directory, float(eval_fraction),
             Options(**options, wait_for_merge=False))


def prepare_split(files: Sequence[str], tokenizer, directory: str, *, eval_fraction: float,
                  **options) -> tuple[TokenStore, TokenStore]:
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
    train, eval_ = _prepare(files, tokenizer, directory, float(eval_fraction), Options(**options))
    return train, eval_
