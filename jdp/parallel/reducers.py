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
- Hybrid sharding (`shard_params` / `shard_optimizer_state` = "host"): FSDP or
  ZeRO-1 over the `local` axis only, the state replicated across hosts. Gathers
  and scatters stay inside hosts; `AcrossHosts` then sums each device's 1/L part
  of the gradient over the hosts, once per optimizer step, after accumulation
  (PyTorch FSDP's HYBRID_SHARD, MaxText's ici_fsdp x dcn_data).
- With a model axis (`parallel.model_parallel`), any of them runs on each device's
  own shard of the model-split gradients (`PerModelShard`): the gradients reduce over
  the data axes only, and a device of each model group sums its own part.

On CPU the all-reduces are fused: the leaves travel packed into a few flat buffers
(`fused_psum`), one all-reduce each, as Horovod's tensor fusion and PyTorch DDP's
gradient buckets pack them. XLA:CPU runs an all-reduce of many operands operand by
operand, each paying the collective's fixed cost (over gloo between processes, a few
milliseconds); XLA:GPU runs them as one grouped NCCL call, so on GPU the leaves travel
as they are.

A ring reduce-scatter is half of a ring all-reduce, and the all-gather of the
updated (ZeRO-1) or used (FSDP) params the other half, so all of them send what
plain data parallelism sends.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jdp import DATA_AXIS, HOSTS_AXIS, LOCAL_AXIS, MODEL_AXIS
from jdp.parallel.mesh import sharded_over_data
from jdp.parallel.two_level import RESIDUAL_SPECS, TwoLevel, param_count

# The reduction of the step is found by this name in the HLO (the dry run, the tests).
GRADIENT_SCOPE = "gradient_all_reduce"

# The most bytes `fused_psum` packs into one buffer: big enough that a small model's
# gradients travel in one all-reduce, small enough that the packed copy is no burden.
FUSED_BUCKET_BYTES = 64 * 2**20


def fused_psum(tree, axis, bucket_bytes: int = FUSED_BUCKET_BYTES):
    """`jax.lax.psum(tree, axis)`, the leaves packed into flat buffers (one per dtype,
    each at most `bucket_bytes` unless one leaf is larger), one all-reduce per buffer.
    Each element is summed over the same devices as by a psum of its own leaf."""
    leaves, treedef = jax.tree.flatten(tree)
    buckets: list[list[int]] = []
    open_bucket: dict[Any, tuple[list[int], int]] = {}  # dtype -> (leaf indices, bytes)
    for i, leaf in enumerate(leaves):
        dtype, nbytes = jnp.dtype(leaf.dtype), leaf.size * jnp.dtype(leaf.dtype).itemsize
        indices, size = open_bucket.get(dtype, ([], 0))
        if indices and size + nbytes > bucket_bytes:
            indices, size = [], 0
        if not indices:
            buckets.append(indices)
        indices.append(i)
        open_bucket[dtype] = (indices, size + nbytes)
    summed = list(leaves)
    for indices in buckets:
        if len(indices) == 1:
            summed[indices[0]] = jax.lax.psum(leaves[indices[0]], axis)
            continue
        flat = jax.lax.psum(jnp.concatenate([jnp.ravel(leaves[i]) for i in indices]), axis)
        offset = 0
        for i in indices:
            summed[i] = flat[offset:offset + leaves[i].size].reshape(leaves[i].shape)
            offset += leaves[i].size
    return jax.tree.unflatten(treedef, summed)


def _psum(tree, axis, fuse: bool):
    """The reducers' all-reduce: packed (`fused_psum`) where `fuse` (on CPU), else as is."""
    return fused_psum(tree, axis) if fuse else jax.lax.psum(tree, axis)


