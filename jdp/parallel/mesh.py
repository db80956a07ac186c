"""The global device mesh and the shardings jdp places arrays with.

The mesh has two axes, `hosts` x `local` (jdp.DATA_AXIS names both): a host is
a group of devices that share a fast interconnect, by default the devices of
one process; `parallel.hosts` may split a process's devices into several
virtual hosts, or join processes into one. The global batch is split over both
axes, hosts major, so each process owns one contiguous block of rows of every
global batch. The 'flat' shape orders each host's devices by id, the 'hybrid'
shape in their fast-interconnect order (`create_hybrid_device_mesh`, processes
as the granules).

With `parallel.model_parallel` = M > 1 each host's devices are split further into
local x model (`hosts` x `local` x `model`, jdp.MODEL_AXIS innermost, so a model
group is M devices of one host with neighbouring ids): the batch is split over the
data axes only, and each param over `model` as its logical axis names say
(`jdp.experiment.partitioning`).
"""

from __future__ import annotations

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jdp import DATA_AXIS, HOSTS_AXIS, LOCAL_AXIS, MODEL_AXIS

REPLICATED = P()  # a spec that splits nothing


def host_count(hosts: int, devices=None) -> int:
    """`parallel.hosts` resolved: 0 means one host per process of `devices`."""
    devices = list(jax.devices() if devices is None else devices)
    return hosts or len({d.process_index for d in devices})


