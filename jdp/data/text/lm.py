"""The data of a language model trained on text files: `config.data.text_files`.

files -> tokenizer -> token store (prepared once, in `data.token_dir` or the workdir's
`tokens/`, reused after) -> packed windows of `data.seq_len` + 1 tokens. Example g of
the training stream is window `index_shuffle(g)` of the store, a pure function of
(seed, g) like every jdp stream, so packed text trains on the same examples on any
topology and resumes exactly at any step.

The examples' features (a user's own model reads the same ones):
`inputs`, `targets` (int32 [seq_len]), `weights` (float32: 1, 0 on evaluation padding),
with `data.document_mask` also `segment_ids` and `positions` (int32 [seq_len]: attention
stays inside a document, positions restart at each), and `tokens_per_byte` (float32
scalar: the split's target tokens per byte of text, for bits per byte).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import shutil
import time
from collections.abc import Callable, Collection

import jax
import numpy as np
from absl import logging

from jdp.data.core import Data
from jdp.data.text import corpus, store, tokenizers
from jdp.data.text.store import TokenStore
from jdp.data.text.windows import PackedWindows, target_tokens_and_bytes
from jdp.errors import ConfigError
from jdp.runtime import leftovers, storage

TOKENS_DIR = "tokens"  # inside the workdir, unless data.token_dir names another place
# In a token directory, written last: what it was made from (the config keys DESCRIBED),
# so that naming the directory is enough to train on it.
DESCRIPTION = "token_dir.json"
DESCRIPTION_FORMAT = "jdp.text.token_dir"
DESCRIBED = ("text_files", "eval_text_files", "text_field", "tokenizer", "eval_fraction")
# DIR.building: a token directory being made, shared by the job's processes; kept by a kill
# so that the next build resumes from its finished shards.
BUILDING = "building"
# How long a process that does not prepare the store waits for process 0 to finish it.
WAIT_FOR_STORE_S = 3600.0


def uses_text(data_config) -> bool:
    return bool(data_config.get("text_files", ""))


def token_dir(data_config, workdir: str) -> str:
    if not (data_config.token_dir or workdir):
        raise ConfigError("config.data.token_dir='': no workdir to keep the token store in. Fix: "
                          "pass --config.data.token_dir=DIR.")
    directory = data_config.token_dir or os.path.join(workdir, TOKENS_DIR)
    if storage.is_bucket(directory):
        field = "token_dir" if data_config.token_dir else "token_dir='' (the workdir's tokens/)"
        raise ConfigError(
            f"config.data.{field} is in a bucket ({directory}): the token store is memory-"
            "mapped from a local file system. Fix: pass --config.data.token_dir=DIR, a "
            "directory on a file system every host shares.")
    return directory


def build(data_config, *, workdir: str, eval_batch_size: int) -> Data:
    """Train and eval windows over the token stores of the configured text (prepared by
    process 0; every other process waits for them and opens the same files)."""
    if data_config.seq_len < 1:
        raise ConfigError(f"config.data.seq_len={data_config.seq_len}: must be >= 1. Fix: pass "
                          "the model's context length, e.g. --config.data.seq_len=128.")

    def windows(train_store, eval_store) -> tuple[PackedWindows, PackedWindows]:
        train = PackedWindows(train_store, data_config.seq_len,
                              document_mask=data_config.document_mask)
        evaluation = PackedWindows(eval_store, data_config.seq_len,
                                   document_mask=data_config.document_mask, pad_last=True)
        if len(evaluation) < eval_batch_size:
            raise ConfigError(
                f"config.eval_batch_size={eval_batch_size}: the held-out text makes only "
                f"{len(evaluation)} windows of data.seq_len={data_config.seq_len} tokens, fewer "
                "than one evaluation batch. Fix: hold out more text (data.eval_fraction or "
                "data.eval_text_files), or pass a smaller --config.eval_batch_size.")
        return train, evaluation

    directory = token_dir(data_config, workdir)
    # Checked before a new store is published: a refused run leaves nothing behind.
    train_store, eval_store = prepare(data_config, directory,
                                      prepared=bool(data_config.token_dir),
                                      check=lambda stores: windows(*stores))
    train, evaluation = windows(train_store, eval_store)
    eval_tokens, eval_bytes = target_tokens_and_bytes(evaluation)
    logging.info("text: %d train / %d eval documents, %s / %s tokens (%s), %d train windows "
                 "of %d tokens; eval: %s target tokens over %s bytes", train_store.num_documents,
                 eval_store.num_documents, f"{train_store.num_tokens:,}",
                 f"{eval_store.num_tokens:,}", data_config.tokenizer, len(train),
                 data_config.seq_len, f"{eval_tokens:,}", f"{eval_bytes:,}")
    train_ratio = (train_store.num_tokens - 1) / max(train_store.num_bytes, 1)
    return Data(train=train, eval=evaluation,
                preprocess=_with_tokens_per_byte(train_ratio),
                eval_preprocess=_with_tokens_per_byte(eval_tokens / max(eval_bytes, 1)),
                batch_preprocess=_with_tokens_per_byte_batch(train_ratio),
                eval_batch_preprocess=_with_tokens_per_byte_batch(eval_tokens / max(eval_bytes, 1)))


def build_eval(data_config, *, run_token_dir: str, directory: str) -> Data:
    """Data for evaluating a trained run on other text: `data.eval_text_files` tokenized
    by the run's tokenizer (a trained one is in `run_token_dir`) into a store of its own
    in `directory` (reused while the files are unchanged), as the eval split. The train
    split is the same windows: nothing trains on them."""
    files = corpus.expand_files(data_config.eval_text_files, "data.eval_text_files")
    tokenizer = _tokenizer(data_config, run_token_dir)
    # The evaluation's own store: a changed file is tokenized again, not refused.
    eval_store = store.prepare(files, tokenizer, directory, rebuild=True,
                               field="data.eval_text_files", text_field=data_config.text_field,
                               processes=data_config.tokenize_processes or None)
    evaluation = PackedWindows(eval_store, data_config.seq_len,
                               document_mask=data_config.document_mask, pad_last=True)
    eval_tokens, eval_bytes = target_tokens_and_bytes(evaluation)
    ratio = _with_tokens_per_byte(eval_tokens / max(eval_bytes, 1))
    batch_ratio = _with_tokens_per_byte_batch(eval_tokens / max(eval_bytes, 1))
    return Data(train=evaluation, eval=evaluation, preprocess=ratio, eval_preprocess=ratio,
                batch_preprocess=batch_ratio, eval_batch_preprocess=batch_ratio)


# --- The token directory and what it was made from ----------------------------------------


def read_description(directory: str) -> dict | None:
    """What a token directory was made from (its DESCRIPTION), None where there is none."""
    try:
        with open(os.path.join(directory, DESCRIPTION), encoding="utf-8") as f:
            description = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise ConfigError(f"token directory {directory}: {DESCRIPTION} unreadable "
                          f"({' '.join(str(e).split())}). Fix: point data.token_dir at a "
                          "directory that python -m jdp.text prepare made.") from e
    if not (isinstance(description, dict) and description.get("format") == DESCRIPTION_FORMAT
            and all(key in description for key in DESCRIBED)):
        raise ConfigError(f"token directory {directory}: {DESCRIPTION} is not a jdp token "
                          "directory's description. Fix: point data.token_dir at a directory "
                          "that python -m jdp.text prepare made.")
    return description


def _described(data_config) -> dict:
    """The inputs of a token directory that a config names: eval_fraction only without
    eval files, which replace it."""
    inputs = {key: data_config[key] for key in DESCRIBED}
    if inputs["eval_text_files"]:
        inputs["eval_fraction"] = None
    return inputs


def _contradictions(description: dict, data_config) -> list[str]:
    have, want = _described(description), _described(data_config)
    return [f"data.{key}={want[key]!r} (the store's: {have[key]!r})" for key in DESCRIBED
            if have[key] != want[key]]


def adopt_prepared(data_config, explicit: Collection[str]) -> list[str]:
    """A `data.token_dir` that names a prepared token directory supplies the inputs it was
    made from (files, tokenizer, held-out split): each DESCRIBED key the user did not set
    (`explicit`, dotted keys such as "data.tokenizer") takes the directory's value, in
    place. Returns the keys taken; keys the user set are checked against it later."""
    if not (uses_text(data_config) and data_config.token_dir):
        return []
    description = read_description(data_config.token_dir)
    if description is None:
        return []
    taken = [key for key in DESCRIBED
             if f"data.{key}" not in explicit and data_config[key] != description[key]]
    for key in taken:
        data_config[key] = description[key]
    if taken:
        logging.info("using the token store %s as prepared: %s", data_config.token_dir,
                     ", ".join(f"data.{key}={description[key]!r}" for key in taken))
    return taken


def holds_store(data_config, workdir: str) -> bool:
    """Whether the configured token directory already holds something (a store to reuse,
    or one to be refused): a dry run needs to know before it reads it."""
    directory = token_dir(data_config, workdir)
    return os.path.isdir(directory) and bool(os.listdir(directory))


def prepare(data_config, directory: str, *, prepared: bool,
            check: Callable[[tuple[TokenStore, TokenStore]], object] | None = None,
            progress: store.Progress | None = None) -> tuple[TokenStore, TokenStore]:
    """The (train, eval) stores of the text `data_config` names (its DESCRIBED keys and
    `rebuild_tokens`), in `directory`: reused as they are, or made.

    A directory with a description of the same inputs is reused: a `prepared` one (named
    by data.token_dir, the unit of reuse) as it is, a run's own (<workdir>/tokens) only
    while its files are unchanged. A directory of other inputs is refused in one line
    listing every difference, and nothing is written into it; only a run's own is
    rebuilt, with `rebuild_tokens`. A new directory is made whole in a temporary sibling
    (tokenizer for bpe:N, stores, `check(stores)`, description last) and renamed into
    place, so a failure anywhere leaves nothing behind. Process 0 makes it; the others
    wait for it.
    """
    description = read_description(directory)
    if description is not None:
        differences = _contradictions(description, data_config)
        if not differences:
            if prepared:  # as it is: its source files may have moved or changed since
                return _open_as_made(directory, data_config)
            stores = _open_matching(directory, data_config)
            if stores is not None:
                return stores
            differences = ["its source files changed since"]
        if prepared:
            raise ConfigError(
                f"config.data.token_dir={directory} holds a token store made from other inputs: "
                f"{'; '.join(differences)}. Fix: drop those --config.data keys (the store "
                "supplies its own), or point data.token_dir at another directory.")
        if not data_config.rebuild_tokens:
            raise ConfigError(
                f"token directory {directory} was made from other inputs: "
                f"{'; '.join(differences)}. Fix: rebuild it (--config.data.rebuild_tokens=true; "
                "python -m jdp.text prepare --rebuild), or keep it and use another directory "
                "(--config.data.token_dir=DIR).")
    elif os.path.isdir(directory) and os.listdir(directory):
        return _made_before_descriptions(directory, data_config, prepared)
    return _make(directory, data_config, check, progress, prepared=prepared,
                 replace=description is not None)


def _files(data_config) -> tuple[list[str], list[str] | None]:
    train = corpus.expand_files(data_config.text_files, "data.text_files")
    evaluation = (corpus.expand_files(data_config.eval_text_files, "data.eval_text_files")
                  if data_config.eval_text_files else None)
    return train, evaluation


def _layout(directory: str, data_config) -> tuple[str, str]:
    """Where the train and eval stores are: DIR/split/{train,eval} for text held out by
    data.eval_fraction, DIR/{train,eval} with data.eval_text_files."""
    if data_config.eval_text_files:
        return os.path.join(directory, "train"), os.path.join(directory, "eval")
    return os.path.join(split_dir(directory), "train"), os.path.join(split_dir(directory), "eval")


def _open_as_made(directory: str, data_config) -> tuple[TokenStore, TokenStore]:
    stores = tuple(store.open_store(path) for path in _layout(directory, data_config))
    tokenizer = _tokenizer(data_config, directory)
    for opened in stores:
        if not store.same_tokenizer(opened, tokenizer):
            raise ConfigError(
                f"config.data.tokenizer={data_config.tokenizer!r}: the tokenizer file changed "
                f"since the store {opened.directory} was made with it. Fix: restore that "
                "tokenizer, or prepare another token directory.")
    return stores  # type: ignore[return-value]


def _open_matching(directory: str, data_config) -> tuple[TokenStore, TokenStore] | None:
    """The stores if their manifests name the config's files as they are now (and its
    tokenizer); None if any changed."""
    train_files, eval_files = _files(data_config)
    tokenizer = _tokenizer(data_config, directory)
    if eval_files is None:
        split = store.open_matching(train_files, tokenizer, split_dir(directory),
                                    eval_fraction=data_config.eval_fraction,
                                    text_field=data_config.text_field)
        return None if split is None else (split[0], split[1])
    train_dir, eval_dir = _layout(directory, data_config)
    train = store.open_matching(train_files, tokenizer, train_dir,
                                text_field=data_config.text_field)
    evaluation = store.open_matching(eval_files, tokenizer, eval_dir,
                                     field="data.eval_text_files",
                                     text_field=data_config.text_field)
    return None if train is None or evaluation is None else (train[0], evaluation[0])


def _made_before_descriptions(directory: str, data_config, prepared: bool):
    """A token directory of an earlier jdp (no description): reused if its stores'
    manifests match the config, rebuilt only if it is the run's own and rebuild_tokens
    says so, never written into otherwise."""
    stores = _open_matching(directory, data_config)
    if stores is not None:
        return stores
    if not prepared and data_config.rebuild_tokens:
        if jax.process_index() != 0:
            return _wait_for(directory, data_config, prepared)
        return _make(directory, data_config, None, None, replace=True)
    fix = ("point data.token_dir at another directory" if prepared else
           "pass --config.data.rebuild_tokens=true to rebuild it, or --config.data.token_dir="
           "DIR to make a new one elsewhere")
    raise ConfigError(f"token directory {directory} holds stores of other inputs (made before "
                      f"token directories described themselves). Fix: {fix}.")


def _wait_for(directory: str, data_config, prepared: bool) -> tuple[TokenStore, TokenStore]:
    """For processes other than 0: the stores once process 0 has made them."""
    deadline = time.monotonic() + WAIT_FOR_STORE_S
    while True:
        description = read_description(directory)
        if description is not None and not _contradictions(description, data_config):
            stores = (_open_as_made(directory, data_config) if prepared
                      else _open_matching(directory, data_config))
            if stores is not None:
                return stores
        if time.monotonic() >= deadline:
            raise TimeoutError(f"token directory {directory} was not prepared within "
                               f"{WAIT_FOR_STORE_S:g} s. Fix: check that process 0 is running "
                               "and can write there, or prepare it ahead with python -m "
                               "jdp.text prepare.")
        time.sleep(1.0)


def _make(directory: str, data_config, check, progress, *, prepared: bool, replace: bool):
    """Makes the token directory in DIR.building and renames it into place.

    DIR.building starts with the description of what it is being made from (a building of
    other inputs is replaced). Every process of a job tokenizes its share of the shards
    there (`store`'s resumable shards); process 0 trains a bpe:N tokenizer first, merges
    the shards into the stores, runs `check` on them and renames the whole onto DIR. A
    kill leaves DIR.building for the next build to resume from its finished shards; bad
    input or a failed check removes it, and the parents it made."""
    train_files, eval_files = _files(data_config)
    building = f"{directory}.{BUILDING}"
    leader = jax.process_index() == 0
    created = _missing_parents(os.path.dirname(directory)) if leader else []
    intent = {"format": DESCRIPTION_FORMAT, "version": 1,
              **{key: data_config[key] for key in DESCRIBED}}
    try:
        if leader:
            _start_building(building, intent)
        elif not _wait_for_building(building, directory, intent):
            return _wait_for(directory, data_config, prepared)  # already published
        tokenizer = _trained_tokenizer(data_config, train_files, building, leader)
        options = dict(rebuild=True,  # DIR.building is this build's own
                       text_field=data_config.text_field,
                       processes=data_config.tokenize_processes or None,
                       share=(jax.process_index(), jax.process_count()), progress=progress)
        if not leader:  # its share of the shards, then the directory process 0 publishes
            _tokenize_share(train_files, eval_files, tokenizer, building, data_config, options)
            return _wait_for(directory, data_config, prepared)
        train_dir, eval_dir = _layout(building, data_config)
        if eval_files is None:
            made = store.prepare_split(train_files, tokenizer, split_dir(building),
                                       eval_fraction=data_config.eval_fraction, **options)
        else:
            made = (store.prepare(train_files, tokenizer, train_dir, **options),
                    store.prepare(eval_files, tokenizer, eval_dir, field="data.eval_text_files",
                                  **options))
        if check is not None:
            check(made)
        _publish(building, directory, replace=replace)
    except ConfigError:  # bad input or a failed check: nothing of this build is kept
        if leader:
            shutil.rmtree(building, ignore_errors=True)
            for made_dir in created:  # deepest first; kept if something else appeared in it
                with contextlib.suppress(OSError):
                    os.rmdir(made_dir)
        raise
    description = read_description(directory)
    if description is None or _contradictions(description, data_config):
        raise ConfigError(f"token directory {directory} was just made by another process from "
                          "other inputs. Fix: give each run its own data.token_dir.")
    return _open_as_made(directory, data_config)


def _start_building(building: str, intent: dict) -> None:
    """DIR.building for `intent`: a killed build's of the same inputs kept (its shards
    resume), one of other inputs replaced."""
    if not os.path.isdir(building) or read_description(building) != intent:
        shutil.rmtree(building, ignore_errors=True)
        os.makedirs(building)
        temporary = os.path.join(building, DESCRIPTION + ".tmp")
        with open(temporary, "w", encoding="utf-8") as f:
            json.dump(intent, f, indent=1)
        os.replace(temporary, os.path.join(building, DESCRIPTION))


def _wait_for_building(building: str, directory: str, intent: dict) -> bool:
    """For processes other than 0: until process 0 has started DIR.building for `intent`
    (True), or has already built it and renamed it onto DIR (False: a small corpus can be
    done between two looks)."""
    deadline = time.monotonic() + WAIT_FOR_STORE_S
    while True:
        if read_description(building) == intent:
            return True
        if read_description(directory) == intent:
            return False
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{building} was not started within {WAIT_FOR_STORE_S:g} s. "
                               "Fix: check that process 0 is running and can write there.")
        time.sleep(1.0)


def _trained_tokenizer(data_config, train_files: list[str], building: str,
                       leader: bool) -> tokenizers.Tokenizer:
    """The configured tokenizer; a bpe:N one trained on the training files into
    DIR.building by process 0 (once: a kept building keeps it), waited for by the others."""
    vocab_size = tokenizers.trained_vocab_size(data_config.tokenizer)
    if vocab_size is not None:
        path = tokenizers.trained_path(data_config.tokenizer, building)
        if leader and not os.path.isfile(path):
            logging.info("training the %s tokenizer on %d files", data_config.tokenizer,
                         len(train_files))
            tokenizers.train_tokenizer(train_files, vocab_size=vocab_size, out=path, kind="bpe",
                                       field="data.tokenizer", text_field=data_config.text_field)
        elif not os.path.isfile(path):
            store.wait_for_file(path, f"the tokenizer {path}", WAIT_FOR_STORE_S)
    return _tokenizer(data_config, building)


def _tokenize_share(train_files, eval_files, tokenizer, building: str, data_config,
                    options: dict) -> None:
    """A process other than 0's share of the shards of the stores `_make` builds."""
    train_dir, eval_dir = _layout(building, data_config)
    if eval_files is None:
        store.tokenize_share(train_files, tokenizer, split_dir(building),
                             eval_fraction=data_config.eval_fraction, **options)
        return
    store.tokenize_share(train_files, tokenizer, train_dir, **options)
    store.tokenize_share(eval_files, tokenizer, eval_dir, field="data.eval_text_files",
                         **options)


