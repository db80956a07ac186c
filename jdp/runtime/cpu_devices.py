"""Simulated CPU devices: the environment that gives a process N of them (XLA's host
platform device count), the rest of XLA_FLAGS kept. The local launcher's processes and
the benchmarks' measuring processes are started with it."""

from __future__ import annotations

from collections.abc import Mapping

DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def with_device_count(xla_flags: str, devices: int) -> str:
    """XLA_FLAGS with the host device count set, replacing any earlier count."""
    kept = [flag for flag in xla_flags.split() if flag.split("=", 1)[0] != DEVICE_COUNT_FLAG]
    return " ".join([*kept, f"{DEVICE_COUNT_FLAG}={devices}"])


def cpu_device_env(environ: Mapping[str, str], devices: int) -> dict[str, str]:
    """The variables that make a process started from `environ` run on `devices`
    simulated CPU devices: JAX_PLATFORMS and XLA_FLAGS (its other flags kept)."""
    return {"JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": with_device_count(environ.get("XLA_FLAGS", ""), devices)}
