"""The pmap and pjit backends behind one small interface.

Both keep the canonical ("global") form of the state as global jax.Arrays
with NamedShardings over the mesh: that is what initialisation produces and
what checkpoints and evaluation see. Each backend converts to its own
working layout and back.

- pjit: `jax.jit` over the global state and batch. The gradient computation
  runs per device under `shard_map` (so accumulation and the reduction dtype
  are explicit and there is one gradient all-reduce); the optimizer update,
  ZeRO/FSDP sharding and evaluation are partitioned by XLA. With a model axis
  the `shard_map` binds the data axes only: XLA partitions each layer over the
  model axis from its params' shardings (`jdp.experiment.partitioning`), inserting the
  activations' all-reduces, and the gradients reduce over the data axes alone.
- pmap: a full replica of the state on each local device with a leading
  device axis; gradients reduced with one explicit `psum` over every device.
  pmap binds one axis name, so it maps `local` over all devices of all
  processes and `hosts` is a vmapped axis of size 1 inside: jdp.DATA_AXIS
  still names every device, and the reduction is always flat.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jdp import DATA_AXIS, HOSTS_AXIS, LOCAL_AXIS, MODEL_AXIS
from jdp.experiment import partitioning
from jdp.experiment.adapters import Model
from jdp.experiment.task import Task
from jdp.parallel import mesh as mesh_lib
from jdp.parallel import step as step_lib
from jdp.parallel.reducers import Reducer, make_reducer, residual_specs
from jdp.parallel.state import TrainState, init_state, step_rng
from jdp.runtime import jax_compat


@dataclasses.dataclass(frozen=True)
class StepOptions:
    accum_steps: int = 1
    reduce_dtype: str = "float32"
    shard_optimizer_state: bool | str = False  # ZeRO-1: True over every device, or "host"
    shard_params: bool | str = False  # FSDP-style: True over every device, or "host"
    compiler_options: dict | None = None  # passed to XLA when compiling the train step
    learning_rate_fn: Callable | None = None  # step -> LR, reported from inside the step
    device_preprocess: Callable | None = None  # batch -> batch before the model (jdp.data.Data)
    # How gradients are summed (`jdp.parallel.reducers`; pmap: flat only).
    reduction: str = "flat"  # or "two_level"
    cross_host_reduce: str = "float32"  # two_level: what crosses hosts
    error_feedback: bool = True
    # Logical axis name -> MODEL_AXIS or None: what a mesh's model axis splits.
    axis_rules: tuple = ()


def compiler_options(platform: str, remat: str, shard_params: bool = False) -> dict | None:
    """XLA options the train step needs on this platform.

    XLA:CPU's default scheduler optimises for concurrency: it issues every FSDP
    all-gather at the start, which materialises the whole model, and up to jaxlib 0.11.0
    it hoists the recomputation of rematerialised blocks back into the forward pass,
    which undoes remat. Its memory-optimised scheduler keeps both savings (ViT-B/16:
    571 MiB per device with FSDP instead of 722). From jaxlib 0.11.1 the default one keeps
    remat's (`jax_compat.cpu_schedule_keeps_remat`) and then holds far less than the
    memory-optimised one where remat matters, with many activations (ViT-B/16, 32
    examples per device, full remat, jax 0.12.1: 1,000 MiB of temporaries against 1,740;
    with FSDP 1,024 against 3,697; at one example per device, where remat saves little,
    the memory-optimised one holds less: 760 against 1,000).
    """
    if platform != "cpu":
        return None
    if (remat != "none" and not jax_compat.cpu_schedule_keeps_remat()) or (
            remat == "none" and shard_params):
        return {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"}
    return None


def _replicated_sharding_tree(mesh: Mesh, tree):
    return jax.tree.map(lambda _: mesh_lib.replicated(mesh), tree)


class Backend:
    """What the trainer needs from a parallel backend."""

    name: str

    def __init__(self, mesh: Mesh, model: Model, task: Task, tx: optax.GradientTransformation,
                 options: StepOptions):
        self.mesh = mesh
        self.model = model
        self.task = task
        self.tx = tx
        self.options = options
        self._eval_step = None  # the backend's jitted or pmapped eval step
        self._compiled_eval_step = None
        self._model_specs = None  # each param's split over the model axis, once known

    def reducer(self, param_specs=None, optimizer_specs=None, model_specs=None) -> Reducer:
        """The gradient reduction strategy of these options over this mesh (the specs
        are the state's over the data axes: FSDP and ZeRO-1 need them to split the
        gradients; `model_specs` the gradients' over the model axis)."""
        opts = self.options
        return make_reducer(
            reduction=opts.reduction, reduce_dtype=opts.reduce_dtype,
            shard_params=opts.shard_params, shard_optimizer_state=opts.shard_optimizer_state,
            param_specs=param_specs, optimizer_specs=optimizer_specs,
            cross_host=opts.cross_host_reduce, error_feedback=opts.error_feedback,
            hosts=self.mesh.shape[HOSTS_AXIS], local=self.mesh.shape[LOCAL_AXIS],
            fuse=self._on_cpu(), model_specs=model_specs)

    def _on_cpu(self) -> bool:
        """Whether the mesh is XLA:CPU's, which runs many small kernels, each at a fixed
        cost: its reductions travel packed, its norms pack the small leaves."""
        return self.mesh.devices.flat[0].platform == "cpu"

    # -- state: the canonical form is global arrays over the mesh ----------------
    def global_shardings(self, abstract_state: TrainState, sample_inputs: tuple):
        """Shardings of the canonical state (what init produces and checkpoints hold):
        over the model axis as the params' names say, over the data axes as ZeRO/FSDP
        say (on another dimension)."""
        mesh, opts = self.mesh, self.options
        model_specs = self.model_specs(sample_inputs, abstract_state.params)
        if model_specs is None:  # every leaf whole over the (absent) model axis
            model_specs = jax.tree.map(lambda _: P(), abstract_state.params)

        optimizer_mode = opts.shard_params or opts.shard_optimizer_state

        def optimizer_leaf(x, spec=mesh_lib.REPLICATED):
            return mesh_lib.state_leaf_sharding(mesh, x, optimizer_mode, spec)

        if mesh_lib.model_size(mesh) == 1:
            opt_state = jax.tree.map(optimizer_leaf, abstract_state.opt_state)
        else:  # each copy of the params in the optimizer state is split as the params
            opt_state = optax.tree_map_params(self.tx, optimizer_leaf, abstract_state.opt_state,
                                              model_specs, transform_non_params=optimizer_leaf)
        return TrainState(
            step=mesh_lib.replicated(mesh),
            params=jax.tree.map(
                lambda x, spec: mesh_lib.state_leaf_sharding(mesh, x, opts.shard_params, spec),
                abstract_state.params, model_specs),
            model_state=_replicated_sharding_tree(mesh, abstract_state.model_state),
            opt_state=opt_state,
            rng=mesh_lib.replicated(mesh),
            residuals={name: NamedSharding(mesh, spec)
                       for name, spec in residual_specs(abstract_state.residuals).items()},
        )

    def model_specs(self, sample_inputs: tuple, abstract_params):
        """Each param's split over the model axis (`partitioning.model_specs`; None on a
        mesh without one), read from the model once."""
        if self._model_specs is None and mesh_lib.model_size(self.mesh) > 1:
            self._model_specs = partitioning.model_specs(
                self.model, sample_inputs, self.options.axis_rules,
                mesh_lib.model_size(self.mesh), abstract_params)
        return self._model_specs

    def abstract_state(self, rng: jax.Array, sample_inputs: tuple) -> TrainState:
        """Shapes, dtypes and canonical shardings of the state, without computing it.

        `sample_inputs` are the model's inputs for one example (leading dimension 1).
        """
        init = functools.partial(init_state, self.model, self.tx, reducer=self.reducer())
        shapes = jax.eval_shape(init, rng, sample_inputs)
        shardings = self.global_shardings(shapes, sample_inputs)
        return jax.tree.map(
            lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)

    def init_global(self, rng: jax.Array, sample_inputs: tuple) -> TrainState:
        """The initial state, created directly with its shardings (nothing on one device first)."""
        init = functools.partial(init_state, self.model, self.tx, reducer=self.reducer())
        shardings = self.global_shardings(jax.eval_shape(init, rng, sample_inputs),
                                          sample_inputs)
        return jax.jit(init, out_shardings=shardings)(rng, sample_inputs)

    def from_global(self, state, *, consume: bool = False):
        """The canonical state -> this backend's working layout. `consume`: the input is
        not used again, so a backend that copies may free each leaf once copied."""
        return state

    def to_global(self, state, *, consume: bool = False):
        """The working layout -> the canonical state (see `from_global`)."""
        return state

    def with_global(self, state, use: Callable[[Any], None]):
        """Calls `use(canonical state)` (a save) and returns the working state to go on
        with. The state never exists twice in memory: a backend whose layouts differ
        converts leaf by leaf, freeing each source leaf once copied, and back."""
        global_state = self.to_global(state, consume=True)
        try:
            use(global_state)
        finally:
            state = self.from_global(global_state, consume=True)
        return state

    def abstract_working(self, abstract_state, example: dict, global_batch_size: int):
        """(state, batch) as the compiled step sees them, shapes only: for compiling
        ahead of time without allocating anything (the dry run)."""
        batch = {key: jax.ShapeDtypeStruct((global_batch_size, *np.shape(value)),
                                           np.asarray(value).dtype,
                                           sharding=mesh_lib.batch_sharding(self.mesh))
                 for key, value in example.items()}
        return abstract_state, batch

    # -- steps ---------------------------------------------------------------
    def put_batch(self, local_batch: dict[str, np.ndarray]):
        raise NotImplementedError

    def lowered_train_step(self, state, batch):
        """The train step lowered for these arguments: the program before XLA optimises it."""
        raise NotImplementedError

    def compiled_train_step(self, state, batch):
        """The compiled train step: called as `(state, batch) -> (state, metrics)` and read
        for memory_analysis(), cost_analysis() and the optimised HLO."""
        return self.lowered_train_step(state, batch).compile(self.options.compiler_options)

    def lowered_window_step(self, state, batch):
        """The step the loop runs (`compiled_window_step`), lowered for these arguments,
        which may be shapes alone (`abstract_working`): the same program either way, so a
        compile ahead of time (the dry run, the tuner's footprints) leaves the run's own
        compile a hit in the persistent compilation cache."""
        return self._lower(self._window_fn_for(state), state, batch,
                           *self._window_inputs(state, batch))

    def compiled_window_step(self, state, batch):
        """The step the loop runs, compiled: `(state, batch, sums, reset) -> (state, sums)`,
        the train step with the logging window's running sums added inside it
        (`step.add_to_window`), so a step is one dispatch. Returns it with the window's
        first inputs: zero sums and the `(reset, keep)` flags, in this backend's layout.

        The sums are not donated: the host reads a closed window one step late, while
        the next step is already running on it.
        """
        def constant(value, like) -> jax.Array:  # from the host: nothing to compile
            host = np.full(like.shape, value, like.dtype)
            return jax.make_array_from_callback(like.shape, like.sharding,
                                                lambda index: host[index])

        # Lowered with the arrays it is called with: the program `lowered_window_step`
        # lowers from shapes.
        sums, reset = self._window_inputs(state, batch)
        sums = jax.tree.map(lambda m: constant(0, m), sums)
        reset, keep = constant(True, reset), constant(False, reset)
        compiled = self._lower(self._window_fn_for(state), state, batch, sums, reset).compile(
            self.options.compiler_options)
        return compiled, sums, (reset, keep)

    def _lower(self, fn, *args) -> jax.stages.Lowered:
        """`fn` (this backend's jitted or pmapped step) lowered for `args`, arrays or
        shapes alike."""
        return fn.lower(*args)

    def _window_inputs(self, state, batch):
        """(sums, reset) of the window step, shapes only, in this backend's layout."""
        sharding, flag_shape = self._window_layout()
        sums = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=sharding),
                            self._metric_shapes(state, batch))
        return sums, jax.ShapeDtypeStruct(flag_shape, np.bool_, sharding=sharding)

    def _metric_shapes(self, state, batch):
        """The train step's metrics, shapes only, as the window step returns them."""
        raise NotImplementedError

    def _window_fn_for(self, state) -> Callable:
        """The jitted or pmapped window step (`step.window_step`) for this state's layout."""
        raise NotImplementedError

    def _window_layout(self):
        """(sharding, flag shape) of the window's sums and flags."""
        raise NotImplementedError

    def compile_eval_step(self, state, batch) -> None:
        """Compiles the eval step for batches shaped like `batch` now, ahead of time."""
        self._compiled_eval_step = self._eval_step.lower(state, batch).compile()

    def eval_step(self, state, batch):
        """Weighted sums of the eval objective over the batch and its number of examples."""
        return (self._compiled_eval_step or self._eval_step)(state, batch)

    def fetch(self, tree) -> Any:
        """Replicated device values -> host numpy (blocks)."""
        raise NotImplementedError


