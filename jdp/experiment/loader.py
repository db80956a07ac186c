"""Loading an experiment file: `get_config(arg)`, `build_model` and the optional functions.

    def get_config(arg=None) -> ml_collections.ConfigDict      # start from jdp.config.defaults()
    def build_model(config, *, num_classes) -> flax.linen.Module
    def build_model(config, *, num_classes, rngs) -> flax.nnx.Module   # NNX: take `rngs`
    def build_optimizer(config, learning_rate_fn) -> optax.GradientTransformation  # optional
    def build_data(config) -> jdp.data.Data                     # optional
    def build_task(config) -> jdp.task.Task                     # optional
    def flops_per_example(config) -> float                      # optional: for MFU
    def build_hooks(config) -> list[jdp.hooks.Hook]             # optional: periodic hooks
    def axis_rules(config) -> [(logical name, "model" | None)]  # optional: model axis

`num_classes` is passed only when `build_model` takes it. Without
`build_optimizer`, jdp uses AdamW (`jdp.experiment.optim.adamw`); without `build_data`, the
data the config names (`jdp.data.default`); without `build_task`, softmax
classification of `image` into `label` (`jdp.task.classification`); without
`axis_rules`, the rules of jdp's own models (`jdp.models.axes.RULES`): which logical
axis names of the params `parallel.model_parallel` splits.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import os
import sys
from collections.abc import Callable

import cloudpickle

from jdp.data import default as default_data
from jdp.errors import ConfigError
from jdp.experiment import optim
from jdp.experiment import task as task_lib


def _default_task(config) -> task_lib.Task:
    return task_lib.classification(config.label_smoothing)


def _default_axis_rules(config) -> tuple:
    from jdp.models.axes import RULES  # the models' names: flax, loaded where used

    return RULES


@dataclasses.dataclass(frozen=True)
class Experiment:
    path: str
    build_model: Callable
    build_optimizer: Callable = optim.adamw
    build_data: Callable = default_data.build
    build_task: Callable = _default_task
    flops_per_example: Callable | None = None  # model FLOPs of one training example
    build_hooks: Callable | None = None  # -> [jdp.hooks.Hook]: run after their steps
    axis_rules: Callable = _default_axis_rules  # logical axis name -> "model" or None

    def function_name(self, hook: str) -> str:
        """How errors name one of the functions: the experiment's own, or jdp's default."""
        function = getattr(self, hook)
        if function.__module__.startswith("jdp."):
            return f"jdp's default {hook} ({function.__module__}.{function.__name__})"
        return f"{hook}() in {self.path}"


def check_file(path: str) -> None:
    """Raises the one-line ConfigError for an experiment file that does not exist."""
    if not os.path.isfile(path):
        raise ConfigError(f"--config={path!r}: no such experiment file. Fix: pass the path of "
                          "a Python file that defines get_config(), e.g. experiments/vit.py.")


def load(path: str) -> Experiment:
    check_file(path)
    # A name unique to the file, so two experiment files never share a module.
    name = "jdp_experiment_" + hashlib.sha1(os.path.abspath(path).encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    # Worker processes (data.num_workers) cannot import this module by its made-up
    # name, so its functions and classes (e.g. the preprocessing) travel by value.
    cloudpickle.register_pickle_by_value(module)
    spec.loader.exec_module(module)
    if not callable(getattr(module, "build_model", None)):
        raise ConfigError(f"--config={path!r}: the experiment file defines no build_model(config, "
                          "*, num_classes). Fix: add one that returns the Flax model to train.")
    hooks = {hook: getattr(module, hook) for hook in ("build_optimizer", "build_data",
                                                      "build_task", "flops_per_example",
                                                      "build_hooks", "axis_rules")
             if callable(getattr(module, hook, None))}
    return Experiment(path=path, build_model=module.build_model, **hooks)
