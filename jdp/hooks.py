"""Periodic hooks for experiment files: `build_hooks(config) -> [Hook(fn, every=N)]`.

The mechanism and its guarantees are documented in `jdp.train.hooks`.
"""

from jdp.train.hooks import Hook, HookInfo

__all__ = ["Hook", "HookInfo"]
