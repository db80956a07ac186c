"""The non-finite guard: counts the updates the step skipped and stops the run when
the config allows no more."""

from __future__ import annotations

from collections.abc import Callable

from absl import logging

from jdp.parallel.step import FIRST_NONFINITE_STEP, NONFINITE


class NonFiniteError(Exception):
    """The loss or gradients went non-finite more often than allowed; nothing was saved
    past the last good checkpoint. The job exits with status 3."""


class NonFiniteGuard:
    """`allowed` skipped updates before stopping (`skip_nonfinite_steps`); `crash=False`
    (`crash_on_nan=False`): never stop. `latest_checkpoint()` names what is kept."""

    def __init__(self, allowed: int, crash: bool, latest_checkpoint: Callable[[], int | None]):
        self.allowed = allowed
        self.crash = crash
        self.latest_checkpoint = latest_checkpoint
        self.skipped = 0

    def check(self, sums: dict, step: int, count: bool = True) -> None:
        """Raises if a window's sums hold more non-finite steps than allowed; `count`:
        add them to `skipped` (a window is counted once, when it is reported)."""
        new = int(round(float(sums[NONFINITE])))
        if new == 0:
            return
        first = int(sums[FIRST_NONFINITE_STEP])
        if self.crash and self.skipped + new > self.allowed:
            latest = self.latest_checkpoint()
            kept = f"step {latest}" if latest is not None else "none yet"
            raise NonFiniteError(
                f"the loss or gradients were not finite at step {first} ({self.skipped + new} "
                f"non-finite step(s) by step {step}, config.skip_nonfinite_steps="
                f"{self.allowed}); nothing non-finite was saved (newest checkpoint: {kept}). "
                "Fix: lower --config.learning_rate, set --config.grad_clip_norm=1.0, compute "
                "in float32, or let --config.skip_nonfinite_steps=N skip a few bad batches.")
        if count:
            self.skipped += new
            logging.warning("skipped %d non-finite update(s), the first at step %d (%d so far)",
                            new, first, self.skipped)
