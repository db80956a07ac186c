"""Data parallelism over the global device mesh.

`mesh` builds the hosts x local mesh and the shardings, `state` the train state,
`step` the per-device gradient, update and evaluation math both backends run,
`reducers` one object per gradient-reduction strategy (flat, ZeRO-1, FSDP,
two-level; `two_level` holds the two-level math and its compression), `backends`
the pmap and pjit backends behind one interface, and `factory` the configured
backend.
"""

from jdp.parallel.backends import Backend, StepOptions, compiler_options, make_backend
from jdp.parallel.state import TrainState

__all__ = ["Backend", "StepOptions", "TrainState", "compiler_options", "make_backend"]
