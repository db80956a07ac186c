"""The global device mesh and the shardings jdp places arrays with.

One logical axis, `data`, runs over every device of every process. The
'hybrid' shape orders it with `create_hybrid_device_mesh` (processes as the
granules: hosts x local devices, each host's devices in its fast-interconnect
order); either way each process owns one contiguous block of rows of every
global batch.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jdp import DATA_AXIS


def make_mesh(shape: str = "flat", devices=None) -> Mesh:
    """A 1-D mesh over all devices, processes in order, local devices in order."""
    devices = list(jax.devices() if devices is None else devices)
    if shape == "hybrid" and jax.process_count() > 1:
        local = jax.local_device_count()
        grid = mesh_utils.create_hybrid_device_mesh(
            (local,), (jax.process_count(),), devices=devices, process_is_granule=True)
        device_array = np.asarray(grid).reshape(-1)
    else:
        # Sorting by (process, id) makes every process's devices one block,
        # which the sampler's row ranges rely on.
        device_array = np.asarray(sorted(devices, key=lambda d: (d.process_index, d.id)))
    return Mesh(device_array, (DATA_AXIS,), axis_types=(jax.sharding.AxisType.Auto,))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Leading (batch) dimension split over the data axis."""
    return NamedSharding(mesh, P(DATA_AXIS))


def process_rows(mesh: Mesh, global_batch_size: int) -> slice:
    """The rows of each global batch that this process holds, read off the sharding."""
    index_map = batch_sharding(mesh).addressable_devices_indices_map((global_batch_size,))
    starts = sorted(index[0].start or 0 for index in index_map.values())
    per_device = global_batch_size // mesh.size
    if starts != list(range(starts[0], starts[0] + per_device * len(starts), per_device)):
        raise RuntimeError(
            f"process {jax.process_index()}'s devices hold rows {starts} of the batch, "
            "not one contiguous block; build the mesh with jdp.mesh.make_mesh")
    return slice(starts[0], starts[0] + per_device * len(starts))


def sharded_over_data(shape: tuple[int, ...], data_size: int) -> P:
    """ZeRO/FSDP rule: split the largest dimension divisible by the data axis, else replicate."""
    candidates = [(size, dim) for dim, size in enumerate(shape) if size % data_size == 0]
    if not candidates or data_size == 1:
        return P()
    _, dim = max(candidates)
    spec = [None] * len(shape)
    spec[dim] = DATA_AXIS
    return P(*spec)


def state_leaf_sharding(mesh: Mesh, leaf, shard: bool) -> NamedSharding:
    if not shard or not getattr(leaf, "shape", ()):
        return replicated(mesh)
    return NamedSharding(mesh, sharded_over_data(tuple(leaf.shape), mesh.size))
