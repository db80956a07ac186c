"""The dry run: compile the train step for the configured topology, without
training, evaluating or writing anything, and describe it (`jdp.plan`): mesh,
batch split, parameters, per-device memory against the device's capacity,
FLOPs, the collectives of the compiled step, and the modelled cost of the
gradient all-reduce at larger scales.

    python -m jdp.main --config=experiments/vit.py --workdir=runs/vit --dry_run
"""

from __future__ import annotations

import dataclasses

import jax

from jdp import mesh as mesh_lib
from jdp import metrics as metrics_lib
from jdp import optim
from jdp import plan as plan_lib
from jdp.config import BatchPlan
from jdp.experiment import Experiment, Parts
from jdp.parallel import hlo
from jdp.train import build_backend


@dataclasses.dataclass
class Preflight:
    inputs: plan_lib.PlanInputs
    lowered_hlo: str  # the program jdp hands XLA (before XLA's own rewrites)

    def text(self) -> str:
        return plan_lib.format_plan(self.inputs)


def preflight(config, experiment: Experiment, parts: Parts, plan: BatchPlan, devices=None, *,
              device_memory_bytes: int | None = None,
              step_time_s: float | None = None) -> Preflight:
    """Compiles the configured train step from shapes alone and gathers the plan's figures.

    `device_memory_bytes` overrides the capacity the device reports (CPUs report
    none); `step_time_s` is a measured step time for the scaling estimate.
    """
    mesh = mesh_lib.make_mesh(config.parallel.mesh, devices, config.parallel.hosts)
    backend = build_backend(config, mesh, parts,
                            experiment.build_optimizer(config, optim.learning_rate_fn(config)))
    abstract = backend.abstract_state(jax.random.key(config.seed), parts.sample_inputs())
    state, batch = backend.abstract_working(abstract, parts.sample, plan.global_batch_size)
    lowered = backend.lowered_train_step(state, batch)
    compiled = lowered.compile(backend.options.compiler_options)
    memory = compiled.memory_analysis()
    device = mesh.local_devices[0]
    if device_memory_bytes is None:
        stats = device.memory_stats() if hasattr(device, "memory_stats") else None
        device_memory_bytes = (stats or {}).get("bytes_limit")
    params = jax.tree.leaves(abstract.params)
    inputs = plan_lib.PlanInputs(
        platform=device.platform, device_kind=device.device_kind, device_count=mesh.size,
        process_count=jax.process_count(), mesh_shape=dict(mesh.shape),
        global_batch_size=plan.global_batch_size,
        per_process_batch_size=plan.per_process_batch_size,
        per_device_batch_size=plan.per_device_batch_size,
        micro_batch_size=plan.micro_batch_size, grad_accum_steps=plan.grad_accum_steps,
        num_params=sum(p.size for p in params),
        param_bytes=sum(p.size * p.dtype.itemsize for p in params),
        argument_bytes=memory.argument_size_in_bytes, output_bytes=memory.output_size_in_bytes,
        temp_bytes=memory.temp_size_in_bytes, alias_bytes=memory.alias_size_in_bytes,
        device_memory_bytes=device_memory_bytes,
        flops_per_step=(compiled.cost_analysis() or {}).get("flops"),
        peak_flops_per_s=metrics_lib.peak_flops_per_s(device.device_kind),
        step_time_s=step_time_s, collectives=tuple(hlo.collectives(compiled.as_text())),
        grad_reduce_dtype=config.parallel.grad_reduce_dtype,
        # (sum, weight) of the loss and each metric, packed beside the gradients
        metric_bytes=4 * 2 * (1 + len(parts.metric_names)))
    return Preflight(inputs, lowered.as_text(dialect="hlo", debug_info=True))
