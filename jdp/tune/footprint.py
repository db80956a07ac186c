"""A candidate's per-device memory, read from its train step compiled from shapes (the
dry run's compile: nothing is allocated, no data is read), and the capacity it must fit.
"""

from __future__ import annotations

import dataclasses

import jax

from jdp import config as config_lib
from jdp.dryrun import estimate, preflight
from jdp.experiment import components as components_lib
from jdp.experiment.loader import Experiment


@dataclasses.dataclass(frozen=True)
class Footprint:
    needed_bytes: int | None  # per device; None where XLA gives no memory analysis
    reported_capacity_bytes: int | None  # what the device says it has (CPUs: nothing)


def measure(config, experiment: Experiment, devices=None, workdir: str = "") -> Footprint:
    """Compiles the step `config`'s loop runs from shapes; reads its per-device footprint."""
    device_count = jax.device_count() if devices is None else len(devices)
    split = config_lib.validate(config, device_count, jax.process_count())
    components = components_lib.build(experiment, config, workdir=workdir)
    try:
        plan = preflight.preflight(config, experiment, components, split, devices)
    except estimate.MemoryUnknown:
        return Footprint(None, None)
    return Footprint(estimate.needed_bytes(plan.inputs), plan.inputs.device_memory_bytes)


@dataclasses.dataclass(frozen=True)
class Capacity:
    """The per-device memory a candidate may use: the capacity less the margin."""

    capacity_bytes: int | None  # None: unknown, every candidate fits
    margin: float  # the fraction of the capacity kept free

    @property
    def usable_bytes(self) -> int | None:
        return None if self.capacity_bytes is None else int(
            self.capacity_bytes * (1 - self.margin))

    def fits(self, needed_bytes: int | None) -> bool:
        """An unknown footprint or capacity fits: only the trial can tell."""
        usable = self.usable_bytes
        return needed_bytes is None or usable is None or needed_bytes <= usable
