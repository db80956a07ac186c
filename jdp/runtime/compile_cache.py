"""Where compiled executables are cached across runs: jax's persistent compilation cache.

Sharing a directory (jax 0.10.2's source): in a job only process 0 writes
(`compiler._cache_write`), separate jobs each write. `lru_cache.LRUCache.put` writes in place
(no temp file + rename, no lock), so a reader can meet a torn entry: it fails to decompress,
and `compiler._cache_read` turns that into a warning and a recompile, not a failed run.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator, Mapping

import jax
from absl import logging
from jax.experimental.compilation_cache import compilation_cache

OFF = "none"

# jax writes only programs that took at least 1 s to compile (its default). jdp's
# train, eval and init steps of small models can compile faster than that on a fast
# machine, and would then be compiled again by every run; 0.1 s still keeps out the
# helpers that compile in milliseconds (after a 2-step ViT-nano run trains, about 80
# array slices of 10-40 ms each), whose files would cost about what they save. jax's
# minimum entry size stays at its default, 0 bytes: every size is worth a file.
_MIN_COMPILE_TIME_S = 0.1


def resolve_dir(value: str, environ: Mapping[str, str] = os.environ) -> str | None:
    """The cache directory config.compile_cache_dir names; None when it is 'none' (off).

    "" picks $JDP_COMPILE_CACHE_DIR, else $XDG_CACHE_HOME/jdp/compile_cache, else
    ~/.cache/jdp/compile_cache. The cache stays on a local disk: a bucket URL warns and
    falls back to the local default (every compile would read and write the bucket).
    """
    if value.strip().lower() == OFF:
        return None
    if "://" in value:
        fallback = resolve_dir("", {k: v for k, v in environ.items()
                                    if k != "JDP_COMPILE_CACHE_DIR" or "://" not in v})
        logging.warning("compilation cache: %r is not a local directory; using %s instead. "
                        "Fix: set config.compile_cache_dir (or $JDP_COMPILE_CACHE_DIR) to a "
                        "local directory", value, fallback)
        return fallback
    if value:
        return os.path.abspath(os.path.expanduser(value))
    if environ.get("JDP_COMPILE_CACHE_DIR"):
        return resolve_dir(environ["JDP_COMPILE_CACHE_DIR"], environ={})
    cache_home = environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
    return os.path.join(os.path.expanduser(cache_home), "jdp", "compile_cache")


def enable(directory: str | None) -> None:
    """Points jax's persistent cache at `directory` (None: off) for every later compile.

    A directory that cannot be created or written only warns: the run goes on
    without a cache rather than failing over it.
    """
    if directory is not None:
        try:
            _check_writable(directory)
        except OSError as e:
            logging.warning("compilation cache off: config.compile_cache_dir resolved to %r, "
                            "which is not a writable directory (%s). Fix: set it to one, or "
                            "to 'none'", directory, e.strerror or e)
            directory = None
    jax.config.update("jax_compilation_cache_dir", directory)
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:  # the user's choice wins
        jax.config.update("jax_persistent_cache_min_compile_time_secs", _MIN_COMPILE_TIME_S)
    # jax decides whether to use the cache at a process's first compile and opens the
    # directory once: forget both, so that this call applies even after earlier
    # compiles or an earlier call with another directory.
    compilation_cache.reset_cache()
    logging.info("compilation cache: %s", directory or "off")


@contextlib.contextmanager
def enabled(directory: str | None) -> Iterator[None]:
    """`enable(directory)` for the compiles inside the block; the process's cache
    settings as they were after it (a benchmark run in-process, e.g. by a test)."""
    previous = (jax.config.jax_compilation_cache_dir,
                jax.config.jax_persistent_cache_min_compile_time_secs)
    enable(directory)
    try:
        yield
    finally:
        jax.config.update("jax_compilation_cache_dir", previous[0])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", previous[1])
        compilation_cache.reset_cache()


def _check_writable(directory: str) -> None:
    os.makedirs(directory, exist_ok=True)
    # A unique name: the processes of a job may probe one shared directory at once.
    fd, probe = tempfile.mkstemp(prefix=".jdp_write_test_", dir=directory)
    os.close(fd)
    os.remove(probe)
