"""Periodic hooks: what runs after a training step, every N steps.

The loop is: next batch, step, then the hooks that are due. jdp's own periodic
actions (logging, evaluation, checkpoints, profiling, preemption:
`jdp.train.actions`) and an experiment's `build_hooks(config)` use this one
mechanism:

    from jdp.hooks import Hook

    def build_hooks(config):
        def probe(step, info):
            info.write({"probe/weight_norm": float(norm(info.state.params))})
        return [Hook(probe, every=100)]

A hook runs after optimizer steps N, 2N, 3N, ... counted from the start of
training, so a resumed run runs it at the same steps, none twice and none
skipped. It runs on every process at the same steps, in the order given, after
jdp's own; a hook may issue collectives (all processes call it alike). `info`
reads the device only when asked: `info.state` (the train state as global
arrays, valid during the call) and `info.metrics` (the last log window's means,
when there are new ones) each cost a device sync; a hook that reads neither
leaves the loop asynchronous. `info.written` is what the writers were given since
the previous step's hooks, this step's hooks before this one included: a tracker
(`jdp.track`) is a hook that reads it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from jdp.errors import first_line


@dataclasses.dataclass(frozen=True)
class Hook:
    """`fn(step, info)` after every `every`-th optimizer step (and, with `at_end`,
    after the last step too)."""

    fn: Callable[[int, HookInfo], Any]
    every: int
    at_end: bool = False
    name: str = ""

    def __post_init__(self):
        if not callable(self.fn):
            raise TypeError(f"Hook.fn is a {type(self.fn).__name__}; pass a function "
                            "fn(step, info)")
        if not isinstance(self.every, int) or self.every < 0:
            raise ValueError(f"Hook(every={self.every!r}) for {self.label}: pass a whole "
                             "number of steps >= 1 (0: never)")

    @property
    def label(self) -> str:
        return self.name or getattr(self.fn, "__qualname__", type(self.fn).__name__)

    def due(self, step: int, total_steps: int) -> bool:
        return (self.every > 0 and step % self.every == 0) or (self.at_end and
                                                               step == total_steps)


class HookError(Exception):
    """A user hook raised; the run stops (exit 1) with the hook named."""


class HookInfo:
    """What a hook sees after one step. Built by the loop, one per step."""

    def __init__(self, *, step: int, workdir: str, is_writer: bool, total_steps: int,
                 state_fn: Callable[[], Any], metrics_fn: Callable[[], dict | None],
                 write_fn: Callable[[int, dict], None],
                 write_text_fn: Callable[[int, str, str], None],
                 written_fn: Callable[[], list[tuple[int, dict]]]):
        self.step = step
        self.workdir = workdir
        self.is_writer = is_writer  # this process writes metrics.jsonl and TensorBoard
        self.total_steps = total_steps
        self.eval_metrics: dict | None = None  # this step's evaluation, when there was one
        self._state_fn = state_fn
        self._metrics_fn = metrics_fn
        self._write_fn = write_fn
        self._write_text_fn = write_text_fn
        self._written_fn = written_fn

    @property
    def state(self):
        """The train state at this step as global arrays (a device sync)."""
        return self._state_fn()

    @property
    def metrics(self) -> dict[str, float] | None:
        """The last log window's train metrics, when new since a hook last saw them."""
        return self._metrics_fn()

    @property
    def written(self) -> list[tuple[int, dict[str, float | str]]]:
        """What the writers were given since the previous step's hooks ran, in order:
        `(step, values)`, a text as a string value. That is the train report of the last
        log step (read one step late), this step's evaluation and what the hooks before
        this one wrote; no device sync."""
        return self._written_fn()

    def write(self, values: dict[str, float]) -> None:
        """Writes `values` at this step to metrics.jsonl and TensorBoard (writer only)."""
        self._write_fn(self.step, values)

    def write_text(self, name: str, text: str) -> None:
        """Writes `text` at this step to TensorBoard's text tab (writer only)."""
        self._write_text_fn(self.step, name, text)


class Hooks:
    """An ordered list of hooks, run after each step where they are due."""

    def __init__(self, hooks: Sequence[Hook], total_steps: int, *, users_from: int):
        self.hooks = list(hooks)
        self.total_steps = total_steps
        self._users_from = users_from  # hooks from this index on are the experiment's

    def run(self, step: int, info: HookInfo) -> None:
        for index, hook in enumerate(self.hooks):
            if not hook.due(step, self.total_steps):
                continue
            if index < self._users_from:
                hook.fn(step, info)
                continue
            try:
                hook.fn(step, info)
            except Exception as error:
                raise HookError(
                    f"hook {hook.label} (every={hook.every}) failed at step {step}: "
                    f"{type(error).__name__}: {first_line(error)}. The checkpoints and metrics "
                    "written so far are kept. Fix: the hook (build_hooks in the experiment "
                    "file), then rerun to resume.") from error


def check_hooks(hooks, where: str) -> list[Hook]:
    """An experiment's `build_hooks` result: a list of `Hook`s (raises ValueError)."""
    if not isinstance(hooks, (list, tuple)) or not all(isinstance(h, Hook) for h in hooks):
        raise ValueError(f"{where} returned {type(hooks).__name__}; expected a list of "
                         "jdp.hooks.Hook(fn, every=N)")
    return list(hooks)
