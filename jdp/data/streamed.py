"""The global-index sampler: which examples make up global batch `s`.

Global example `g` of a run is a pure function of (seed, g): grain shuffles
each epoch with a seed folded with the epoch number, and augmentation draws
from a generator seeded by (seed, g). Global batch `s` is examples
`s*B .. s*B+B-1`; a process reads only its own rows of it. So the stream
is the same on any topology, and the position in it follows from the step.

Batches are prepared by threads of this process, or by worker processes
(`num_workers`): worker i prepares whole batches i, i+N, i+2N, ... and grain
interleaves them back in order, so the stream is also the same for any
number of workers.

Splits that fit in memory take a shorter road to the same batches
(`jdp.data.in_memory`); `StreamedTrain` and `StreamedEval` are this module's
side of the split interface both roads implement (`jdp.data.splits`).
"""

from __future__ import annotations

import dataclasses
import gc
import math
import os
import threading
import time
from collections.abc import Callable, Iterator
from multiprocessing import shared_memory
from typing import Any

import grain
import numpy as np
from absl import flags

from jdp.data.core import Batch
from jdp.runtime import preemption


def example_stream(source, preprocess: Callable, seed: int) -> grain.MapDataset:
    """An infinite random-access dataset: element g is global training example g."""
    return grain.MapDataset.source(source).seed(seed).shuffle().repeat().random_map(preprocess)


def global_index(step: int, row: int, global_batch_size: int) -> int:
    """The one formula of the stream: row `row` of global batch `step` is example
    `step * global_batch_size + row`, on every topology."""
    return step * global_batch_size + row


def _local_position(local_index: int, rows: slice) -> tuple[int, int]:
    """This process's `local_index`-th example -> (batch, row of the global batch)."""
    step, row = divmod(local_index, rows.stop - rows.start)
    return step, rows.start + row


def _read_options(num_threads: int) -> grain.ReadOptions:
    return grain.ReadOptions(num_threads=num_threads, prefetch_buffer_size=2 * num_threads + 2)


# How often a worker checks that the process that started it is still alive.
_ORPHAN_CHECK_S = 1.0


