"""Entry point, the same command on every host:

    python -m jdp.main --config=experiments/vit.py[:ARG] --workdir=DIR [--config.KEY=VALUE ...]

Flags, then distributed start-up, validation, and one call into the trainer.
Nothing is written to the workdir until the config has been validated.
"""

from __future__ import annotations

import json
import os
import sys

from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Experiment file defining get_config(arg); `path.py:arg` passes arg.",
    lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for config, metrics and checkpoints.")


class UsageError(Exception):
    """A bad command line or environment: reported as one line, exit status 2."""


def _check_workdir(workdir: str) -> None:
    """Fails before anything is written if the workdir cannot be created or written."""
    path = os.path.abspath(workdir)
    if os.path.exists(path) and not os.path.isdir(path):
        raise UsageError(f"--workdir={workdir!r} exists and is not a directory. "
                         "Fix: pass a directory path.")
    existing = path
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing) or not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(f"--workdir={workdir!r} is not writable ({existing!r} does not allow "
                         "writing). Fix: choose a directory you can write to.")


def run(config, config_path: str, workdir: str) -> dict:
    """Everything after flag parsing; tests call this directly."""
    import jax

    from jdp import config as config_lib
    from jdp import experiment as experiment_lib
    from jdp import train
    from jdp.data import datasets

    experiment = experiment_lib.load(config_path)
    plan = config_lib.validate(config, jax.device_count(), jax.process_count())
    _check_workdir(workdir)
    model = _build_model(experiment, config)
    datasets.check_prepared(config.data.name, datasets.resolve_data_dir(config.data.data_dir))

    if jax.process_index() == 0:
        os.makedirs(workdir, exist_ok=True)
        with open(os.path.join(workdir, "config.json"), "w") as f:
            f.write(config.to_json_best_effort(indent=2, sort_keys=True) + "\n")
    return train.train_and_evaluate(config, workdir, experiment, model, plan)


def _build_model(experiment, config):
    """Builds the model now, so a bad model setting fails before anything is written."""
    from jdp import modeling
    from jdp.config import ConfigError
    from jdp.data import datasets

    try:
        return modeling.build(experiment.build_model, config,
                              datasets.spec(config.data.name).num_classes)
    except (ValueError, KeyError, AttributeError) as e:
        raise ConfigError(f"building the model from {experiment.path}: {e}") from e


def main(argv) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    from jdp.config import ConfigError

    if _WORKDIR.value is None:
        _fail("--workdir is required. Fix: pass --workdir=DIR (created if missing).")
    config_path = config_flags.get_config_filename(flags.FLAGS["config"])
    try:
        result = run(_CONFIG.value, config_path, _WORKDIR.value)
    except (ConfigError, UsageError) as e:
        _fail(str(e))
    logging.info("final evaluation: %s", json.dumps(result))


def _fail(message: str) -> None:
    print(f"jdp: error: {message}", file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
    flags.mark_flag_as_required("config")
    app.run(main)
