"""Stopping: a notice to stop (SIGTERM from a scheduler, Ctrl-C from a user), agreed on by
every process at one step.

A scheduler that preempts a job sends SIGTERM, often to one process only. jax's
preemption sync point (the coordination service) makes every process of a
multi-process job see the notice at the same step, so all of them save that step
and stop together; a lone process has nobody to agree with and notes the signal
itself. The trainer asks `reached(step)` after every step and, when it is True,
saves a checkpoint and raises `Preempted`, which `jdp.main` turns into exit status
76 (`exit_codes.PREEMPTED`: "resume me").

Ctrl-C (SIGINT) is the same notice: the first one saves at the next step and stops;
in a job of several processes it is passed on as SIGTERM to jax's notifier, so the
other processes stop at the same step. A second Ctrl-C stops the process at once
(exit status 130) without waiting for anything; the checkpoints already complete are
kept, and a save cut short is never counted as one (its temporary directory is
removed at the next start).

Input worker processes ignore both signals (`ignore_in_worker`): a notice sent to the
whole process group must not kill them before the trainer has saved.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import threading

import jax
from jax.experimental import multihost_utils

from jdp.runtime import exit_codes


class Preempted(Exception):
    """Raised out of the loop once the stopping checkpoint is saved."""

    def __init__(self, step: int, interrupted: bool = False):
        cause = "interrupted (Ctrl-C)" if interrupted else "preempted"
        super().__init__(f"{cause}: saved a checkpoint at step {step}; rerun the same command "
                         "to resume")
        self.step = step


class PreemptionNotice:
    """Whether this job was told to stop, the same answer on every process at a step.

    Create it in the main thread before the loop; `close()` restores the previous
    SIGTERM and SIGINT handlers.
    """

    def __init__(self) -> None:
        self._notice = threading.Event()
        self.interrupted = False  # this process got Ctrl-C
        self._previous: dict[int, object] = {}
        # jax's sync point needs jax.distributed and reports False without it.
        self._lone = jax.process_count() == 1
        if threading.current_thread() is not threading.main_thread():
            return
        if self._lone:
            self._previous[signal.SIGTERM] = signal.signal(signal.SIGTERM,
                                                           lambda *_: self._notice.set())
        self._previous[signal.SIGINT] = signal.signal(signal.SIGINT, self._on_interrupt)

    def _on_interrupt(self, signum, frame) -> None:
        del signum, frame
        if self.interrupted:  # the second Ctrl-C: stop now
            print("jdp: interrupted again: stopping now, without saving; the complete "
                  "checkpoints are kept", file=sys.stderr, flush=True)
            for child in multiprocessing.active_children():  # input workers
                child.kill()
            os._exit(exit_codes.INTERRUPTED)
        self.interrupted = True
        print("jdp: interrupted: saving a checkpoint at the next step, then stopping "
              "(Ctrl-C again stops at once)", file=sys.stderr, flush=True)
        if self._lone:
            self._notice.set()
        else:  # jax's notifier tells every process, which then stop at one step
            os.kill(os.getpid(), signal.SIGTERM)

    def reached(self, step: int) -> bool:
        """True once a notice arrived (any process's); call it at every step on every
        process, which is what lets the processes agree on the step."""
        if self._lone:
            return self._notice.is_set()
        try:
            return multihost_utils.reached_preemption_sync_point(step)
        except RuntimeError:  # the coordination service runs no preemption service
            return False

    def close(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()


def ignore_in_worker() -> None:
    """For input worker processes: the trainer decides when the job stops."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
