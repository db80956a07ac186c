"""The configured backend: `config.parallel` and the step settings, read in one place."""

from __future__ import annotations

import optax
from jax.sharding import Mesh

from jdp.experiment import optim
from jdp.experiment.components import Components
from jdp.parallel.backends import Backend, StepOptions, compiler_options, make_backend


def step_options(config, platform: str, device_preprocess=None,
                 axis_rules: tuple = ()) -> StepOptions:
    """The train step's settings from the config, for devices of `platform` (and the
    experiment's data preprocessing on the device and rules for the model axis)."""
    parallel = config.parallel
    return StepOptions(
        accum_steps=config.grad_accum_steps,
        reduce_dtype=parallel.grad_reduce_dtype,
        shard_optimizer_state=parallel.shard_optimizer_state,
        shard_params=parallel.shard_params,
        compiler_options=compiler_options(platform, config.remat, parallel.shard_params),
        learning_rate_fn=optim.learning_rate_fn(config),
        device_preprocess=device_preprocess,
        reduction=parallel.reduction,
        cross_host_reduce=parallel.cross_host_reduce,
        error_feedback=parallel.error_feedback,
        axis_rules=axis_rules,
    )


def build_backend(config, mesh: Mesh, components: Components,
                  tx: optax.GradientTransformation) -> Backend:
    """The configured parallel backend for the experiment's model, task and data (its
    device preprocessing) with optimizer `tx` over `mesh`."""
    options = step_options(config, mesh.devices.flat[0].platform,
                           components.data.device_preprocess, components.axis_rules)
    return make_backend(config.parallel.backend, mesh, components.model, components.task, tx,
                        options)
