"""jax's internals jdp needs, and every difference between the jax versions jdp runs on.

The one module that imports `jax._src` (a test checks it), so a jax that moves these
breaks here alone, with the message below:
- the coordination-service state `jax.distributed` set up: its key-value client (the
  watchdog's heartbeats, the cross-process config check), and the process id, count
  and coordinator address it resolved;
- the cluster environments jax auto-detects (SLURM, Open MPI, Kubernetes, TPU), so
  that jdp can say which one it will use before joining;
- whether jax has started its backends (the GPU settings must come before that);
- jaxlib's version, for the differences below.

Versions: jax 0.10.2 (Python >= 3.11) to 0.12.x (from 0.11.0, Python >= 3.12). Read for
0.11.2 and 0.12.1 (their wheels' sources) against 0.10.2, for every jax API jdp calls:
the pieces above, `jax.distributed.initialize`'s keywords, `shard_map`, `Mesh` and its
axis types, `pmap`, the compilation cache, `multihost_utils`, the profiler,
`memory_analysis` / `cost_analysis`: none that jdp uses differs. What differs is XLA:CPU
from jaxlib 0.11.1: its older fusion emitters are gone (`cpu_fusion_emitters_option`)
and its default schedule keeps remat (`cpu_schedule_keeps_remat`). A difference found
later is handled here and nowhere else.
"""

from __future__ import annotations

import jax

# The versions whose sources were read for jdp's use of jax (see BUILD_NOTES.md).
CHECKED_VERSIONS = ("0.10.2", "0.11.2", "0.12.1")

try:
    from jax._src import clusters as _clusters
    from jax._src import distributed as _distributed
    from jax._src import lib as _lib
    from jax._src import xla_bridge as _xla_bridge

    _clusters.ClusterEnv._cluster_types  # noqa: B018 - fail here, not mid-start-up
    _distributed.global_state  # noqa: B018
    _xla_bridge.backends_are_initialized  # noqa: B018
    _lib.version  # noqa: B018
except (ImportError, AttributeError) as error:
    raise ImportError(
        f"jdp needs jax's jax._src.distributed.global_state, jax._src.clusters.ClusterEnv, "
        f"jax._src.xla_bridge.backends_are_initialized and jax._src.lib.version, which jax "
        f"{jax.__version__} "
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


def cpu_fusion_emitters_option(use_fusion_emitters: bool) -> dict[str, bool]:
    """XLA:CPU's compile option that picks its fusion emitters, as {name: value}: the
    MLIR-based ones (True, the default) or the older ones (False, which compile faster);
    empty where jaxlib has only the MLIR-based ones. XLA removed the older emitters and
    the option `xla_cpu_use_fusion_emitters` between jaxlib 0.11.0 (its libjax_common.so
    has the option's name) and 0.11.1 (it does not), and aborts the process on an option
    it does not know."""
    if _lib.version >= (0, 11, 1):
        return {}
    return {"xla_cpu_use_fusion_emitters": use_fusion_emitters}


def cpu_schedule_keeps_remat() -> bool:
    """Whether XLA:CPU's default schedule (concurrency-optimised) leaves the recomputation
    of rematerialised blocks in the backward pass, where remat puts it. jaxlib 0.11.0 and
    earlier hoist it into the forward pass, which undoes remat: a 6-layer ViT step with
    full remat holds 44,070,848 B of temporaries there, as many as without remat, and
    9,560,768 B on 0.11.2 (8,445,888 on 0.12.1). jaxlib 0.11.1 took a new XLA, the same
    step as the fusion emitters' removal above."""
    return _lib.version >= (0, 11, 1)
