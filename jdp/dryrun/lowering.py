"""The train step lowered from shapes alone: nothing is allocated or run."""

from __future__ import annotations

import jax

from jdp.parallel.backends import Backend
from jdp.parallel.state import TrainState


def lower_from_shapes(backend: Backend, sample_inputs: tuple, example: dict,
                      global_batch_size: int, seed: int = 0) -> tuple[jax.stages.Lowered,
                                                                     TrainState]:
    """(the lowered train step for batches of `global_batch_size` examples shaped like
    `example`, the abstract canonical state). `sample_inputs` are the model's inputs for
    one example (leading dimension 1)."""
    abstract = backend.abstract_state(jax.random.key(seed), sample_inputs)
    state, batch = backend.abstract_working(abstract, example, global_batch_size)
    return backend.lowered_train_step(state, batch), abstract
