"""Preemption: a notice to stop (SIGTERM), agreed on by every process at one step.

A scheduler that preempts a job sends SIGTERM, often to one process only. jax's
preemption sync point (the coordination service) makes every process of a
multi-process job see the notice at the same step, so all of them save that step
and stop together; a lone process has nobody to agree with and notes SIGTERM
itself. The trainer asks `reached(step)` after every step and, when it is True,
saves a checkpoint and raises `Preempted`, which `jdp.main` turns into exit status
76 (`exit_codes.PREEMPTED`: "resume me").

Input worker processes ignore SIGTERM (`ignore_in_worker`): a notice sent to the
whole process group must not kill them before the trainer has saved.
"""

from __future__ import annotations

import signal
import threading

import jax
from jax.experimental import multihost_utils


class Preempted(Exception):
    """Raised out of the loop once the preemption checkpoint is saved."""

    def __init__(self, step: int):
        super().__init__(f"preempted: saved a checkpoint at step {step}; rerun to resume")
        self.step = step


class PreemptionNotice:
    """Whether this job was told to stop, the same answer on every process at a step.

    Create it in the main thread before the loop; `close()` restores the previous
    SIGTERM handler.
    """

    def __init__(self) -> None:
        self._sigterm = threading.Event()
        self._previous_handler = None
        # jax's sync point needs jax.distributed and reports False without it.
        self._lone = jax.process_count() == 1
        if self._lone and threading.current_thread() is threading.main_thread():
            self._previous_handler = signal.signal(signal.SIGTERM,
                                                   lambda *_: self._sigterm.set())

    def reached(self, step: int) -> bool:
        """True once a notice arrived (any process's); call it at every step on every
        process, which is what lets the processes agree on the step."""
        if self._lone:
            return self._sigterm.is_set()
        try:
            return multihost_utils.reached_preemption_sync_point(step)
        except RuntimeError:  # the coordination service runs no preemption service
            return False

    def close(self) -> None:
        if self._previous_handler is not None:
            signal.signal(signal.SIGTERM, self._previous_handler)
            self._previous_handler = None


def ignore_in_worker() -> None:
    """For input worker processes: the trainer decides when the job stops."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
