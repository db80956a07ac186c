"""Entry point, the same command on every host:

    python -m jdp.main --config=experiments/vit.py[:ARG] --workdir=DIR [--config.KEY=VALUE ...]

Flags, then distributed start-up, validation, and one call into the trainer.
Nothing is written to the workdir until the config has been validated.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import tempfile
from collections.abc import Collection

import jax
from absl import app, flags, logging
from ml_collections import config_flags

import jdp
from jdp import config as config_lib
from jdp.config import overrides, paths, tuned
from jdp.errors import ConfigError
from jdp.experiment import loader
from jdp.runtime import compile_cache, distributed, exit_codes, gpu_flags, storage
from jdp.runtime.preemption import Preempted

# The trainer (Orbax, the loop, the parallel backends) is imported where it is first
# used, not here: a process that stops at its flags (a bad --config override) ends
# sooner, and so does every input worker process, which multiprocessing starts by
# importing this module again.

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Experiment file defining get_config(arg); `path.py:arg` passes arg.",
    lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for config, metrics and checkpoints.")
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None, "host:port of process 0 (multi-host; else JDP_* env vars "
    "or the cluster's own variables are used).")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Processes in the job.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index in the job.")
_DISTRIBUTED_TIMEOUT = flags.DEFINE_float(
    "distributed_timeout_s", 300.0, "Give up joining the job after this many seconds.")
_DRY_RUN = flags.DEFINE_bool(
    "dry_run", False, "Compile the train step for this topology and print the plan (memory, "
    "FLOPs, collectives, scaling); train nothing, write nothing to the workdir.")
_DEVICE_MEMORY = flags.DEFINE_float(
    "device_memory_gib", None, "With --dry_run: the per-device memory to plan for (default: "
    "what the device reports; CPUs report none).")
_STEP_TIME = flags.DEFINE_float(
    "step_time_s", None, "With --dry_run: a measured step time for the scaling estimate.")

_JDP_FLAGS = (_CONFIG, _WORKDIR, _COORDINATOR, _NUM_PROCESSES, _PROCESS_ID, _DISTRIBUTED_TIMEOUT,
              _DRY_RUN, _DEVICE_MEMORY, _STEP_TIME)


def load_config(path: str, *overrides: str):
    """The config exactly as `--config=path --config.KEY=VALUE ...` gives it to `run`
    (`path` may carry `:ARG`): for programs that call `run` without the command line."""
    flag_values = flags.FlagValues()
    argv = ["jdp", f"--config={path}", *overrides]
    config_flags.DEFINE_config_file("config", None, "", flag_values=flag_values,
                                    lock_config=True, sys_argv=argv)
    flag_values(argv)
    return flag_values.config


class UsageError(Exception):
    """A bad command line or environment: reported as one line, exit status 2."""


def _make_workdir(workdir: str) -> None:
    """Creates the workdir, the last check before anything is written into it (a bucket
    needs no directories; `storage.check_writable` checked it at start)."""
    if storage.is_bucket(workdir):
        return
    try:
        os.makedirs(workdir, exist_ok=True)
        probe = os.path.join(workdir, ".jdp_write_test")
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as e:
        raise UsageError(f"--workdir={workdir!r} is not a writable directory ({e.strerror}). "
                         "Fix: choose a directory you can create and write to.") from e


def run(config, config_path: str, workdir: str, devices=None, dry_run: bool = False,
        device_memory_gib: float | None = None, step_time_s: float | None = None,
        explicit_keys: Collection[str] | None = None):
    """Everything after flag parsing; tests call this directly. Returns a loop.TrainResult,
    or with `dry_run` the `preflight.Preflight` plan (nothing trained or written).

    `explicit_keys`: the config keys the user set (the command line's overrides; default:
    those that differ from the experiment's own config), which a prepared token store
    named by data.token_dir does not replace."""
    from jdp import trained_run
    from jdp.checkpoint import check_best_metric, hf_import
    from jdp.checkpoint.resume import check_resumable
    from jdp.data.text import lm as text_lm
    from jdp.experiment import components as components_lib
    from jdp.track import configured as trackers
    from jdp.train import loop

    # Paths enter here: relative ones are made absolute once, so a run behaves the same from
    # any directory and nothing below sees a relative path.
    workdir = paths.absolute(workdir)
    paths.make_absolute(config)
    if explicit_keys is None:
        explicit_keys = _differing_keys(config, config_path)
    # A prepared token store supplies the text it was made from (files, tokenizer, split)
    # where the user set none; then the config describes what the run trains on.
    text_lm.adopt_prepared(config.data, explicit_keys)
    applied = tuned.apply(config)  # --config.tune=FILE: a saved jdp.tune result
    if applied:
        logging.info("applied %s: %s", config.tune, applied)
    storage.check_supported(workdir, "--workdir")
    if config.checkpoint.init_from:  # a jdp checkpoint or hf:DIR, a transformers model
        storage.check_supported(config.checkpoint.init_from.removeprefix("hf:"),
                                "config.checkpoint.init_from")
    storage.configure()  # before any GCS client is imported
    if hf_import.is_hf(config.checkpoint.init_from):  # a bad directory fails before writing
        hf_import.transformer_fields(config.checkpoint.init_from)
    experiment = loader.load(config_path)
    device_count = jax.device_count() if devices is None else len(devices)
    split = config_lib.validate(config, device_count, jax.process_count())
    trackers.check(config, workdir)
    # Before anything compiles, so that the train step is read from the cache or added to it.
    compile_cache.enable(compile_cache.resolve_dir(config.compile_cache_dir))
    config_json = config.to_json_best_effort(indent=2, sort_keys=True)
    distributed.check_same_across_processes(
        {"config": config_json, "jdp": jdp.__version__, "jax": jax.__version__})
    if storage.is_bucket(workdir) and not dry_run:  # before reading it: the bucket exists
        storage.check_writable(workdir)
    check_resumable(workdir, json.loads(config_json))
    if dry_run:
        with tempfile.TemporaryDirectory(prefix="jdp-dry-run-") as scratch:
            return _dry_run(config, experiment, split, devices, workdir, scratch,
                            device_memory_gib, step_time_s)
    # The data, task and model, checked (text data prepares its token store here).
    components = components_lib.build(experiment, config, workdir=workdir)
    check_best_metric(config.checkpoint.keep_best, components.eval_keys())
    # The trackers last: they send what the hooks before them wrote.
    hooks = [*_call_build_hooks(experiment, config), *trackers.configured_hooks(config, workdir)]

    if jax.process_index() == 0:
        _make_workdir(workdir)
        with storage.open_file(storage.join(workdir, trained_run.CONFIG_FILE), "w") as f:
            f.write(config_json + "\n")
        # What the programs used after training (sample, evaluate) load.
        with storage.open_file(storage.join(workdir, trained_run.RUN_FILE), "w") as f:
            json.dump({"experiment_file": os.path.abspath(config_path)}, f)
    return loop.train_and_evaluate(config, workdir, experiment, components, split, devices,
                                   hooks)


def _dry_run(config, experiment: loader.Experiment, split, devices, workdir: str, scratch: str,
             device_memory_gib: float | None, step_time_s: float | None):
    """The plan, with nothing written: data an experiment prepares into its workdir (a
    token store) goes to `scratch`, which is removed afterwards; a store already prepared
    is read where it is."""
    from jdp.checkpoint import check_best_metric
    from jdp.data.text import lm as text_lm
    from jdp.dryrun import estimate, preflight
    from jdp.experiment import components as components_lib

    if text_lm.uses_text(config.data) and not text_lm.holds_store(config.data, workdir):
        config.data.token_dir = os.path.join(scratch, text_lm.TOKENS_DIR)
    components = components_lib.build(experiment, config, workdir=scratch)
    check_best_metric(config.checkpoint.keep_best, components.eval_keys())
    _call_build_hooks(experiment, config)
    memory = None if device_memory_gib is None else int(device_memory_gib * 2**30)
    result = preflight.preflight(config, experiment, components, split, devices,
                                 device_memory_bytes=memory, step_time_s=step_time_s)
    print(result.text())
    try:
        estimate.check_fits(result.inputs)
    except estimate.PlanError as e:
        raise ConfigError(str(e)) from e
    return result


def _differing_keys(config, config_path: str) -> set[str]:
    """The keys whose values differ from the experiment's own config (`config_path`, with
    its `:ARG`), paths compared made absolute."""
    own = load_config(config_path)
    paths.make_absolute(own)
    mine, theirs = (config_lib.flatten(json.loads(c.to_json_best_effort())) for c in (config, own))
    return {key for key in mine if mine[key] != theirs.get(key, _ABSENT)}


_ABSENT = object()


def _call_build_hooks(experiment: loader.Experiment, config) -> list:
    from jdp.train import loop

    try:
        return loop.user_hooks(experiment, config)
    except ConfigError:
        raise
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise ConfigError(f"{experiment.function_name('build_hooks')} failed: "
                          f"{type(e).__name__}: {e}") from e


def _parse_flags(argv: list[str], known_flags=_JDP_FLAGS) -> list[str]:
    """absl flag parsing with one-line errors for bad overrides instead of tracebacks;
    an unknown flag's error lists `known_flags`."""
    try:
        return flags.FLAGS(argv)
    except flags.UnrecognizedFlagError as e:
        known = ", ".join(f"--{holder.name}" for holder in known_flags)
        fail(f"unknown flag --{e.flagname}. Fix: use jdp's flags ({known}), or "
             "--config.KEY=VALUE to override a config field.")
    except flags.Error as e:
        fail(f"{e}. Fix: pass a value of the field's type (see the experiment's get_config).")
    except SyntaxError as e:  # the experiment file, loaded by the --config flag: bad input,
        # exit 2, which a launcher never restarts (1 would be)
        column = f", column {e.offset}" if e.offset else ""
        fail(f"--config={e.filename!r}: {e.msg} at line {e.lineno}{column}. Fix: correct the "
             "experiment file's Python syntax there.")
    except (AttributeError, KeyError) as e:  # an override naming no field of the config
        fail(_unknown_override(argv) or f"a --config override names no config field ({e}). "
             "Fix: override only fields that the experiment's config defines (listed in "
             "<workdir>/config.json).")
    return []


