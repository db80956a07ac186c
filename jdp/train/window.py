"""The logging window: per-step metrics summed on the device, read one step late.

`MetricWindow` owns the protocol the loop used to carry in loose locals: the
running sums of the open window, and a closed window waiting to be read. A window
is closed at a log step and read (`flush`) after the next step has been
dispatched, so the host never waits for the device to report; anything that must
see the report first (evaluation, a save, the end of the loop) flushes it.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from jdp.parallel.step import FIRST_NONFINITE_STEP


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


class MetricWindow:
    """`add` each step's metrics; `close(step)` at a log step; `flush()` reads a closed
    window and hands `report(step, sums, steps)` the host values."""

    def __init__(self, fetch: Callable, report: Callable[[int, dict, int], None]):
        self._fetch = fetch  # device values -> host numpy (the backend's)
        self._report = report
        self._sums = None  # device sums of the open window
        self._steps = 0
        self._closed = None  # (step, sums, steps) of a window not yet read

    def add(self, metrics: dict) -> None:
        self._sums = metrics if self._sums is None else add_to_window(self._sums, metrics)
        self._steps += 1

    def close(self, step: int) -> None:
        self.flush()
        if self._sums is not None:
            self._closed, self._sums, self._steps = (step, self._sums, self._steps), None, 0

    def flush(self) -> None:
        if self._closed is not None:
            step, sums, steps = self._closed
            self._closed = None
            self._report(step, self._fetch(sums), steps)

    def open_sums(self) -> dict | None:
        """The open window's sums, read now (a sync: before a save, to check them)."""
        return None if self._sums is None else self._fetch(self._sums)
