"""The global-index sampler: which examples make up global batch `s`.

Global example `g` of a run is a pure function of (seed, g): grain shuffles
each epoch with a seed folded with the epoch number, and augmentation draws
from a generator seeded by (seed, g). Global batch `s` is examples
`s*B .. s*B+B-1`; a process reads only its own rows of it. So the stream
is the same on any topology, and the position in it follows from the step.
"""

from __future__ import annotations

import math
import queue
import threading
from collections.abc import Callable, Iterator

import grain
import numpy as np

Batch = dict[str, np.ndarray]


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


def train_batches(
    stream: grain.MapDataset,
    *,
    global_batch_size: int,
    rows: slice,
    start_step: int,
    num_steps: int,
    num_threads: int = 4,
) -> Iterator[Batch]:
    """This process's rows of global batches start_step .. start_step+num_steps-1."""
    rows_per_process = rows.stop - rows.start

    def example(local_index: int) -> dict:
        step, row = _local_position(local_index, rows)
        return stream[global_index(start_step + step, row, global_batch_size)]

    local = (grain.MapDataset.range(num_steps * rows_per_process)
             .map(example)
             .batch(rows_per_process, batch_fn=_stack))
    return iter(local.to_iter_dataset(_read_options(num_threads)))


def num_eval_batches(num_examples: int, global_batch_size: int) -> int:
    return math.ceil(num_examples / global_batch_size)


def eval_batches(
    source,
    preprocess: Callable,
    *,
    global_batch_size: int,
    rows: slice,
    num_threads: int = 4,
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
    local = grain.MapDataset.range(count).map(example).batch(rows_per_process, batch_fn=_stack)
    return iter(local.to_iter_dataset(_read_options(num_threads)))


def _stack(examples: list[dict]) -> Batch:
    """Stacks examples into a batch; one clear error when their shapes differ."""
    try:
        return {key: np.stack([np.asarray(e[key]) for e in examples]) for key in examples[0]}
    except (ValueError, KeyError) as e:
        shapes = sorted({str({k: np.shape(v) for k, v in ex.items()}) for ex in examples})
        raise ValueError(
            f"cannot batch examples of different keys or shapes ({'; '.join(shapes)}). Fix: "
            "make the preprocessing return one shape for every example (pad or crop).") from e


def eval_sample_batch(sample: dict, rows: slice) -> Batch:
    """A batch shaped like this process's rows of an evaluation batch (zeros, mask 0):
    what the eval step is compiled for ahead of time."""
    count = rows.stop - rows.start
    batch = {key: np.zeros((count, *np.shape(value)), np.asarray(value).dtype)
             for key, value in sample.items()}
    batch["mask"] = np.zeros((count,), np.float32)
    return batch


class Prefetcher:
    """Moves host batches onto devices in a background thread, `depth` ahead.

    `put` turns a host batch into device arrays (it is the backend's); the
    transfer overlaps the running step. Errors surface on the next `next()`.
    """

    _DONE = object()

    def __init__(self, batches: Iterator[Batch], put: Callable, depth: int = 2):
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._fill, args=(batches, put), daemon=True)
        self._thread.start()

    def _fill(self, batches, put) -> None:
        try:
            for batch in batches:
                item = put(batch)
                while not self._stop.is_set():
                    try:
                        self._queue.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if self._stop.is_set():
                    return
            self._queue.put(self._DONE)
        except BaseException as e:  # noqa: BLE001 - re-raised in the consumer
            self._queue.put(e)

    def __iter__(self) -> Prefetcher:
        return self

    def __next__(self):
        item = self._queue.get()
        if item is self._DONE:
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        self._stop.set()
