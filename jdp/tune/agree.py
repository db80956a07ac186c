"""Process 0 decides: every process runs the same search, and each decision (a footprint,
whether to start a trial, a measured speed) is process 0's, carried to the others through
the coordination service's key-value store, so that every process compiles the same
candidates and starts the same collective trials.
"""

from __future__ import annotations

import itertools
import json

import jax
from jax.experimental import multihost_utils

from jdp.runtime import distributed

_rounds = itertools.count()  # advances identically on every process: the same code runs


def from_process_0(value, *, timeout_s: float = 1800.0):
    """Process 0's `value` (anything JSON can carry), on every process; `value` itself
    with one process."""
    state = distributed.job_state()
    if state is None:
        return value
    key = f"jdp/tune/{next(_rounds)}"
    if state.process_id == 0:
        state.client.key_value_set(key, json.dumps(value))
        return value
    return json.loads(state.client.blocking_key_value_get(key, int(timeout_s * 1000)))


def barrier(name: str) -> None:
    """Every process waits here until all have arrived (no-op with one process)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)
