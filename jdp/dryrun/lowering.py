"""The step the loop runs, lowered from shapes alone: nothing is allocated or run."""

from __future__ import annotations

import jax

from jdp.parallel.backends import Backend
from jdp.parallel.state import TrainState


def lower_from_shapes(backend: Backend, sample_inputs: tuple, example: dict,
                      global_batch_size: int, seed: int = 0) -> tuple[jax.stages.Lowered,
                                                                     TrainState]:
    """(the lowered step for batches of `global_batch_size` examples shaped like `example`,
    the abstract canonical state). The step is the one the loop runs, window sums and
    all (`Backend.lowered_window_step`), so the run's own compile of it is a hit in the
    persistent compilation cache. `sample_inputs` are the model's inputs for one example
    (leading dimension 1)."""
    abstract = backend.abstract_state(jax.random.key(seed), sample_inputs)
    state, batch = backend.abstract_working(abstract, example, global_batch_size)
    return backend.lowered_window_step(state, batch), abstract
