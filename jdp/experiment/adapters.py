"""One functional interface over Linen and NNX models.

The trainer only sees `Model.init(rng, inputs) -> (params, model_state)` and
`Model.apply(params, model_state, inputs, train, rng) -> (outputs,
model_state)`, where `inputs` is the tuple of batch features the task names
(images; token ids; several arrays) passed to the module positionally.
params are what the optimizer updates, model_state is the rest (BatchNorm
statistics; NNX RNG counters). Both are plain pytrees, so the backends, the
optimizer and Orbax need not know which API built them. The logical axis names a
model gives its params (Linen's `nn.with_logical_partitioning`, NNX's `out_sharding`
metadata) are read apart, by `Model.axis_names`: the params themselves are plain
arrays whatever the names, so checkpoints do not depend on them.

`init` is jitted once per Model: jax then traces the module's init once for given
input shapes, however many programs call it. A run calls it on one example's zeros
in the start-up check, in the state's shapes and in the sharded init of the state,
and the check's trace is the one they reuse.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import flax.linen as nn
import jax

if TYPE_CHECKING:
    from flax import nnx

Params = Any
ModelState = Any


@dataclasses.dataclass(frozen=True)
class Model:
    init: Callable[..., tuple[Params, ModelState]]
    apply: Callable[..., tuple[Any, ModelState]]
    # inputs -> the params' logical axis names: a tree like the params of PartitionSpecs
    # of names (P() for a leaf that names none), or None when no param names any.
    axis_names: Callable[[tuple], Any] = lambda inputs: None


def from_linen(module: nn.Module) -> Model:
    """A Linen module called as `module(*inputs, train=...)`, dropout from the 'dropout' rng."""

    def boxed_init(rng, inputs):  # params carrying their names (`nn.Partitioned`)
        return dict(module.init({"params": rng, "dropout": rng}, *inputs, train=False))

    def init(rng, inputs):
        variables = nn.unbox(boxed_init(rng, inputs))
        params = variables.pop("params")
        return params, variables

    def axis_names(inputs):
        boxed = jax.eval_shape(boxed_init, jax.random.key(0), inputs)["params"]
        annotated = any(isinstance(leaf, nn.meta.AxisMetadata) for leaf in jax.tree.leaves(
            boxed, is_leaf=lambda x: isinstance(x, nn.meta.AxisMetadata)))
        return nn.get_partition_spec(boxed) if annotated else None

    def apply(params, model_state, inputs, train, rng):
        variables = {"params": params, **model_state}
        rngs = {"dropout": rng}
        if train and model_state:
            outputs, updated = module.apply(
                variables, *inputs, train=True, rngs=rngs, mutable=list(model_state))
            return outputs, {**model_state, **updated}
        return module.apply(variables, *inputs, train=train, rngs=rngs), model_state

    return Model(jax.jit(init), apply, axis_names)


def from_nnx(factory: Callable[[nnx.Rngs], nnx.Module]) -> Model:
    """An NNX module built by `factory(rngs)`, switched with .train()/.eval()."""
    from flax import nnx  # imported by NNX experiments only: a fifth of a second to load

    def build(rngs):
        # Variables named with `out_sharding` are placed by jdp (the backends), not
        # where they are created: NNX would need a mesh around every creation.
        with nnx.use_eager_sharding(False):
            return factory(rngs)

    abstract = nnx.eval_shape(lambda: build(nnx.Rngs(0)))
    graphdef, abstract_params, _ = nnx.split(abstract, nnx.Param, ...)

    # Params and state cross jit boundaries as pure dicts of arrays: NNX Variable
    # objects may only be mutated in the trace that created them.
    def split(module):
        _, params, rest = nnx.split(module, nnx.Param, ...)
        return nnx.to_pure_dict(params), nnx.to_pure_dict(rest)

    def init(rng, inputs):
        del inputs  # NNX modules are built with their shapes
        return split(build(nnx.Rngs(rng)))

    def apply(params, model_state, inputs, train, rng):
        del rng  # NNX modules carry their own RNG streams in model_state
        with nnx.use_eager_sharding(False):
            module = nnx.merge(graphdef, params, model_state)
        module.train() if train else module.eval()
        outputs = module(*inputs)
        return outputs, split(module)[1]

    def axis_names(inputs):
        del inputs
        variables = jax.tree.leaves(abstract_params,
                                    is_leaf=lambda x: isinstance(x, nnx.Variable))
        if not any(v.get_metadata().get("out_sharding") for v in variables):
            return None
        return nnx.to_pure_dict(nnx.get_partition_spec(abstract_params))

    return Model(jax.jit(init), apply, axis_names)


def build(build_model: Callable, config, num_classes: int | None) -> Model:
    """Calls the experiment's `build_model`; NNX if it takes `rngs`, else Linen.

    `num_classes` (from the data) is passed when `build_model` takes it.
    """
    parameters = inspect.signature(build_model).parameters
    kwargs = {}
    if "num_classes" in parameters:
        if num_classes is None:
            raise ValueError(
                "build_model takes num_classes, but the data does not say how many classes "
                "there are. Fix: set --config.data.num_classes, or return "
                "jdp.data.Data(..., num_classes=N) from build_data")
        kwargs["num_classes"] = num_classes
    if "rngs" in parameters:
        return from_nnx(lambda rngs: build_model(config, rngs=rngs, **kwargs))
    module = build_model(config, **kwargs)
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"build_model returned {type(module).__name__}; expected a flax.linen.Module, "
            "or take an `rngs` argument and return a flax.nnx.Module")
    return from_linen(module)


def forward_flops(model: Model, sample_inputs: tuple) -> float | None:
    """XLA's FLOP count of one forward pass (inference mode) on `sample_inputs`; from the
    lowered program, nothing is compiled or run. None where XLA gives no count."""
    rng = jax.random.key(0)
    params, model_state = jax.eval_shape(model.init, rng, sample_inputs)

    def forward(params, model_state, inputs):
        return model.apply(params, model_state, inputs, False, rng)[0]

    cost = jax.jit(forward).lower(params, model_state, sample_inputs).cost_analysis()
    return (cost or {}).get("flops")
