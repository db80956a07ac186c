"""python -m jdp.evaluate --workdir=W [--step=N] [--config.KEY=VALUE ...]: evaluates a
trained run (see jdp.evaluate), prints the metrics and appends them to W/evaluations.jsonl."""

import argparse
import sys

from absl import flags
from ml_collections import config_flags

from jdp.errors import ConfigError
from jdp.runtime.exit_codes import BAD_CONFIG


def _changes(config, args: list[str]) -> dict:
    """The `--config.KEY=VALUE` arguments as {key: value} of the config's own types."""
    from jdp.config import overrides

    known = overrides.keys_of(config)
    for key, arg in overrides.override_keys(args):
        problem = overrides.unknown_key(key, known)
        if problem:
            raise ConfigError(f"{problem} (in {arg}). Fix: override only keys of the run's "
                              "config (its config.json).")
    values = flags.FlagValues()
    config_flags.DEFINE_config_dict("config", config.copy_and_resolve_references(),
                                    flag_values=values)
    try:
        values(["jdp.evaluate", *args])
    except flags.Error as e:
        raise ConfigError(f"{e}. Fix: pass a value of the field's type (see the run's "
                          "config.json).") from e
    return dict(config_flags.get_override_values(values["config"]))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jdp.evaluate", description=__doc__)
    parser.add_argument("--workdir", required=True, help="a training run's workdir")
    parser.add_argument("--step", type=int, default=None,
                        help="the checkpoint to evaluate (default: the newest)")
    args, rest = parser.parse_known_args(argv)
    unexpected = [arg for arg in rest if not arg.startswith("--config.")]
    if unexpected:
        parser.error(f"unrecognized arguments: {' '.join(unexpected)} (the config is "
                     "overridden with --config.KEY=VALUE)")
    from jdp import trained_run
    from jdp.checkpoint import CheckpointError
    from jdp.evaluate import evaluate_run

    try:
        changes = _changes(trained_run.open_run(args.workdir).config, rest)
        metrics = evaluate_run(args.workdir, step=args.step, changes=changes)
    except (ConfigError, CheckpointError) as e:
        print(f"jdp.evaluate: error: {e}", file=sys.stderr)
        return BAD_CONFIG
    for name, value in metrics.items():
        print(f"{name} {value:.6g}")
    return 0


sys.exit(main())
