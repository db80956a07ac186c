"""Benchmarks: programs that print figures, compared as ratios within one run.

    python -m jdp.bench overhead     # jdp's whole training loop vs a minimal hand-written loop
    python -m jdp.bench overhead_e2e # the default command's wall time to its final accuracy
                                     # vs a minimal script's (jdp/bench/minimal_vit.py)
    python -m jdp.bench step_overhead  # jdp's compiled train step vs a minimal jit step
    python -m jdp.bench scaling      # examples/s of the same model at 1, 2, 4, 8 devices
    python -m jdp.bench checkpoint   # how long a save stalls training: async vs synchronous
    python -m jdp.bench memory       # per-device memory and traffic: replicated, ZeRO-1, FSDP
    python -m jdp.bench compile      # the train step's compile: empty vs warm compilation cache
    python -m jdp.bench input        # input pipeline examples/s: threads vs worker processes
    python -m jdp.bench tokenize     # token store MB/s at 1 and 2 processes vs encode_batch
    python -m jdp.bench communication  # gradient bytes inside / across hosts and the modelled
                                       # time: flat, two-level, bf16 and int8 cross-host
    python -m jdp.bench network  # the same reductions measured between emulated hosts
                                 # over shaped links (root), beside the model
    python -m jdp.bench gpu --out=DIR  # the prepared GPU check (--smoke: its paths on CPU)

Each subcommand lives in its own module of this package, which defines
`add_arguments(parser, name)` and `run(args)`; it prints one line per measurement
and its summary figure last. On a CPU machine, simulate devices with
XLA_FLAGS=--xla_force_host_platform_device_count=8 (the overhead benchmarks
start their own processes with the device counts they measure, and the rest of
XLA_FLAGS as given).
"""

import os

from jdp.runtime.cpu_devices import cpu_device_env


def cpu_child_env(devices: int) -> dict[str, str]:
    """The environment of a measuring process on `devices` simulated CPU devices: this
    process's, its XLA_FLAGS included, with only the device count replaced."""
    return {**os.environ, **cpu_device_env(os.environ, devices)}


def pair_order(pair: int) -> tuple[str, str]:
    """Which of "jdp" and "minimal" runs first in pair `pair` (counted from 0): each in
    every other pair, so that a drift of the machine's speed within pairs, which a fixed
    order puts on one side of every ratio, cancels over an even number of them."""
    return ("jdp", "minimal") if pair % 2 == 0 else ("minimal", "jdp")
