"""The logging window: per-step metrics summed inside the step, read one step late.

The compiled step adds each step's metrics to the window's running sums itself
(`jdp.parallel.step.add_to_window`), so a step is one dispatch. `MetricWindow`
holds the host's side of that protocol: the sums the next step takes, whether it
starts a new window, and a closed window waiting to be read. A window is closed
at a log step and read (`flush`) after the next step has been dispatched, so the
host never waits for the device to report; anything that must see the report
first (evaluation, a save, the end of the loop) flushes it.
"""

from __future__ import annotations

from collections.abc import Callable

from jdp.parallel.step import FIRST_NONFINITE_STEP, LEARNING_RATE


def window_means(sums: dict[str, float], steps: int) -> dict[str, float]:
    """The window's mean of every summed metric (the host divides once, at log time);
    the learning rate is the last step's."""
    return {key: float(value) if key == LEARNING_RATE else float(value) / steps
            for key, value in sums.items() if key != FIRST_NONFINITE_STEP}


class MetricWindow:
    """`begin` with the step's first window inputs; each step takes `inputs()` and
    hands back its sums (`stepped`); `close(step)` at a log step; `flush()` reads a
    closed window and hands `report(step, sums, steps)` the host values."""

    def __init__(self, fetch: Callable, report: Callable[[int, dict, int], None]):
        self._fetch = fetch  # device values -> host numpy (the backend's)
        self._report = report
        self._sums = None  # device sums: of the open window, or the closed one before a step
        self._flags = None  # (reset, keep) as device values
        self._reset = True  # the next step starts a new window
        self._steps = 0
        self._closed = None  # (step, sums, steps) of a window not yet read

    def begin(self, sums, flags: tuple) -> None:
        self._sums, self._flags = sums, flags

    def inputs(self) -> tuple:
        """(sums, reset flag) for the next step."""
        return self._sums, self._flags[0 if self._reset else 1]

    def stepped(self, sums) -> None:
        self._sums, self._reset = sums, False
        self._steps += 1

    def close(self, step: int) -> None:
        self.flush()
        if self._steps:
            self._closed = (step, self._sums, self._steps)
            self._reset, self._steps = True, 0

    def flush(self) -> None:
        if self._closed is not None:
            step, sums, steps = self._closed
            self._closed = None
            self._report(step, self._fetch(sums), steps)

    def open_sums(self) -> dict | None:
        """The open window's sums, read now (a sync: before a save, to check them)."""
        return None if not self._steps else self._fetch(self._sums)
