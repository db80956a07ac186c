"""Where metrics go: `metrics.jsonl` in the workdir and a console line a person can follow.

Only process 0 writes files; every process logs to its own console.
"""

from __future__ import annotations

import json
import os
import time

from absl import logging


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


def read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


class StepTimer:
    """Throughput between log points, from host wall time at each (late) metrics fetch."""

    def __init__(self, global_batch_size: int, total_steps: int, clock=time.monotonic):
        self.global_batch_size = global_batch_size
        self.total_steps = total_steps
        self.clock = clock
        self._last_time: float | None = None
        self._last_step = 0

    def start(self, step: int) -> None:
        self._last_time, self._last_step = self.clock(), step

    def lap(self, step: int) -> dict[str, float]:
        now = self.clock()
        steps = max(step - self._last_step, 1)
        step_time_s = (now - self._last_time) / steps
        self._last_time, self._last_step = now, step
        return {"train/step_time_s": step_time_s,
                "train/examples_per_s": self.global_batch_size / step_time_s}

    def eta_s(self, step: int, step_time_s: float) -> float:
        return (self.total_steps - step) * step_time_s


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


def compute_metrics(flops_per_step: float | None, step_time_s: float,
                    peak: float | None) -> dict[str, float]:
    """Achieved FLOP/s per device (XLA's count for the compiled step) and MFU."""
    if not flops_per_step:
        return {}
    achieved = flops_per_step / step_time_s
    out = {"train/tflops_per_s_per_device": achieved / 1e12}
    if peak:
        out["train/mfu"] = achieved / peak
    return out


def format_duration(seconds: float) -> str:
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    minutes, seconds = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m{seconds:02d}s" if hours else f"{minutes}m{seconds:02d}s"


def log_train(step: int, total_steps: int, metrics: dict[str, float], eta_s: float) -> None:
    mfu = f"  MFU {100 * metrics['train/mfu']:.1f}%" if "train/mfu" in metrics else ""
    logging.info(
        "step %d/%d (%.0f%%)  loss %.4f  lr %.3g  %.0f examples/s  %.1f ms/step%s  ETA %s",
        step, total_steps, 100.0 * step / total_steps, metrics["train/loss"],
        metrics["train/learning_rate"], metrics["train/examples_per_s"],
        1000 * metrics["train/step_time_s"], mfu, format_duration(eta_s))


def log_eval(step: int, metrics: dict[str, float]) -> None:
    names = "".join(f"  {key[len('eval/'):]} {value:.4f}" for key, value in metrics.items()
                    if key not in ("eval/loss", "eval/num_examples"))
    logging.info("eval at step %d: loss %.4f%s  (%d examples)", step, metrics["eval/loss"],
                 names, metrics["eval/num_examples"])
