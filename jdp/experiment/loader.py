"""Loading an experiment file: `get_config(arg)`, `build_model` and the optional hooks.

    def get_config(arg=None) -> ml_collections.ConfigDict      # start from jdp.config.defaults()
    def build_model(config, *, num_classes) -> flax.linen.Module
    def build_model(config, *, num_classes, rngs) -> flax.nnx.Module   # NNX: take `rngs`
    def build_optimizer(config, learning_rate_fn) -> optax.GradientTransformation  # optional
    def build_data(config) -> jdp.data.Data                     # optional
    def build_task(config) -> jdp.task.Task                     # optional
    def flops_per_example(config) -> float                      # optional: for MFU

`num_classes` is passed only when `build_model` takes it. Without
`build_optimizer`, jdp uses AdamW (`jdp.optim.adamw`); without `build_data`, the
data the config names (`jdp.data.default`); without `build_task`, softmax
classification of `image` into `label` (`jdp.task.classification`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import os
import sys
from collections.abc import Callable

import cloudpickle
import jax
import numpy as np

from jdp import HOSTS_AXIS, LOCAL_AXIS, modeling, optim
from jdp import task as task_lib
from jdp.data import core as data_core
from jdp.data import default as default_data
from jdp.data.core import Data
from jdp.errors import ConfigError


def _default_task(config) -> task_lib.Task:
    return task_lib.classification(config.label_smoothing)


@dataclasses.dataclass(frozen=True)
class Experiment:
    path: str
    build_model: Callable
    build_optimizer: Callable = optim.adamw
    build_data: Callable = default_data.build
    build_task: Callable = _default_task
    flops_per_example: Callable | None = None  # model FLOPs of one training example

    def hook_name(self, hook: str) -> str:
        """How errors name a hook: the experiment's own function, or jdp's default."""
        function = getattr(self, hook)
        if function.__module__.startswith("jdp."):
            return f"jdp's default {hook} ({function.__module__}.{function.__name__})"
        return f"{hook}() in {self.path}"


def load(path: str) -> Experiment:
    if not os.path.isfile(path):
        raise ConfigError(f"--config={path!r}: no such experiment file. Fix: pass the path of "
                          "a Python file that defines get_config(), e.g. experiments/vit.py.")
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
                                                      "build_task", "flops_per_example")
             if callable(getattr(module, hook, None))}
    return Experiment(path=path, build_model=module.build_model, **hooks)


@dataclasses.dataclass(frozen=True)
class Parts:
    """An experiment's pieces, built from the config and checked against each other."""

    data: Data
    task: task_lib.Task
    model: modeling.Model
    sample: dict[str, np.ndarray]  # one preprocessed eval example, as the host ships it
    metric_names: tuple[str, ...] = ()  # the eval objective's metrics, besides the loss

    def sample_inputs(self) -> tuple:
        """The model inputs for initialisation: zeros of one example's shapes, as the model
        sees them (after the data's device_preprocess: e.g. float32 images, not uint8)."""
        batch = {key: np.zeros((1, *np.shape(value)), np.asarray(value).dtype)
                 for key, value in self.sample.items()}
        if self.data.device_preprocess is not None:
            batch = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype),
                                 jax.eval_shape(self.data.device_preprocess, batch))
        return self.task.model_inputs(batch)


def build(experiment: Experiment, config) -> Parts:
    """Builds data, task and model, and traces model + objective once on abstract values.

    Everything a user's hooks can get wrong (a source without a length, a missing
    feature, a loss without weights or with a mean instead of per-example values)
    fails here with one line naming the hook, before anything is compiled or written.
    """
    data = _call(experiment, "build_data", config)
    sample = data_core.check(data, experiment.hook_name("build_data"))
    if config.data.num_workers:
        data_core.check_picklable(data, experiment.hook_name("build_data"),
                                  config.data.num_workers)
    task = _call(experiment, "build_task", config)
    if not isinstance(task, task_lib.Task):
        raise ConfigError(f"{experiment.hook_name('build_task')} returned "
                          f"{type(task).__name__}. Fix: return jdp.task.Task(objective, inputs).")
    try:
        model = modeling.build(experiment.build_model, config, data.num_classes)
    except (ValueError, KeyError, AttributeError, TypeError) as e:
        raise ConfigError(f"building the model with {experiment.hook_name('build_model')}: "
                          f"{e}") from e
    parts = Parts(data, task, model, sample)
    eval_objective = _check_task(experiment, parts)
    return dataclasses.replace(parts, metric_names=tuple(sorted(eval_objective.metrics)))