def make_mesh(shape: str = "flat", devices=None, hosts: int = 0,
              model_parallel: int = 1) -> Mesh:
    """The (hosts, local) mesh over `devices` (default: all), processes in order; with
    `model_parallel` > 1 the (hosts, local, model) mesh.

    `hosts` (0: one per process) must divide the device count, and either divide
    the process count or be a multiple of it; `model_parallel` must divide the devices
    of a host (config.validate says so first).
    """
    devices = list(jax.devices() if devices is None else devices)
    hosts = host_count(hosts, devices)
    process_count = len({d.process_index for d in devices})
    if shape == "hybrid" and process_count > 1 and process_count == jax.process_count():
        grid = mesh_utils.create_hybrid_device_mesh(
            (len(devices) // process_count,), (process_count,), devices=devices,
            process_is_granule=True)
        device_array = np.asarray(grid).reshape(-1)
    else:
        # Sorting by (process, id) makes every process's devices one block,
        # which the sampler's row ranges rely on.
        device_array = np.asarray(sorted(devices, key=lambda d: (d.process_index, d.id)))
    if len(device_array) % hosts:
        raise ValueError(f"{hosts} hosts do not divide {len(device_array)} devices")
    per_host = len(device_array) // hosts
    if per_host % model_parallel:
        raise ValueError(f"model_parallel={model_parallel} does not divide the {per_host} "
                         "devices of a host")
    auto = jax.sharding.AxisType.Auto
    if model_parallel == 1:  # the data-parallel mesh exactly as it always was
        return Mesh(device_array.reshape(hosts, -1), (HOSTS_AXIS, LOCAL_AXIS),
                    axis_types=(auto, auto))
    return Mesh(device_array.reshape(hosts, -1, model_parallel),
                (HOSTS_AXIS, LOCAL_AXIS, MODEL_AXIS), axis_types=(auto, auto, auto))


def model_size(mesh: Mesh) -> int:
    """Devices along the model axis (1 on a data-parallel mesh)."""
    return mesh.shape.get(MODEL_AXIS, 1)


def data_size(mesh: Mesh) -> int:
    """Devices along the data axes: the ways the batch is split."""
    return mesh.size // model_size(mesh)


def host_of(mesh: Mesh) -> dict[int, int]:
    """A device's position in the mesh -> the host (row of the mesh) it belongs to. The
    compiled program's replica groups name devices by these positions, which are their
    ids only on one process (another process's devices have ids of their own)."""
    per_host = mesh.devices.size // mesh.shape[HOSTS_AXIS]
    return {position: position // per_host for position in range(mesh.devices.size)}


def local_data_replicas(mesh: Mesh) -> int:
    """The data replicas this process holds devices of: the blocks of rows of each batch
    it feeds (a model group may span processes, as with one process per GPU)."""
    local, replica_of = set(mesh.local_devices), data_replica_of(mesh)
    return len({replica_of[position] for position, device in enumerate(mesh.devices.flat)
                if device in local})


def data_replica_of(mesh: Mesh) -> dict[int, int]:
    """A device's position in the mesh -> its data replica (the group of devices along
    the model axis that computes on one block of the batch's rows)."""
    model = model_size(mesh)
    return {position: position // model for position in range(mesh.devices.size)}


def device_bytes(tree) -> int:
    """What one device holds of `tree`, arrays (or their shapes) with shardings: its
    shard of each leaf, the whole leaf where it is replicated."""
    return sum(int(np.prod(leaf.sharding.shard_shape(leaf.shape))) * leaf.dtype.itemsize
               for leaf in jax.tree.leaves(tree))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Leading (batch) dimension split over the data axis."""
    return NamedSharding(mesh, P(DATA_AXIS))


def process_rows(mesh: Mesh, global_batch_size: int) -> slice:
    """The rows of each global batch that this process holds, read off the sharding
    (the devices along the model axis hold the same rows)."""
    index_map = batch_sharding(mesh).addressable_devices_indices_map((global_batch_size,))
    starts = sorted({index[0].start or 0 for index in index_map.values()})
    per_device = global_batch_size // data_size(mesh)
    if starts != list(range(starts[0], starts[0] + per_device * len(starts), per_device)):
        raise RuntimeError(
            f"process {jax.process_index()}'s devices hold rows {starts} of the batch, "
            "not one contiguous block; build the mesh with jdp.mesh.make_mesh")
    return slice(starts[0], starts[0] + per_device * len(starts))


def sharded_over_data(shape: tuple[int, ...], ways: int, axis=DATA_AXIS,
                      model_spec: P = REPLICATED) -> P:
    """ZeRO/FSDP rule: split the largest dimension divisible by `ways` (the axis's size) over
    `axis` (every data-parallel device, or `LOCAL_AXIS`: those of each host), else
    replicate; added to `model_spec` (the leaf's split over the model axis), on a
    dimension it leaves whole."""
    taken = tuple(model_spec) + (None,) * (len(shape) - len(model_spec))
    candidates = [(size, dim) for dim, size in enumerate(shape)
                  if size % ways == 0 and taken[dim] is None]
    if not candidates or ways == 1:
        return model_spec
    _, dim = max(candidates)
    spec = list(taken)
    spec[dim] = axis
    return P(*spec)


def shard_axis(mesh: Mesh, mode) -> tuple[tuple[str, ...] | str, int]:
    """(axis, size) a sharding mode splits state over: True every data-parallel device,
    "host" those of each host (replicated across hosts)."""
    if mode == "host":
        return LOCAL_AXIS, mesh.shape[LOCAL_AXIS]
    return DATA_AXIS, data_size(mesh)


def state_leaf_sharding(mesh: Mesh, leaf, mode, model_spec: P = REPLICATED) -> NamedSharding:
    """A state leaf's sharding under a mode of `parallel.shard_params` (False, True, "host"),
    over the model axis as `model_spec` says."""
    if not mode or not getattr(leaf, "shape", ()):
        return NamedSharding(mesh, model_spec)
    axis, size = shard_axis(mesh, mode)
    return NamedSharding(mesh, sharded_over_data(tuple(leaf.shape), size, axis, model_spec))


# A param's full PartitionSpec joins its split over the model axis and its split over the
# data axes (ZeRO/FSDP), on another dimension; the step takes the two apart.
def _keep(spec: P, axes: set[str]) -> P:
    def entry(name):
        if isinstance(name, tuple):
            kept = tuple(n for n in name if n in axes)
            return kept if kept else None
        return name if name in axes else None
    return P(*(entry(name) for name in spec))


def data_part(spec: P) -> P:
    """The entries of `spec` over the data axes: what the per-device step's `shard_map`
    binds by hand (it leaves the model axis to XLA)."""
    return _keep(spec, {HOSTS_AXIS, LOCAL_AXIS})


def model_part(spec: P) -> P:
    """The entries of `spec` over the model axis."""
    return _keep(spec, {MODEL_AXIS})


def splits_over_model(spec: P) -> bool:
    """Whether `spec` splits a dimension over the model axis."""
    return any(name is not None for name in model_part(spec))