def _unknown_override(argv: list[str]) -> str | None:
    """The one-line error for the first `--config.KEY` override whose KEY the experiment's
    config lacks (at any depth), with the closest keys it has; None if every key exists."""
    given = [arg.split("=", 1)[1] for arg in argv if arg.startswith("--config=")]
    given += [after for arg, after in zip(argv, argv[1:], strict=False) if arg == "--config"]
    if not given:
        return None
    known = overrides.keys_of(load_config(given[-1]))
    for key, arg in overrides.override_keys(argv):
        problem = overrides.unknown_key(key, known)
        if problem:
            return (f"{problem} (in {arg}). Fix: override only keys the experiment's config "
                    "defines (listed in <workdir>/config.json).")
    return None


def start_up(argv) -> str:
    """What a jdp program does between its flags and its work, on every host: checks the
    experiment file, applies the GPU settings before jax starts, joins the job, quiets the
    log's library chatter. Returns the experiment file's path."""
    # What the process has imported (jax, flax, optax, orbax, the experiment) lives as long
    # as it does: moved out of the collector's generations, the full collections that
    # tracing sets off no longer walk it. A short run spends about a seventh less CPU.
    gc.freeze()
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    if _WORKDIR.value is None:
        fail("--workdir is required. Fix: pass --workdir=DIR (created if missing).")
    console = ConsoleFilter()
    logging.get_absl_handler().addFilter(console)
    # The flag keeps `path.py:ARG` whole; the experiment file is the part before ':'.
    config_path = config_flags.get_config_filename(flags.FLAGS["config"]).partition(":")[0]
    try:  # reading a config that failed to load raises; say why in one line first
        loader.check_file(config_path)
    except ConfigError as e:
        fail(str(e))
    if "gpu" in _CONFIG.value:
        try:  # before anything starts jax's backends, which read them once
            gpu_flags.apply(_CONFIG.value.gpu)
        except ConfigError as e:
            fail(str(e))
    try:
        distributed.initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value,
                               timeout_s=_DISTRIBUTED_TIMEOUT.value)
    except ValueError as e:
        fail(str(e))
    if jax.process_count() > 1:
        console.prefix = f"[p{jax.process_index()}] "
    return config_path


