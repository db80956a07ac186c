"""A candidate's speed, measured on the real training loop: `jdp.main.run` for a few
steps in a scratch workdir, on real batches, input pipeline included.

The figure is what the loop itself logs per window (`train/examples_per_s`, and
`train/tokens_per_s` for language models): the loop's clock starts after the train
step is compiled and leaves out evaluation and checkpoint saves, so compile, the final
evaluation and the final save are not in it. The first window, which holds the first
dispatch and any warm-up, is dropped when there are others. Compiled programs come
from the persistent compilation cache where a trial ran before.
"""

from __future__ import annotations

import dataclasses
import shutil
import time

import jax
from absl import logging

from jdp.errors import quoted
from jdp.observe.writers import read_metrics
from jdp.tune import agree

# Windows per trial: the first is dropped, the others measured.
_WINDOWS = 4


@dataclasses.dataclass(frozen=True)
class Speed:
    examples_per_s: float
    tokens_per_s: float | None  # language models: real target tokens
    mfu: float | None  # where the device's peak is known

    @property
    def rate(self) -> float:
        """What candidates are ranked by: tokens/s where counted, else examples/s."""
        return self.examples_per_s if self.tokens_per_s is None else self.tokens_per_s


@dataclasses.dataclass(frozen=True)
class Timing:
    speed: Speed | None  # None: the trial logged no window (it failed)
    start_s: float  # since the first trial started
    length_s: float  # the whole trial: start-up, compile, steps, evaluation, save


def trial_settings(config, trial_steps: int) -> dict:
    """Overrides that make a run a trial: `trial_steps` steps in `_WINDOWS` log windows,
    no evaluation but the final one, no TensorBoard, no tracker, no profile. The
    learning-rate schedule is shortened with the run; the step's cost does not depend on
    it."""
    return {"total_steps": trial_steps,
            "warmup_steps": min(config.warmup_steps, trial_steps - 1),
            "log_every_steps": max(1, trial_steps // _WINDOWS),
            "eval_every_steps": 0, "checkpoint.every_steps": 0, "checkpoint.every_minutes": 0,
            "checkpoint.keep_best": "",
            "tensorboard": False, "tracker.kind": "", "profile.num_steps": 0}


def speed_of(records: list[dict]) -> Speed | None:
    """The loop's figures over its windows after the first, weighted by their time."""
    windows = [r for r in records if "train/examples_per_s" in r]
    if not windows:
        return None
    measured, previous_step = [], 0
    for window in windows:
        measured.append((window, window["step"] - previous_step))
        previous_step = window["step"]
    measured = measured[1:] or measured
    seconds = [w["train/step_time_s"] * n for w, n in measured]
    total_s = sum(seconds)

    def mean(key: str) -> float | None:
        if any(key not in w for w, _ in measured):
            return None
        return sum(w[key] * s for (w, _), s in zip(measured, seconds, strict=True)) / total_s

    return Speed(mean("train/examples_per_s"), mean("train/tokens_per_s"), mean("train/mfu"))


class TrialFailed(Exception):
    """A trial's run raised (out of device memory, a bug on one path): that candidate is
    not timed, and the search goes on."""


def run_trial(run, config, workdir: str) -> Speed | None:
    """Trains `config` in the scratch `workdir` with `run(config, workdir)` (jdp.main's
    `run`), then removes it; process 0's reading of the loop's figures, on every process.
    Raises TrialFailed, with the error's first line, when the run raised."""
    failure = None
    try:
        try:
            run(config, workdir)
        except Exception as e:  # noqa: BLE001 - this candidate's failure, not the search's
            logging.exception("tune: the trial in %s failed", workdir)
            failure = quoted(e)
        speed = None if failure else agree.from_process_0(_read_speed(workdir))
    finally:
        agree.barrier(f"jdp.tune trial {workdir}")  # every process is done with it
        shutil.rmtree(workdir, ignore_errors=True)
    if failure:
        raise TrialFailed(failure)
    return None if speed is None else Speed(**speed)


def _read_speed(workdir: str) -> dict | None:
    if jax.process_index() != 0:  # only process 0 writes metrics
        return None
    speed = speed_of(read_metrics(workdir))
    return None if speed is None else dataclasses.asdict(speed)


class Budget:
    """Seconds for the timed trials, from the first trial's start. The first trial always
    runs (the winner is measured); another starts only if, at the mean length of the
    trials so far, it would end within the budget. So the last trial ends at most one
    trial's length past the budget, and only when trials vary in length."""

    def __init__(self, budget_s: float | None, clock=time.monotonic):
        self.budget_s = budget_s
        self.clock = clock
        self.started: float | None = None
        self.lengths_s: list[float] = []

    def allows_another(self) -> bool:
        if self.budget_s is None or not self.lengths_s:
            return True
        mean_s = sum(self.lengths_s) / len(self.lengths_s)
        return self.elapsed_s() + mean_s <= self.budget_s

    def elapsed_s(self) -> float:
        return 0.0 if self.started is None else self.clock() - self.started

    def timed(self, run_trial_fn) -> Timing:
        """Runs `run_trial_fn()` (-> Speed | None) and records its length."""
        if self.started is None:
            self.started = self.clock()
        start_s = self.elapsed_s()
        try:
            speed = run_trial_fn()
        finally:  # a failed trial's time counts against the budget too
            self.lengths_s.append(self.elapsed_s() - start_s)
        return Timing(speed, start_s, self.lengths_s[-1])
