"""jax's internals jdp needs, and every difference between the jax versions jdp runs on.

The one module that imports `jax._src` (a test checks it), so a jax that moves these
breaks here alone, with the message below:
- the coordination-service state `jax.distributed` set up: its key-value client (the
  watchdog's heartbeats, the cross-process config check), and the process id, count
  and coordinator address it resolved;
- the cluster environments jax auto-detects (SLURM, Open MPI, Kubernetes, TPU), so
  that jdp can say which one it will use before joining;
- whether jax has started its backends (the GPU settings must come before that).

Versions: jax 0.10.2 (Python >= 3.10) and 0.11.x (0.11.0 dropped Python 3.11). Read
for 0.11.2 (its wheel's sources) against 0.10.2, for every jax API jdp calls: the
pieces above, `jax.distributed.initialize`'s keywords, `shard_map`, `Mesh` and its
axis types, `pmap`, the compilation cache, `multihost_utils`, the profiler,
`memory_analysis` / `cost_analysis`. None that jdp uses differs, so no code here
branches on the version; a difference found later is handled here and nowhere else.
"""

from __future__ import annotations

import jax

# The versions whose sources were read for jdp's use of jax (see BUILD_NOTES.md).
CHECKED_VERSIONS = ("0.10.2", "0.11.2")

try:
    from jax._src import clusters as _clusters
    from jax._src import distributed as _distributed
    from jax._src import xla_bridge as _xla_bridge

    _clusters.ClusterEnv._cluster_types  # noqa: B018 - fail here, not mid-start-up
    _distributed.global_state  # noqa: B018
    _xla_bridge.backends_are_initialized  # noqa: B018
except (ImportError, AttributeError) as error:
    raise ImportError(
        f"jdp needs jax's jax._src.distributed.global_state, jax._src.clusters.ClusterEnv "
        f"and jax._src.xla_bridge.backends_are_initialized, which jax {jax.__version__} "
        f"does not have ({error}). Fix: install a jax version pyproject.toml allows "
        "(pip install -e . picks one), or update jdp/runtime/jax_compat.py for this "
        "jax.") from error

ClusterEnv = _clusters.ClusterEnv


def distributed_state():
    """jax.distributed's state: `.client`, `.process_id`, `.num_processes`,
    `.coordinator_address` (None before `jax.distributed.initialize`)."""
    return _distributed.global_state


def cluster_types() -> list[type[ClusterEnv]]:
    """The cluster environments jax tries, in its order."""
    return list(_clusters.ClusterEnv._cluster_types)


def backends_initialized() -> bool:
    """Whether jax has created its backends: XLA_FLAGS and the XLA_PYTHON_CLIENT_*
    variables set after that have no effect on this process."""
    return _xla_bridge.backends_are_initialized()
