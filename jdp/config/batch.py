"""The batch arithmetic: how one global batch splits over processes, devices and
micro-batches, and how the learning rate scales with the global batch."""

from __future__ import annotations

import dataclasses
import math

from jdp.config.checks import fail


@dataclasses.dataclass(frozen=True)
class BatchSplit:
    """How one global batch is split over processes, devices and micro-batches. With a
    model axis (`model_parallel` > 1) the batch splits over the data-parallel devices
    only: the devices of a model group compute on the same rows."""

    global_batch_size: int
    process_count: int
    device_count: int
    grad_accum_steps: int
    model_parallel: int = 1

    @property
    def data_parallel_size(self) -> int:
        """The ways the batch is split: devices / model_parallel."""
        return self.device_count // self.model_parallel

    @property
    def per_process_batch_size(self) -> int:
        return self.global_batch_size // self.process_count

    @property
    def per_device_batch_size(self) -> int:
        """Examples each device computes on (its data replica's rows)."""
        return self.global_batch_size // self.data_parallel_size

    @property
    def micro_batch_size(self) -> int:
        """Examples per device in one accumulation micro-step."""
        return self.per_device_batch_size // self.grad_accum_steps



def data_devices_text(device_count: int, model_parallel: int) -> str:
    """How an error names the devices the batch splits over."""
    if model_parallel == 1:
        return f"the device count ({device_count})"
    return (f"the data-parallel device count ({device_count} devices / model_parallel "
            f"{model_parallel} = {device_count // model_parallel})")


def batch_split(
    global_batch_size: int, grad_accum_steps: int, device_count: int, process_count: int,
    model_parallel: int = 1,
) -> BatchSplit:
    """Checks the batch arithmetic; every later size is derived from the global batch.
    The batch splits over the data-parallel devices (`device_count / model_parallel`)."""
    data_devices = device_count // model_parallel
    if global_batch_size % data_devices:
        lower = global_batch_size - global_batch_size % data_devices
        fail(
            "batch_size",
            global_batch_size,
            "the global batch must be divisible by "
            f"{data_devices_text(device_count, model_parallel)}",
            f"use a multiple of {data_devices}, e.g. --config.batch_size={lower or data_devices}",
        )
    per_device = global_batch_size // data_devices
    if per_device % grad_accum_steps:
        devices = (f"{data_devices} devices" if model_parallel == 1 else
                   f"{data_devices} data-parallel devices")
        fail(
            "grad_accum_steps",
            grad_accum_steps,
            f"must divide the per-device batch ({global_batch_size} / {devices} "
            f"= {per_device})",
            f"use a divisor of {per_device}, or a batch_size that is a multiple of "
            f"{data_devices * grad_accum_steps}",
        )
    return BatchSplit(global_batch_size, process_count, device_count, grad_accum_steps,
                      model_parallel)



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

