"""A trained run read from its workdir on one host: its experiment file, config,
tokenizer, model, its checkpoints' steps and the params of a step.

For the programs that use a run after training without changing it (`jdp.sample`,
`jdp.evaluate`, `jdp.export`): the workdir records which experiment file trained it
(run.json) and the config (config.json); the checkpoints hold global arrays, so their
params read on one host without the training mesh, whatever topology and sharding saved
them.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import flax.linen as nn
import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from jdp.checkpoint import CHECKPOINT_DIR, CheckpointError, load_params
from jdp.checkpoint.saved_params import SavedParams
from jdp.config import paths
from jdp.data.text import lm, store, tokenizers
from jdp.errors import ConfigError
from jdp.experiment import loader

RUN_FILE = "run.json"  # in the workdir: which experiment file trained it
CONFIG_FILE = "config.json"


@dataclasses.dataclass(frozen=True)
class TrainedRun:
    workdir: str
    experiment: loader.Experiment
    config: ml_collections.ConfigDict

    @property
    def checkpoint_dir(self) -> str:
        return os.path.join(self.workdir, CHECKPOINT_DIR)

    def steps(self) -> list[int]:
        """The complete checkpoints' steps, oldest first."""
        if not os.path.isdir(self.checkpoint_dir):
            return []
        return sorted(ocp.utils.checkpoint_steps(epath.Path(self.checkpoint_dir)))

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
            raise CheckpointError(f"--step={step}: {self.checkpoint_dir} holds no complete "
                                  f"checkpoint of that step (it has {steps}). Fix: pass one of "
                                  "those, or leave --step out for the newest.")
        return os.path.join(self.checkpoint_dir, str(step))

    def model(self) -> Any:
        """The experiment's model (`build_model(config)`)."""
        return self.experiment.build_model(self.config)

    def tokenizer(self) -> tokenizers.Tokenizer:
        """The run's tokenizer (a trained "bpe:N" one is in its token dir)."""
        return lm.run_tokenizer(self.config.data, self.workdir)

    def saved_params(self, step: int | None = None) -> SavedParams:
        """The params of checkpoint `step` (default: the newest), read leaf by leaf."""
        if not os.path.isdir(self.checkpoint_dir):
            raise ConfigError(f"--workdir={self.workdir!r} has no checkpoints ({CHECKPOINT_DIR}/ "
                              "is missing). Fix: train the run first, or point --workdir at a "
                              "run that saved checkpoints.")
        return SavedParams(self.checkpoint_dir, step)

    def params(self, model: Any) -> Any:
        """The newest checkpoint's params of `model`, on this process's first device."""
        tokens = np.zeros((1, min(self.config.data.seq_len, model.max_len)), np.int32)
        abstract = jax.eval_shape(
            lambda: nn.unbox(model.init(jax.random.key(0), tokens, train=False)))
        one_device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return load_params(self.checkpoint_dir, jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one_device),
            abstract["params"]))

    def eval_store(self) -> store.TokenStore:
        """The token store of the run's held-out text."""
        return lm.eval_store(self.config.data, self.workdir)


def open_run(workdir: str) -> TrainedRun:
    """The run in `workdir` (ConfigError where it holds none)."""
    workdir = paths.absolute(workdir)
    run_file, config_file = (os.path.join(workdir, name) for name in (RUN_FILE, CONFIG_FILE))
    for path in (run_file, config_file):
        if not os.path.isfile(path):
            raise ConfigError(f"--workdir={workdir!r} has no {os.path.basename(path)}. Fix: "
                              "point --workdir at the workdir of a jdp training run.")
    with open(run_file) as f:
        experiment = loader.load(json.load(f)["experiment_file"])
    with open(config_file) as f:
        config = ml_collections.ConfigDict(json.load(f))
    return TrainedRun(workdir, experiment, config)
