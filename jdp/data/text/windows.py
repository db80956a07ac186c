"""Packed next-token windows over a token store, and the bits-per-byte accounting.

`PackedWindows` cuts the store's one token stream (documents separated by eos, see
`store`) into fixed-length examples, with segment ids and positions so that a model
can keep attention inside each document. `target_tokens_and_bytes` and
`bits_per_byte` turn an evaluation's mean loss per token into bits per byte of text.

Segment convention: an eos token *starts* the next document's segment; it serves as
that document's beginning-of-sequence. So the last token of a document predicts the
eos (in its own segment), the eos predicts the first token of the next document
(in the next segment, position 0), and no prediction sees another document. A
segment also starts at every window's first position. Positions count from 0 at
each segment start; segment ids count from 1 within a window; padding has segment
0, position 0, weight 0 and inputs and targets 0.
"""

from __future__ import annotations

import math
import operator
from typing import SupportsIndex

import numpy as np

from jdp.data.text.store import TokenStore, open_store
from jdp.errors import ConfigError

Example = dict[str, np.ndarray]


class PackedWindows:
    """Window i holds tokens[i*seq_len : i*seq_len + seq_len + 1]: `inputs` its first
    seq_len tokens and `targets` its last seq_len (int32), `weights` float32 1 (0 on
    padding) and, with `document_mask`, int32 `segment_ids` and `positions`.

    Windows follow each other with stride seq_len, so each store token after the
    first is a target of exactly one window. Without `pad_last` (training) there are
    (num_tokens - 1) // seq_len full windows and the few targets left over are never
    used; with it (evaluation) there are ceil((num_tokens - 1) / seq_len) and the
    last is padded, so every target is evaluated exactly once. A random-access source:
    picklable (the store's memory map is opened again where it is unpickled).
    """

    # `get_batch` reads the store's memory-mapped tokens: jdp.data.in_memory gathers each
    # batch from them rather than reading every window into memory first.
    memory_mapped = True

    def __init__(self, store: TokenStore | str, seq_len: int, *, document_mask: bool = True,
                 pad_last: bool = False) -> None:
        self.store = open_store(store) if isinstance(store, str) else store
        if seq_len < 1:
            raise ValueError(f"seq_len must be at least 1, got {seq_len}")
        self.seq_len = int(seq_len)
        self.document_mask = document_mask
        self.pad_last = pad_last
        targets = self.store.num_tokens - 1
        self._length = -(-targets // seq_len) if pad_last else targets // seq_len
        if self._length == 0:
            raise ConfigError(f"token store {self.store.directory} holds {targets} targets, fewer "
                              f"than one window of seq_len={seq_len}. Fix: give more text or a "
                              "shorter sequence length.")

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: SupportsIndex) -> Example:
        i = operator.index(index)
        if not 0 <= i < self._length:
            raise IndexError(f"index {i} is out of range for {self._length} windows "
                             f"(valid: 0 to {self._length - 1})")
        start = i * self.seq_len
        window = np.asarray(self.store.tokens[start:start + self.seq_len + 1], np.int32)
        real = len(window) - 1  # targets in this window; fewer only in a padded last one
        window = np.pad(window, (0, self.seq_len + 1 - len(window)))
        valid = np.arange(self.seq_len) < real
        return {key: value[0] for key, value in self._features(window[None], valid[None]).items()}

    def get_batch(self, indices: np.ndarray) -> Example:
        """The examples of `indices`, stacked: equal to stacking `self[i]`, bitwise."""
        indices = np.asarray(indices, np.int64).reshape(-1)
        if indices.size and (indices.min() < 0 or indices.max() >= self._length):
            raise IndexError(f"indices {indices.min()}..{indices.max()} are out of range for "
                             f"{self._length} windows")
        offsets = indices[:, None] * self.seq_len + np.arange(self.seq_len + 1)
        last = self.store.num_tokens - 1
        # A plain view of the map: indexing the np.memmap subclass costs ~10x more.
        tokens = np.asarray(self.store.tokens)
        if not indices.size or offsets[:, -1].max() <= last:  # every target exists
            return self._features(tokens[offsets].astype(np.int32), None)
        windows = tokens[np.minimum(offsets, last)].astype(np.int32)
        return self._features(windows, offsets[:, 1:] <= last)  # target j: offsets[:, j + 1]

    def _features(self, windows: np.ndarray, valid: np.ndarray | None) -> Example:
        """Features of [n, seq_len + 1] token windows; valid[n, seq_len]: the target exists
        (None: every one does, as in every training window)."""
        inputs, targets = windows[:, :-1], windows[:, 1:]

        def masked(values: np.ndarray) -> np.ndarray:
            return (values if valid is None else np.where(valid, values, 0)).astype(np.int32)

        example = {"inputs": masked(inputs), "targets": masked(targets),
                   "weights": (np.ones(inputs.shape, np.float32) if valid is None
                               else valid.astype(np.float32))}
        if self.document_mask:
            starts = inputs == self.store.eos_id
            starts[:, 0] = True
            steps = np.arange(self.seq_len)
            segment_start = np.maximum.accumulate(np.where(starts, steps, 0), axis=1)
            example["segment_ids"] = masked(np.cumsum(starts, axis=1))
            example["positions"] = masked(steps - segment_start)
        return example

    def __repr__(self) -> str:
        return (f"PackedWindows({self.store!r}, seq_len={self.seq_len}, "
                f"document_mask={self.document_mask}, pad_last={self.pad_last})")


def target_tokens_and_bytes(windows: PackedWindows) -> tuple[int, int]:
    """(target tokens, UTF-8 bytes) that evaluating every window of `windows` covers.

    With pad_last, the weighted targets are every store token but the first: each
    document's tokens and its closing eos. The first token is the leading eos, which
    has no text, so the bytes are exactly the store's text bytes (`num_bytes`).
    """
    if not windows.pad_last:
        raise ValueError("only PackedWindows(..., pad_last=True) evaluates every target; "
                         "without it the targets after the last full window are left out")
    return windows.store.num_tokens - 1, windows.store.num_bytes


def tokens_per_byte(windows: PackedWindows) -> float:
    """Target tokens per byte of text of `windows` (pad_last=True)."""
    tokens, num_bytes = target_tokens_and_bytes(windows)
    return tokens / num_bytes


def bits_per_byte(nats_per_token: float, tokens: int, num_bytes: int) -> float:
    """eval/bits_per_byte = nats per token * tokens / bytes / ln 2.

    `nats_per_token` is the mean cross-entropy (natural log) over the weighted
    targets, `tokens` and `num_bytes` from `target_tokens_and_bytes`: the total
    code length of the text in bits, per UTF-8 byte. The eos targets are included
    (predicting where a document ends is part of the text's code) though they have
    no bytes of their own; the figure compares models with different tokenizers.
    """
    return nats_per_token * tokens / num_bytes / math.log(2)
