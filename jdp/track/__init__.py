"""Trackers: a run's records sent to Weights & Biases, MLflow or your own backend as well as
to metrics.jsonl.

A tracker (`Tracker`: `start`, `log`, `finish`) is fed by a hook like any other
(`tracking_hook(tracker)`, `feed`), on process 0, one `StepRecord` per step; a failing
tracker gives one warning and training goes on. `tracker.kind` names the built-in ones
(`configured`), which jdp adds after the experiment's own hooks.
"""

from jdp.track.feed import tracking_hook
from jdp.track.tracker import StepRecord, Tracker

__all__ = ["StepRecord", "Tracker", "tracking_hook"]
