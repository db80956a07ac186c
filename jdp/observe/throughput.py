"""The figures a log window reports about speed and resources: its wall time split
into steps, input wait, evaluation and checkpoints (`WindowClock`), FLOP/s and MFU
against the device's peak, and host and device memory.
"""

from __future__ import annotations

import os
import time


class WindowClock:
    """Splits the wall time of a log window: steps, input wait, evaluation, checkpoints.

    The loop wraps what it waits for in `timed(phase)`; the step time is what is
    left of the window's wall time, per step. `clock` is injectable for tests.
    """

    PHASES = ("data_wait", "eval", "checkpoint")

    def __init__(self, global_batch_size: int, device_count: int, clock=time.monotonic):
        self.global_batch_size = global_batch_size
        self.device_count = device_count
        self.clock = clock
        self.started = clock()
        self._window_start = self.started
        self._window_step = 0
        self._spent = dict.fromkeys(self.PHASES, 0.0)
        self.totals = dict.fromkeys(self.PHASES, 0.0)  # since this clock was made

    def start(self, step: int) -> None:
        self._window_start, self._window_step = self.clock(), step
        self._spent = dict.fromkeys(self.PHASES, 0.0)

    def timed(self, phase: str) -> _Timed:
        return _Timed(self, phase)

    def lap(self, step: int) -> dict[str, float]:
        """The window's figures, then a new window starts at `step`."""
        now = self.clock()
        wall = now - self._window_start
        steps = max(step - self._window_step, 1)
        training = wall - self._spent["eval"] - self._spent["checkpoint"]
        step_time_s = training / steps
        examples_per_s = self.global_batch_size / step_time_s if step_time_s > 0 else 0.0
        out = {"train/step_time_s": step_time_s,
               "train/examples_per_s": examples_per_s,
               "train/examples_per_s_per_device": examples_per_s / self.device_count,
               "train/data_wait_fraction": self._spent["data_wait"] / training
               if training > 0 else 0.0,
               "time/eval_s": self._spent["eval"],
               "time/checkpoint_s": self._spent["checkpoint"],
               "time/wall_s": now - self.started}
        self._window_start, self._window_step = now, step
        self._spent = dict.fromkeys(self.PHASES, 0.0)
        return out


class _Timed:
    """Adds the time spent inside a `with` block to a WindowClock's phase (a class of
    its own: the loop enters one every step)."""

    __slots__ = ("_clock", "_phase", "_t0")

    def __init__(self, clock: WindowClock, phase: str):
        self._clock, self._phase = clock, phase

    def __enter__(self) -> None:
        self._t0 = self._clock.clock()

    def __exit__(self, *exc) -> None:
        spent = self._clock.clock() - self._t0
        self._clock._spent[self._phase] += spent
        self._clock.totals[self._phase] += spent


def memory_metrics(device, compiled_bytes: int | None) -> dict[str, float]:
    """Host RSS, and device memory in use and at peak where the device reports it
    (GPUs, TPUs); else the compiled step's per-device footprint (CPU)."""
    out = {}
    rss = _host_rss_bytes()
    if rss is not None:
        out["memory/host_rss_mib"] = rss / 2**20
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and "bytes_in_use" in stats:
        out["memory/device_in_use_mib"] = stats["bytes_in_use"] / 2**20
        if "peak_bytes_in_use" in stats:
            out["memory/device_peak_mib"] = stats["peak_bytes_in_use"] / 2**20
    elif compiled_bytes is not None:
        out["memory/compiled_step_mib"] = compiled_bytes / 2**20
    return out


def _host_rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def eta_s(step: int, total_steps: int, step_time_s: float) -> float:
    return (total_steps - step) * step_time_s


# Dense bfloat16 peak FLOP/s per device, by `device_kind` prefix (vendor data sheets).
_PEAK_BF16_FLOPS = (("NVIDIA H200", 989e12), ("NVIDIA H100", 989e12), ("NVIDIA A100", 312e12),
                    ("TPU v6 lite", 918e12), ("TPU v5p", 459e12), ("TPU v5 lite", 197e12),
                    ("TPU v4", 275e12))


def peak_flops_per_s(device_kind: str) -> float | None:
    """The device's dense bf16 peak, for MFU; None where unknown (CPUs, other chips)."""
    for prefix, peak in _PEAK_BF16_FLOPS:
        if device_kind.startswith(prefix):
            return peak
    return None


def known_device_kinds() -> tuple[str, ...]:
    """The device kinds (prefixes) whose peak `peak_flops_per_s` knows."""
    return tuple(prefix for prefix, _ in _PEAK_BF16_FLOPS)


def flops_metrics(flops_per_step: float | None, model_flops_per_step: float | None,
                    step_time_s: float, peak: float | None) -> dict[str, float]:
    """FLOP/s per device: XLA's count of the compiled step (hardware FLOPs, remat
    recomputation included) and the model's own FLOPs; MFU = model FLOP/s / peak,
    only when both are known."""
    out = {}
    if step_time_s <= 0:
        return out
    if flops_per_step:
        out["train/tflops_per_s_per_device"] = flops_per_step / step_time_s / 1e12
    if model_flops_per_step:
        model = model_flops_per_step / step_time_s
        out["train/model_tflops_per_s_per_device"] = model / 1e12
        if peak:
            out["train/mfu"] = model / peak
    return out

