"""Loaded at the start of every Python process a test starts (tests/conftest.py puts this
folder on PYTHONPATH): applies tests/site/cache_reuse.py's changes to jax's compilation
cache once jax loads it, and does nothing in processes that never import jax."""

import cache_reuse

cache_reuse.install_when_jax_loads()