def main(argv) -> None:
    config_path = start_up(argv)
    from jdp.checkpoint import CheckpointError, CheckpointSaveError
    from jdp.train.hooks import HookError
    from jdp.train.nonfinite import NonFiniteError

    with distributed.ending_promptly_on_failure():
        try:
            result = run(_CONFIG.value, config_path, _WORKDIR.value, dry_run=_DRY_RUN.value,
                         device_memory_gib=_DEVICE_MEMORY.value, step_time_s=_STEP_TIME.value,
                         explicit_keys=config_flags.get_override_values(flags.FLAGS["config"]))
        except (CheckpointSaveError, HookError) as e:
            fail(str(e), exit_codes.FAILED)
        except (ConfigError, UsageError, CheckpointError, distributed.MismatchError) as e:
            fail(str(e))
        except NonFiniteError as e:
            fail(str(e), exit_codes.NONFINITE)
        except Preempted as e:
            print(f"jdp: {e}", file=sys.stderr, flush=True)
            sys.exit(exit_codes.PREEMPTED)
        except KeyboardInterrupt:  # Ctrl-C before the loop could save anything
            print("jdp: interrupted before training started; nothing was saved",
                  file=sys.stderr, flush=True)
            sys.exit(exit_codes.INTERRUPTED)
    if not _DRY_RUN.value:
        logging.info("final evaluation: %s", json.dumps(result.eval_metrics))


# Libraries whose INFO lines (every Orbax save phase, TFDS loads, jax's search for
# a TPU, its compilation cache being reset) would bury the training log; their
# warnings and errors still show.
_QUIET_BELOW_WARNING = ("/orbax/", "/tensorflow_datasets/", "/jax/_src/xla_bridge.py",
                        "/jax/_src/compilation_cache.py")


class ConsoleFilter(logging.logging.Filter):
    """One readable log per process: library chatter dropped, `[pN] ` on every line
    once the process knows its index."""

    prefix = ""

    def filter(self, record) -> bool:
        if record.levelno < logging.logging.WARNING and any(
                part in record.pathname for part in _QUIET_BELOW_WARNING):
            return False
        record.msg = self.prefix + str(record.msg)
        return True


def fail(message: str, exit_code: int = exit_codes.BAD_CONFIG) -> None:
    print(f"jdp: error: {message}", file=sys.stderr)
    sys.exit(exit_code)


if __name__ == "__main__":
    flags.mark_flag_as_required("config")
    app.run(main, flags_parser=_parse_flags)
