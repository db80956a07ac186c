"""The one module where jdp reaches into JAX's private modules (`jax._src`).

jax 0.10 has no public API for these, which the multi-host code needs:
- the coordination-service state `jax.distributed` set up: its key-value
  client (the watchdog's heartbeats, the cross-process config check), and the
  process id, count and coordinator address it resolved;
- the cluster environments jax auto-detects (SLURM, Open MPI, Kubernetes, TPU),
  so that jdp can say which one it will use before joining.

Everything else in jdp uses public APIs (a test checks it), so a jax that moves
these breaks this module alone, with the message below, and widening the jax
version range is a change here and in pyproject.toml.
"""

from __future__ import annotations

import jax

try:
    from jax._src import clusters as _clusters
    from jax._src import distributed as _distributed

    _clusters.ClusterEnv._cluster_types  # noqa: B018 - fail here, not mid-start-up
    _distributed.global_state  # noqa: B018
except (ImportError, AttributeError) as error:
    raise ImportError(
        f"jdp needs jax's jax._src.distributed.global_state and "
        f"jax._src.clusters.ClusterEnv, which jax {jax.__version__} does not have "
        f"({error}). Fix: install the jax version pyproject.toml names "
        "(pip install -e . picks it), or update jdp/jax_private.py for this jax.") from error

ClusterEnv = _clusters.ClusterEnv


def distributed_state():
    """jax.distributed's state: `.client`, `.process_id`, `.num_processes`,
    `.coordinator_address` (None before `jax.distributed.initialize`)."""
    return _distributed.global_state


def cluster_types() -> list[type[ClusterEnv]]:
    """The cluster environments jax tries, in its order."""
    return list(_clusters.ClusterEnv._cluster_types)
