"""The two-level gradient reduction and its cross-host compression (pjit backend).

The mesh is hosts x local devices (`jdp.parallel.mesh`); inside a host devices talk
over a fast interconnect (NVLink, ICI), across hosts over a network 10-100x slower.
A flat all-reduce runs as one ring (or tree) through all N devices, so every host
link carries about 2(N-1)/N of the gradient bytes. Instead:

- `two_level` (Horovod's hierarchical all-reduce, MaxText's ici/dcn axes): the
  gradients, flattened into one buffer, are reduce-scattered inside each host,
  each device's 1/L shard (L devices per host) is all-reduced across the H
  hosts, and the result all-gathered inside the host. A host then sends
  2(H-1)/H of the gradient bytes across hosts, and each cross-host collective
  has H participants instead of N.
- `cross_host` compression (`bfloat16`, or `int8` with one float32 scale per
  block of 256 values), two-level only: the cross-host all-reduce of the shard
  becomes an all-to-all of compressed chunks, a float32 sum of the H chunks a
  device receives, and an all-gather of that sum compressed again: the bytes
  of a ring all-reduce of the compressed shard, with every addition in float32.
  Inside hosts everything stays in `parallel.grad_reduce_dtype`.
- Error feedback (Seide et al. 2014; Karimireddy et al. 2019): what compressing
  loses is kept per device, for its shard and for the chunk it summed, and
  added to the next step's values before they are compressed, so the error of
  one step is paid back in the next rather than accumulated. The residuals are
  part of the train state (`TrainState.residuals`), checkpointed with it, so a
  resumed run continues bitwise.

All of it runs inside the per-device gradient function under the named mesh
axes, once per optimizer step, after the accumulation loop.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jdp import HOSTS_AXIS, LOCAL_AXIS

INT8_BLOCK = 256  # values per float32 scale
INT8_MAX = 127.0

# The error-feedback residuals, global arrays over the (hosts, local) mesh, indexed
# by position in the flattened gradient (so they keep their meaning, and are
# restored, when a run resumes with another number of devices per host and the
# same hosts and padded size; otherwise they restart at zero):
# `shard`: (hosts, padded size); [h, i] is what compression lost of host h's sum
#   at position i; device (h, l) holds [h, l*S:(l+1)*S] (S = padded size / L).
# `chunk`: (padded size,); [i] is what compressing the cross-host sum at i lost;
#   device (h, l) holds l*S + h*C .. + C (C = S / H).
RESIDUAL_SPECS = {"shard": P(HOSTS_AXIS, LOCAL_AXIS), "chunk": P((LOCAL_AXIS, HOSTS_AXIS))}


@dataclasses.dataclass(frozen=True)
class TwoLevel:
    """The two-level reduction of one step, over a mesh of `hosts` x `local` devices."""

    cross_host: str = "float32"
    error_feedback: bool = True
    hosts: int = 1
    local: int = 1

    @property
    def compressed(self) -> bool:
        return self.cross_host != "float32"

    @property
    def keeps_residuals(self) -> bool:
        return self.compressed and self.error_feedback

    def padded_size(self, size: int) -> int:
        """The flattened gradient's length, padded so that every device's chunk (1/N of
        it) holds whole int8 blocks."""
        unit = self.hosts * self.local * (INT8_BLOCK if self.cross_host == "int8" else 1)
        return math.ceil(size / unit) * unit

    def residual_shapes(self, param_count: int) -> dict[str, tuple[int, ...]]:
        """Global shapes of the error-feedback residuals for `param_count` gradient values
        (none unless compressed with error feedback)."""
        if not self.keeps_residuals:
            return {}
        padded = self.padded_size(param_count)
        return {"shard": (self.hosts, padded), "chunk": (padded,)}

    def __call__(self, grads, residuals: dict):
        """(summed gradients, new residuals); runs on one device under the mesh axes."""
        flat, unravel = jax.flatten_util.ravel_pytree(grads)
        size = flat.size
        flat = jnp.pad(flat, (0, self.padded_size(size) - size))
        shard = jax.lax.psum_scatter(flat, LOCAL_AXIS, scatter_dimension=0, tiled=True)
        shard, residuals = self.sum_over_hosts(shard, residuals)
        flat = jax.lax.all_gather(shard, LOCAL_AXIS, axis=0, tiled=True)
        return unravel(flat[:size]), residuals

    def sum_over_hosts(self, shard: jax.Array, residuals: dict):
        """(the sum over hosts of this device's flat shard, new residuals): one
        all-reduce across hosts, or its compressed form. The shard's length is 1/L of
        a `padded_size`."""
        if self.compressed:
            return self._compressed_sum_over_hosts(shard, residuals)
        return jax.lax.psum(shard, HOSTS_AXIS), residuals

    def _compressed_sum_over_hosts(self, shard: jax.Array, residuals: dict):
        """The sum over hosts of this device's shard, sent compressed (see the module)."""
        dtype = shard.dtype
        values = shard.astype(jnp.float32)
        if self.error_feedback:
            values = values + residuals["shard"][0]
        chunks = values.reshape(self.hosts, -1)  # chunk j goes to host j
        sent = self._compress(chunks)
        received = jax.tree.map(
            lambda x: jax.lax.all_to_all(x, HOSTS_AXIS, 0, 0, tiled=True), sent)
        # Row j: host j's copy of this device's chunk; summed in float32, in host order.
        total = self._decompress(received).sum(axis=0)
        if self.error_feedback:
            total = total + residuals["chunk"]
        summed = self._compress(total[None])
        gathered = jax.tree.map(
            lambda x: jax.lax.all_gather(x[0], HOSTS_AXIS, axis=0, tiled=True), summed)
        result = self._decompress(jax.tree.map(
            lambda x: x.reshape(self.hosts, -1), gathered)).reshape(-1)
        if self.error_feedback:
            residuals = {"shard": (values - self._decompress(sent).reshape(-1))[None],
                         "chunk": total - self._decompress(summed)[0]}
        return result.astype(dtype), residuals

    def _compress(self, rows: jax.Array) -> dict:
        """float32 rows -> what crosses hosts: bfloat16 values, or int8 values and one
        float32 scale per block of INT8_BLOCK (absmax / 127, round to nearest)."""
        if self.cross_host == "bfloat16":
            return {"values": rows.astype(jnp.bfloat16)}
        blocks = rows.reshape(rows.shape[0], -1, INT8_BLOCK)
        scale = jnp.max(jnp.abs(blocks), axis=-1, keepdims=True) / INT8_MAX
        scale = jnp.where(scale > 0, scale, 1.0)
        values = jnp.clip(jnp.round(blocks / scale), -INT8_MAX, INT8_MAX).astype(jnp.int8)
        return {"values": values.reshape(rows.shape), "scales": scale[..., 0]}

    def _decompress(self, sent: dict) -> jax.Array:
        values = sent["values"].astype(jnp.float32)
        if self.cross_host == "bfloat16":
            return values
        blocks = values.reshape(values.shape[0], -1, INT8_BLOCK)
        return (blocks * sent["scales"][..., None]).reshape(values.shape)


def param_count(params) -> int:
    return sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(params))