def _missing_parents(directory: str) -> list[str]:
    """`directory` and those of its ancestors that do not exist yet, deepest first."""
    missing = []
    while directory and not os.path.exists(directory):
        missing.append(directory)
        directory = os.path.dirname(directory)
    return missing


def _publish(staging: str, directory: str, *, replace: bool) -> None:
    """Renames the finished `staging` onto `directory` (absent, empty, or replaced when
    `replace`); another process's directory that got there first is kept."""
    aside = None
    if replace and os.path.lexists(directory):
        aside = f"{directory}.old-{leftovers.tag()}-{secrets.token_hex(4)}"
        os.rename(directory, aside)
    try:
        os.rename(staging, directory)
    except OSError as e:
        if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
            raise
    finally:
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)


def _tokenizer(data_config, directory: str) -> tokenizers.Tokenizer:
    """The configured tokenizer; a "bpe:N" one is read from the token directory, where it
    was trained when the directory was made."""
    return tokenizers.from_spec(data_config.tokenizer, "data.tokenizer", directory)


def run_tokenizer(data_config, workdir: str) -> tokenizers.Tokenizer:
    """The tokenizer of a run whose store is prepared (a "bpe:N" one is in its token dir)."""
    return tokenizers.from_spec(data_config.tokenizer, "data.tokenizer",
                                token_dir(data_config, workdir))


