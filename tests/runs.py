"""Helpers for tests that run the real trainer in-process with tiny settings."""

import json
import os

from absl import flags
from ml_collections import config_flags

from jdp import main as jdp_main


def load_config(path: str, *overrides: str):
    """The config exactly as `python -m jdp.main --config=path --config.k=v ...` would see it."""
    flag_values = flags.FlagValues()
    argv = ["prog", f"--config={path}", *overrides]
    config_flags.DEFINE_config_file("config", None, "", flag_values=flag_values,
                                    lock_config=True, sys_argv=argv)
    flag_values(argv)
    return flag_values.config


def train(path: str, workdir, *overrides: str, devices=None):
    """Runs the trainer; returns (TrainResult, metrics.jsonl records)."""
    config = load_config(path, *overrides)
    result = jdp_main.run(config, path.split(":")[0], str(workdir), devices=devices)
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    return result, records


def losses(records) -> dict[int, float]:
    return {r["step"]: r["train/loss"] for r in records if "train/loss" in r}
