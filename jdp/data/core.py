"""What jdp needs from an experiment's data, and the checks run on it at start.

An experiment file may define `build_data(config) -> jdp.data.Data` (or
`build_data(config, *, workdir)`, to keep prepared data in the workdir): train and
eval *sources* (anything with `__len__` and `__getitem__(index) -> dict`: a
TFDS data source, a grain source, `jdp.data.files` sources, numpy arrays
wrapped in a class; one that also has `get_batch(indices) -> dict` of stacked
examples is read into memory by it, or, with `memory_mapped = True`, asked for each
batch), the per-example preprocessing on the host and, optionally,
a batch preprocessing on the device. jdp keeps the rest: the global-index
sampler, each process reading only its rows, padding and a mask for
evaluation, worker processes, prefetching and resuming at a step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import cloudpickle
import numpy as np

from jdp.errors import ConfigError

Batch = dict[str, np.ndarray]  # feature name -> stacked values, one row per example
# (example, rng) -> dict of numpy arrays. rng is a numpy Generator seeded by
# (seed, global example index) for training and None for evaluation.
Preprocess = Callable[[dict, "np.random.Generator | None"], dict]
# (batch, rngs) -> batch: `Preprocess` for n examples at once. batch holds their
# features as read from the source, stacked (one array per feature, leading axis n);
# rngs[i] is the generator `Preprocess` gets for example i (None for evaluation).
BatchPreprocess = Callable[[dict, "Sequence[np.random.Generator] | None"], dict]
# batch -> batch, traced inside the compiled train and eval steps.
DevicePreprocess = Callable[[dict], dict]

# How many examples of each split are preprocessed at start to check shapes.
_CHECKED_EXAMPLES = 4


def _identity(example: dict, rng) -> dict:
    del rng
    return {key: np.asarray(value) for key, value in example.items()}


@dataclasses.dataclass(frozen=True)
class Data:
    """The train and eval sources and how one example becomes model inputs.

    `preprocess` runs on the host, per example (in worker processes with
    `data.num_workers`, so it must be picklable). `eval_preprocess` defaults to
    `preprocess` (called with rng=None). `device_preprocess`, if given, is a
    jittable function of a batch dict (one device's rows, or all of them) that
    runs inside the compiled train and eval steps before the model and the
    objective see the batch: do the cheap elementwise work there (e.g. uint8
    pixels -> normalised float32) so that fewer bytes cross to the device. It
    must treat rows independently and return every feature the model and the
    objective read. `num_classes` is passed to `build_model(config, *,
    num_classes)` when it asks.

    `batch_preprocess(batch, rngs)`, optional, is `preprocess` for a whole batch:
    `batch` maps each feature to the stacked values of n examples as the source
    gives them (numeric features only), `rngs[i]` is the generator `preprocess`
    would get for example i (valid during the call, as grain's are; None for
    evaluation), and it must return exactly what stacking `preprocess(example_i,
    rngs[i])` gives, bitwise, dtypes included (draw from each rngs[i] what
    `preprocess` draws, in the same order; do the rest vectorised). With it, a
    split that fits in memory (`data.in_memory`) is read once into arrays and
    each batch is one fancy index and one call, with no threads or worker
    processes. `eval_batch_preprocess` is the batch form of `eval_preprocess`;
    it defaults to `batch_preprocess` where `eval_preprocess` is unset. A split
    without a batch form streams through grain, example by example.
    """

    train: Any
    eval: Any
    preprocess: Preprocess = _identity
    eval_preprocess: Preprocess | None = None
    num_classes: int | None = None
    device_preprocess: DevicePreprocess | None = None
    batch_preprocess: BatchPreprocess | None = None
    eval_batch_preprocess: BatchPreprocess | None = None

    def preprocess_for(self, train: bool) -> Preprocess:
        if train or self.eval_preprocess is None:
            return self.preprocess
        return self.eval_preprocess

    def batch_preprocess_for(self, train: bool) -> BatchPreprocess | None:
        """The batch form of `preprocess_for(train)`, None where there is none."""
        if train:
            return self.batch_preprocess
        if self.eval_batch_preprocess is not None:
            return self.eval_batch_preprocess
        # batch_preprocess is the batch form of preprocess, not of an eval_preprocess.
        return self.batch_preprocess if self.eval_preprocess is None else None


def _describe(example: dict) -> dict[str, tuple]:
    return {key: (np.shape(value), np.asarray(value).dtype.name) for key, value in example.items()}


def check(data: Data, where: str) -> dict[str, np.ndarray]:
    """Checks `data` and returns one preprocessed eval example (the model's sample input).

    Both sources must have a length and examples; a few examples of each split
    are preprocessed, and every one must give a dict of arrays with the same
    keys, shapes and dtypes, so that batches can be stacked.
    """
    if not isinstance(data, Data):
        raise ConfigError(f"{where} returned {type(data).__name__}. Fix: return "
                          "jdp.data.Data(train=..., eval=..., preprocess=...).")
    for field, kind in (("device_preprocess", "a jittable function batch -> batch"),
                        ("batch_preprocess", "a function (batch, rngs) -> batch"),
                        ("eval_batch_preprocess", "a function (batch, rngs) -> batch")):
        value = getattr(data, field)
        if value is not None and not callable(value):
            raise ConfigError(f"{where}: {field} is a {type(value).__name__}. Fix: pass "
                              f"{kind}, or None.")
    examples = []
    for split, source in (("train", data.train), ("eval", data.eval)):
        if not (hasattr(source, "__len__") and hasattr(source, "__getitem__")):
            raise ConfigError(
                f"{where}: the {split} source ({type(source).__name__}) has no "
                f"{'__len__' if not hasattr(source, '__len__') else '__getitem__'}. Fix: return "
                "a random-access source (a TFDS data source, a grain source, "
                "jdp.data.files.open_files(...), or a class with __len__ and __getitem__).")
        if len(source) == 0:
            raise ConfigError(f"{where}: the {split} source is empty. Fix: point it at data.")
        preprocess = data.preprocess_for(train=split == "train")
        for index in range(min(_CHECKED_EXAMPLES, len(source))):
            rng = np.random.default_rng(0) if split == "train" else None
            example = preprocess(source[index], rng)
            if not isinstance(example, dict):
                raise ConfigError(f"{where}: preprocessing {split} example {index} returned "
                                  f"{type(example).__name__}. Fix: return a dict of numpy arrays.")
            examples.append((split, index, example))
    first_split, first_index, first = examples[0]
    for split, index, example in examples[1:]:
        if _describe(example) != _describe(first):
            raise ConfigError(
                f"{where}: {split} example {index} preprocesses to {_describe(example)} but "
                f"{first_split} example {first_index} to {_describe(first)}; every example "
                "must give the same keys, shapes and dtypes to be batched. Fix: pad, crop or "
                "resize to one shape in the preprocessing.")
    return next(example for split, _, example in examples if split == "eval")


def check_picklable(data: Data, where: str, num_workers: int) -> None:
    """Worker processes receive the sources and the preprocessing by pickle (cloudpickle):
    fails here, before anything starts, naming what cannot be sent."""
    for name in ("train", "eval", "preprocess", "eval_preprocess"):
        try:
            cloudpickle.dumps(getattr(data, name))
        except Exception as e:  # noqa: BLE001 - pickling raises many types; all mean the same
            raise ConfigError(
                f"config.data.num_workers={num_workers}: the {name} of {where} cannot be sent "
                f"to worker processes ({type(e).__name__}: {e}). Fix: build it from picklable "
                "parts (open files, locks and clients lazily, inside the function, not in "
                "build_data), or pass --config.data.num_workers=0 to prepare the data with "
                "threads of the training process.") from e