def eval_store(data_config, workdir: str) -> store.TokenStore:
    """The prepared token store of a run's held-out text."""
    directory = token_dir(data_config, workdir)
    if data_config.eval_text_files:
        return store.open_store(os.path.join(directory, "eval"))
    return store.open_split(split_dir(directory))[1]


def tokenizer_vocab_size(data_config) -> int:
    """The configured tokenizer's vocabulary (ids 0 .. vocab_size - 1), known before a
    "bpe:N" tokenizer is trained (N)."""
    trained = tokenizers.trained_vocab_size(data_config.tokenizer)
    if trained is not None:
        return trained
    return tokenizers.from_spec(data_config.tokenizer, "data.tokenizer").vocab_size


def check_model_fits(data_config, *, vocab_size: int, max_len: int) -> None:
    """A model for this text must embed every token id and take `data.seq_len` tokens."""
    needed = tokenizer_vocab_size(data_config)
    if vocab_size < needed:
        raise ConfigError(
            f"config.model.vocab_size={vocab_size}: the tokenizer {data_config.tokenizer!r} "
            f"has {needed} token ids, more than the model embeds. Fix: pass "
            f"--config.model.vocab_size={needed} (or 0 for the tokenizer's).")
    if data_config.seq_len > max_len:
        raise ConfigError(
            f"config.data.seq_len={data_config.seq_len}: above the model's maximum sequence "
            f"length ({max_len}). Fix: pass --config.data.seq_len={max_len} or less, or a "
            "model with a longer maximum (config.model.max_len).")


def split_dir(directory: str) -> str:
    """Where the stores of text split by `data.eval_fraction` are kept in a token dir
    (DIR/split/train, DIR/split/eval); with `data.eval_text_files`: DIR/train, DIR/eval."""
    return os.path.join(directory, "split")


class _with_tokens_per_byte:  # noqa: N801 - a picklable function (worker processes)
    def __init__(self, ratio: float):
        self.ratio = np.float32(ratio)

    def __call__(self, example: dict, rng) -> dict:
        del rng
        return {**example, "tokens_per_byte": self.ratio}


class _with_tokens_per_byte_batch(_with_tokens_per_byte):  # noqa: N801
    def __call__(self, batch: dict, rngs) -> dict:
        del rngs
        rows = len(next(iter(batch.values())))
        return {**batch, "tokens_per_byte": np.full((rows,), self.ratio, np.float32)}
