"""Splits batched by vectorised numpy: read once into arrays, or gathered from a memory map.

Streaming a split through grain costs ~115 us of Python per example (read and
decode, grain's wrappers, the index shuffle, a seeded generator): ~15 ms of CPU
per 128-example batch, taken from the cores the step runs on. A split whose `Data`
has a batch form of its preprocessing (`Data.batch_preprocess`) is instead batched
here, when `config.data.in_memory` is 'auto' or 'true' ('false': never). A source
whose `get_batch` reads memory-mapped files (it says so with `memory_mapped = True`,
as a token store's windows do) is gathered from them batch by batch: nothing is
read ahead, so host memory does not grow with the corpus (the page cache holds what
is read). Any other source is read once, one array per feature, when the arrays take
at most `BUDGET_BYTES` ('auto'; 'true': whatever they take). A batch is then the
source positions of its global indices (a lookup in the epoch's permutation), one
gather and one call of the batch preprocessing, in the thread that asks for it:
`data.num_threads` and `data.num_workers` do not apply.

The batches are bitwise grain's (`streamed.example_stream`): global example g is
in epoch g // n at the source position grain's shuffle gives g % n in that epoch
(the same cipher, `jdp.data.index_shuffle`, with the seed grain derives for the
epoch), and its preprocessing draws from the generator grain's `random_map` makes
for g. Before a split is used, that is checked against grain itself at a few
global indices of several epochs, and the batch preprocessing against the
per-example one on the first examples.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import numpy as np
from absl import logging

from jdp.data import index_shuffle, streamed
from jdp.data.core import Batch, BatchPreprocess, Data, Preprocess
from jdp.errors import ConfigError

BUDGET_BYTES = 2**30  # 'auto': the most a split's arrays may take, in each process
_CHECKED_EXAMPLES = 4  # the batch preprocessing is compared with the per-example one on these
_READ_CHUNK = 4096  # examples per call of a source's get_batch(indices)

Arrays = dict[str, np.ndarray]


class Unsuitable(Exception):
    """Why a split cannot be batched from memory."""


class Rows(Protocol):
    """A split's examples by source position, gathered a batch at a time."""

    def __len__(self) -> int: ...

    def gather(self, positions: np.ndarray) -> Batch:
        """The stacked numeric features of the examples at `positions`."""

    def describe(self) -> str:
        """Where the examples come from, for the log."""


@dataclasses.dataclass(frozen=True)
class ArrayRows:
    """Examples read into memory once, one array per feature (`read`)."""

    arrays: Arrays

    def __len__(self) -> int:
        return len(next(iter(self.arrays.values())))

    def gather(self, positions: np.ndarray) -> Batch:
        return {key: array[positions] for key, array in self.arrays.items()}

    def describe(self) -> str:
        return (f"read into memory, {sum(a.nbytes for a in self.arrays.values()) / 2**20:.1f} "
                "MiB (" + ", ".join(f"{k} {a.dtype}{list(a.shape[1:])}"
                                    for k, a in self.arrays.items()) + ")")


@dataclasses.dataclass(frozen=True)
class MappedRows:
    """Examples gathered by the source's own `get_batch` from memory-mapped files."""

    source: Any

    def __len__(self) -> int:
        return len(self.source)

    def gather(self, positions: np.ndarray) -> Batch:
        return self.source.get_batch(positions)

    def describe(self) -> str:
        return "gathered from memory-mapped files batch by batch (nothing read ahead)"


@dataclasses.dataclass(frozen=True)
class InMemoryTrain:
    """The training split batched here: `batches` gives bitwise what
    `streamed.StreamedTrain.batches` gives."""

    rows: Rows
    batch_preprocess: BatchPreprocess
    order: Order

    def batches(self, *, global_batch_size: int, rows: slice, start_step: int,
                num_steps: int) -> Iterator[Batch]:
        """This process's rows of global batches start_step .. start_step+num_steps-1,
        prepared in the thread that iterates."""
        local_rows = np.arange(rows.start, rows.stop)
        for step in range(start_step, start_step + num_steps):
            indices = streamed.global_index(step, local_rows, global_batch_size)
            batch = self.rows.gather(self.order.positions(indices))
            yield self.batch_preprocess(batch, self.order.generators(indices))


@dataclasses.dataclass(frozen=True)
class InMemoryEval:
    """The evaluation split batched here: `batches` gives bitwise what
    `streamed.StreamedEval.batches` gives, padding and mask included."""

    rows: Rows
    batch_preprocess: BatchPreprocess

    def batches(self, *, global_batch_size: int, rows: slice) -> Iterator[Batch]:
        num_examples = len(self.rows)
        local_rows = np.arange(rows.start, rows.stop)
        for step in range(streamed.num_eval_batches(num_examples, global_batch_size)):
            indices = streamed.global_index(step, local_rows, global_batch_size)
            valid = indices < num_examples  # padding: copies of example 0, masked out
            batch = self.rows.gather(np.where(valid, indices, 0))
            yield {**self.batch_preprocess(batch, None), "mask": valid.astype(np.float32)}