@dataclasses.dataclass(frozen=True)
class Reducer:
    """Sums one device's gradient and metric sums over the data axes.

    `gather_params` turns the params a device holds into those the model uses;
    `reduce` returns (summed gradients, summed flat metric sums, new residuals);
    `param_specs` / `grad_specs` are how params enter and gradients leave the
    per-device computation (`shard_map` specs); `residual_shapes(params)` the global
    shapes of the state the strategy keeps across steps (`TrainState.residuals`).
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

    def residual_shapes(self, params) -> dict[str, tuple[int, ...]]:
        del params
        return {}

    def _cast(self, grads):
        return jax.tree.map(lambda g: g.astype(self.reduce_dtype), grads)


@dataclasses.dataclass(frozen=True)
class AcrossHosts:
    """The cross-host step of the host-sharded modes: each device's part of the
    gradient, already summed inside its host, summed over the hosts in one all-reduce
    (or its compressed form with error feedback, as in the two-level reduction)."""

    two_level: TwoLevel
    fuse: bool = False  # all-reduce packed buffers (`fused_psum`): on CPU

    def __call__(self, parts, residuals: dict, specs):
        """`specs`: how each leaf is split inside the host (`parts` holds the whole leaf,
        summed over the host, where a spec splits nothing)."""
        if not self.two_level.compressed:
            return _psum(parts, HOSTS_AXIS, self.fuse), residuals
        # Only the split leaves travel compressed: a leaf every device of a host holds
        # whole must come back identical on all of them, and a block's int8 scale
        # depends on its neighbours, which differ from device to device.
        leaves, treedef = jax.tree.flatten(parts)
        split = [split_dim(spec) is not None for spec in treedef.flatten_up_to(specs)]
        whole = _psum([leaf for leaf, s in zip(leaves, split, strict=True) if not s],
                      HOSTS_AXIS, self.fuse)
        flat, unravel = jax.flatten_util.ravel_pytree(
            [leaf for leaf, s in zip(leaves, split, strict=True) if s])
        size = flat.size
        flat = jnp.pad(flat, (0, self._padded(size) - size))
        flat, residuals = self.two_level.sum_over_hosts(flat, residuals)
        shards, whole = iter(unravel(flat[:size])), iter(whole)
        return jax.tree.unflatten(treedef, [next(shards) if s else next(whole)
                                            for s in split]), residuals

    def _padded(self, part_size: int) -> int:
        local = self.two_level.local
        return self.two_level.padded_size(part_size * local) // local

    def residual_shapes(self, params) -> dict[str, tuple[int, ...]]:
        """Indexed like the two-level reduction's, over a device's flattened part."""
        local = self.two_level.local

        def part(leaf) -> int:  # of the split leaves (the rest travel uncompressed)
            spec = sharded_over_data(tuple(leaf.shape), local, LOCAL_AXIS)
            return int(np.prod(leaf.shape)) // local if split_dim(spec) is not None else 0

        part_size = sum(part(leaf) for leaf in jax.tree.leaves(params))
        return self.two_level.residual_shapes(part_size * local)


@dataclasses.dataclass(frozen=True)
class Flat(Reducer):
    fuse: bool = False  # all-reduce packed buffers (`fused_psum`): on CPU

    def reduce(self, grads, flat_sums, residuals):
        grads, flat_sums = _psum((self._cast(grads), flat_sums), DATA_AXIS, self.fuse)
        return grads, flat_sums, residuals


@dataclasses.dataclass(frozen=True)
class ZeroScatter(Reducer):
    """ZeRO-1: `specs` are the optimizer state's PartitionSpecs (params replicated),
    over `axis`; with `across` (hybrid: `axis` is `local`) the host's sums are then
    summed over the hosts."""

    fuse: bool = False  # all-reduce packed buffers (`fused_psum`): on CPU
    specs: Any = None
    axis: Any = DATA_AXIS
    across: AcrossHosts | None = None

    def reduce(self, grads, flat_sums, residuals):
        leaves, treedef = jax.tree.flatten(self._cast(grads))
        dims = [split_dim(spec) for spec in treedef.flatten_up_to(self.specs)]
        whole = [leaf for leaf, dim in zip(leaves, dims, strict=True) if dim is None]
        if self.across is None:
            whole, flat_sums = _psum((whole, flat_sums), DATA_AXIS, self.fuse)
        else:
            whole = _psum(whole, self.axis, self.fuse)
            flat_sums = jax.lax.psum(flat_sums, DATA_AXIS)
        whole = iter(whole)
        reduced = jax.tree.unflatten(treedef, [
            next(whole) if dim is None else
            jax.lax.psum_scatter(leaf, self.axis, scatter_dimension=dim, tiled=True)
            for leaf, dim in zip(leaves, dims, strict=True)])
        if self.across is not None:
            reduced, residuals = self.across(reduced, residuals, self.specs)
        return reduced, flat_sums, residuals

    def grad_specs(self):
        return self.specs

    def residual_shapes(self, params):
        return {} if self.across is None else self.across.residual_shapes(params)


@dataclasses.dataclass(frozen=True)
class Fsdp(Reducer):
    """FSDP: `specs` are the params' PartitionSpecs (each split along at most one
    dimension over `axis`, else replicated); with `across` (hybrid: `axis` is `local`)
    the host's gradient shards are then summed over the hosts."""

    specs: Any = None
    axis: Any = DATA_AXIS
    across: AcrossHosts | None = None

    def gather_params(self, params):
        gathers = jax.tree.map(self._gather_leaf, self.specs, is_leaf=lambda x: isinstance(x, P))
        return jax.tree.map(lambda gather, p: gather(p), gathers, params)

    def _gather_leaf(self, spec: P):
        """Local shard -> full param, whose gradient comes back reduce-scattered (a
        replicated param's gradient is summed with a psum), in `reduce_dtype`."""
        dim, reduce_dtype, axis = split_dim(spec), self.reduce_dtype, self.axis

        @jax.custom_vjp
        def gather(x):
            if dim is None:
                return x
            return jax.lax.all_gather(x, axis, axis=dim, tiled=True)

        def forward(x):
            return gather(x), None

        def backward(_, g):
            g = g.astype(reduce_dtype)
            with jax.named_scope(GRADIENT_SCOPE):
                if dim is not None:
                    g = jax.lax.psum_scatter(g, axis, scatter_dimension=dim, tiled=True)
                else:
                    g = jax.lax.psum(g, axis)
            return (g.astype(jnp.float32),)

        gather.defvjp(forward, backward)
        return gather

    def reduce(self, grads, flat_sums, residuals):
        # The gradients were reduce-scattered by the gather's transpose (per micro-batch,
        # over `axis`); what is left is the one sum over the hosts.
        if self.across is not None:
            grads, residuals = self.across(grads, residuals, self.specs)
        return grads, jax.lax.psum(flat_sums, DATA_AXIS), residuals

    def residual_shapes(self, params):
        return {} if self.across is None else self.across.residual_shapes(params)

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

    def residual_shapes(self, params) -> dict[str, tuple[int, ...]]:
        return self.two_level.residual_shapes(param_count(params))