def _call(experiment: Experiment, hook: str, config):
    try:
        return getattr(experiment, hook)(config)
    except ConfigError:
        raise
    except (ValueError, KeyError, AttributeError, TypeError, OSError) as e:
        raise ConfigError(f"{experiment.hook_name(hook)} failed: {type(e).__name__}: {e}") from e


def _device_features(experiment: Experiment, parts: Parts, batch: dict) -> list[str]:
    """The features of `batch` after the data's device_preprocess (traced, not run)."""
    if parts.data.device_preprocess is None:
        return sorted(batch)
    where = f"the device_preprocess of {experiment.hook_name('build_data')}"
    try:
        features = jax.eval_shape(parts.data.device_preprocess, batch)
    except (KeyError, ValueError, TypeError, AttributeError) as e:
        raise ConfigError(
            f"{where} failed on a batch of the preprocessed examples (features "
            f"{sorted(batch)}): {type(e).__name__}: {e}. Fix: make it a jittable function "
            "of the batch dict that returns a dict of the features.") from e
    if not isinstance(features, dict):
        raise ConfigError(f"{where} returned {type(features).__name__}. Fix: return the batch "
                          "dict with the features changed: {**batch, 'image': ...}.")
    return sorted(features)


def _check_task(experiment: Experiment, parts: Parts) -> task_lib.Objective:
    """Traces model + objectives on a two-example batch; returns the abstract eval objective."""
    task_name = experiment.hook_name("build_task")
    rows = 2
    batch = {key: np.stack([value] * rows) for key, value in parts.sample.items()}
    features = _device_features(experiment, parts, batch)
    missing = [name for name in parts.task.inputs if name not in features]
    if missing:
        raise ConfigError(
            f"{task_name}: the model inputs {missing} are not features of the preprocessed "
            f"examples (they have {features}). Fix: name those features in "
            "Task(inputs=...), or return them from the preprocessing in build_data.")

    def trace(batch):
        if parts.data.device_preprocess is not None:
            batch = parts.data.device_preprocess(batch)
        rng = jax.random.key(0)
        params, model_state = parts.model.init(rng, parts.task.model_inputs(batch))
        outputs, _ = parts.model.apply(params, model_state, parts.task.model_inputs(batch),
                                       True, rng)
        return (parts.task.objective_for(train=True)(outputs, batch),
                parts.task.objective_for(train=False)(outputs, batch))

    # Traced as one device of the mapped data axes (hosts, local), which BatchNorm
    # over the global batch names; the leading axes of 1 are dropped again.
    one_device = jax.vmap(jax.vmap(trace, axis_name=LOCAL_AXIS), axis_name=HOSTS_AXIS)
    try:
        objectives = jax.tree.map(
            lambda s: jax.ShapeDtypeStruct(s.shape[2:], s.dtype),
            jax.eval_shape(one_device, jax.tree.map(lambda x: x[None, None], batch)))
    except KeyError as e:
        raise ConfigError(
            f"{task_name}: the objective reads batch[{e.args[0]!r}], which the preprocessing "
            f"does not return (it gives {features}). Fix: return that feature from "
            "the preprocessing, or read one of those.") from e
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{task_name}: calling the model and the objective on a batch of "
                          f"{rows} examples failed: {type(e).__name__}: {e}") from e
    for objective, which in zip(objectives, ("objective", "eval_objective"), strict=True):
        try:
            task_lib.check_objective(objective, rows, f"the task's {which}")
        except ValueError as e:
            raise ConfigError(f"{task_name}: {e}. Fix: return per-example (or per-token) values "
                              "with weights of the same shape: "
                              "Objective(Weighted(loss, weights), {name: Weighted(...)}).") from e
    return objectives[1]
