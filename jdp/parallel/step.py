"""The per-device training and evaluation math that both backends run.

`device_gradients` is written for one device's rows of the global batch,
under the named mesh axes `hosts` and `local` (jdp.DATA_AXIS; pmap and the
pjit backend's shard_map bind them). It accumulates micro-batch gradients of
the task's weighted loss sum locally in float32 and issues exactly one
cross-device reduction per optimizer step (the reducer's: `reducers`), so
gradient accumulation costs no extra communication and the loss is the
weighted mean over the whole global batch. `apply_gradients` is the optimizer
update, skipped when not finite; `eval_sums` the evaluation.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.flatten_util
import jax.numpy as jnp
import optax

from jdp.experiment import task as task_lib
from jdp.experiment.adapters import Model
from jdp.experiment.task import Task
from jdp.parallel.reducers import GRADIENT_SCOPE, Flat, Reducer
from jdp.parallel.state import TrainState

FLAT = Flat()  # the default: one all-reduce of the gradients over every device


def device_gradients(
    model: Model,
    task: Task,
    params,
    model_state,
    batch: dict,
    rng: jax.Array,
    *,
    accum_steps: int,
    reducer: Reducer = FLAT,
    residuals: dict | None = None,
    device_preprocess: Callable[[dict], dict] | None = None,
):
    """Gradients of the global weighted mean loss, the updated model state, the metrics
    and the reducer's new residuals (`TrainState.residuals`, this device's part).

    Runs on one device's rows. Each micro-batch contributes the gradient of its
    weighted loss *sum*; these and the weighted metric sums accumulate in float32
    on the device, then the `reducer` (`jdp.parallel.reducers`) sums gradients,
    metric sums and weight totals over the devices, and only then is everything
    divided by the global weight. So the result is `sum(loss * weight) /
    sum(weight)` over all devices and micro-batches, never a mean of per-device
    means. `params` are what this device holds (FSDP: its shards, which the
    reducer gathers where the model uses them).
    """

    def loss_fn(p, state, micro_batch, key):
        p = reducer.gather_params(p)
        if device_preprocess is not None:  # the data's batch -> batch on the device
            micro_batch = device_preprocess(micro_batch)
        outputs, state = model.apply(p, state, task.model_inputs(micro_batch), True, key)
        sums = task_lib.weighted_sums(task.objective(outputs, micro_batch))
        return sums[task_lib.LOSS][0], (state, sums)

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    if accum_steps == 1:
        (_, (model_state, sums)), grads = grad_fn(params, model_state, batch, rng)
    else:
        micro_batches = jax.tree.map(
            lambda x: x.reshape(accum_steps, -1, *x.shape[1:]), batch)

        def accumulate(carry, inputs):
            grads_sum, state, sums_total = carry
            micro_batch, index = inputs
            (_, (state, sums)), grads = grad_fn(
                params, state, micro_batch, jax.random.fold_in(rng, index))
            grads_sum = jax.tree.map(lambda s, g: s + g.astype(jnp.float32), grads_sum, grads)
            return (grads_sum, state, jax.tree.map(jnp.add, sums_total, sums)), None

        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        # The sums' structure, from tracing the forward pass alone (no gradient).
        zero_sums = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(
            loss_fn, params, model_state, jax.tree.map(lambda x: x[0], micro_batches),
            rng)[1][1])
        (grads, model_state, sums), _ = jax.lax.scan(
            accumulate, (zeros, model_state, zero_sums), (micro_batches, jnp.arange(accum_steps)))

    # The one reduction of the step: gradient sums, metric sums and weight totals (the
    # sums stay float32 whatever the gradients travel in, as one vector: one operand
    # instead of two per metric).
    flat_sums, unflatten = jax.flatten_util.ravel_pytree(sums)
    with jax.named_scope(GRADIENT_SCOPE):
        grads, flat_sums, residuals = reducer.reduce(grads, flat_sums, residuals or {})
    sums = unflatten(flat_sums)
    loss_weight = sums[task_lib.LOSS][1]
    grads = jax.tree.map(lambda g: task_lib.safe_divide(g.astype(jnp.float32), loss_weight),
                         grads)
    return grads, model_state, {**task_lib.means(sums), LOSS_WEIGHT: loss_weight}, residuals


# Per-step statistics the step reports beside the task's metrics.
NONFINITE = "nonfinite"  # 1.0 when the loss or the gradients were not finite (update skipped)
FIRST_NONFINITE_STEP = "first_nonfinite_step"  # summed over a window with min, not +
LOSS_WEIGHT = "loss_weight"  # the step's total loss weight: examples, or real target tokens
LEARNING_RATE = "learning_rate"  # a window reports its last step's, not a mean


def add_to_window(sums: dict, metrics: dict, reset: jax.Array) -> dict:
    """The logging window's running sums after one more step, inside the step.

    Each metric is summed, except `FIRST_NONFINITE_STEP` (the minimum) and
    `LEARNING_RATE` (the last value). `reset` (the step after a log step) starts a
    new window from this step's values; the host divides by the window's length.
    """
    def combine(key, total, value):
        if key == LEARNING_RATE:
            return value
        joined = jnp.minimum(total, value) if key == FIRST_NONFINITE_STEP else total + value
        return jnp.where(reset, value, joined)

    return {key: combine(key, sums[key], value) for key, value in metrics.items()}


def window_step(step_fn: Callable) -> Callable:
    """`step_fn(state, batch) -> (state, metrics)` as the loop runs it:
    `(state, batch, sums, reset) -> (state, sums)`, one dispatch per step."""

    def train_step(state, batch, sums, reset):
        state, metrics = step_fn(state, batch)
        return state, add_to_window(sums, metrics, reset)

    return train_step


# The largest leaf (in elements) `global_norm` packs with the others on XLA:CPU.
PACKED_NORM_ELEMENTS = 16384


def global_norm(tree, pack_small: bool = False) -> jax.Array:
    """The L2 norm of all the tree's leaves together, as `optax.tree.norm`.

    With `pack_small` (XLA:CPU, leaves not sharded), the leaves of at most
    PACKED_NORM_ELEMENTS elements are concatenated and reduced as one vector. XLA:CPU
    runs each leaf's sum of squares as two or three kernels of its own, whose fixed
    cost outweighs a small leaf's arithmetic: a ViT-nano's 39 leaves take 92 us a norm
    one by one, 38 packed; a ViT-Ti's 199 take 965 us and 800 with the small ones
    packed (its matrices are reduced where they lie, where a copy would cost more).
    Concatenating sharded leaves would make XLA gather them, hence the option.
    """
    if not pack_small:
        return optax.tree.norm(tree)
    leaves = jax.tree.leaves(tree)
    small = [jnp.ravel(x).astype(jnp.float32) for x in leaves if x.size <= PACKED_NORM_ELEMENTS]
    squares = [jnp.sum(jnp.square(x.astype(jnp.float32))) for x in leaves
               if x.size > PACKED_NORM_ELEMENTS]
    if small:
        squares.append(jnp.sum(jnp.square(jnp.concatenate(small))))
    return jnp.sqrt(sum(squares, jnp.zeros((), jnp.float32)))


def apply_gradients(tx: optax.GradientTransformation, state: TrainState, grads, model_state,
                    metrics: dict, learning_rate_fn=None, residuals=None,
                    pack_norms: bool = False) -> tuple[TrainState, dict]:
    """One optimizer update, skipped (state kept, step counted) when it is not finite.

    A non-finite loss or gradient never reaches the params, so every state the
    trainer can save is finite; the step reports it (`nonfinite`) for the trainer
    to stop or count. Also reports the global gradient, update and parameter
    norms and the learning rate of this step, all computed on the device
    (`global_norm`; `pack_norms`: its `pack_small`).
    """
    def norm(tree):
        return global_norm(tree, pack_norms)

    grad_norm = norm(grads)
    finite = jnp.isfinite(metrics[task_lib.LOSS]) & jnp.isfinite(grad_norm)

    def update(state):
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        return state.replace(params=params, opt_state=opt_state, model_state=model_state,
                             residuals=state.residuals if residuals is None else residuals), \
            norm(updates)

    def skip(state):
        return state, jnp.zeros((), jnp.float32)

    # A branch rather than a select of every leaf between the old and new state: a
    # select makes XLA copy the donated state each step (+18% on a ViT-Ti step).
    state, update_norm = jax.lax.cond(finite, update, skip, state)
    stats = {"grad_norm": grad_norm, "update_norm": update_norm,
             "param_norm": norm(state.params),
             NONFINITE: 1.0 - finite.astype(jnp.float32),
             FIRST_NONFINITE_STEP: jnp.where(finite, jnp.iinfo(jnp.int32).max, state.step + 1)}
    if learning_rate_fn is not None:
        stats[LEARNING_RATE] = jnp.asarray(learning_rate_fn(state.step), jnp.float32)
    # The data position is the step: a skipped update still consumed its batch.
    return state.replace(step=state.step + 1), {**metrics, **stats}


def eval_sums(model: Model, task: Task, state: TrainState, batch: dict,
              device_preprocess: Callable[[dict], dict] | None = None):
    """(weighted sums of the eval objective, number of real examples) over the rows
    given; each row's weights are multiplied by its `mask`, so padding rows count
    for nothing."""
    mask = batch["mask"]  # read before device_preprocess, which need not keep it
    if device_preprocess is not None:
        batch = device_preprocess(batch)
    outputs, _ = model.apply(state.params, state.model_state, task.model_inputs(batch), False,
                             jax.random.wrap_key_data(state.rng))
    return task_lib.weighted_sums(task.objective_for(train=False)(outputs, batch), mask), \
        jnp.sum(mask)
