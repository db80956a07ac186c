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

import os

import jax
import numpy as np
from absl import logging

from jdp.data.core import Data
from jdp.data.text import corpus, store, tokenizers
from jdp.data.text.windows import PackedWindows, target_tokens_and_bytes
from jdp.errors import ConfigError
from jdp.runtime import storage

TOKENS_DIR = "tokens"  # inside the workdir, unless data.token_dir names another place
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
    train_files = corpus.expand_files(data_config.text_files, "data.text_files")
    eval_files = (corpus.expand_files(data_config.eval_text_files, "data.eval_text_files")
                  if data_config.eval_text_files else None)
    directory = token_dir(data_config, workdir)
    tokenizer = _tokenizer(data_config, train_files, directory)
    train_store, eval_store = _stores(train_files, eval_files, tokenizer, directory, data_config)
    train = PackedWindows(train_store, data_config.seq_len,
                          document_mask=data_config.document_mask)
    evaluation = PackedWindows(eval_store, data_config.seq_len,
                               document_mask=data_config.document_mask, pad_last=True)
    if len(evaluation) < eval_batch_size:
        raise ConfigError(
            f"config.eval_batch_size={eval_batch_size}: the held-out text makes only "
            f"{len(evaluation)} windows of data.seq_len={data_config.seq_len} tokens, fewer than "
            "one evaluation batch. Fix: hold out more text (data.eval_fraction or "
            "data.eval_text_files), or pass a smaller --config.eval_batch_size.")
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


def _tokenizer(data_config, train_files: list[str], directory: str) -> tokenizers.Tokenizer:
    """The configured tokenizer; "bpe:N" is trained on the training files first (by
    process 0, once: the store's manifest then names its hash, so a retrained one is
    a changed input)."""
    spec = data_config.tokenizer
    if tokenizers.trained_vocab_size(spec) is None:
        return tokenizers.from_spec(spec, "data.tokenizer")
    path = tokenizers.trained_path(spec, directory)
    if jax.process_index() == 0 and not os.path.isfile(path):
        logging.info("training the %s tokenizer on %d files into %s", spec, len(train_files),
                     path)
        tokenizers.train_tokenizer(train_files, vocab_size=tokenizers.trained_vocab_size(spec),
                                   out=path, kind="bpe", field="data.tokenizer",
                                   text_field=data_config.text_field)
    elif not os.path.isfile(path):
        store.wait_for_file(path, f"the tokenizer {path}", WAIT_FOR_STORE_S)
    return tokenizers.from_spec(spec, "data.tokenizer", directory)



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


def _stores(train_files, eval_files, tokenizer, directory: str, data_config):
    """(train, eval) stores. Every process tokenizes its share of the shards (and helps
    with the rest); process 0 merges them, the others wait for the stores."""
    options = dict(rebuild=data_config.rebuild_tokens, text_field=data_config.text_field,
                   processes=data_config.tokenize_processes or None,
                   share=(jax.process_index(), jax.process_count()), wait_s=WAIT_FOR_STORE_S)
    if eval_files is None:
        return store.prepare_split(train_files, tokenizer, split_dir(directory),
                                   eval_fraction=data_config.eval_fraction, **options)
    train_dir, eval_dir = os.path.join(directory, "train"), os.path.join(directory, "eval")
    return (store.prepare(train_files, tokenizer, train_dir, **options),
            store.prepare(eval_files, tokenizer, eval_dir, field="data.eval_text_files",
                          **options))


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
