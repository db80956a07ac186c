"""The per-device training and evaluation math that both backends run.

`device_gradients` is written for one device's rows of the global batch,
under the named mesh axes `hosts` and `local` (jdp.DATA_AXIS; pmap and the
pjit backend's shard_map bind them). It accumulates micro-batch gradients of
the task's weighted loss sum locally in float32 and issues exactly one
cross-device reduction per optimizer step (flat, or two-level: see
`reduction`), so gradient accumulation costs no extra communication and the
loss is the weighted mean over the whole global batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import flax.struct
import jax
import jax.flatten_util
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from jdp import DATA_AXIS
from jdp import task as task_lib
from jdp.metrics import FIRST_NONFINITE_STEP
from jdp.modeling import Model
from jdp.parallel.reduction import FLAT, Reduction, param_count
from jdp.task import Task


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # int32 scalar: optimizer steps taken; the data position follows from it
    params: Any
    model_state: Any  # non-trained variables: BatchNorm statistics, NNX RNG counters
    opt_state: Any
    rng: jax.Array  # uint32 key data; per-step and per-device keys are folded from it
    # The gradient reduction's own state: the error-feedback residuals of compressed
    # cross-host reduction (reduction.RESIDUAL_SPECS), else empty. They belong to one
    # topology; a resume on another starts them at zero.
    comm: Any = dataclasses.field(default_factory=dict)


def init_state(model: Model, tx: optax.GradientTransformation, rng: jax.Array, inputs: tuple,
               reduction: Reduction | None = None):
    params, model_state = model.init(rng, inputs)
    shapes = reduction.residual_shapes(param_count(params)) if reduction else {}
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, model_state=model_state,
                      opt_state=tx.init(params), rng=jax.random.key_data(rng),
                      comm={name: jnp.zeros(shape, jnp.float32) for name, shape in shapes.items()})


def step_rng(rng: jax.Array, step: jax.Array,
             axis_name: str | tuple[str, ...] | None = DATA_AXIS) -> jax.Array:
    """A key for this step and (under a mapped axis) this device: dropout never repeats."""
    key = jax.random.fold_in(jax.random.wrap_key_data(rng), step)
    if axis_name is not None:
        key = jax.random.fold_in(key, jax.lax.axis_index(axis_name))
    return key


GRADIENT_ALL_REDUCE = "gradient_all_reduce"


def fsdp_gather(specs, reduce_dtype: jnp.dtype, axis_name: tuple[str, ...] = DATA_AXIS):
    """Local param shards -> full params, whose gradient comes back reduce-scattered.

    For FSDP under shard_map: `specs` gives each param's PartitionSpec (split over
    `axis_name` along at most one dimension, else replicated). The forward pass
    all-gathers a sharded param where the model uses it; its transpose sums the
    gradient over devices and leaves each device its own shard (a reduce-scatter,
    in `reduce_dtype`), so neither the whole model's gradient nor an all-reduce
    of it ever exists. A replicated param's gradient is summed with a psum.
    """

    def gather_leaf(spec):
        dim = _split_dim(spec)

        @jax.custom_vjp
        def gather(x):
            if dim is None:
                return x
            return jax.lax.all_gather(x, axis_name, axis=dim, tiled=True)

        def forward(x):
            return gather(x), None

        def backward(_, g):
            g = g.astype(reduce_dtype)
            with jax.named_scope(GRADIENT_ALL_REDUCE):
                if dim is not None:
                    g = jax.lax.psum_scatter(g, axis_name, scatter_dimension=dim, tiled=True)
                else:
                    g = jax.lax.psum(g, axis_name)
            return (g.astype(jnp.float32),)

        gather.defvjp(forward, backward)
        return gather

    gathers = jax.tree.map(gather_leaf, specs, is_leaf=lambda x: isinstance(x, P))
    return lambda params: jax.tree.map(lambda gather, p: gather(p), gathers, params)


def device_gradients(
    model: Model,
    task: Task,
    params,
    model_state,
    batch: dict,
    rng: jax.Array,
    *,
    accum_steps: int,
    reduce_dtype: jnp.dtype,
    reduction: Reduction = FLAT,
    residuals: dict | None = None,
    gather=None,
    scatter_specs=None,
    device_preprocess: Callable[[dict], dict] | None = None,
):
    """Gradients of the global weighted mean loss, the updated model state, the metrics
    and the reduction's new residuals (`TrainState.comm`, this device's part).

    Runs on one device's rows. Each micro-batch contributes the gradient of its
    weighted loss *sum*; these and the weighted metric sums accumulate in float32
    on the device, then one `psum` reduces gradients, sums and weight totals
    together, and only then is everything divided by the global weight. So the
    result is `sum(loss * weight) / sum(weight)` over all devices and micro-batches,
    never a mean of per-device means.

    With `gather` (FSDP, `fsdp_gather`), `params` are this device's shards and the
    gradients come back reduced and sharded from the gather's transpose, once per
    micro-batch; the one psum then carries only the metric sums. A two-level
    `reduction` reduces the gradients by itself, and the sums travel apart.

    With `scatter_specs` (ZeRO-1: the optimizer state's PartitionSpecs, params
    replicated), each gradient the specs split comes back reduce-scattered, as
    the shard this device's optimizer state updates; the others travel with the
    metric sums in one psum.
    """

    def loss_fn(p, state, micro_batch, key):
        if gather is not None:
            p = gather(p)
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

    # The one collective of the step: gradient sums, metric sums and weight totals
    # in one all-reduce (the sums stay float32 whatever the gradients travel in).
    # The sums travel as one float32 vector: one operand instead of two per metric.
    flat_sums, unflatten = jax.flatten_util.ravel_pytree(sums)
    residuals = {} if residuals is None else residuals
    with jax.named_scope(GRADIENT_ALL_REDUCE):  # found by this name in the HLO (the plan)
        if gather is not None:  # already reduce-scattered by the gather's transpose
            flat_sums = jax.lax.psum(flat_sums, DATA_AXIS)
        else:
            grads = jax.tree.map(lambda g: g.astype(reduce_dtype), grads)
            if reduction.kind == "flat" and scatter_specs is not None:
                grads, flat_sums = _reduce_scatter(grads, flat_sums, scatter_specs)
            elif reduction.kind == "flat":
                grads, flat_sums = jax.lax.psum((grads, flat_sums), DATA_AXIS)
            else:
                grads, residuals = reduction(grads, residuals)
                flat_sums = jax.lax.psum(flat_sums, DATA_AXIS)
    sums = unflatten(flat_sums)
    loss_weight = sums[task_lib.LOSS][1]
    grads = jax.tree.map(lambda g: task_lib.safe_divide(g.astype(jnp.float32), loss_weight),
                         grads)
    return grads, model_state, task_lib.means(sums), residuals


def _split_dim(spec: P) -> int | None:
    """The dimension a ZeRO/FSDP spec splits over the data axis (at most one), or None."""
    dims = [dim for dim, name in enumerate(spec) if name is not None]
    return dims[0] if dims else None


def _reduce_scatter(grads, flat_sums, specs):
    """(gradients reduced over the data axis, each split leaf reduce-scattered along the
    dimension its spec splits; the metric sums reduced): ZeRO-1's reduction. A ring
    reduce-scatter sends half of an all-reduce, and the params' all-gather after the
    update the other half, so ZeRO-1 sends what plain data parallelism does."""
    leaves, treedef = jax.tree.flatten(grads)
    dims = [_split_dim(spec) for spec in treedef.flatten_up_to(specs)]
    whole = [leaf for leaf, dim in zip(leaves, dims, strict=True) if dim is None]
    whole, flat_sums = jax.lax.psum((whole, flat_sums), DATA_AXIS)
    whole = iter(whole)
    reduced = [next(whole) if dim is None else
               jax.lax.psum_scatter(leaf, DATA_AXIS, scatter_dimension=dim, tiled=True)
               for leaf, dim in zip(leaves, dims, strict=True)]
    return jax.tree.unflatten(treedef, reduced), flat_sums


# Per-step statistics the step reports beside the task's metrics.
NONFINITE = "nonfinite"  # 1.0 when the loss or the gradients were not finite (update skipped)


def apply_gradients(tx: optax.GradientTransformation, state: TrainState, grads, model_state,
                    metrics: dict, learning_rate_fn=None, comm=None) -> tuple[TrainState, dict]:
    """One optimizer update, skipped (state kept, step counted) when it is not finite.

    A non-finite loss or gradient never reaches the params, so every state the
    trainer can save is finite; the step reports it (`nonfinite`) for the trainer
    to stop or count. Also reports the global gradient, update and parameter
    norms and the learning rate of this step, all computed on the device.
    """
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(metrics[task_lib.LOSS]) & jnp.isfinite(grad_norm)

    def update(state):
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        return state.replace(params=params, opt_state=opt_state, model_state=model_state,
                             comm=state.comm if comm is None else comm), \
            optax.tree.norm(updates)

    def skip(state):
        return state, jnp.zeros((), jnp.float32)

    # A branch rather than a select of every leaf between the old and new state: a
    # select makes XLA copy the donated state each step (+18% on a ViT-Ti step).
    state, update_norm = jax.lax.cond(finite, update, skip, state)
    stats = {"grad_norm": grad_norm, "update_norm": update_norm,
             "param_norm": optax.tree.norm(state.params),
             NONFINITE: 1.0 - finite.astype(jnp.float32),
             FIRST_NONFINITE_STEP: jnp.where(finite, jnp.iinfo(jnp.int32).max, state.step + 1)}
    if learning_rate_fn is not None:
        stats["learning_rate"] = jnp.asarray(learning_rate_fn(state.step), jnp.float32)
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
