"""jdp's own periodic actions, as hooks: logging, evaluation, checkpoints, preemption
and profiling. Each owns its state and its period; the loop only runs them."""

from __future__ import annotations

from collections.abc import Callable

from jdp.checkpoint import Checkpointer
from jdp.observe.profiling import StepProfiler
from jdp.runtime.preemption import Preempted, PreemptionNotice
from jdp.train.hooks import Hook, HookInfo
from jdp.train.nonfinite import NonFiniteGuard
from jdp.train.window import MetricWindow


class LiveState:
    """The loop's working state; a hook that saves it may hand back a new one."""

    def __init__(self, state):
        self.state = state


def log_hook(window: MetricWindow, every: int) -> Hook:
    """Closes the metric window at each log step; it is read one step later."""
    return Hook(lambda step, info: window.close(step), every=every, at_end=True, name="log")


class Evaluation:
    """Evaluates every `every` steps and at the end; remembers the last result."""

    def __init__(self, run_eval: Callable[[int, object], dict], window: MetricWindow,
                 live: LiveState):
        self.run_eval = run_eval
        self.window = window
        self.live = live
        self.last: dict = {}

    def __call__(self, step: int, info: HookInfo) -> None:
        self.window.flush()  # the train line of this step before the eval line
        info.eval_metrics = self.last = self.run_eval(step, self.live.state)


class Checkpointing:
    """Saves at the checkpointer's own cadence, at the end and when asked (preemption).

    Never saves past a step that was not finite: the open window's sums are checked
    first (the save waits for the device anyway)."""

    def __init__(self, checkpointer: Checkpointer, save_global: Callable, window: MetricWindow,
                 guard: NonFiniteGuard, total_steps: int, timed: Callable):
        self.checkpointer = checkpointer
        self.save_global = save_global  # (step, metrics) -> None; converts and saves the state
        self.window = window
        self.guard = guard
        self.total_steps = total_steps
        self.timed = timed  # a context manager: the time the save stalls the loop

    def __call__(self, step: int, info: HookInfo) -> None:
        if self.checkpointer.due(step) or step == self.total_steps:
            self.save(step, info)

    def save(self, step: int, info: HookInfo) -> None:
        self.window.flush()
        sums = self.window.open_sums()
        if sums is not None:
            self.guard.check(sums, step, count=False)
        with self.timed():
            self.save_global(step, info.eval_metrics)


class Preemption:
    """After every step: once any process was told to stop (SIGTERM, Ctrl-C), report the
    open metric window, save and leave the loop."""

    def __init__(self, notice: PreemptionNotice, checkpointing: Checkpointing,
                 window: MetricWindow):
        self.notice = notice
        self.checkpointing = checkpointing
        self.window = window

    def __call__(self, step: int, info: HookInfo) -> None:
        if self.notice.reached(step):
            # The steps since the last report are reported now, marked partial: the
            # resumed run starts its window at the next step, so each step's loss is
            # logged exactly once across the stop.
            self.window.close(step)
            self.checkpointing.save(step, info)
            raise Preempted(step, interrupted=self.notice.interrupted)


class Profiling:
    """Starts the profiler trace before the first profiled step, stops it after the last."""

    def __init__(self, profiler: StepProfiler, outputs: Callable):
        self.profiler = profiler
        self.outputs = outputs  # the last step's outputs, waited on when the trace stops

    def __call__(self, step: int, info: HookInfo) -> None:
        self.profiler.after(step, self.outputs())
        self.profiler.before(step)
