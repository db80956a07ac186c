"""The trainer: `train_and_evaluate(config, workdir, experiment)`.

One long function in titled sections (mesh, data, model and state, compile,
loop, final evaluation); the helpers around it are small. The loop never
waits for the device except where it must: metrics are read one step late,
batches are prefetched onto the devices.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import time

import jax
import jax.numpy as jnp
from absl import logging

from jdp import HOSTS_AXIS, LOCAL_AXIS, distributed, modeling, optim, profiling
from jdp import mesh as mesh_lib
from jdp import metrics as metrics_lib
from jdp.checkpoint import Checkpointer, DamagedCheckpointError, load_params
from jdp.config import BatchPlan
from jdp.data import in_memory, pipeline
from jdp.experiment import Experiment, Parts
from jdp.parallel import Backend, Reduction, StepOptions, TrainState, compiler_options, make_backend
from jdp.parallel import step as step_lib
from jdp.watchdog import Watchdog


def _should(step: int, every: int, total: int) -> bool:
    """Periodic events happen every `every` steps (0 = never) and always at the end."""
    return step == total or (every > 0 and step % every == 0)


def evaluate(backend: Backend, state, split, *, global_batch_size: int, rows: slice,
             num_threads: int, num_workers: int = 0, heartbeat=lambda: None) -> dict[str, float]:
    """The task's loss and every metric over the whole `split` (`in_memory.open_eval`),
    each example exactly once (padding masked out): `eval/<name>` = sum(value * weight) /
    sum(weight)."""
    totals = None
    batches = split.batches(global_batch_size=global_batch_size, rows=rows,
                            num_threads=num_threads, num_workers=num_workers)
    with contextlib.closing(batches):  # its workers stop also when the loop is left early
        for local_batch in batches:
            heartbeat()
            sums = backend.eval_step(state, backend.put_batch(local_batch))
            totals = sums if totals is None else jax.tree.map(lambda a, b: a + b, totals, sums)
    sums, count = backend.fetch(totals)
    result = {f"eval/{name}": float(total) / float(weight) if weight else 0.0
              for name, (total, weight) in sums.items()}
    return {**result, "eval/num_examples": float(count)}


def _log_compiled(compiled) -> int | None:
    """Logs the compiled step's per-device memory; returns its total bytes (None if unknown)."""
    memory = compiled.memory_analysis()
    if memory is None:
        return None
    logging.info("compiled train step, per device: arguments %.1f MiB, outputs %.1f MiB, "
                 "temporaries %.1f MiB", memory.argument_size_in_bytes / 2**20,
                 memory.output_size_in_bytes / 2**20, memory.temp_size_in_bytes / 2**20)
    return (memory.argument_size_in_bytes + memory.output_size_in_bytes
            + memory.temp_size_in_bytes - memory.alias_size_in_bytes)


def _model_flops_per_example(experiment: Experiment, config, parts: Parts) -> float | None:
    """The experiment's own count (`flops_per_example`), else 3 x XLA's count of one
    example's forward pass (forward + backward; remat recomputation is not counted)."""
    if experiment.flops_per_example is not None:
        return float(experiment.flops_per_example(config))
    forward = modeling.forward_flops(parts.model, parts.sample_inputs())
    return None if forward is None else 3 * forward


def _writers(config, workdir: str, is_writer: bool, start_step: int) -> metrics_lib.Writer:
    """metrics.jsonl and (unless turned off) TensorBoard event files; process 0 only."""
    writers = [metrics_lib.JsonlWriter(os.path.join(workdir, "metrics.jsonl"),
                                       enabled=is_writer, resume_step=start_step)]
    if is_writer and config.tensorboard:
        writers.append(metrics_lib.TensorBoardWriter(os.path.join(workdir, "tensorboard")))
    return metrics_lib.MultiWriter(writers)


class NonFiniteError(Exception):
    """The loss or gradients went non-finite more often than allowed; nothing was saved
    past the last good checkpoint. The job exits with status 3."""


