"""Test set-up: 8 CPU devices in every test process, set before jax is imported."""

import atexit
import os
import shutil
import tempfile

# XLA:CPU's code generation at optimisation level 1 instead of 2: the tests' compiles
# take about half the time (a 12-step ViT run from an empty compilation cache: 16.7 s
# against 20.3 s, its losses and evaluation the same to the last digit; level 0 changes
# the numbers). Every process a test starts gets the same flags (runs.xla_flags), so
# runs compared bitwise are compiled alike.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8 "
                                   "--xla_backend_optimization_level=1")
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


def _reuse_deserialized_executables() -> None:
    """Within this test process, a program read from the compilation cache is deserialized
    once: the many short runs of the same tiny models otherwise spend about a second each
    turning the same cache entries back into executables. A hit is still a hit only where
    the cache in use holds the same entry, so every test sees the cache's real hits,
    misses and damaged entries.
    Runs only on the jax whose private function it wraps; elsewhere nothing changes."""
    try:
        from jax._src import compilation_cache
    except ImportError:
        return
    original = getattr(compilation_cache, "get_executable_and_time", None)
    get_cache = getattr(compilation_cache, "_get_cache", None)
    if original is None or get_cache is None:
        return
    import jax

    loaded = {}

    def get_executable_and_time(cache_key, compile_options, backend, executable_devices):
        cache = get_cache(backend)
        entry = None if cache is None else cache.get(cache_key)
        if entry is None:
            return original(cache_key, compile_options, backend, executable_devices)
        # The entry's bytes are in the key: a torn or rewritten entry is read afresh.
        key = (jax.config.jax_compilation_cache_dir, cache_key, hash(entry))
        if key not in loaded:
            loaded[key] = original(cache_key, compile_options, backend, executable_devices)
        return loaded[key]

    compilation_cache.get_executable_and_time = get_executable_and_time


_reuse_deserialized_executables()
