"""Objectives: what the model is trained to minimise and what is reported.

A `Task` names the batch features the model is called with and an objective
`(outputs, batch) -> Objective`. The objective returns a *per-example* (or
per-token) loss with weights, and named metrics as weighted values, never
means: jdp sums `value * weight` and `weight` over the whole global batch
(all devices, all micro-batches) in the step's one all-reduce and only then
divides, so the optimised loss is `sum(loss * weight) / sum(weight)` however
the batch is split. Padding weighs 0; evaluation multiplies every weight by
the row mask of its padded last batch.

Built in: `classification` (softmax cross-entropy, accuracy) and `next_token`
(language modelling: token accuracy and exact match of a whole sequence).
An experiment file defines its own with `build_task(config) -> Task`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax


@flax.struct.dataclass
class Weighted:
    """Per-example (or per-token) values and their weights, of the same shape."""

    values: jax.Array
    weights: jax.Array


@flax.struct.dataclass
class Objective:
    loss: Weighted  # what is minimised
    metrics: dict[str, Weighted]  # reported as train/<name> and eval/<name>


@dataclasses.dataclass(frozen=True)
class Task:
    """The objective and the features the model is called with, in order.

    `eval_objective` (default: `objective`) is what evaluation reports; the
    classification task uses it to report the loss without label smoothing.
    `derived(means) -> {name: value}` adds evaluation figures that are functions of
    the weighted means rather than means themselves (perplexity = exp(loss)).
    `weight_unit` names what the loss weights count: with "tokens", the loop reports
    `train/tokens_per_s` from the weight total (real target tokens, never padding).
    """

    objective: Callable[[Any, dict], Objective]
    inputs: tuple[str, ...] = ("image",)
    eval_objective: Callable[[Any, dict], Objective] | None = None
    derived: Callable[[dict[str, float]], dict[str, float]] | None = None
    weight_unit: str = "examples"

    def model_inputs(self, batch: dict) -> tuple:
        return tuple(batch[name] for name in self.inputs)

    def objective_for(self, train: bool) -> Callable[[Any, dict], Objective]:
        return self.objective if train or self.eval_objective is None else self.eval_objective


def classification(label_smoothing: float = 0.0, *, inputs: tuple[str, ...] = ("image",),
                   label_key: str = "label") -> Task:
    """Softmax cross-entropy on integer labels; `accuracy` of the arg-max."""

    def objective(smoothing: float):
        def fn(logits, batch) -> Objective:
            logits = logits.astype(jnp.float32)
            labels = batch[label_key]
            targets = jax.nn.one_hot(labels, logits.shape[-1])
            if smoothing:
                targets = optax.smooth_labels(targets, smoothing)
            ones = jnp.ones(labels.shape, jnp.float32)
            correct = (jnp.argmax(logits, -1) == labels).astype(jnp.float32)
            return Objective(Weighted(optax.softmax_cross_entropy(logits, targets), ones),
                             {"accuracy": Weighted(correct, ones)})

        return fn

    return Task(objective(label_smoothing), inputs, eval_objective=objective(0.0))


def next_token(*, inputs: str | tuple[str, ...] = "inputs", targets: str = "targets",
               weights: str = "weights", exact_match: bool = True,
               tokens_per_byte: str | None = None) -> Task:
    """Next-token cross-entropy over the weighted target positions.

    `inputs` names the model's input features (packed text: the tokens, segment ids
    and positions). `token_accuracy` counts weighted positions whose arg-max is the
    target; `exact_match` counts sequences (with any weight) whose every weighted
    position is right: under teacher forcing that equals greedy decoding. With
    `tokens_per_byte` (a per-example feature: the split's target tokens per byte of
    text), `bits_per_byte` = nats per token x tokens / bytes / ln 2, comparable across
    tokenizers. Evaluation also reports `perplexity` = exp(loss).
    """

    def objective(logits, batch) -> Objective:
        logits = logits.astype(jnp.float32)
        labels, weight = batch[targets], batch[weights].astype(jnp.float32)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
        correct = (jnp.argmax(logits, -1) == labels).astype(jnp.float32)
        metrics = {"token_accuracy": Weighted(correct, weight)}
        if exact_match:
            wrong_tokens = jnp.sum((1.0 - correct) * (weight > 0), axis=-1)
            has_targets = jnp.any(weight > 0, axis=-1).astype(jnp.float32)
            metrics["exact_match"] = Weighted((wrong_tokens == 0).astype(jnp.float32),
                                              has_targets)
        if tokens_per_byte is not None:
            scale = batch[tokens_per_byte].astype(jnp.float32)[:, None] / math.log(2.0)
            metrics["bits_per_byte"] = Weighted(loss * scale, weight)
        return Objective(Weighted(loss, weight), metrics)

    names = (inputs,) if isinstance(inputs, str) else tuple(inputs)
    return Task(objective, names, derived=_perplexity, weight_unit="tokens")


def _perplexity(means: dict[str, float]) -> dict[str, float]:
    return {"perplexity": math.exp(min(means[LOSS], 700.0))}  # exp overflows past ~709


# -- the reduction: sums here, division after the all-reduce ----------------------

Sums = dict[str, tuple[jax.Array, jax.Array]]  # name -> (sum of value * weight, sum of weight)
LOSS = "loss"


def weighted_sums(objective: Objective, mask: jax.Array | None = None) -> Sums:
    """`(sum(value * weight), sum(weight))` for the loss and each metric.

    `mask` (one value per row) multiplies every weight: evaluation's padding rows
    count for nothing whatever the task's own weights say.
    """

    def reduce(item: Weighted) -> tuple[jax.Array, jax.Array]:
        weights = item.weights.astype(jnp.float32)
        if mask is not None:
            weights = weights * mask.reshape(mask.shape + (1,) * (weights.ndim - 1))
        return jnp.sum(item.values.astype(jnp.float32) * weights), jnp.sum(weights)

    return {LOSS: reduce(objective.loss), **{name: reduce(m)
                                             for name, m in objective.metrics.items()}}


def safe_divide(total: jax.Array, weight: jax.Array) -> jax.Array:
    """`total / weight`, and 0 where nothing had weight (an all-padding batch)."""
    return jnp.where(weight > 0, total / jnp.maximum(weight, 1e-30), 0.0)


def means(sums: Sums) -> dict[str, jax.Array]:
    return {name: safe_divide(total, weight) for name, (total, weight) in sums.items()}


def check_objective(objective: Objective, batch_rows: int, where: str) -> None:
    """Shapes of an objective's result (abstract arrays are fine); raises ValueError."""
    if not isinstance(objective, Objective):
        raise ValueError(f"{where} returned {type(objective).__name__}; expected "
                         "jdp.task.Objective(loss=Weighted(values, weights), metrics={...})")
    for name, item in {LOSS: objective.loss, **objective.metrics}.items():
        if not isinstance(item, Weighted):
            raise ValueError(f"{where}: {name} is {type(item).__name__}, not jdp.task.Weighted "
                             "(per-example values with their weights)")
        values, weights = jnp.shape(item.values), jnp.shape(item.weights)
        if values != weights:
            raise ValueError(f"{where}: {name} has values of shape {values} but weights of "
                             f"shape {weights}; they must match")
        if not values or values[0] != batch_rows:
            raise ValueError(f"{where}: {name} has shape {values}; expected one value per "
                             f"example (leading dimension {batch_rows}), not a mean")