class _NonFiniteGuard:
    """Counts the updates the step skipped as non-finite and stops the run when the
    config allows no more (`skip_nonfinite_steps`; `crash_on_nan=False`: never stop)."""

    def __init__(self, config, checkpointer: Checkpointer):
        self.allowed = config.skip_nonfinite_steps
        self.crash = config.crash_on_nan
        self.checkpointer = checkpointer
        self.skipped = 0

    def check(self, sums: dict, step: int, count: bool = True) -> None:
        new = int(round(float(sums[step_lib.NONFINITE])))
        if new == 0:
            return
        first = int(sums[metrics_lib.FIRST_NONFINITE_STEP])
        if self.crash and self.skipped + new > self.allowed:
            latest = self.checkpointer.latest_step()
            kept = f"step {latest}" if latest is not None else "none yet"
            raise NonFiniteError(
                f"the loss or gradients were not finite at step {first} ({self.skipped + new} "
                f"non-finite step(s) by step {step}, config.skip_nonfinite_steps="
                f"{self.allowed}); nothing non-finite was saved (newest checkpoint: {kept}). "
                "Fix: lower --config.learning_rate, set --config.grad_clip_norm=1.0, compute "
                "in float32, or let --config.skip_nonfinite_steps=N skip a few bad batches.")
        if count:
            self.skipped += new
            logging.warning("skipped %d non-finite update(s), the first at step %d (%d so far)",
                            new, first, self.skipped)


CHECKPOINT_DIR = "checkpoints"  # inside the workdir


class Preempted(Exception):
    """Raised out of the loop once a preemption checkpoint is saved; the job exits 76
    (`exit_codes.PREEMPTED`), which launchers take as "resume me"."""

    def __init__(self, step: int):
        super().__init__(f"preempted: saved a checkpoint at step {step}; rerun to resume")
        self.step = step


@dataclasses.dataclass
class TrainResult:
    eval_metrics: dict[str, float]  # the final evaluation
    state: TrainState  # the final state, as global arrays whichever backend trained


def _initial_state(backend: Backend, checkpointer: Checkpointer, rng, sample_inputs,
                   init_from: str):
    """The order matters: 1. resume this run's newest complete checkpoint, 2. else
    start fresh, with params from `init_from` when fine-tuning."""
    steps = checkpointer.steps()
    abstract = backend.abstract_state(rng, sample_inputs) if steps else None

    def fresh_comm():  # the reduction's error-feedback residuals, on another topology
        return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype, device=a.sharding),
                            abstract.comm)

    for step in steps:
        try:
            state = checkpointer.restore(step, abstract, fresh={"comm": fresh_comm})
        except DamagedCheckpointError as error:
            # Left where it is: the damage may be transient (storage), or worth a look.
            logging.warning("skipping checkpoint step %d, which cannot be read; falling back "
                            "to an older one. %s", step, error)
            continue
        # Processes that disagree on the step would train on different states.
        distributed.check_same_across_processes({"resumed_step": str(step)})
        logging.info("resuming from %s/%d", checkpointer.directory, step)
        return state
    if steps:
        raise DamagedCheckpointError(
            f"none of the checkpoints in {checkpointer.directory} (steps {steps}) can be read; "
            "see the warnings above. Fix: restore them from a backup, or start a new --workdir.")
    state = backend.init_global(rng, sample_inputs)
    if init_from:
        # A run's workdir stands for its newest checkpoint.
        if os.path.isdir(os.path.join(init_from, CHECKPOINT_DIR)):
            init_from = os.path.join(init_from, CHECKPOINT_DIR)
        logging.info("initialising params from %s", init_from)
        state = state.replace(params=load_params(init_from, backend.abstract_state(
            rng, sample_inputs).params))
    return state


def build_backend(config, mesh, parts: Parts, tx) -> Backend:
    """The configured parallel backend for the experiment's `parts` (model, task and the
    data's device preprocessing) and optimizer `tx` over `mesh`."""
    return make_backend(config.parallel.backend, mesh, parts.model, parts.task, tx, StepOptions(
        accum_steps=config.grad_accum_steps,
        reduce_dtype=config.parallel.grad_reduce_dtype,
        shard_optimizer_state=config.parallel.shard_optimizer_state,
        shard_params=config.parallel.shard_params,
        compiler_options=compiler_options(mesh.devices.flat[0].platform, config.remat,
                                          config.parallel.shard_params),
        learning_rate_fn=optim.learning_rate_fn(config),
        device_preprocess=parts.data.device_preprocess,
        reduction=Reduction(
            kind=config.parallel.reduction, cross_host=config.parallel.cross_host_reduce,
            error_feedback=config.parallel.error_feedback, hosts=mesh.shape[HOSTS_AXIS],
            local=mesh.shape[LOCAL_AXIS]),
    ))


