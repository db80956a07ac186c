"""The per-device training and evaluation math that both backends run.

`device_gradients` is written for one device's rows of the global batch,
under the named mesh axis `data` (pmap binds it; the pjit backend binds it
with shard_map). It accumulates micro-batch gradients locally in float32 and
issues exactly one cross-device reduction per optimizer step, so gradient
accumulation costs no extra communication.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax

from jdp import DATA_AXIS
from jdp.modeling import Model


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # int32 scalar: optimizer steps taken; the data position follows from it
    params: Any
    model_state: Any  # non-trained variables: BatchNorm statistics, NNX RNG counters
    opt_state: Any
    rng: jax.Array  # uint32 key data; per-step and per-device keys are folded from it


def init_state(model: Model, tx: optax.GradientTransformation, rng: jax.Array, images):
    params, model_state = model.init(rng, images)
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, model_state=model_state,
                      opt_state=tx.init(params), rng=jax.random.key_data(rng))


def step_rng(rng: jax.Array, step: jax.Array, axis_name: str | None = DATA_AXIS) -> jax.Array:
    """A key for this step and (under a mapped axis) this device: dropout never repeats."""
    key = jax.random.fold_in(jax.random.wrap_key_data(rng), step)
    if axis_name is not None:
        key = jax.random.fold_in(key, jax.lax.axis_index(axis_name))
    return key


def _cross_entropy(logits, labels, num_classes: int, label_smoothing: float):
    targets = jax.nn.one_hot(labels, num_classes)
    if label_smoothing:
        targets = optax.smooth_labels(targets, label_smoothing)
    return optax.softmax_cross_entropy(logits, targets)


def device_gradients(
    model: Model,
    params,
    model_state,
    batch: dict,
    rng: jax.Array,
    *,
    accum_steps: int,
    reduce_dtype: jnp.dtype,
    label_smoothing: float = 0.0,
    axis_name: str = DATA_AXIS,
):
    """Mean gradients over the global batch, and the updated model state and metrics.

    Runs on one device's rows. Micro-batch gradients are summed in float32 on
    the device; then one `pmean` reduces gradients and metrics together.
    """

    def loss_fn(p, state, micro_batch, key):
        logits, state = model.apply(p, state, micro_batch["image"], True, key)
        logits = logits.astype(jnp.float32)
        num_classes = logits.shape[-1]
        loss = _cross_entropy(logits, micro_batch["label"], num_classes, label_smoothing).mean()
        accuracy = jnp.mean(jnp.argmax(logits, -1) == micro_batch["label"])
        return loss, (state, accuracy)

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    if accum_steps == 1:
        (loss, (model_state, accuracy)), grads = grad_fn(params, model_state, batch, rng)
    else:
        micro_batches = jax.tree.map(
            lambda x: x.reshape(accum_steps, -1, *x.shape[1:]), batch)

        def accumulate(carry, inputs):
            grads_sum, state, loss_sum, accuracy_sum = carry
            micro_batch, index = inputs
            (loss, (state, accuracy)), grads = grad_fn(
                params, state, micro_batch, jax.random.fold_in(rng, index))
            grads_sum = jax.tree.map(lambda s, g: s + g.astype(jnp.float32), grads_sum, grads)
            return (grads_sum, state, loss_sum + loss, accuracy_sum + accuracy), None

        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        carry = (zeros, model_state, jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32))
        (grads, model_state, loss, accuracy), _ = jax.lax.scan(
            accumulate, carry, (micro_batches, jnp.arange(accum_steps)))
        grads = jax.tree.map(lambda g: g / accum_steps, grads)
        loss, accuracy = loss / accum_steps, accuracy / accum_steps

    grads = jax.tree.map(lambda g: g.astype(reduce_dtype), grads)
    metrics = {"loss": loss, "accuracy": accuracy}  # float32 whatever the gradients travel in
    # The one collective of the step: gradients and metrics in one all-reduce.
    grads, metrics = jax.lax.pmean((grads, metrics), axis_name)
    return jax.tree.map(lambda g: g.astype(jnp.float32), grads), model_state, metrics


def apply_gradients(tx: optax.GradientTransformation, state: TrainState, grads, model_state):
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    return state.replace(step=state.step + 1, params=optax.apply_updates(state.params, updates),
                         opt_state=opt_state, model_state=model_state)


def eval_sums(model: Model, state: TrainState, batch: dict) -> dict:
    """Masked sums over the rows given: padding rows (mask 0) count for nothing."""
    logits, _ = model.apply(state.params, state.model_state, batch["image"], False,
                            jax.random.wrap_key_data(state.rng))
    logits = logits.astype(jnp.float32)
    mask = batch["mask"]
    loss = _cross_entropy(logits, batch["label"], logits.shape[-1], 0.0)
    correct = (jnp.argmax(logits, -1) == batch["label"]).astype(jnp.float32)
    return {"loss_sum": jnp.sum(loss * mask), "correct": jnp.sum(correct * mask),
            "count": jnp.sum(mask)}