class PjitBackend(Backend):
    name = "pjit"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._train_step = None
        self._eval_step = jax.jit(functools.partial(
            step_lib.eval_sums, self.model, self.task,
            device_preprocess=self.options.device_preprocess))

    def put_batch(self, local_batch):
        sharding = mesh_lib.batch_sharding(self.mesh)
        process_rows = next(iter(local_batch.values())).shape[0]
        global_rows = (process_rows // mesh_lib.local_data_replicas(self.mesh)
                       * mesh_lib.data_size(self.mesh))
        return {
            key: jax.make_array_from_process_local_data(
                sharding, value, (global_rows, *value.shape[1:]))
            for key, value in local_batch.items()
        }

    def _step_fn(self, param_specs, abstract_params):
        """The train step; `param_specs` are the params' PartitionSpecs (FSDP shards them
        over the data axes, the model axis as their names say)."""
        opts, model, task, mesh = self.options, self.model, self.task, self.mesh
        with_model_axis = mesh_lib.model_size(mesh) > 1
        model_specs = (jax.tree.map(mesh_lib.model_part, param_specs)
                       if with_model_axis else None)
        # ZeRO-1's optimizer state splits each param along one dimension (where it can).
        axis, size = mesh_lib.shard_axis(mesh, opts.shard_optimizer_state)
        optimizer_specs = jax.tree.map(
            lambda x, spec: mesh_lib.data_part(mesh_lib.sharded_over_data(
                tuple(x.shape), size, axis, mesh_lib.model_part(spec))),
            abstract_params, param_specs)
        reducer = self.reducer(jax.tree.map(mesh_lib.data_part, param_specs),
                               optimizer_specs, model_specs)
        # The per-device function binds the data axes; XLA partitions the model axis.
        manual_axes = frozenset((HOSTS_AXIS, LOCAL_AXIS)) if with_model_axis else frozenset()

        def device_grads(params, model_state, batch, rng, step, residuals):
            return step_lib.device_gradients(
                model, task, params, model_state, batch, step_rng(rng, step),
                accum_steps=opts.accum_steps, reducer=reducer, residuals=residuals,
                device_preprocess=opts.device_preprocess)

        def train_step(state, batch):
            # check_vma=False gives pmap's semantics: the gradient of a replicated
            # input stays per-device (no implicit psum), so the reducer's one
            # reduction is the only one, exactly as under pmap.
            specs = residual_specs(state.residuals)
            grads, model_state, metrics, residuals = jax.shard_map(
                device_grads, mesh=mesh,
                in_specs=(reducer.param_specs(), P(), P(DATA_AXIS), P(), P(), specs),
                out_specs=(reducer.grad_specs(), P(), P(), specs),
                axis_names=manual_axes, check_vma=False,
            )(state.params, state.model_state, batch, state.rng, state.step, state.residuals)
            return step_lib.apply_gradients(
                self.tx, state, grads, model_state, metrics, opts.learning_rate_fn, residuals,
                pack_norms=self._on_cpu() and not (opts.shard_params or with_model_axis
                                                   or opts.shard_optimizer_state))

        return train_step

    def _jitted(self, state):
        if self._train_step is None:
            state_shardings = jax.tree.map(lambda x: x.sharding, state)
            param_specs = jax.tree.map(lambda sharding: sharding.spec, state_shardings.params)
            batch_sharding = mesh_lib.batch_sharding(self.mesh)
            replicated = mesh_lib.replicated(self.mesh)
            self._train_step = jax.jit(
                self._step_fn(param_specs, state.params),
                in_shardings=(state_shardings, batch_sharding),
                out_shardings=(state_shardings, replicated), donate_argnums=0)
            # Calls the jitted step inside, so the two share one trace.
            self._window_step = jax.jit(
                step_lib.window_step(self._train_step),
                in_shardings=(state_shardings, batch_sharding, replicated, replicated),
                out_shardings=(state_shardings, replicated), donate_argnums=0)
        return self._train_step

    def _metric_shapes(self, state, batch):
        return jax.eval_shape(self._jitted(state), state, batch)[1]

    def _window_fn_for(self, state):
        self._jitted(state)
        return self._window_step

    def _window_layout(self):
        return mesh_lib.replicated(self.mesh), ()

    def lowered_train_step(self, state, batch):
        return self._lower(self._jitted(state), state, batch)

    def fetch(self, tree):
        return jax.device_get(tree)


