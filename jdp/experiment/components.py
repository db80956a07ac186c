"""An experiment's components built from the config, and checked against each other
before anything is compiled: the data, the task and the model."""

from __future__ import annotations

import dataclasses
import inspect

import jax
import numpy as np

from jdp import HOSTS_AXIS, LOCAL_AXIS
from jdp.data import core as data_core
from jdp.data.core import Data
from jdp.errors import ConfigError
from jdp.experiment import adapters, partitioning
from jdp.experiment import task as task_lib
from jdp.experiment.loader import Experiment


@dataclasses.dataclass(frozen=True)
class Components:
    """An experiment's pieces, built from the config and checked against each other."""

    data: Data
    task: task_lib.Task
    model: adapters.Model
    sample: dict[str, np.ndarray]  # one preprocessed eval example, as the host ships it
    metric_names: tuple[str, ...] = ()  # the eval objective's metrics, besides the loss
    # Logical axis name of the params -> "model" or None (the experiment's axis_rules).
    axis_rules: tuple = ()

    def eval_keys(self) -> list[str]:
        """Every key evaluation reports: `eval/loss`, the metrics, the derived figures."""
        names = ["loss", *self.metric_names]
        if self.task.derived is not None:
            names += list(self.task.derived(dict.fromkeys(names, 0.0)))
        return [f"eval/{name}" for name in names] + ["eval/num_examples"]

    def sample_inputs(self) -> tuple:
        """The model inputs for initialisation: zeros of one example's shapes, as the model
        sees them (after the data's device_preprocess: e.g. float32 images, not uint8)."""
        batch = {key: np.zeros((1, *np.shape(value)), np.asarray(value).dtype)
                 for key, value in self.sample.items()}
        if self.data.device_preprocess is not None:
            batch = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype),
                                 jax.eval_shape(self.data.device_preprocess, batch))
        return self.task.model_inputs(batch)


def build(experiment: Experiment, config, *, workdir: str = "",
          data: Data | None = None) -> Components:
    """Builds data (unless given: an evaluation's own), task and model, and traces model +
    objective once on abstract values.

    Everything a user's hooks can get wrong (a source without a length, a missing
    feature, a loss without weights or with a mean instead of per-example values)
    fails here with one line naming the hook, before anything is compiled or written.
    """
    # A model that takes nothing from the data is built first: its own checks against the
    # config (a language model's vocabulary and length against the tokenizer's) then fail
    # before the data writes anything (a token store).
    model = (None if "num_classes" in inspect.signature(experiment.build_model).parameters
             else _build_model(experiment, config, None))
    if data is None:
        data = _call(experiment, "build_data", config, workdir=workdir)
    sample = data_core.check(data, experiment.function_name("build_data"))
    if config.data.num_workers:
        data_core.check_picklable(data, experiment.function_name("build_data"),
                                  config.data.num_workers)
    task = _call(experiment, "build_task", config)
    if not isinstance(task, task_lib.Task):
        raise ConfigError(f"{experiment.function_name('build_task')} returned "
                          f"{type(task).__name__}. Fix: return jdp.task.Task(objective, inputs).")
    if model is None:
        model = _build_model(experiment, config, data.num_classes)
    components = Components(data, task, model, sample,
                            axis_rules=tuple(_call(experiment, "axis_rules", config)))
    eval_objective = _check_task(experiment, components)
    # What a model axis splits, checked against it (a model whose params name no axes,
    # a split dimension it does not divide); a run saved before there was one has none.
    partitioning.check_model(model, components.sample_inputs(), components.axis_rules,
                             config.parallel.get("model_parallel", 1))
    return dataclasses.replace(components, metric_names=tuple(sorted(eval_objective.metrics)))


def _build_model(experiment: Experiment, config, num_classes: int | None) -> adapters.Model:
    try:
        return adapters.build(experiment.build_model, config, num_classes)
    except (ValueError, KeyError, AttributeError, TypeError) as e:
        raise ConfigError(f"building the model with {experiment.function_name('build_model')}: "
                          f"{e}") from e


def _call(experiment: Experiment, hook: str, config, **optional):
    """Calls the experiment's function `hook` with the `optional` keywords it takes."""
    function = getattr(experiment, hook)
    parameters = inspect.signature(function).parameters
    kwargs = {name: value for name, value in optional.items() if name in parameters}
    try:
        return function(config, **kwargs)
    except ConfigError:
        raise
    except (ValueError, KeyError, AttributeError, TypeError, OSError) as e:
        raise ConfigError(f"{experiment.function_name(hook)} failed: "
                          f"{type(e).__name__}: {e}") from e


def _device_features(experiment: Experiment, components: Components, batch: dict) -> list[str]:
    """The features of `batch` after the data's device_preprocess (traced, not run)."""
    if components.data.device_preprocess is None:
        return sorted(batch)
    where = f"the device_preprocess of {experiment.function_name('build_data')}"
    try:
        features = jax.eval_shape(components.data.device_preprocess, batch)
    except (KeyError, ValueError, TypeError, AttributeError) as e:
        raise ConfigError(
            f"{where} failed on a batch of the preprocessed examples (features "
            f"{sorted(batch)}): {type(e).__name__}: {e}. Fix: make it a jittable function "
            "of the batch dict that returns a dict of the features.") from e
    if not isinstance(features, dict):
        raise ConfigError(f"{where} returned {type(features).__name__}. Fix: return the batch "
                          "dict with the features changed: {**batch, 'image': ...}.")
    return sorted(features)


def _check_task(experiment: Experiment, components: Components) -> task_lib.Objective:
    """Initialises the model on one example and traces model + objectives on a two-example
    batch, all abstractly; returns the abstract eval objective."""
    task_name = experiment.function_name("build_task")
    rows = 2
    batch = {key: np.stack([value] * rows) for key, value in components.sample.items()}
    features = _device_features(experiment, components, batch)
    missing = [name for name in components.task.inputs if name not in features]
    if missing:
        raise ConfigError(
            f"{task_name}: the model inputs {missing} are not features of the preprocessed "
            f"examples (they have {features}). Fix: name those features in "
            "Task(inputs=...), or return them from the preprocessing in build_data.")

    def trace(batch, params, model_state):
        if components.data.device_preprocess is not None:
            batch = components.data.device_preprocess(batch)
        outputs, _ = components.model.apply(params, model_state,
                                            components.task.model_inputs(batch), True,
                                            jax.random.key(0))
        return (components.task.objective_for(train=True)(outputs, batch),
                components.task.objective_for(train=False)(outputs, batch))

    # The model is initialised as the run initialises it (one example's zeros, outside
    # any mapped axis), so the run reuses this trace of its init (adapters.py). The
    # model and objectives are traced as one device of the mapped data axes (hosts,
    # local), which BatchNorm over the global batch names; the leading axes of 1 are
    # dropped again.
    one_device = jax.vmap(jax.vmap(trace, in_axes=(0, None, None), axis_name=LOCAL_AXIS),
                          in_axes=(0, None, None), axis_name=HOSTS_AXIS)
    try:
        variables = jax.eval_shape(components.model.init, jax.random.key(0),
                                   components.sample_inputs())
    except (KeyError, ValueError, TypeError) as e:
        raise ConfigError(f"{experiment.function_name('build_model')}: initialising the model "
                          f"on one example failed: {type(e).__name__}: {e}") from e
    try:
        objectives = jax.tree.map(
            lambda s: jax.ShapeDtypeStruct(s.shape[2:], s.dtype),
            jax.eval_shape(one_device, jax.tree.map(lambda x: x[None, None], batch),
                           *variables))
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