@dataclasses.dataclass(frozen=True)
class PerModelShard(Reducer):
    """`inner`, run with the model axis bound by hand (a `shard_map` over it inside the
    step's over the data axes): each device reduces its own shard of the gradients,
    split as `model_specs` say, over the data axes; XLA adds nothing over the model
    axis. (The step's forward and backward leave the model axis to XLA, which would
    gather the shards a flattening reduction packs.)"""

    inner: Reducer = Flat()
    model_specs: Any = None  # each gradient's PartitionSpec over the model axis

    def gather_params(self, params):
        return self.inner.gather_params(params)

    def reduce(self, grads, flat_sums, residuals):
        return jax.shard_map(
            self.inner.reduce, in_specs=(self.model_specs, P(), P()),
            out_specs=(self.model_specs, P(), P()), axis_names={MODEL_AXIS},
            check_vma=False)(grads, flat_sums, residuals)

    def param_specs(self):
        return self.inner.param_specs()

    def grad_specs(self):
        return self.inner.grad_specs()

    def residual_shapes(self, params):
        return self.inner.residual_shapes(params)


def split_dim(spec: P) -> int | None:
    """The dimension a ZeRO/FSDP spec splits over the data axis (at most one), or None."""
    dims = [dim for dim, name in enumerate(spec) if name is not None]
    return dims[0] if dims else None


def make_reducer(*, reduction: str = "flat", reduce_dtype: str = "float32",
                 shard_params=False, shard_optimizer_state=False,
                 param_specs=None, optimizer_specs=None, cross_host: str = "float32",
                 error_feedback: bool = True, hosts: int = 1, local: int = 1,
                 fuse: bool = False, model_specs=None) -> Reducer:
    """The strategy as configured (see `_strategy`), on each device's shard of the
    gradients where `model_specs` split them over the model axis (`PerModelShard`)."""
    reducer = _strategy(
        reduction=reduction, reduce_dtype=reduce_dtype, shard_params=shard_params,
        shard_optimizer_state=shard_optimizer_state, param_specs=param_specs,
        optimizer_specs=optimizer_specs, cross_host=cross_host, error_feedback=error_feedback,
        hosts=hosts, local=local, fuse=fuse)
    return reducer if model_specs is None else PerModelShard(inner=reducer,
                                                              model_specs=model_specs)


def _strategy(*, reduction, reduce_dtype, shard_params, shard_optimizer_state, param_specs,
              optimizer_specs, cross_host, error_feedback, hosts, local, fuse) -> Reducer:
    """The one place a strategy is chosen. FSDP's gradients are reduce-scattered as its
    params are gathered; ZeRO-1's are scattered to the optimizer state's shards unless
    the two-level reduction (which returns whole gradients) is asked for. The "host"
    modes shard inside hosts and reduce across them in two levels whatever
    `reduction` says. `fuse`: all-reduce whole leaves packed (`fused_psum`): the flat and
    ZeRO-1 reductions' and the sums across hosts (FSDP reduces each leaf in its gather's
    transpose, the two-level reduction one flattened buffer)."""
    dtype = jnp.dtype(reduce_dtype)
    across = AcrossHosts(TwoLevel(cross_host, error_feedback, hosts, local), fuse)
    if shard_params == "host":
        return Fsdp(dtype, specs=param_specs, axis=LOCAL_AXIS, across=across)
    if shard_optimizer_state == "host" and not shard_params:
        return ZeroScatter(dtype, fuse, specs=optimizer_specs, axis=LOCAL_AXIS, across=across)
    if shard_params:
        return Fsdp(dtype, specs=param_specs)
    if reduction == "two_level":
        return TwoLevelReducer(dtype, TwoLevel(cross_host, error_feedback, hosts, local))
    if shard_optimizer_state:
        return ZeroScatter(dtype, fuse, specs=optimizer_specs)
    return Flat(dtype, fuse)


def residual_specs(residuals: dict) -> dict[str, P]:
    """The PartitionSpecs of a reducer's residuals (each device holds its own part)."""
    return {name: RESIDUAL_SPECS[name] for name in residuals}