class PmapBackend(Backend):
    name = "pmap"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # pmap's arrays here are global: a leading axis over every device of the
        # mesh, split over `data`; each process holds the rows of its own devices.
        self._stacked = NamedSharding(self.mesh, P(DATA_AXIS))
        opts, model, task = self.options, self.model, self.task

        if opts.reduction != "flat":
            raise ValueError("the pmap backend reduces gradients flat; use the pjit backend "
                             f"for a {opts.reduction} reduction")
        if MODEL_AXIS in self.mesh.shape:
            raise ValueError("the pmap backend keeps a whole replica on every device; use the "
                             "pjit backend with a model axis")
        reducer = self.reducer()

        def train_step(state, batch):
            grads, model_state, metrics, _ = step_lib.device_gradients(
                model, task, state.params, state.model_state, batch,
                step_rng(state.rng, state.step), accum_steps=opts.accum_steps,
                reducer=reducer, device_preprocess=opts.device_preprocess)
            return step_lib.apply_gradients(self.tx, state, grads, model_state, metrics,
                                            opts.learning_rate_fn, pack_norms=self._on_cpu())

        def eval_step(state, batch):
            return jax.lax.psum(step_lib.eval_sums(model, task, state, batch,
                                                   opts.device_preprocess), DATA_AXIS)

        # pmap is given every device of the mesh (all processes): its collectives then
        # span the whole job, while each process feeds and holds its local replicas.
        devices = list(self.mesh.devices.flat)
        # One device's step, jitted: both pmaps call it, so they share one trace.
        device_step = self._device_step = jax.jit(train_step)
        self._train_step = jax.pmap(_with_hosts_axis(device_step), axis_name=LOCAL_AXIS,
                                    donate_argnums=0, devices=devices)
        self._window_step = jax.pmap(
            _with_hosts_axis(step_lib.window_step(device_step)), axis_name=LOCAL_AXIS,
            donate_argnums=0, devices=devices)
        self._eval_step = jax.pmap(_with_hosts_axis(eval_step), axis_name=LOCAL_AXIS,
                                   devices=devices)
        # Between the canonical layout and the working one, leaf by leaf, each device
        # copying its own replica (a ZeRO-sharded leaf is gathered first): one small
        # program per leaf shape, where indexing each device's buffer compiled one per
        # shape and device.
        self._stack = jax.jit(jax.shard_map(
            lambda x: x[None], mesh=self.mesh, in_specs=P(), out_specs=P(DATA_AXIS),
            check_vma=False))
        self._unstack = jax.jit(jax.shard_map(
            lambda x: x[0], mesh=self.mesh, in_specs=P(DATA_AXIS), out_specs=P(),
            check_vma=False))

    def from_global(self, state, *, consume: bool = False):
        """Replicated global arrays -> one replica per device, stacked on a leading axis."""
        return jax.tree.map(lambda x: _free_after(self._stack(x), x, consume), state)

    def to_global(self, state, *, consume: bool = False):
        """The per-device replicas -> replicated global arrays over the whole mesh."""
        return jax.tree.map(lambda x: _free_after(self._unstack(x), x, consume), state)

    def abstract_working(self, abstract_state, example: dict, global_batch_size: int):
        def stacked(shape, dtype):
            return jax.ShapeDtypeStruct((self.mesh.size, *shape), dtype, sharding=self._stacked)

        per_device = global_batch_size // self.mesh.size
        state = jax.tree.map(lambda x: stacked(x.shape, x.dtype), abstract_state)
        batch = {key: stacked((per_device, *np.shape(value)), np.asarray(value).dtype)
                 for key, value in example.items()}
        return state, batch

    def put_batch(self, local_batch):
        local_count = len(self.mesh.local_devices)

        def put(value):
            per_device = value.reshape(local_count, -1, *value.shape[1:])
            return jax.make_array_from_process_local_data(
                self._stacked, per_device, (self.mesh.size, *per_device.shape[1:]))

        return {key: put(value) for key, value in local_batch.items()}

    def lowered_train_step(self, state, batch):
        return self._lower(self._train_step, state, batch)

    def _lower(self, fn, *args):
        # On several processes pmap converts each argument, as a process's own rows, to
        # a global array, which it cannot do for shapes (`jax.ShapeDtypeStruct`); abstract
        # values it takes as global already, as these are.
        if jax.process_count() > 1:
            args = jax.tree.map(lambda x: jax.core.ShapedArray(x.shape, x.dtype)
                                if isinstance(x, jax.ShapeDtypeStruct) else x, args)
        return fn.lower(*args)

    def _metric_shapes(self, state, batch):
        # One device's step under its axis names, by vmap over an axis of 1: jax.eval_shape
        # of the pmapped step does not take global arrays of several processes.
        def one_device(x):
            return jax.ShapeDtypeStruct((1, *x.shape[1:]), x.dtype)

        metrics = jax.eval_shape(
            jax.vmap(_with_hosts_axis(self._device_step), axis_name=LOCAL_AXIS),
            jax.tree.map(one_device, state), jax.tree.map(one_device, batch))[1]
        return jax.tree.map(
            lambda m: jax.ShapeDtypeStruct((self.mesh.size, *m.shape[1:]), m.dtype), metrics)

    def _window_fn_for(self, state):
        return self._window_step

    def _window_layout(self):
        return self._stacked, (self.mesh.size,)

    def fetch(self, tree):
        # Every replica holds the same (reduced) value: read the first.
        return jax.tree.map(lambda x: np.asarray(x.addressable_shards[0].data[0]), tree)


