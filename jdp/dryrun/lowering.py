"""The step the loop runs, lowered from shapes alone: nothing is allocated or run; and a
lowered program compiled only to be read."""

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


# On CPU, XLA generates the machine code of a program compiled only to be read at this
# level: its optimised HLO and memory analysis are what the default level gives (compared
# for every program of the memory and communication benchmarks and of the tests that
# read programs), in about a quarter less time.
_READ_ONLY_CPU_OPTIONS = {"xla_backend_optimization_level": 0}


def compile_to_read(lowered: jax.stages.Lowered,
                    options: dict | None = None) -> jax.stages.Compiled:
    """`lowered` (for jax's default backend) compiled with XLA `options` for reading
    (`as_text()`, memory and cost analysis), never to run. Not for a program a run will
    fetch from the compilation cache (the dry run's): that needs the run's own options."""
    options = dict(options or {})
    if jax.default_backend() == "cpu":
        options.update(_READ_ONLY_CPU_OPTIONS)
    return lowered.compile(options)
