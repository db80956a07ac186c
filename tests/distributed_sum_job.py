"""A tiny multi-process JAX job that launcher tests run in place of `jdp.main`.

Joins `jax.distributed` the way jdp.main does (the JDP_COORDINATOR_ADDRESS /
JDP_NUM_PROCESSES / JDP_PROCESS_ID variables, else JAX's cluster
auto-detection such as SLURM), builds a global array holding 1..D over all D
devices of all processes (each process fills only its own shards), sums it
with one jitted cross-process reduction and prints one line per process:

    process_index=0 process_count=2 local_devices=4 global_devices=8 sum=36

The expected sum is D * (D + 1) / 2.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

# Bounded, so that a missing peer fails the job instead of hanging a test.
INIT_TIMEOUT_S = 60


def init_distributed() -> None:
    # gloo must be chosen before the CPU backend is created.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if "JDP_COORDINATOR_ADDRESS" in os.environ:
        jax.distributed.initialize(
            coordinator_address=os.environ["JDP_COORDINATOR_ADDRESS"],
            num_processes=int(os.environ["JDP_NUM_PROCESSES"]),
            process_id=int(os.environ["JDP_PROCESS_ID"]),
            initialization_timeout=INIT_TIMEOUT_S,
        )
    else:
        jax.distributed.initialize(initialization_timeout=INIT_TIMEOUT_S)


def global_sum() -> float:
    devices = jax.devices()
    mesh = Mesh(np.array(devices), ("data",))
    sharding = NamedSharding(mesh, PartitionSpec("data"))
    # Entry i is i + 1; each process materialises only the rows of its devices.
    values = jax.make_array_from_callback(
        (len(devices),),
        sharding,
        lambda index: np.arange(len(devices), dtype=np.float32)[index] + 1,
    )
    total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, PartitionSpec()))(values)
    return float(total.addressable_data(0))


def main() -> None:
    init_distributed()
    total = global_sum()
    print(
        f"process_index={jax.process_index()} process_count={jax.process_count()} "
        f"local_devices={jax.local_device_count()} global_devices={jax.device_count()} "
        f"sum={total:g}",
        flush=True,
    )
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