def load(data: Data, *, train: bool, setting: str) -> tuple[Rows, BatchPreprocess] | None:
    """The split's rows and batch preprocessing (checked), None for setting 'false'."""
    if setting == "false":
        return None
    split = "train" if train else "eval"
    batch_preprocess = data.batch_preprocess_for(train)
    if batch_preprocess is None:
        raise Unsuitable("its Data has no batch form of the preprocessing (Data.batch_preprocess; "
                          "jdp's image preprocessing has none for images it resizes)")
    source = data.train if train else data.eval
    if getattr(source, "memory_mapped", False) and hasattr(source, "get_batch"):
        rows: Rows = MappedRows(source)
    else:
        rows = ArrayRows(read(source, budget_bytes=BUDGET_BYTES if setting == "auto" else None))
    _check_batch_form(rows, source, data.preprocess_for(train), batch_preprocess,
                      train=train, where=f"config.data.in_memory={setting!r}: the {split} split")
    logging.info("the %s split is batched by numpy: %d examples, %s", split, len(source),
                 rows.describe())
    return rows, batch_preprocess


def _is_numeric(value) -> bool:
    return np.asarray(value).dtype.kind in "biufc"


def read(source, budget_bytes: int | None = None) -> Arrays:
    """Every example of `source`, one array per feature with the examples on its first
    axis. Features that are not numeric (bytes, strings) are left out; each numeric one
    must have one shape and dtype in every example. Raises Unsuitable, before reading
    on, once the arrays would take more than `budget_bytes`."""
    count = len(source)
    first = source[0]
    keys = [key for key, value in first.items() if _is_numeric(value)]
    if not keys:
        raise Unsuitable(f"no feature is numeric (they are {', '.join(map(repr, first))})")
    arrays = {key: np.empty((count, *np.shape(first[key])), np.asarray(first[key]).dtype)
              for key in keys}
    size_bytes = sum(array.nbytes for array in arrays.values())  # nothing allocated yet
    if budget_bytes is not None and size_bytes > budget_bytes:
        raise Unsuitable(f"its {count:,} examples take {size_bytes / 2**20:,.1f} MiB, above the "
                          f"{budget_bytes / 2**20:,.1f} MiB that 'auto' reads into memory")
    if hasattr(source, "get_batch"):  # a source that reads many examples at once
        for start in range(0, count, _READ_CHUNK):
            chunk = source.get_batch(np.arange(start, min(start + _READ_CHUNK, count)))
            for key, array in arrays.items():
                array[start:start + len(chunk[key])] = chunk[key]
        return arrays
    for index in range(count):
        example = first if index == 0 else source[index]
        for key, array in arrays.items():
            if key not in example:
                raise Unsuitable(f"example {index} has no feature {key!r}")
            value = np.asarray(example[key])
            if value.shape != array.shape[1:] or value.dtype != array.dtype:
                raise Unsuitable(f"feature {key!r} is {value.dtype}{list(value.shape)} in example "
                                  f"{index} but {array.dtype}{list(array.shape[1:])} in example 0")
            array[index] = value
    return arrays


def _check_batch_form(rows: Rows, source, preprocess: Preprocess,
                      batch_preprocess: BatchPreprocess, *, train: bool, where: str) -> None:
    """The batch preprocessing of the first examples must be bitwise the stacked
    per-example preprocessing (with generators seeded alike); a mistake is named here."""
    count = min(_CHECKED_EXAMPLES, len(source))

    def generators():
        return [np.random.default_rng(i) for i in range(count)] if train else [None] * count

    expected = streamed.stack_examples(
        [preprocess(source[i], rng) for i, rng in enumerate(generators())])
    fix = ("Fix: make batch_preprocess(batch, rngs) return exactly what stacking "
           "preprocess(example, rng) gives, or pass --config.data.in_memory=false to use "
           "preprocess alone.")
    try:
        batch = rows.gather(np.arange(count))
        got = batch_preprocess(batch, generators() if train else None)
    except Exception as e:  # noqa: BLE001 - whatever the user's function raises
        raise ConfigError(
            f"{where}: its batch_preprocess failed on examples 0-{count - 1} "
            f"({type(e).__name__}: {e}); it gets the numeric features "
            f"{sorted(batch)}. {fix}") from e
    difference = _difference(got, expected)
    if difference:
        raise ConfigError(f"{where}: its batch_preprocess is not its preprocess for a batch: on "
                          f"examples 0-{count - 1}, {difference}. {fix}")


def _difference(got, expected: Batch) -> str:
    """How a batch differs from the expected one, bitwise; '' when it does not."""
    if not isinstance(got, dict):
        return f"it returned {type(got).__name__}, not a dict"
    if sorted(got) != sorted(expected):
        return f"it gives features {sorted(got)}, preprocess {sorted(expected)}"
    for key, want in expected.items():
        value = np.asarray(got[key])
        if (value.dtype, value.shape) != (want.dtype, want.shape):
            return (f"feature {key!r} is {value.dtype}{list(value.shape)}, preprocess gives "
                    f"{want.dtype}{list(want.shape)}")
        if value.tobytes() != want.tobytes():
            return f"feature {key!r} has other values"
    return ""


