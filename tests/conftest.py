"""Test set-up: 8 CPU devices in every test process, set before jax is imported."""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# A test started inside a SLURM allocation must not join that job.
for _name in [n for n in os.environ if n.startswith("SLURM_")]:
    del os.environ[_name]

# Tests prepare the built-in dataset in their own directory, not in the user's home.
if "TFDS_DATA_DIR" not in os.environ:
    os.environ["TFDS_DATA_DIR"] = tempfile.mkdtemp(prefix="jdp-tfds-")

# One compilation cache for the session, inherited by every `python -m jdp.main` the
# tests start: the same tiny models compile once, and nothing lands in ~/.cache.
os.environ["JDP_COMPILE_CACHE_DIR"] = tempfile.mkdtemp(prefix="jdp-compile-cache-")
atexit.register(shutil.rmtree, os.environ["JDP_COMPILE_CACHE_DIR"], ignore_errors=True)
