"""Profiler traces of a window of training steps (`profile.start_step`,
`profile.num_steps`): a `jax.profiler` trace per process in the workdir, each
step annotated with `StepTraceAnnotation`, readable by TensorBoard's profile
plugin or Perfetto. Off by default (num_steps = 0).
"""

from __future__ import annotations

import contextlib
import shutil

import jax
from absl import logging

from jdp.runtime import storage


class StepProfiler:
    """Starts a trace before step `start_step` and stops it after `num_steps` steps."""

    def __init__(self, start_step: int, num_steps: int, logdir: str):
        self.start_step = start_step
        self.stop_step = start_step + num_steps
        self.enabled = num_steps > 0
        self.logdir = logdir
        self._local_dir = logdir  # where jax writes the trace
        self.active = False

    def before(self, step: int) -> None:
        """Called before dispatching step `step` (0-based: the step count so far)."""
        if self.enabled and step == self.start_step and not self.active:
            # jax's own gs:// writer ignores the emulator and credentials jdp configures:
            # a bucket's trace is written locally and copied up when it stops.
            self._local_dir = (storage.staging_dir("profile")
                               if storage.is_bucket(self.logdir) else self.logdir)
            jax.profiler.start_trace(self._local_dir)
            self.active = True
            logging.info("profiling steps %d to %d into %s", self.start_step + 1,
                         self.stop_step, self.logdir)

    def annotate(self, step: int):
        """Marks the dispatch of one step in the trace (nothing when not tracing)."""
        if not self.active:
            return contextlib.nullcontext()
        return jax.profiler.StepTraceAnnotation("train", step_num=step)

    def after(self, done: int, outputs) -> None:
        """Called after step `done` was dispatched; stops once its work is in the trace."""
        if self.active and done >= self.stop_step:
            jax.block_until_ready(outputs)  # only here: the traced steps must have run
            self.close()

    def close(self) -> None:
        if self.active:
            jax.profiler.stop_trace()
            self.active = False
            if self._local_dir != self.logdir:
                storage.upload(self._local_dir, self.logdir)
                shutil.rmtree(self._local_dir, ignore_errors=True)
