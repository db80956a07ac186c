"""Loading an experiment file: `get_config(arg)`, `build_model` and optionally
`build_optimizer`.

    def get_config(arg=None) -> ml_collections.ConfigDict      # start from jdp.config.defaults()
    def build_model(config, *, num_classes) -> flax.linen.Module
    def build_model(config, *, num_classes, rngs) -> flax.nnx.Module   # NNX: take `rngs`
    def build_optimizer(config, learning_rate_fn) -> optax.GradientTransformation  # optional

Without `build_optimizer`, jdp uses AdamW (`jdp.optim.adamw`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import os
import sys
from collections.abc import Callable

from jdp import optim
from jdp.config import ConfigError


@dataclasses.dataclass(frozen=True)
class Experiment:
    path: str
    build_model: Callable
    build_optimizer: Callable


def load(path: str) -> Experiment:
    if not os.path.isfile(path):
        raise ConfigError(f"--config={path!r}: no such experiment file. Fix: pass the path of "
                          "a Python file that defines get_config(), e.g. experiments/vit.py.")
    # A name unique to the file, so two experiment files never share a module.
    name = "jdp_experiment_" + hashlib.sha1(os.path.abspath(path).encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    if not callable(getattr(module, "build_model", None)):
        raise ConfigError(f"--config={path!r}: the experiment file defines no build_model(config, "
                          "*, num_classes). Fix: add one that returns the Flax model to train.")
    return Experiment(path=path, build_model=module.build_model,
                      build_optimizer=getattr(module, "build_optimizer", optim.adamw))
