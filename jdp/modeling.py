"""One functional interface over Linen and NNX models.

The trainer only sees `Model.init(rng, images) -> (params, model_state)` and
`Model.apply(params, model_state, images, train, rng) -> (logits,
model_state)`: params are what the optimizer updates, model_state is the
rest (BatchNorm statistics; NNX RNG counters). Both are plain pytrees, so
the backends, the optimizer and Orbax need not know which API built them.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import flax.linen as nn
from flax import nnx

Params = Any
ModelState = Any


@dataclasses.dataclass(frozen=True)
class Model:
    init: Callable[..., tuple[Params, ModelState]]
    apply: Callable[..., tuple[Any, ModelState]]


def from_linen(module: nn.Module) -> Model:
    """A Linen module called as `module(images, train=...)`, dropout from the 'dropout' rng."""

    def init(rng, images):
        variables = dict(module.init({"params": rng, "dropout": rng}, images, train=False))
        params = variables.pop("params")
        return params, variables

    def apply(params, model_state, images, train, rng):
        variables = {"params": params, **model_state}
        rngs = {"dropout": rng}
        if train and model_state:
            logits, updated = module.apply(
                variables, images, train=True, rngs=rngs, mutable=list(model_state))
            return logits, {**model_state, **updated}
        return module.apply(variables, images, train=train, rngs=rngs), model_state

    return Model(init, apply)


def from_nnx(factory: Callable[[nnx.Rngs], nnx.Module]) -> Model:
    """An NNX module built by `factory(rngs)`, switched with .train()/.eval()."""
    graphdef, _, _ = nnx.split(nnx.eval_shape(lambda: factory(nnx.Rngs(0))), nnx.Param, ...)

    # Params and state cross jit boundaries as pure dicts of arrays: NNX Variable
    # objects may only be mutated in the trace that created them.
    def split(module):
        _, params, rest = nnx.split(module, nnx.Param, ...)
        return nnx.to_pure_dict(params), nnx.to_pure_dict(rest)

    def init(rng, images):
        del images  # NNX modules are built with their shapes
        return split(factory(nnx.Rngs(rng)))

    def apply(params, model_state, images, train, rng):
        del rng  # NNX modules carry their own RNG streams in model_state
        module = nnx.merge(graphdef, params, model_state)
        module.train() if train else module.eval()
        logits = module(images)
        return logits, split(module)[1]

    return Model(init, apply)


def build(build_model: Callable, config, num_classes: int) -> Model:
    """Calls the experiment's `build_model`; NNX if it takes `rngs`, else Linen."""
    if "rngs" in inspect.signature(build_model).parameters:
        return from_nnx(lambda rngs: build_model(config, num_classes=num_classes, rngs=rngs))
    module = build_model(config, num_classes=num_classes)
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"build_model returned {type(module).__name__}; expected a flax.linen.Module, "
            "or take an `rngs` argument and return a flax.nnx.Module")
    return from_linen(module)
