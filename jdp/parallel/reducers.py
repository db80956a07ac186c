"""One object per gradient-reduction strategy, chosen once by `make_reducer`.

Every strategy runs inside the per-device gradient function (under the mesh axes
`hosts` and `local`), once per optimizer step after the accumulation loop, and
reduces the metric sums beside the gradients:

- `Flat`: one all-reduce of the gradients and the metric sums over every device.
- `ZeroScatter` (ZeRO-1): each gradient the optimizer state splits is
  reduce-scattered to the shard that device updates; the rest travel with the sums.
- `Fsdp` (FSDP): params enter as shards and are all-gathered where the model uses
  them; the gather's transpose reduce-scatters each gradient, once per micro-batch,
  so only the sums are left to reduce.
- `TwoLevelReducer`: inside each host, across hosts, inside again, with optional
  compression across (`jdp.parallel.two_level`).

A ring reduce-scatter is half of a ring all-reduce, and the all-gather of the
updated (ZeRO-1) or used (FSDP) params the other half, so all of them send what
plain data parallelism sends.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jdp import DATA_AXIS
from jdp.parallel.two_level import RESIDUAL_SPECS, TwoLevel

# The reduction of the step is found by this name in the HLO (the dry run, the tests).
GRADIENT_SCOPE = "gradient_all_reduce"


@dataclasses.dataclass(frozen=True)
class Reducer:
    """Sums one device's gradient and metric sums over the data axes.

    `gather_params` turns the params a device holds into those the model uses;
    `reduce` returns (summed gradients, summed flat metric sums, new residuals);
    `param_specs` / `grad_specs` are how params enter and gradients leave the
    per-device computation (`shard_map` specs); `residual_shapes` the global shapes
    of the state the strategy keeps across steps (`TrainState.residuals`).
    """

    reduce_dtype: Any = jnp.float32

    def gather_params(self, params):
        return params

    def reduce(self, grads, flat_sums: jax.Array, residuals: dict):
        raise NotImplementedError

    def param_specs(self):
        return P()

    def grad_specs(self):
        return P()

    def residual_shapes(self, param_count: int) -> dict[str, tuple[int, ...]]:
        del param_count
        return {}

    def _cast(self, grads):
        return jax.tree.map(lambda g: g.astype(self.reduce_dtype), grads)


@dataclasses.dataclass(frozen=True)
class Flat(Reducer):
    def reduce(self, grads, flat_sums, residuals):
        grads, flat_sums = jax.lax.psum((self._cast(grads), flat_sums), DATA_AXIS)
        return grads, flat_sums, residuals


@dataclasses.dataclass(frozen=True)
class ZeroScatter(Reducer):
    """ZeRO-1: `specs` are the optimizer state's PartitionSpecs (params replicated)."""

    specs: Any = None

    def reduce(self, grads, flat_sums, residuals):
        leaves, treedef = jax.tree.flatten(self._cast(grads))
        dims = [split_dim(spec) for spec in treedef.flatten_up_to(self.specs)]
        whole = [leaf for leaf, dim in zip(leaves, dims, strict=True) if dim is None]
        whole, flat_sums = jax.lax.psum((whole, flat_sums), DATA_AXIS)
        whole = iter(whole)
        reduced = [next(whole) if dim is None else
                   jax.lax.psum_scatter(leaf, DATA_AXIS, scatter_dimension=dim, tiled=True)
                   for leaf, dim in zip(leaves, dims, strict=True)]
        return jax.tree.unflatten(treedef, reduced), flat_sums, residuals

    def grad_specs(self):
        return self.specs


@dataclasses.dataclass(frozen=True)
class Fsdp(Reducer):
    """FSDP: `specs` are the params' PartitionSpecs (each split along at most one
    dimension over the data axes, else replicated)."""

    specs: Any = None

    def gather_params(self, params):
        gathers = jax.tree.map(self._gather_leaf, self.specs, is_leaf=lambda x: isinstance(x, P))
        return jax.tree.map(lambda gather, p: gather(p), gathers, params)

    def _gather_leaf(self, spec: P):
        """Local shard -> full param, whose gradient comes back reduce-scattered (a
        replicated param's gradient is summed with a psum), in `reduce_dtype`."""
        dim, reduce_dtype = split_dim(spec), self.reduce_dtype

        @jax.custom_vjp
        def gather(x):
            if dim is None:
                return x
            return jax.lax.all_gather(x, DATA_AXIS, axis=dim, tiled=True)

        def forward(x):
            return gather(x), None

        def backward(_, g):
            g = g.astype(reduce_dtype)
            with jax.named_scope(GRADIENT_SCOPE):
                if dim is not None:
                    g = jax.lax.psum_scatter(g, DATA_AXIS, scatter_dimension=dim, tiled=True)
                else:
                    g = jax.lax.psum(g, DATA_AXIS)
            return (g.astype(jnp.float32),)

        gather.defvjp(forward, backward)
        return gather

    def reduce(self, grads, flat_sums, residuals):
        # The gradients were reduce-scattered by the gather's transpose.
        return grads, jax.lax.psum(flat_sums, DATA_AXIS), residuals

    def param_specs(self):
        return self.specs

    def grad_specs(self):
        return self.specs


@dataclasses.dataclass(frozen=True)
class TwoLevelReducer(Reducer):
    two_level: TwoLevel = TwoLevel()

    def reduce(self, grads, flat_sums, residuals):
        grads, residuals = self.two_level(self._cast(grads), residuals)
        return grads, jax.lax.psum(flat_sums, DATA_AXIS), residuals

    def residual_shapes(self, param_count: int) -> dict[str, tuple[int, ...]]:
        return self.two_level.residual_shapes(param_count)


def split_dim(spec: P) -> int | None:
    """The dimension a ZeRO/FSDP spec splits over the data axis (at most one), or None."""
    dims = [dim for dim, name in enumerate(spec) if name is not None]
    return dims[0] if dims else None


def make_reducer(*, reduction: str = "flat", reduce_dtype: str = "float32",
                 shard_params: bool = False, shard_optimizer_state: bool = False,
                 param_specs=None, optimizer_specs=None, cross_host: str = "float32",
                 error_feedback: bool = True, hosts: int = 1, local: int = 1) -> Reducer:
    """The one place a strategy is chosen. FSDP's gradients are reduce-scattered as its
    params are gathered; ZeRO-1's are scattered to the optimizer state's shards unless
    the two-level reduction (which returns whole gradients) is asked for."""
    dtype = jnp.dtype(reduce_dtype)
    if shard_params:
        return Fsdp(dtype, param_specs)
    if reduction == "two_level":
        return TwoLevelReducer(dtype, TwoLevel(cross_host, error_feedback, hosts, local))
    if shard_optimizer_state:
        return ZeroScatter(dtype, optimizer_specs)
    return Flat(dtype)


def residual_specs(residuals: dict) -> dict[str, P]:
    """The PartitionSpecs of a reducer's residuals (each device holds its own part)."""
    return {name: RESIDUAL_SPECS[name] for name in residuals}
