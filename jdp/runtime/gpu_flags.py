"""GPU performance settings: the XLA flags and runtime variables set before jax starts.

Only on a GPU host (a CUDA PJRT plugin installed and an NVIDIA device present, and
JAX_PLATFORMS not excluding it), and only where the user has not chosen: a flag
already in XLA_FLAGS or a variable already in the environment wins over
`config.gpu.flags`, which wins over jdp's defaults; `config.gpu.enable_defaults=False`
sets none of jdp's. They must be in place before jax creates its backends, so
`jdp.main` applies them first (`apply`); later they would have no effect.

The defaults are the data-parallel / FSDP set of the JAX GPU performance guide
(docs/gpu_performance_tips.md) and MaxText's GPU scripts
(end_to_end/gpu/a3/test_llama2_7b.sh): the latency-hiding scheduler, the
collective combine thresholds and pipelined collectives. Every flag name was checked
against the names compiled into jaxlib 0.10.2 (XLA 5a9e73cb) and into the
jax-cuda12-pjrt 0.10.2 and jax-cuda13-pjrt 0.11.2 GPU plugins (XLA of jax 0.11.x):
XLA aborts a process whose XLA_FLAGS name an unknown flag, so a name that moves
must change here. What each does to step time is measured on the GPU
(`python -m jdp.bench gpu`), not assumed.
"""

from __future__ import annotations

import dataclasses
import glob
import importlib.util
import os
import re
import shlex
import subprocess
from collections.abc import Mapping, MutableMapping

from absl import logging

from jdp.errors import ConfigError

# name -> value, as XLA_FLAGS spells them. MaxText's A3 (H100) values.
DEFAULT_XLA_FLAGS: dict[str, str] = {
    # Lets XLA start a collective early and overlap it with independent compute.
    "xla_gpu_enable_latency_hiding_scheduler": "true",
    # Collectives below these sizes are merged into one: fewer, larger NCCL calls.
    "xla_gpu_all_reduce_combine_threshold_bytes": str(128 * 2**20),
    "xla_gpu_all_gather_combine_threshold_bytes": str(128 * 2**20),
    "xla_gpu_reduce_scatter_combine_threshold_bytes": str(64 * 2**20),
    # Moves collectives of a loop iteration across iterations (accumulation, FSDP).
    "xla_gpu_enable_pipelined_all_reduce": "true",
    "xla_gpu_enable_pipelined_all_gather": "true",
    "xla_gpu_enable_pipelined_reduce_scatter": "true",
    # Collectives on the highest-priority stream, so compute does not delay them.
    "xla_gpu_enable_highest_priority_async_stream": "true",
}
# The share of GPU memory jax preallocates (its default is 0.75): the JAX-Toolbox
# guide's 0.9 leaves room for cuDNN / NCCL workspaces.
DEFAULT_MEM_FRACTION = "0.9"
# On Hopper one hardware work queue keeps NCCL kernels in XLA's launch order.
HOPPER_ENV = {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}

_FLAG = re.compile(r"--([A-Za-z0-9_]+)(=.*)?")


@dataclasses.dataclass(frozen=True)
class Plan:
    """What `apply` sets: the XLA_FLAGS value and the variables, and what it left alone."""

    xla_flags: str
    env: dict[str, str]
    set_by_jdp: tuple[str, ...]  # "name=value" of every setting jdp added
    kept: tuple[str, ...]  # names the user had already set, left as they were

    def describe(self) -> str:
        added = ", ".join(self.set_by_jdp) or "none"
        kept = f"; kept the user's {', '.join(self.kept)}" if self.kept else ""
        return f"GPU settings: {added}{kept}"


