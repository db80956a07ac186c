"""The trainer: `train_and_evaluate(config, workdir, experiment)`.

One long function in titled sections (mesh, data, model and state, compile,
loop, final evaluation); the helpers around it are small. The loop never
waits for the device except where it must: metrics are read one step late,
batches are prefetched onto the devices.
"""

from __future__ import annotations

import dataclasses
import os
import time

import jax
import numpy as np
from absl import logging

from jdp import mesh as mesh_lib
from jdp import metrics as metrics_lib
from jdp import modeling, optim
from jdp import task as task_lib
from jdp.checkpoint import Checkpointer, load_params
from jdp.config import BatchPlan
from jdp.data import pipeline
from jdp.experiment import Experiment, Parts
from jdp.parallel import Backend, StepOptions, TrainState, compiler_options, make_backend
from jdp.watchdog import Watchdog


def _should(step: int, every: int, total: int) -> bool:
    """Periodic events happen every `every` steps (0 = never) and always at the end."""
    return step == total or (every > 0 and step % every == 0)


def evaluate(backend: Backend, state, source, preprocess, *, global_batch_size: int,
             rows: slice, num_threads: int, heartbeat=lambda: None) -> dict[str, float]:
    """The task's loss and every metric over the whole split, each example exactly once
    (padding masked out): `eval/<name>` = sum(value * weight) / sum(weight)."""
    totals = None
    batches = pipeline.eval_batches(source, preprocess, global_batch_size=global_batch_size,
                                    rows=rows, num_threads=num_threads)
    for local_batch in batches:
        heartbeat()
        sums = backend.eval_step(state, backend.put_batch(local_batch))
        totals = sums if totals is None else jax.tree.map(lambda a, b: a + b, totals, sums)
    sums, count = backend.fetch(totals)
    result = {f"eval/{name}": float(total) / float(weight) if weight else 0.0
              for name, (total, weight) in sums.items()}
    return {**result, "eval/num_examples": float(count)}


def _log_compiled(compiled) -> None:
    memory = compiled.memory_analysis()
    if memory is not None:
        logging.info("compiled train step, per device: arguments %.1f MiB, outputs %.1f MiB, "
                     "temporaries %.1f MiB", memory.argument_size_in_bytes / 2**20,
                     memory.output_size_in_bytes / 2**20, memory.temp_size_in_bytes / 2**20)


CHECKPOINT_DIR = "checkpoints"  # inside the workdir


class Preempted(Exception):
    """Raised out of the loop once a preemption checkpoint is saved; the job exits 0."""

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
    latest = checkpointer.latest_step()
    if latest is not None:
        logging.info("resuming from %s/%d", checkpointer.directory, latest)
        return checkpointer.restore(latest, backend.abstract_state(rng, sample_inputs))
    state = backend.init_global(rng, sample_inputs)
    if init_from:
        # A run's workdir stands for its newest checkpoint.
        if os.path.isdir(os.path.join(init_from, CHECKPOINT_DIR)):
            init_from = os.path.join(init_from, CHECKPOINT_DIR)
        logging.info("initialising params from %s", init_from)
        state = state.replace(params=load_params(init_from, backend.abstract_state(
            rng, sample_inputs).params))
    return state


def build_backend(config, mesh, model: modeling.Model, task: task_lib.Task, tx) -> Backend:
    """The configured parallel backend for `model`, `task` and optimizer `tx` over `mesh`."""
    return make_backend(config.parallel.backend, mesh, model, task, tx, StepOptions(
        accum_steps=config.grad_accum_steps,
        reduce_dtype=config.parallel.grad_reduce_dtype,
        shard_optimizer_state=config.parallel.shard_optimizer_state,
        shard_params=config.parallel.shard_params,
        compiler_options=compiler_options(mesh.devices.flat[0].platform, config.remat),
    ))


