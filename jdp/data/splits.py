"""The splits the trainer reads batches from, behind one declared interface.

A split is opened once (`open_train`, `open_eval`) and asked for this
process's rows of consecutive global batches. Two implementations give
bitwise the same batches: a split that fits in memory, or is memory-mapped, is
batched by vectorised numpy (`jdp.data.in_memory`); the others stream through
grain, example by example (`jdp.data.streamed`). Which one serves a split is
decided here, from `config.data.in_memory` and what the data allows.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import numpy as np
from absl import logging

from jdp.data import in_memory, streamed
from jdp.data.core import Batch, Data
from jdp.errors import ConfigError


class TrainSplit(Protocol):
    def batches(self, *, global_batch_size: int, rows: slice, start_step: int,
                num_steps: int) -> Iterator[Batch]:
        """This process's `rows` of global batches start_step .. start_step+num_steps-1."""


class EvalSplit(Protocol):
    def batches(self, *, global_batch_size: int, rows: slice) -> Iterator[Batch]:
        """This process's `rows` of every evaluation batch, each example once; the last
        batch is padded, and `mask` (one value per row) is 0 on the padding."""


def open_train(data: Data, *, seed: int, setting: str, num_threads: int = 4,
               num_workers: int = 0) -> TrainSplit:
    """The training split from memory where `setting` and the data allow, else through grain."""
    try:
        loaded = in_memory.load(data, train=True, setting=setting)
        if loaded is not None:
            order = in_memory.Order(len(data.train), seed)
            order.check_against_grain()
            return in_memory.InMemoryTrain(*loaded, order)
    except in_memory.Unsuitable as reason:
        _stream_instead("train", setting, reason)
    return streamed.StreamedTrain(data.train, data.preprocess_for(train=True), seed,
                                  num_threads=num_threads, num_workers=num_workers)


def open_eval(data: Data, *, setting: str, num_threads: int = 4,
              num_workers: int = 0) -> EvalSplit:
    """The evaluation split from memory where `setting` and the data allow, else through grain."""
    try:
        loaded = in_memory.load(data, train=False, setting=setting)
        if loaded is not None:
            return in_memory.InMemoryEval(*loaded)
    except in_memory.Unsuitable as reason:
        _stream_instead("eval", setting, reason)
    return streamed.StreamedEval(data.eval, data.preprocess_for(train=False),
                                 num_threads=num_threads, num_workers=num_workers)


def _stream_instead(split: str, setting: str, reason: in_memory.Unsuitable) -> None:
    if setting == "true":
        raise ConfigError(
            f"config.data.in_memory='true': the {split} split cannot be batched from memory: "
            f"{reason}. Fix: pass --config.data.in_memory=auto to stream it through grain "
            "instead.") from reason
    logging.info("the %s split streams through grain, example by example: %s", split, reason)


def eval_sample_batch(sample: dict, rows: slice) -> Batch:
    """A batch shaped like this process's rows of an evaluation batch (zeros, mask 0):
    what the eval step is compiled for ahead of time."""
    count = rows.stop - rows.start
    batch = {key: np.zeros((count, *np.shape(value)), np.asarray(value).dtype)
             for key, value in sample.items()}
    batch["mask"] = np.zeros((count,), np.float32)
    return batch
