"""Loaded at the start of every Python process a test starts (tests/conftest.py puts this
folder on PYTHONPATH): applies tests/site/cache_reuse.py's changes to jax's compilation
cache once jax loads it, and does nothing in processes that never import jax.

SIGUSR2 makes such a process write its threads' stacks to stderr and go on: a test that
gives up on a process sends it first (runs.stacks_then_kill), so a hang in CI says where
each process waited."""

import faulthandler
import signal

import cache_reuse

cache_reuse.install_when_jax_loads()
faulthandler.register(signal.SIGUSR2, all_threads=True)
