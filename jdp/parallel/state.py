"""The train state: what a checkpoint holds and every step updates."""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax

from jdp import DATA_AXIS
from jdp.experiment.adapters import Model
from jdp.parallel.reducers import Reducer


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # int32 scalar: optimizer steps taken; the data position follows from it
    params: Any
    model_state: Any  # non-trained variables: BatchNorm statistics, NNX RNG counters
    opt_state: Any
    rng: jax.Array  # uint32 key data; per-step and per-device keys are folded from it
    # The gradient reducer's own state: the error-feedback residuals of compressed
    # cross-host reduction (two_level.RESIDUAL_SPECS), else empty. They belong to one
    # topology; a resume on another starts them at zero.
    residuals: Any = dataclasses.field(default_factory=dict)


def init_state(model: Model, tx: optax.GradientTransformation, rng: jax.Array, inputs: tuple,
               reducer: Reducer | None = None) -> TrainState:
    params, model_state = model.init(rng, inputs)
    shapes = reducer.residual_shapes(params) if reducer else {}
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, model_state=model_state,
                      opt_state=tx.init(params), rng=jax.random.key_data(rng),
                      residuals={name: jnp.zeros(shape, jnp.float32)
                                 for name, shape in shapes.items()})


def step_rng(rng: jax.Array, step: jax.Array,
             axis_name: str | tuple[str, ...] | None = DATA_AXIS) -> jax.Array:
    """A key for this step and (under a mapped axis) this device: dropout never repeats."""
    key = jax.random.fold_in(jax.random.wrap_key_data(rng), step)
    if axis_name is not None:
        key = jax.random.fold_in(key, jax.lax.axis_index(axis_name))
    return key
