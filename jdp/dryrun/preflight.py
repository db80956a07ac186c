"""The dry run: compile the train step for the configured topology, without
training, evaluating or writing anything, and describe it (`estimate`): mesh,
batch split, parameters, per-device memory against the device's capacity,
FLOPs, the collectives of the compiled step, and the modelled cost of the
gradient all-reduce at larger scales.

    python -m jdp.main --config=experiments/vit.py --workdir=runs/vit --dry_run
"""

from __future__ import annotations

import dataclasses

import jax

from jdp.config import BatchSplit
from jdp.dryrun import estimate, hlo
from jdp.dryrun.lowering import lower_from_shapes
from jdp.experiment import optim
from jdp.experiment.components import Components
from jdp.experiment.loader import Experiment
from jdp.observe.throughput import peak_flops_per_s
from jdp.parallel import mesh as mesh_lib
from jdp.parallel.factory import build_backend


@dataclasses.dataclass
class Preflight:
    inputs: estimate.PlanInputs
    lowered_hlo: str  # the program jdp hands XLA (before XLA's own rewrites)

    def text(self) -> str:
        return estimate.format_plan(self.inputs)


def preflight(config, experiment: Experiment, components: Components, split: BatchSplit,
              devices=None, *,
              device_memory_bytes: int | None = None,
              step_time_s: float | None = None) -> Preflight:
    """Compiles the configured train step from shapes alone and gathers the plan's figures.
    The program is the one the loop runs (`lowering.lower_from_shapes`), so a run after
    the plan, sharing its compilation cache, reads the step from the cache.

    `device_memory_bytes` overrides the capacity the device reports (CPUs report
    none); `step_time_s` is a measured step time for the scaling estimate.
    """
    mesh = mesh_lib.make_mesh(config.parallel.mesh, devices, config.parallel.hosts,
                              config.parallel.model_parallel)
    backend = build_backend(config, mesh, components,
                            experiment.build_optimizer(config, optim.learning_rate_fn(config)))
    lowered, abstract = lower_from_shapes(backend, components.sample_inputs(), components.sample,
                                          split.global_batch_size, config.seed)
    compiled = lowered.compile(backend.options.compiler_options)
    memory = compiled.memory_analysis()
    device = mesh.local_devices[0]
    if memory is None:
        raise estimate.MemoryUnknown(
            f"XLA gave no memory analysis of the train step on {device.platform} "
            f"({device.device_kind}): its per-device memory is unknown. Fix: plan the memory "
            "on a platform that reports it (GPU, TPU, CPU).")
    if device_memory_bytes is None:
        stats = device.memory_stats() if hasattr(device, "memory_stats") else None
        device_memory_bytes = (stats or {}).get("bytes_limit")
    params = jax.tree.leaves(abstract.params)
    # What this process feeds: more than its share where a model group spans processes.
    rows = mesh_lib.process_rows(mesh, split.global_batch_size)
    inputs = estimate.PlanInputs(
        platform=device.platform, device_kind=device.device_kind, device_count=mesh.size,
        process_count=jax.process_count(), mesh_shape=dict(mesh.shape),
        global_batch_size=split.global_batch_size,
        per_process_batch_size=rows.stop - rows.start,
        per_device_batch_size=split.per_device_batch_size,
        micro_batch_size=split.micro_batch_size, grad_accum_steps=split.grad_accum_steps,
        num_params=sum(p.size for p in params),
        param_bytes=sum(p.size * p.dtype.itemsize for p in params),
        argument_bytes=memory.argument_size_in_bytes, output_bytes=memory.output_size_in_bytes,
        temp_bytes=memory.temp_size_in_bytes, alias_bytes=memory.alias_size_in_bytes,
        device_memory_bytes=device_memory_bytes,
        flops_per_step=(compiled.cost_analysis() or {}).get("flops"),
        peak_flops_per_s=peak_flops_per_s(device.device_kind),
        step_time_s=step_time_s, collectives=tuple(hlo.collectives(compiled.as_text())),
        grad_reduce_dtype=config.parallel.grad_reduce_dtype,
        # (sum, weight) of the loss and each metric, packed beside the gradients
        metric_bytes=4 * 2 * (1 + len(components.metric_names)),
        host_of=mesh_lib.host_of(mesh),
        state_bytes_per_device=mesh_lib.device_bytes((abstract.params, abstract.opt_state)),
        model_parallel=mesh_lib.model_size(mesh), data_replica_of=mesh_lib.data_replica_of(mesh),
        reduced_param_count=sum(p.size // mesh_lib.model_size(mesh)
                                if mesh_lib.splits_over_model(p.sharding.spec) else p.size
                                for p in params))
    return Preflight(inputs, lowered.as_text(dialect="hlo", debug_info=True))