def parse_flags(text: str, field: str = "gpu.flags") -> dict[str, str]:
    """`--name=value --other` -> {name: value}; a bare `--name` means true.

    Raises ConfigError naming `field` for anything that is not a `--name[=value]`.
    """
    flags = {}
    for token in shlex.split(text):
        match = _FLAG.fullmatch(token)
        if match is None:
            raise ConfigError(f"config.{field}={text!r}: {token!r} is not an XLA flag. Fix: "
                              "write space-separated --name=value flags, e.g. "
                              "'--xla_gpu_enable_latency_hiding_scheduler=false'.")
        flags[match.group(1)] = (match.group(2) or "=true")[1:]
    return flags


def plan(environ: Mapping[str, str], *, enable_defaults: bool, user_flags: str,
         hopper: bool) -> Plan:
    """The settings for a GPU process whose environment is `environ` (pure; for tests).

    Precedence: XLA_FLAGS / variables already in `environ`, then `user_flags`
    (config.gpu.flags), then jdp's defaults (only with `enable_defaults`).
    """
    existing_text = environ.get("XLA_FLAGS", "")
    existing = _names_in(existing_text)
    wanted = dict(DEFAULT_XLA_FLAGS) if enable_defaults else {}
    wanted.update(parse_flags(user_flags))
    added = {name: value for name, value in wanted.items() if name not in existing}
    kept = [name for name in wanted if name in existing]
    xla_flags = " ".join([existing_text.strip()] * bool(existing_text.strip())
                         + [f"--{name}={value}" for name, value in added.items()])

    env_wanted = {}
    if enable_defaults:
        env_wanted["XLA_PYTHON_CLIENT_MEM_FRACTION"] = DEFAULT_MEM_FRACTION
        if hopper:
            env_wanted.update(HOPPER_ENV)
    env = {name: value for name, value in env_wanted.items() if name not in environ}
    kept += [name for name in env_wanted if name in environ]
    return Plan(xla_flags=xla_flags, env=env,
                set_by_jdp=tuple(f"{n}={v}" for n, v in {**added, **env}.items()),
                kept=tuple(kept))


def _names_in(xla_flags: str) -> set[str]:
    """The flag names an XLA_FLAGS value sets (its other tokens are XLA's to judge)."""
    return {match.group(1) for match in map(_FLAG.fullmatch, xla_flags.split()) if match}


def gpu_expected(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether jax will start a CUDA backend here, judged without starting one."""
    platforms = environ.get("JAX_PLATFORMS", "").lower()
    if platforms and not any(p in platforms for p in ("cuda", "gpu")):
        return False
    if environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    plugin = any(map(_importable, ("jax_plugins.xla_cuda13", "jax_plugins.xla_cuda12",
                                   "jax_cuda13_plugin", "jax_cuda12_plugin")))
    return plugin and bool(glob.glob("/dev/nvidia[0-9]*"))


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its parent package is not installed
        return False


def is_hopper() -> bool:
    """Whether the first GPU is a Hopper (compute capability 9.x), from nvidia-smi."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return out.strip().startswith("9.")


def apply(gpu_config, environ: MutableMapping[str, str] = os.environ) -> Plan | None:
    """Sets the GPU settings in `environ` before jax starts; None (nothing set) off a GPU.

    `gpu_config` is config.gpu: `enable_defaults` (bool) and `flags` (str).
    """
    from jdp.runtime import jax_compat

    user_flags = parse_flags(gpu_config.flags)  # a bad value fails on any platform
    if not gpu_expected(environ):
        return None
    if not gpu_config.enable_defaults and not user_flags:
        return None
    if jax_compat.backends_initialized():
        logging.warning("GPU settings not applied: jax had already started its backends, "
                        "so XLA_FLAGS set now would have no effect. Fix: set them before "
                        "anything uses jax (jdp.main does).")
        return None
    result = plan(environ, enable_defaults=gpu_config.enable_defaults,
                  user_flags=gpu_config.flags, hopper=is_hopper())
    if result.xla_flags:
        environ["XLA_FLAGS"] = result.xla_flags
    environ.update(result.env)
    logging.info("%s", result.describe())
    return result