def _grain_seed(seed: int, depth: int) -> int:
    """The seed grain gives a transformation `depth` levels below `ds.seed(seed)` (its
    `_default_seed`): example_stream's shuffle is 1 level below, its random_map 3."""
    return int(np.random.SeedSequence([seed, depth]).generate_state(1, np.uint32)[0])


class Order:
    """Where global training example g comes from in grain's example stream for `seed`:
    its source position and the generator its preprocessing draws from."""

    _KEPT_EPOCHS = 2  # a batch spans at most two epochs (unless it holds more than one)
    # Larger epochs (a big token store's windows) are shuffled batch by batch, for the
    # indices asked alone, so memory stays bounded whatever the source's size (~0.3 ms a
    # batch, where a kept permutation costs a lookup).
    PERMUTATION_MAX_EXAMPLES = 1 << 22

    def __init__(self, num_examples: int, seed: int):
        self.num_examples = num_examples
        self.seed = seed
        self._shuffle_seed = _grain_seed(seed, 1)
        self._key = np.random.Philox(_grain_seed(seed, 3)).state["state"]["key"]
        self._permutations: dict[int, np.ndarray] = {}
        self.pool: list[np.random.Generator] = []  # what `generators` hands out

    def positions(self, global_indices: np.ndarray) -> np.ndarray:
        """The source positions of `global_indices`: grain's shuffle of each epoch."""
        epochs, offsets = np.divmod(global_indices, self.num_examples)
        positions = np.empty_like(offsets)
        for epoch in np.unique(epochs):
            here = epochs == epoch
            if self.num_examples > self.PERMUTATION_MAX_EXAMPLES:
                positions[here] = index_shuffle.shuffle(offsets[here], self.num_examples,
                                                        self._epoch_seed(int(epoch)))
            else:
                positions[here] = self._permutation(int(epoch))[offsets[here]]
        return positions

    def _epoch_seed(self, epoch: int) -> int:
        return (self._shuffle_seed + epoch) % 2**32  # grain's seed of epoch `epoch`

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch not in self._permutations:
            if len(self._permutations) >= self._KEPT_EPOCHS:
                del self._permutations[next(iter(self._permutations))]  # the oldest
            self._permutations[epoch] = index_shuffle.permutation(self.num_examples,
                                                                  self._epoch_seed(epoch))
        return self._permutations[epoch]

    def generator(self, global_index: int,
                  reuse: np.random.Generator | None = None) -> np.random.Generator:
        """grain's generator for example g: Philox with the random_map's key, counter
        [0, 0, 0, g] and nothing drawn yet; `reuse` is set to that state (~1.5 us, where
        making a generator takes ~10 us)."""
        generator = reuse or np.random.Generator(np.random.Philox(key=self._key))
        generator.bit_generator.state = {
            "bit_generator": "Philox",
            "state": {"counter": np.array([0, 0, 0, global_index], np.uint64), "key": self._key},
            "buffer": np.zeros(4, np.uint64), "buffer_pos": 4, "has_uint32": 0, "uinteger": 0}
        return generator

    def generators(self, global_indices: np.ndarray) -> Sequence[np.random.Generator]:
        """The generators of `global_indices`, each set up when first used (a preprocessing
        that draws nothing costs nothing). They are this Order's, reused by the next call,
        as grain reuses its own: a batch preprocessing must not keep them."""
        return _Generators(self, global_indices)

    def check_against_grain(self) -> None:
        """Raises Unsuitable unless grain's own example stream has the same source position
        and generator at global indices of several epochs (another grain version may not)."""
        n = self.num_examples
        stream = streamed.example_stream(range(n), _position_and_draw, self.seed)
        for index in (0, n - 1, n + n // 2, 5 * n + 3):
            ours = (int(self.positions(np.array([index]))[0]),
                    _position_and_draw(0, self.generator(index))[1])
            if ours != stream[index]:
                raise Unsuitable(
                    f"grain {importlib.metadata.version('grain')} orders or seeds the example "
                    f"stream otherwise than jdp reproduces it (global example {index}: grain "
                    f"gives source position and first draw {stream[index]}, jdp {ours})")


def _position_and_draw(position: int, rng: np.random.Generator) -> tuple[int, int]:
    return int(position), int(rng.integers(2**63))


class _Generators(Sequence):
    def __init__(self, order: Order, global_indices: np.ndarray):
        self._order = order
        self._indices = global_indices
        self._ready: set[int] = set()

    def __len__(self) -> int:
        return len(self._indices)

    def __getitem__(self, i: int) -> np.random.Generator:
        i = range(len(self._indices))[i]  # negative indices; IndexError past the end
        pool = self._order.pool
        while len(pool) <= i:
            pool.append(np.random.Generator(np.random.Philox()))
        if i not in self._ready:
            self._order.generator(int(self._indices[i]), reuse=pool[i])
            self._ready.add(i)
        return pool[i]