def _exit_when_orphaned(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(_ORPHAN_CHECK_S)
    os._exit(0)


def _init_worker(worker_index: int, worker_count: int) -> None:
    """Runs first in each worker process.

    SIGTERM and SIGINT are the trainer's: a preemption notice (or Ctrl-C) sent to
    the whole process group must not kill the workers while the trainer still
    needs batches to reach its preemption save; the trainer closes its workers.
    A trainer that dies without closing them (SIGKILL, the watchdog's os._exit)
    leaves them orphaned, and they exit by themselves.
    """
    del worker_index, worker_count
    preemption.ignore_in_worker()
    threading.Thread(target=_exit_when_orphaned, args=(os.getppid(),), daemon=True).start()


def _iterate(batches: grain.MapDataset, num_threads: int, num_workers: int) -> Iterator[Batch]:
    """An iterator over `batches` in order, with a `close()` that stops its threads or
    workers. Each worker prepares one batch at a time, so N workers use N cores."""
    if not num_workers:
        return iter(batches.to_iter_dataset(_read_options(num_threads)))
    # grain reads one of its absl flags when it starts workers, which fails where no absl
    # app parsed the flags (tests, notebooks, the benchmarks); the defaults are right.
    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
    in_worker = batches.to_iter_dataset(grain.ReadOptions(num_threads=1, prefetch_buffer_size=1))
    return _WorkerBatches(iter(in_worker.mp_prefetch(
        grain.MultiprocessingOptions(num_workers=num_workers, per_worker_buffer_size=2),
        worker_init_fn=_init_worker).map(_out_of_shared_memory)))


class _WorkerBatches:
    """grain's iterator over the workers' batches, whose `close()` also frees the shared
    memory of the last batch each worker handed over.

    grain's iterator keeps that batch (as a shared-memory array, unlinked when garbage
    collected) in reference cycles of its own, which outlive `close()`: at exit Python's
    resource tracker then warned of "leaked shared_memory objects", one per array, and
    unlinked them itself. A collection after the close frees them (~0.1-0.2 s, once
    per pipeline, beside the 2-3 s its workers take to start).
    """

    def __init__(self, batches: Iterator[Batch]):
        self._batches = batches

    def __iter__(self) -> _WorkerBatches:
        return self

    def __next__(self) -> Batch:
        return next(self._batches)

    def close(self) -> None:
        if self._batches is None:
            return
        self._batches.close()
        self._batches = None
        gc.collect()


def _out_of_shared_memory(batch: Batch) -> Batch:
    """Workers hand batches over in shared memory; a copy (one memcpy) is an ordinary
    array that nothing can free under the device transfer or leak at exit. Each segment
    is unlinked here, once copied, rather than by grain's deletion: that runs later in a
    thread pool, which closes the segment's file first and, when the close fails (seen:
    EBADF while the workers start, about one pipeline in 15), never unlinks it, silently,
    so it stays in /dev/shm until the resource tracker removes it at exit."""
    copied = {key: np.array(value) for key, value in batch.items()}
    for value in batch.values():
        _unlink_now(value)
    return copied


def _unlink_now(value: Any) -> None:
    """Removes the name of the shared-memory segment behind `value` (a grain
    SharedMemoryArray this process is to unlink), leaving grain's deletion to unmap it
    only. Anything else is left as it is."""
    segment = getattr(value, "shm", None)
    if isinstance(segment, shared_memory.SharedMemory) and getattr(value, "_unlink_on_del",
                                                                   False):
        segment.unlink()
        value._unlink_on_del = False  # grain's own unlink would now fail, and be lost


def train_batches(
    stream: grain.MapDataset,
    *,
    global_batch_size: int,
    rows: slice,
    start_step: int,
    num_steps: int,
    num_threads: int = 4,
    num_workers: int = 0,
) -> Iterator[Batch]:
    """This process's rows of global batches start_step .. start_step+num_steps-1,
    prepared by `num_threads` threads, or by `num_workers` worker processes if > 0."""
    rows_per_process = rows.stop - rows.start

    def example(local_index: int) -> dict:
        step, row = _local_position(local_index, rows)
        return stream[global_index(start_step + step, row, global_batch_size)]

    local = (grain.MapDataset.range(num_steps * rows_per_process)
             .map(example)
             .batch(rows_per_process, batch_fn=stack_examples))
    return _iterate(local, num_threads, num_workers)


def num_eval_batches(num_examples: int, global_batch_size: int) -> int:
    return math.ceil(num_examples / global_batch_size)


def eval_batches(
    source,
    preprocess: Callable,
    *,
    global_batch_size: int,
    rows: slice,
    num_threads: int = 4,
    num_workers: int = 0,
) -> Iterator[Batch]:
    """This process's rows of every evaluation batch, in order, unshuffled.

    Every process yields the same number of batches (so the collectives
    match); the last one is padded with copies of example 0 whose `mask` is
    0, so that every real example counts exactly once.
    """
    num_examples = len(source)
    rows_per_process = rows.stop - rows.start

    def example(local_index: int) -> dict:
        index = global_index(*_local_position(local_index, rows), global_batch_size)
        valid = index < num_examples
        out = dict(preprocess(source[index if valid else 0], None))
        out["mask"] = np.float32(valid)
        return out

    count = num_eval_batches(num_examples, global_batch_size) * rows_per_process
    local = (grain.MapDataset.range(count).map(example)
             .batch(rows_per_process, batch_fn=stack_examples))
    return _iterate(local, num_threads, num_workers)


def stack_examples(examples: list[dict]) -> Batch:
    """Stacks examples into a batch; one clear error when their shapes differ."""
    try:
        return {key: np.stack([np.asarray(e[key]) for e in examples]) for key in examples[0]}
    except (ValueError, KeyError) as e:
        shapes = sorted({str({k: np.shape(v) for k, v in ex.items()}) for ex in examples})
        raise ValueError(
            f"cannot batch examples of different keys or shapes ({'; '.join(shapes)}). Fix: "
            "make the preprocessing return one shape for every example (pad or crop).") from e


@dataclasses.dataclass(frozen=True)
class StreamedTrain:
    """The training split streamed through grain, example by example."""

    source: Any
    preprocess: Callable
    seed: int
    num_threads: int = 4  # threads of this process preparing examples (num_workers=0)
    num_workers: int = 0  # worker processes preparing whole batches instead

    def batches(self, *, global_batch_size: int, rows: slice, start_step: int,
                num_steps: int) -> Iterator[Batch]:
        return train_batches(example_stream(self.source, self.preprocess, self.seed),
                             global_batch_size=global_batch_size, rows=rows,
                             start_step=start_step, num_steps=num_steps,
                             num_threads=self.num_threads, num_workers=self.num_workers)


@dataclasses.dataclass(frozen=True)
class StreamedEval:
    """The evaluation split streamed through grain, example by example."""

    source: Any
    preprocess: Callable
    num_threads: int = 4
    num_workers: int = 0

    def batches(self, *, global_batch_size: int, rows: slice) -> Iterator[Batch]:
        return eval_batches(self.source, self.preprocess, global_batch_size=global_batch_size,
                            rows=rows, num_threads=self.num_threads,
                            num_workers=self.num_workers)