def train_and_evaluate(config, workdir: str, experiment: Experiment, parts: Parts,
                       plan: BatchPlan, devices=None) -> TrainResult:
    """Trains the experiment's `parts` as configured on `devices` (default: all devices of
    all processes)."""
    is_writer = jax.process_index() == 0

    # -- 1. Mesh and the batch layout ------------------------------------------
    mesh = mesh_lib.make_mesh(config.parallel.mesh, devices, config.parallel.hosts)
    rows = mesh_lib.process_rows(mesh, plan.global_batch_size)
    eval_batch_size = config.eval_batch_size or plan.global_batch_size
    eval_rows = mesh_lib.process_rows(mesh, eval_batch_size)
    logging.info("mesh %s over %d devices in %d processes; global batch %d = %d per process "
                 "= %d per device x %d accumulation steps", dict(mesh.shape), mesh.size,
                 jax.process_count(), plan.global_batch_size, plan.per_process_batch_size,
                 plan.micro_batch_size, plan.grad_accum_steps)

    # -- 2. Data: this process's rows of each global batch -----------------------
    # A split that fits in memory is read once and batched by vectorised numpy; the
    # others stream through grain. Both give bitwise the same batches.
    train_split = in_memory.open_train(parts.data, seed=config.seed,
                                       setting=config.data.in_memory)
    eval_split = in_memory.open_eval(parts.data, setting=config.data.in_memory)

    # -- 3. Model, optimizer, backend and the initial state ----------------------
    learning_rate = optim.learning_rate_fn(config)
    backend = build_backend(config, mesh, parts, experiment.build_optimizer(config, learning_rate))
    checkpointer = Checkpointer(
        os.path.join(os.path.abspath(workdir), CHECKPOINT_DIR),
        every_steps=config.checkpoint.every_steps, max_to_keep=config.checkpoint.max_to_keep,
        async_save=config.checkpoint["async"], best_metric=config.checkpoint.keep_best or None,
        best_mode=config.checkpoint.keep_best_mode)
    state = _initial_state(backend, checkpointer, jax.random.key(config.seed),
                           parts.sample_inputs(), config.checkpoint.init_from)
    start_step = int(jax.device_get(state.step))
    num_params = sum(x.size for x in jax.tree.leaves(state.params))
    logging.info("model has %s parameters; peak learning rate %.3g (lr_scaling=%s)",
                 f"{num_params:,}", optim.peak_learning_rate(config), config.lr_scaling)
    state = backend.from_global(state, consume=True)

    # -- 4. Input stream from the current step, writers and the watchdog ---------
    total_steps = config.total_steps
    batches = pipeline.Prefetcher(
        train_split.batches(global_batch_size=plan.global_batch_size, rows=rows,
                            start_step=start_step, num_steps=total_steps - start_step,
                            num_threads=config.data.num_threads,
                            num_workers=config.data.num_workers),
        backend.put_batch)
    writer = _writers(config, workdir, is_writer, start_step)
    clock = metrics_lib.WindowClock(plan.global_batch_size, mesh.size)
    watchdog = Watchdog(config.watchdog_timeout_s) if config.watchdog_timeout_s else None
    heartbeat = watchdog.heartbeat if watchdog else (lambda step: None)
    busy = watchdog.busy if watchdog else (lambda step: contextlib.nullcontext())
    profiler = profiling.StepProfiler(config.profile.start_step, config.profile.num_steps,
                                      os.path.join(workdir, "profile",
                                                   f"process_{jax.process_index()}"))
    nonfinite = _NonFiniteGuard(config, checkpointer)
    device = mesh.local_devices[0]  # memory_stats() is only for this process's devices
    peak_flops = metrics_lib.peak_flops_per_s(device.device_kind)
    model_flops_per_step = _model_flops_per_example(experiment, config, parts)
    if model_flops_per_step is not None:
        model_flops_per_step *= plan.global_batch_size / mesh.size  # per device

    def run_eval(step, state) -> dict:
        with clock.timed("eval"):
            result = evaluate(backend, state, eval_split,
                              global_batch_size=eval_batch_size, rows=eval_rows,
                              num_threads=config.data.num_threads,
                              num_workers=config.data.num_workers,
                              heartbeat=lambda: heartbeat(step))
        metrics_lib.log_eval(step, result)
        writer.write(step, result)
        return result

    first_log = {}  # figures reported once, with the first log step

    def report(step, steps, window) -> None:
        """A log step's figures: the window's means (read one step late) and its times."""
        sums = backend.fetch(window)
        nonfinite.check(sums, step)
        means = metrics_lib.window_means(sums, steps)
        del means[step_lib.NONFINITE]  # counted in train/skipped_steps instead
        values = {f"train/{k}": v for k, v in means.items()}
        values["train/skipped_steps"] = float(nonfinite.skipped)
        values.update(clock.lap(step))
        values.update(metrics_lib.compute_metrics(flops_per_step, model_flops_per_step,
                                                  values["train/step_time_s"], peak_flops))
        values.update(metrics_lib.memory_metrics(device, compiled_bytes))
        values.update(first_log)
        first_log.clear()
        metrics_lib.log_train(step, total_steps, values,
                              metrics_lib.eta_s(step, total_steps, values["train/step_time_s"]))
        writer.write(step, values)

    # -- 5. Compile ahead of time, then the loop ---------------------------------
    final_eval: dict = {}
    window = None  # device sums of the per-step metrics since the last log step
    window_steps = 0
    pending = None  # (step, steps, window) of a log step, read after the next dispatch
    previous_metrics = None  # the step before the one just dispatched
    flops_per_step = compiled_bytes = None
    try:
        if start_step < total_steps:
            with clock.timed("data_wait"):
                first_batch = next(batches)
            t0 = time.monotonic()
            compiled = backend.compiled_train_step(state, first_batch)
            # The eval step too: compiling it at the first evaluation would stall the
            # loop (and the watchdog's heartbeats) for as long.
            backend.compile_eval_step(state, backend.put_batch(
                pipeline.eval_sample_batch(parts.sample, eval_rows)))
            first_log["time/compile_s"] = compile_s = time.monotonic() - t0
            logging.info("compiled the train and eval steps in %.1f s", compile_s)
            compiled_bytes = _log_compiled(compiled)
            flops_per_step = (compiled.cost_analysis() or {}).get("flops")
            clock.start(start_step)
            if watchdog:
                watchdog.start()
        for step in range(start_step, total_steps):
            if step > start_step:
                with clock.timed("data_wait"):
                    batch = next(batches)
            else:
                batch = first_batch
            profiler.before(step)
            with profiler.annotate(step):
                state, metrics = compiled(state, batch)
            window = metrics if window is None else metrics_lib.add_to_window(window, metrics)
            window_steps += 1
            done = step + 1
            # At most one step in flight behind this one: the device always has the next
            # step queued, and the host never races so far ahead that a dispatch blocks
            # inside the runtime (holding the GIL, which would silence the watchdog).
            if previous_metrics is not None:
                jax.block_until_ready(previous_metrics)
            previous_metrics = metrics
            heartbeat(done)
            profiler.after(done, metrics)
            if pending is not None:
                report(*pending)
                pending = None
            if _should(done, config.log_every_steps, total_steps):
                pending, window, window_steps = (done, window_steps, window), None, 0
            eval_metrics = None
            if _should(done, config.eval_every_steps, total_steps):
                if pending is not None:
                    report(*pending)
                    pending = None
                eval_metrics = final_eval = run_eval(done, state)
            preempted = checkpointer.reached_preemption(done)
            if preempted or _should(done, config.checkpoint.every_steps, total_steps):
                # Never save past a step that was not finite: check every step since the
                # last check (the save waits for the device anyway).
                if pending is not None:
                    report(*pending)
                    pending = None
                if window is not None:
                    nonfinite.check(backend.fetch(window), done, count=False)
                with clock.timed("checkpoint"), busy(done):
                    state = backend.with_global(state, functools.partial(
                        checkpointer.save, done, metrics=eval_metrics, force=True))
            if preempted:
                raise Preempted(done)
        if pending is not None:
            report(*pending)
    finally:
        profiler.close()
        batches.close()
        if watchdog:
            watchdog.stop()  # waiting for the last save may take longer than a step
        checkpointer.wait()
        checkpointer.close()
        writer.close()
    if not final_eval:  # resumed at the end: evaluate what was restored
        final_eval = run_eval(total_steps, state)
    return TrainResult(final_eval, backend.to_global(state, consume=True))
