"""Periodic hooks for experiment files: `build_hooks(config) -> [Hook(fn, every=N)]`,
trackers among them (`tracking_hook(tracker)`).

The mechanism and its guarantees are documented in `jdp.train.hooks`, trackers in
`jdp.track`.
"""

from jdp.track import StepRecord, Tracker, tracking_hook
from jdp.train.hooks import Hook, HookInfo

__all__ = ["Hook", "HookInfo", "StepRecord", "Tracker", "tracking_hook"]