def train_and_evaluate(config, workdir: str, experiment: Experiment, parts: Parts,
                       plan: BatchPlan, devices=None) -> TrainResult:
    """Trains the experiment's `parts` as configured on `devices` (default: all devices of
    all processes)."""
    is_writer = jax.process_index() == 0

    # -- 1. Mesh and the batch layout ------------------------------------------
    mesh = mesh_lib.make_mesh(config.parallel.mesh, devices)
    rows = mesh_lib.process_rows(mesh, plan.global_batch_size)
    eval_batch_size = config.eval_batch_size or plan.global_batch_size
    eval_rows = mesh_lib.process_rows(mesh, eval_batch_size)
    logging.info("mesh %s over %d devices in %d processes; global batch %d = %d per process "
                 "= %d per device x %d accumulation steps", dict(mesh.shape), mesh.size,
                 jax.process_count(), plan.global_batch_size, plan.per_process_batch_size,
                 plan.micro_batch_size, plan.grad_accum_steps)

    # -- 2. Data: this process's rows of each global batch -----------------------
    data = parts.data
    stream = pipeline.example_stream(data.train, data.preprocess_for(train=True), config.seed)

    # -- 3. Model, optimizer, backend and the initial state ----------------------
    learning_rate = optim.learning_rate_fn(config)
    backend = build_backend(config, mesh, parts.model, parts.task,
                            experiment.build_optimizer(config, learning_rate))
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
    state = backend.from_global(state)

    # -- 4. Input stream from the current step, and the compiled step ------------
    total_steps = config.total_steps
    batches = pipeline.Prefetcher(
        pipeline.train_batches(stream, global_batch_size=plan.global_batch_size, rows=rows,
                               start_step=start_step, num_steps=total_steps - start_step,
                               num_threads=config.data.num_threads),
        backend.put_batch)
    writer = metrics_lib.JsonlWriter(os.path.join(workdir, "metrics.jsonl"), enabled=is_writer,
                                     resume_step=start_step)
    timer = metrics_lib.StepTimer(plan.global_batch_size, total_steps)
    watchdog = Watchdog(config.watchdog_timeout_s) if config.watchdog_timeout_s else None
    heartbeat = watchdog.heartbeat if watchdog else (lambda step: None)

    def run_eval(step, state) -> dict:
        result = evaluate(backend, state, data.eval, data.preprocess_for(train=False),
                          global_batch_size=eval_batch_size, rows=eval_rows,
                          num_threads=config.data.num_threads,
                          heartbeat=lambda: heartbeat(step))
        metrics_lib.log_eval(step, result)
        writer.write(step, result)
        return result

    def report(step, metrics) -> None:
        values = {f"train/{k}": float(v) for k, v in backend.fetch(metrics).items()}
        if config.crash_on_nan and not np.isfinite(values["train/loss"]):
            raise FloatingPointError(
                f"train/loss is {values['train/loss']} at step {step}. Fix: lower "
                "--config.learning_rate, set --config.grad_clip_norm, or use float32 compute.")
        values["train/learning_rate"] = float(learning_rate(step - 1))
        values.update(timer.lap(step))
        values.update(metrics_lib.compute_metrics(flops_per_step, values["train/step_time_s"],
                                                  peak_flops))
        metrics_lib.log_train(step, total_steps, values,
                              timer.eta_s(step, values["train/step_time_s"]))
        writer.write(step, values)

    # -- 5. The loop -------------------------------------------------------------
    final_eval: dict = {}
    pending = None  # (step, device metrics) of a log step, read after the next dispatch
    flops_per_step = None  # per device, from XLA's cost analysis of the compiled step
    peak_flops = metrics_lib.peak_flops_per_s(mesh.devices.flat[0].device_kind)
    try:
        if start_step < total_steps:
            first_batch = next(batches)
            t0 = time.monotonic()
            compiled = backend.compiled_train_step(state, first_batch)
            logging.info("compiled the train step in %.1f s", time.monotonic() - t0)
            _log_compiled(compiled)
            flops_per_step = (compiled.cost_analysis() or {}).get("flops")
            timer.start(start_step)
            if watchdog:
                watchdog.start()
        for step in range(start_step, total_steps):
            batch = first_batch if step == start_step else next(batches)
            state, metrics = compiled(state, batch)
            done = step + 1
            heartbeat(done)
            if pending is not None:
                report(*pending)
            pending = (done, metrics) if _should(done, config.log_every_steps, total_steps) \
                else None
            eval_metrics = None
            if _should(done, config.eval_every_steps, total_steps):
                if pending is not None:
                    report(*pending)
                    pending = None
                eval_metrics = final_eval = run_eval(done, state)
            preempted = checkpointer.reached_preemption(done)
            if preempted or _should(done, config.checkpoint.every_steps, total_steps):
                checkpointer.save(done, backend.to_global(state), metrics=eval_metrics,
                                  force=True)
            if preempted:
                if pending is not None:
                    report(*pending)
                raise Preempted(done)
        if pending is not None:
            report(*pending)
    finally:
        batches.close()
        if watchdog:
            watchdog.stop()  # waiting for the last save may take longer than a step
        checkpointer.wait()
        checkpointer.close()
    if not final_eval:  # resumed at the end: evaluate what was restored
        final_eval = run_eval(total_steps, state)
    return TrainResult(final_eval, backend.to_global(state))
