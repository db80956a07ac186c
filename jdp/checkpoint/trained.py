"""A trained run read back from its workdir, without changing it: the experiment file and
config it recorded, and its checkpoints' steps. The programs used after training (sampling,
evaluation, export) start here, on any devices, whatever topology trained the run.
"""

from __future__ import annotations

import dataclasses
import json
import os

import ml_collections
import orbax.checkpoint as ocp
from etils import epath

from jdp.checkpoint import CHECKPOINT_DIR
from jdp.checkpoint.layout import CheckpointError
from jdp.config import paths
from jdp.errors import ConfigError
from jdp.experiment import loader
from jdp.experiment.loader import Experiment

RUN_FILE = "run.json"  # in the workdir: which experiment file trained it
CONFIG_FILE = "config.json"  # in the workdir: the resolved config it trained with


@dataclasses.dataclass(frozen=True)
class TrainedRun:
    workdir: str  # absolute
    experiment: Experiment
    config: ml_collections.ConfigDict  # unlocked: a program may override some keys

    @property
    def checkpoints(self) -> str:
        return os.path.join(self.workdir, CHECKPOINT_DIR)

    def steps(self) -> list[int]:
        """The complete checkpoints' steps, oldest first."""
        if not os.path.isdir(self.checkpoints):
            return []
        return sorted(ocp.utils.checkpoint_steps(epath.Path(self.checkpoints)))

    def step_dir(self, step: int | None = None) -> str:
        """The directory of checkpoint `step` (default: the newest complete one)."""
        steps = self.steps()
        if not steps:
            raise CheckpointError(f"--workdir={self.workdir!r} has no complete checkpoint. Fix: "
                                  "let the run save one (it saves at its end, every "
                                  "checkpoint.every_minutes, and when stopped), or point "
                                  "--workdir at another run.")
        if step is None:
            step = steps[-1]
        if step not in steps:
            raise CheckpointError(f"--step={step}: {self.checkpoints} holds no complete "
                                  f"checkpoint of that step (it has {steps}). Fix: pass one of "
                                  "those, or leave --step out for the newest.")
        return os.path.join(self.checkpoints, str(step))


def open_run(workdir: str) -> TrainedRun:
    """The run in `workdir`: its recorded experiment file (loaded) and config."""
    workdir = paths.absolute(workdir)
    files = {name: os.path.join(workdir, name) for name in (RUN_FILE, CONFIG_FILE)}
    for name, path in files.items():
        if not os.path.isfile(path):
            raise ConfigError(f"--workdir={workdir!r} has no {name}. Fix: point --workdir at "
                              "the workdir of a jdp training run.")
    with open(files[RUN_FILE]) as f:
        experiment = loader.load(json.load(f)["experiment_file"])
    with open(files[CONFIG_FILE]) as f:
        config = ml_collections.ConfigDict(json.load(f))
    return TrainedRun(workdir, experiment, config)
