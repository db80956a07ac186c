"""Test set-up: 8 CPU devices in every test process, set before jax is imported, and the
order in which `pytest -n` hands test modules to its workers."""

import atexit
import collections
import os
import shutil
import sys
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# A test started inside a SLURM allocation must not join that job.
for _name in [n for n in os.environ if n.startswith("SLURM_")]:
    del os.environ[_name]

# Tests prepare the built-in dataset in their own directory, not in the user's home,
# removed at the end by the process that made it (the workers of `pytest -n` inherit it).
if "TFDS_DATA_DIR" not in os.environ:
    os.environ["TFDS_DATA_DIR"] = tempfile.mkdtemp(prefix="jdp-tfds-")
    atexit.register(shutil.rmtree, os.environ["TFDS_DATA_DIR"], ignore_errors=True)

# One compilation cache for the session, inherited by every `python -m jdp.main` the
# tests start: the same tiny models compile once, and nothing lands in ~/.cache. The
# workers of `pytest -n` inherit their controller's (set here before it starts them),
# which removes it at the end.
if "PYTEST_XDIST_WORKER" not in os.environ:
    os.environ["JDP_COMPILE_CACHE_DIR"] = tempfile.mkdtemp(prefix="jdp-compile-cache-")
    atexit.register(shutil.rmtree, os.environ["JDP_COMPILE_CACHE_DIR"], ignore_errors=True)

# Every Python process a test starts loads tests/site/sitecustomize.py, and this one
# installs the same: the compilation cache's entries are deserialized once per process
# and, on CPU, keyed alike in every process of a multi-process job (tests/site/
# cache_reuse.py says why).
_SITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "site")
os.environ["PYTHONPATH"] = os.pathsep.join(
    [_SITE, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])
sys.path.insert(0, _SITE)
import cache_reuse  # noqa: E402

# In a multi-process job only process 0 compiles each program; the others wait for it
# and load the same executable (jax's own sharing through the coordination service).
# Real hosts compile side by side at no cost in time; here the job's processes share
# 2 cores. cache_reuse.py keys a program alike in every process, so the others find
# it (a process that traced another program waits on a key that never comes, and
# fails after the timeout: a divergence still shows). Only where sharing works on CPU
# (cache_reuse.sharing_programs_works says where it does not).
if cache_reuse.sharing_programs_works():
    os.environ.setdefault("JAX_SHARE_BINARY_BETWEEN_HOSTS", "true")
    os.environ.setdefault("JAX_SHARE_BINARY_BETWEEN_HOSTS_TIMEOUT_MS", "240000")

# XLA:CPU compiles the tests' programs for a short compile, not for fast code: LLVM at
# optimisation level 0 (users' runs: 2) and XLA's older fusion emitters (users': the
# MLIR-based ones). Neither changes what the tests check: the level acts only on code
# generation from the optimised HLO, and the emitters only on which ops XLA fuses; the
# collectives, shardings and memory analysis are those of users' programs (compared for
# the ViT step replicated, with remat and with FSDP). The numbers move at float32
# rounding: 12-step ViT and ResNet runs against level 1 with the new emitters,
# which the tests used before, have losses within 2e-7 and parameters within the tests'
# rtol 1e-5. The ViT train step compiles in 1.4 CPU-s instead of 4.3. Level 0's
# code runs slower: the few tests whose cost is their steps' compute compile those steps
# at level 1 (runs.steps_compiled_optimised). Every process a test starts gets the same
# flags (runs.xla_flags), so runs compared bitwise are compiled alike. From jaxlib 0.11.1
# XLA:CPU has only the MLIR-based emitters (jax_compat.cpu_fusion_emitters_option): there
# the tests compile with those, as users' runs do. jax is imported only here, after the
# variables above that its configuration reads at import; XLA reads XLA_FLAGS later, at
# its first backend.
from jdp.runtime.jax_compat import cpu_fusion_emitters_option  # noqa: E402

os.environ.setdefault("XLA_FLAGS", " ".join(
    ["--xla_force_host_platform_device_count=8", "--xla_backend_optimization_level=0"]
    + [f"--{name}={str(value).lower()}"
       for name, value in cpu_fusion_emitters_option(False).items()]))

cache_reuse.install_when_jax_loads()


def pytest_collection_modifyitems(config, items):
    """The modules with the most multi-process and end-to-end tests (marked slow) first.
    Under `pytest -n` (pyproject's addopts) each module runs whole on one worker, in this
    order, as workers come free: a long module that started last would run alone at the
    end while the other workers idle. Within a module the order is the file's."""
    slow = collections.Counter(item.module.__name__ for item in items
                               if item.get_closest_marker("slow"))
    items.sort(key=lambda item: -slow[item.module.__name__])  # stable: modules stay whole
