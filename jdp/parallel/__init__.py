"""Data parallelism: the per-device step math and the pmap / pjit backends."""

from jdp.parallel.backends import BACKENDS, Backend, StepOptions, compiler_options, make_backend
from jdp.parallel.reduction import Reduction
from jdp.parallel.step import TrainState

__all__ = [
    "BACKENDS", "Backend", "Reduction", "StepOptions", "TrainState", "compiler_options",
    "make_backend",
]
