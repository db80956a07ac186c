"""What a model axis splits: each param's logical axis names (`Model.axis_names`)
mapped through the experiment's rules table (logical name -> jdp.MODEL_AXIS or None) to
the one dimension of it that the `parallel.model_parallel` devices of a model group
share, checked when the experiment's components are built, before anything compiles.
The backends join it with the state's split over the data axes
(`jdp.parallel.mesh.sharded_over_data`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
from jax.sharding import PartitionSpec as P

from jdp import MODEL_AXIS
from jdp.errors import ConfigError
from jdp.experiment.adapters import Model

Rules = Sequence[tuple[str, str | None]]


def _is_spec(x) -> bool:
    return isinstance(x, P)


def check_rules(rules: Rules) -> dict[str, str | None]:
    """The rules table as a dict; a rule naming another mesh axis is refused (jdp splits
    the state over the data axes itself: `parallel.shard_params`)."""
    table = {}
    for rule in rules:
        if not (isinstance(rule, tuple | list) and len(rule) == 2 and isinstance(rule[0], str)
                and rule[1] in (MODEL_AXIS, None)):
            raise ConfigError(
                f"axis_rules: {rule!r} is not a rule (logical name, {MODEL_AXIS!r} or None). "
                f"Fix: map each logical axis name to {MODEL_AXIS!r} or None; jdp splits state "
                "over the data axes itself (--config.parallel.shard_params).")
        table[rule[0]] = rule[1]
    return table


# What to change when a dimension of a shipped model's params does not divide.
_FIXES = {"heads": "num_heads", "kv_heads": "num_kv_heads", "mlp": "mlp_dim",
          "vocab": "the vocabulary (pad it: experiments/gpt.py takes --config.model.vocab_size)"}
_FIX_ORDER = list(_FIXES)


def model_specs(model: Model, sample_inputs: tuple, rules: Rules, model_parallel: int,
                abstract_params):
    """Each param's split over the model axis (a tree of PartitionSpecs like the params),
    or None when `model_parallel` is 1. Raises ConfigError, one line, for a model whose
    params name no axes and for a split dimension that `model_parallel` does not divide."""
    if model_parallel == 1:
        return None
    names = model.axis_names(sample_inputs)
    if names is None:
        raise ConfigError(
            f"parallel.model_parallel={model_parallel}: the model's params name no logical "
            "axes, so nothing says which dimension to split over the model axis. Fix: name "
            "them (Linen: kernel_init=nn.with_logical_partitioning(init, ('embed', 'mlp')); "
            "NNX: nnx.with_partitioning) and map the names in the experiment's "
            "axis_rules(config), or use --config.parallel.model_parallel=1.")
    table = check_rules(rules)
    paths = jax.tree_util.tree_flatten_with_path(abstract_params)[0]
    leaf_names = jax.tree.leaves(names, is_leaf=_is_spec)
    specs, refused = [], []
    for (path, leaf), leaf_name in zip(paths, leaf_names, strict=True):
        try:
            specs.append(_leaf_spec(jax.tree_util.keystr(path), leaf.shape, leaf_name, table,
                                    model_parallel))
        except _NotDivisible as e:
            refused.append(e)
    if refused:  # the heads before the key/value heads they default to, then the rest
        raise min(refused, key=lambda e: _FIX_ORDER.index(e.name)
                  if e.name in _FIX_ORDER else len(_FIX_ORDER))
    return jax.tree.unflatten(jax.tree.structure(abstract_params), specs)


class _NotDivisible(ConfigError):
    def __init__(self, message: str, name: str):
        super().__init__(message)
        self.name = name


def check_model(model: Model, sample_inputs: tuple, rules: Rules, model_parallel: int) -> None:
    """`model_specs`' checks on their own, from the model's shapes: for a run to fail at
    start."""
    if model_parallel == 1:
        return
    params = jax.eval_shape(model.init, jax.random.key(0), sample_inputs)[0]
    model_specs(model, sample_inputs, rules, model_parallel, params)


def _leaf_spec(path: str, shape: tuple[int, ...], names: P, table: dict,
               model_parallel: int) -> P:
    split = [dim for dim, name in enumerate(names) if table.get(name) == MODEL_AXIS]
    if len(names) > len(shape) or len(split) > 1:
        raise ConfigError(
            f"param {path} of shape {shape} has the logical axis names {tuple(names)}, of "
            f"which {len(split)} map to {MODEL_AXIS!r}. Fix: name each dimension once and "
            f"map at most one of them to {MODEL_AXIS!r}.")
    if not split:
        return P()
    dim = split[0]
    if shape[dim] % model_parallel:
        name = names[dim]
        fix = _FIXES.get(name, f"the {name!r} dimension")
        raise _NotDivisible(
            f"parallel.model_parallel={model_parallel}: does not divide the {name!r} "
            f"dimension ({shape[dim]}) of param {path}, which the model axis splits. Fix: "
            f"make {fix} a multiple of {model_parallel} (e.g. "
            f"{math.ceil(shape[dim] / model_parallel) * model_parallel}), or use a "
            f"model_parallel that divides {shape[dim]}.", name)
    return P(*([None] * dim), MODEL_AXIS)
