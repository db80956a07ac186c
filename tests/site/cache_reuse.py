"""Two changes to how the tests' processes use jax's persistent compilation cache, so that
the many short runs of the same tiny models pay for each program once. Neither changes a
compiled program or a number: a hit is still a hit only where the cache holds the entry.

- A program read from the cache is deserialized once per process (keyed by the entry's
  bytes, so a miss, a hit and a torn entry are what the cache holds). Short runs otherwise
  spend about a second each turning the same entries back into executables.
- On CPU, the key's "accelerator config" is the devices' kinds, ids and process indices
  instead of XLA:CPU's topology fingerprint. That fingerprint differs from process to
  process of one multi-process job, so every process but 0 (the only writer) missed every
  entry and compiled everything in every run. The device assignment stays in the key
  (compile options), so a program compiled for another topology is never a hit.
- Where jax shares compiled programs between the processes of a job (tests/conftest.py
  turns that on), process 0 also publishes a program it read from the cache. jax
  publishes only what process 0 compiled: when another test's job wrote the entry between
  process 1's miss and process 0's read, process 1 waited for a program that never came.

All three wrap jax's private functions (the same in jax 0.10.2 to 0.12 but for the
argument noted below); where those are missing nothing changes.
"""

import importlib.abc
import sys
from importlib import metadata


def sharing_programs_works() -> bool:
    """Whether jax's sharing of compiled programs between the processes of a CPU job
    works with this jaxlib (read without importing jax, whose configuration reads the
    sharing variable at import). On jaxlib 0.12.1 the processes of a job that share
    programs hang in their first train step: both hold the program and wait for the
    step's results (the suite's multi-process tests and the network benchmark's job,
    which pass with each process compiling its own). Not traced further; taken as from
    the XLA of jaxlib 0.11.1, where XLA:CPU's other differences begin. jdp never shares
    programs itself."""
    version = tuple(int(part) for part in metadata.version("jaxlib").split(".")[:3])
    return version < (0, 11, 1)

_PATCHED = set()


def _reuse_deserialized_executables(compilation_cache) -> None:
    original = getattr(compilation_cache, "get_executable_and_time", None)
    get_cache = getattr(compilation_cache, "_get_cache", None)
    if original is None or get_cache is None:
        return
    loaded = {}

    # jax 0.12 passes a fifth argument (0.10.2 does not): the program's host callbacks. An
    # executable with some is bound to this trace's: loaded as jax loads it, never shared.
    def get_executable_and_time(cache_key, compile_options, backend, executable_devices,
                                *host_callbacks):
        cache = get_cache(backend)
        entry = None if cache is None or any(host_callbacks) else cache.get(cache_key)
        if entry is None:
            found = original(cache_key, compile_options, backend, executable_devices,
                             *host_callbacks)
            if found[0] is not None:  # another job wrote the entry since: a hit all the same
                entry = cache.get(cache_key)
        else:
            import jax

            # The entry's bytes are in the key: a torn or rewritten entry is read afresh.
            key = (jax.config.jax_compilation_cache_dir, cache_key, hash(entry))
            if key not in loaded:
                loaded[key] = original(cache_key, compile_options, backend, executable_devices,
                                       *host_callbacks)
            found = loaded[key]
        if found[0] is not None and entry is not None:
            _publish_for_the_other_processes(compilation_cache, cache_key, entry,
                                             executable_devices)
        return found

    compilation_cache.get_executable_and_time = get_executable_and_time


_PUBLISHED = set()


def _publish_for_the_other_processes(compilation_cache, cache_key, entry, executable_devices):
    """What jax's compiler does after process 0 compiles a program of a multi-process job
    with `jax_share_binary_between_hosts` on, done here for a program read from the cache
    (`entry`, the cache's bytes; on CPU an executable loaded from the cache cannot be
    serialized again): the other processes may have missed the entry and be waiting for
    process 0's copy."""
    from jax._src import config, distributed

    client = distributed.global_state.client
    if cache_key in _PUBLISHED or client is None or not config.share_binary_between_hosts.value:
        return
    devices = list(executable_devices)
    first = min(devices, key=lambda d: d.id).process_index
    if len({d.process_index for d in devices}) < 2 or first != distributed.global_state.process_id:
        return
    serialized, _ = compilation_cache.extract_executable_and_time(
        compilation_cache.decompress_executable(entry))
    client.key_value_set_bytes(cache_key, compilation_cache.compress_executable(serialized),
                               allow_overwrite=True)
    _PUBLISHED.add(cache_key)


def _same_key_in_every_process(cache_key) -> None:
    original = getattr(cache_key, "_hash_accelerator_config", None)
    hash_string = getattr(cache_key, "_hash_string", None)
    if original is None or hash_string is None:
        return

    def hash_accelerator_config(hash_obj, accelerators):
        devices = list(accelerators.flat)
        if not devices or any(d.platform != "cpu" for d in devices):
            return original(hash_obj, accelerators)
        for d in devices:
            hash_string(hash_obj, f"{d.device_kind}:{d.id}:{d.process_index}")

    cache_key._hash_accelerator_config = hash_accelerator_config


_PATCHES = {"jax._src.compilation_cache": _reuse_deserialized_executables,
            "jax._src.cache_key": _same_key_in_every_process}


def _patch(name: str) -> None:
    if name not in _PATCHED and name in sys.modules:
        _PATCHED.add(name)
        _PATCHES[name](sys.modules[name])


class _AfterLoad(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the real loader of the modules in _PATCHES."""

    def find_spec(self, name, path, target=None):
        if name not in _PATCHES or name in _PATCHED:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            spec = finder.find_spec(name, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None and spec.loader is not None:
                exec_module = spec.loader.exec_module

                def exec_and_patch(module, exec_module=exec_module):
                    exec_module(module)
                    _patch(name)

                spec.loader.exec_module = exec_and_patch
                return spec
        return None


def install_when_jax_loads() -> None:
    """Patches now what is already imported, and the rest as it is imported."""
    for name in _PATCHES:
        _patch(name)
    if not any(isinstance(f, _AfterLoad) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterLoad())