def _with_hosts_axis(fn: Callable) -> Callable:
    """`fn` with the `hosts` axis bound, as a vmapped axis of size 1, inside pmap's one
    axis (`local`, over every device): collectives over jdp.DATA_AXIS then span every
    device, and axis_index(DATA_AXIS) is the device's position, as under pjit.

    No argument is mapped (`in_axes=None`): only what depends on the axis index (a
    per-device random key, say) carries the vmapped dimension. Mapping the arguments
    made every op of the step a batched op over a dimension of 1, which XLA:CPU runs
    about 14% slower (ViT-nano, one device)."""

    def with_hosts(*args):
        out = jax.vmap(fn, in_axes=None, axis_name=HOSTS_AXIS, axis_size=1)(*args)
        return jax.tree.map(lambda x: x[0], out)

    return with_hosts


def _free_after(copy: jax.Array, source: jax.Array, free: bool) -> jax.Array:
    """`copy`, having deleted `source` when `free`: a tree converted leaf by leaf then
    holds at most one leaf twice. The runtime keeps the source's buffers alive until the
    pending copy has read them."""
    if free:
        source.delete()
    return copy


_BACKENDS = {backend.name: backend for backend in (PjitBackend, PmapBackend)}


def make_backend(name: str, mesh: Mesh, model: Model, task: Task,
                 tx: optax.GradientTransformation, options: StepOptions) -> Backend:
    """The backend `name` (config.parallel.backend: its choices are these names)."""
    return _BACKENDS[name](mesh, model, task, tx, options)
