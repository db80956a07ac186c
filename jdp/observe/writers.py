"""Where metrics go and how a log window's figures are made.

Writers share one small interface (`write(step, metrics)`, `close()`):
`metrics.jsonl` and TensorBoard event files in the workdir, both written by
process 0 and flushed at every write, so a crash loses nothing logged. The
logging window's train metrics are sums kept on the device (`add_to_window`)
and divided on the host when read; `WindowClock` splits the window's wall time
into steps, waiting for input, evaluation and checkpoint saves.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable
from typing import Protocol

import jax
import jax.numpy as jnp
from absl import logging


class Writer(Protocol):
    def write(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class MultiWriter:
    """Writes every record to each of `writers`."""

    def __init__(self, writers: Iterable[Writer]):
        self.writers = list(writers)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        for writer in self.writers:
            writer.write(step, metrics)

    def close(self) -> None:
        for writer in self.writers:
            writer.close()


class TensorBoardWriter:
    """Scalars as TensorBoard event files in `logdir` (tensorboardX: no TensorFlow needed).

    A resumed run adds a new event file; TensorBoard shows the newest value of a step.
    """

    def __init__(self, logdir: str):
        from tensorboardX import SummaryWriter

        self._writer = SummaryWriter(logdir=logdir)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        for name, value in metrics.items():
            self._writer.add_scalar(name, float(value), global_step=int(step))
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class JsonlWriter:
    """Appends one JSON object per line, each with an integer `step`.

    On resume from step S the lines past S are dropped first, so a restarted
    run continues the file without duplicated or orphaned steps.
    """

    def __init__(self, path: str, *, enabled: bool, resume_step: int = 0):
        self.path = path
        self.enabled = enabled
        if enabled:
            self._truncate_after(resume_step)

    def _truncate_after(self, step: int) -> None:
        if not os.path.exists(self.path):
            return
        with open(self.path) as f:
            kept = [line for line in f if line.strip() and json.loads(line)["step"] <= step]
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(kept)
        os.replace(tmp, self.path)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": int(step), **{k: float(v) for k, v in metrics.items()}})
                    + "\n")

    def close(self) -> None:
        pass  # every write opens, appends and closes the file


def read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


# -- the logging window -------------------------------------------------------------

FIRST_NONFINITE_STEP = "first_nonfinite_step"  # reduced with min, every other key with +


def _add(window: dict, metrics: dict) -> dict:
    return {key: (jnp.minimum if key == FIRST_NONFINITE_STEP else jnp.add)(window[key], value)
            for key, value in metrics.items()}


# Dispatched after every step, on the device: no host sync. A handful of scalars,
# not donated: the trainer still waits on the previous step's metrics.
add_to_window = jax.jit(_add)


def window_means(sums: dict[str, float], steps: int) -> dict[str, float]:
    """The window's mean of every summed metric (the host divides once, at log time)."""
    return {key: float(value) / steps for key, value in sums.items()
            if key != FIRST_NONFINITE_STEP}


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

    def start(self, step: int) -> None:
        self._window_start, self._window_step = self.clock(), step
        self._spent = dict.fromkeys(self.PHASES, 0.0)

    def timed(self, phase: str):
        clock = self

        class _Timed:
            def __enter__(self):
                self.t0 = clock.clock()

            def __exit__(self, *exc):
                clock._spent[phase] += clock.clock() - self.t0

        return _Timed()

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


def compute_metrics(flops_per_step: float | None, model_flops_per_step: float | None,
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


def format_duration(seconds: float) -> str:
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    minutes, seconds = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m{seconds:02d}s" if hours else f"{minutes}m{seconds:02d}s"


def log_train(step: int, total_steps: int, metrics: dict[str, float], eta: float) -> None:
    mfu = f"  MFU {100 * metrics['train/mfu']:.1f}%" if "train/mfu" in metrics else ""
    extras = "".join(f"  {label} {metrics[key]:.1f} s" for key, label in (
        ("time/eval_s", "eval"), ("time/checkpoint_s", "saving"), ("time/compile_s", "compile"))
        if metrics.get(key))
    rss = f"  RSS {metrics['memory/host_rss_mib']:.0f} MiB" \
        if "memory/host_rss_mib" in metrics else ""
    logging.info(
        "step %d/%d (%.0f%%)  loss %.4f  lr %.3g  |g| %.3g  %.0f examples/s  %.1f ms/step  "
        "input wait %.0f%%%s%s%s  ETA %s",
        step, total_steps, 100.0 * step / total_steps, metrics["train/loss"],
        metrics.get("train/learning_rate", float("nan")),
        metrics.get("train/grad_norm", float("nan")), metrics["train/examples_per_s"],
        1000 * metrics["train/step_time_s"], 100 * metrics["train/data_wait_fraction"], mfu,
        extras, rss, format_duration(eta))


def log_eval(step: int, metrics: dict[str, float]) -> None:
    names = "".join(f"  {key[len('eval/'):]} {value:.4f}" for key, value in metrics.items()
                    if key not in ("eval/loss", "eval/num_examples"))
    logging.info("eval at step %d: loss %.4f%s  (%d examples)", step, metrics["eval/loss"],
                 names, metrics["eval/num_examples"])
