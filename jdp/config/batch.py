"""The batch arithmetic: how one global batch splits over processes, devices and
micro-batches, and how the learning rate scales with the global batch."""

from __future__ import annotations

import dataclasses
import math

from jdp.config.checks import fail


@dataclasses.dataclass(frozen=True)
class BatchSplit:
    """How one global batch is split over processes, devices and micro-batches."""

    global_batch_size: int
    process_count: int
    device_count: int
    grad_accum_steps: int

    @property
    def per_process_batch_size(self) -> int:
        return self.global_batch_size // self.process_count

    @property
    def per_device_batch_size(self) -> int:
        return self.global_batch_size // self.device_count

    @property
    def micro_batch_size(self) -> int:
        """Examples per device in one accumulation micro-step."""
        return self.per_device_batch_size // self.grad_accum_steps



def batch_split(
    global_batch_size: int, grad_accum_steps: int, device_count: int, process_count: int
) -> BatchSplit:
    """Checks the batch arithmetic; every later size is derived from the global batch."""
    if global_batch_size % device_count:
        lower = global_batch_size - global_batch_size % device_count
        fail(
            "batch_size",
            global_batch_size,
            f"the global batch must be divisible by the device count ({device_count})",
            f"use a multiple of {device_count}, e.g. --config.batch_size={lower or device_count}",
        )
    per_device = global_batch_size // device_count
    if per_device % grad_accum_steps:
        fail(
            "grad_accum_steps",
            grad_accum_steps,
            f"must divide the per-device batch ({global_batch_size} / {device_count} devices "
            f"= {per_device})",
            f"use a divisor of {per_device}, or a batch_size that is a multiple of "
            f"{device_count * grad_accum_steps}",
        )
    return BatchSplit(global_batch_size, process_count, device_count, grad_accum_steps)



def scaled_learning_rate(
    learning_rate: float, lr_scaling: str, global_batch_size: int, base_batch_size: int
) -> float:
    """The peak learning rate for this batch size.

    `learning_rate` is the rate tuned at `base_batch_size`. 'linear' scales it by
    batch/base (Goyal et al., 2017, for SGD), 'sqrt' by sqrt(batch/base) (the rule
    usually used for Adam-type optimizers), 'none' keeps it as given.
    """
    ratio = global_batch_size / base_batch_size
    if lr_scaling == "linear":
        return learning_rate * ratio
    if lr_scaling == "sqrt":
        return learning_rate * math.sqrt(ratio)
    return learning_rate

