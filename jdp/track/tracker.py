"""What a tracker is: where a run's records go besides metrics.jsonl (W&B, MLflow, your own).

A tracker gets one `StepRecord` per step, in step order, from the hook that feeds it
(`jdp.track.feed`); it never sees a step twice, also across a resume, because it says at
`start` which steps its backend already holds.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol


@dataclasses.dataclass
class StepRecord:
    """Everything the writers were given for one step."""

    step: int
    metrics: dict[str, float]  # train, eval and hooks' values, as in metrics.jsonl
    texts: dict[str, str] = dataclasses.field(default_factory=dict)  # e.g. a model's sample
    images: dict[str, str] = dataclasses.field(default_factory=dict)  # name -> PNG file


class Tracker(Protocol):
    """A run in a tracking backend. Called on process 0 only; any exception it raises
    turns it off for the rest of the process, with one warning."""

    name: str  # names its run id in <workdir>/trackers.json, and it in the warning

    def start(self, run_id: str | None, config: dict) -> tuple[str, int]:
        """Opens the run: a new one when `run_id` is None, else the one of that id (a
        resumed training run). `config`: the resolved config (config.json). Returns the
        run's id and the last step whose record the backend holds (0: none)."""

    def log(self, record: StepRecord) -> None:
        """Adds one step's record; the steps arrive in increasing order."""

    def finish(self) -> None:
        """The training run ended (after the last step's record)."""
