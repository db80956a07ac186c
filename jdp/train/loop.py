"""The trainer: `train_and_evaluate(config, workdir, experiment, components, split)`.

One long function in titled sections (mesh, data, model and state, compile,
loop, final evaluation); the helpers around it are small. The loop body is:
next batch, step, then the hooks that are due (`jdp.train.actions` for jdp's
own: logging, evaluation, checkpoints, preemption, profiling; then the
experiment's `build_hooks`). It never waits for the device except where it
must: metrics are read one step late, batches are prefetched onto the devices.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import time

import jax
from absl import logging

from jdp.checkpoint import CHECKPOINT_DIR, Checkpointer, WallTimeCadence
from jdp.checkpoint.resume import initial_state
from jdp.config import BatchSplit
from jdp.data import prefetch, splits
from jdp.experiment import adapters, optim
from jdp.experiment.components import Components
from jdp.experiment.loader import Experiment
from jdp.observe import console, goodput, throughput
from jdp.observe.profiling import StepProfiler
from jdp.observe.writers import JsonlWriter, MultiWriter, RecentWrites, TensorBoardWriter, Writer
from jdp.parallel import mesh as mesh_lib
from jdp.parallel.factory import build_backend
from jdp.parallel.state import TrainState
from jdp.parallel.step import LOSS_WEIGHT, NONFINITE
from jdp.runtime import storage
from jdp.runtime.preemption import PreemptionNotice
from jdp.runtime.watchdog import Watchdog
from jdp.train import actions
from jdp.train.evaluate import evaluate
from jdp.train.hooks import Hook, HookError, HookInfo, Hooks, check_hooks
from jdp.train.nonfinite import NonFiniteGuard
from jdp.train.window import MetricWindow, window_means


@dataclasses.dataclass
class TrainResult:
    eval_metrics: dict[str, float]  # the final evaluation
    state: TrainState  # the final state, as global arrays whichever backend trained


def user_hooks(experiment: Experiment, config) -> list[Hook]:
    """The experiment's `build_hooks(config)`, checked (before anything is written)."""
    if experiment.build_hooks is None:
        return []
    return check_hooks(experiment.build_hooks(config), experiment.function_name("build_hooks"))


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


def _model_flops_per_example(experiment: Experiment, config,
                             components: Components) -> float | None:
    """The experiment's own count (`flops_per_example`), else 3 x XLA's count of one
    example's forward pass (forward + backward; remat recomputation is not counted)."""
    if experiment.flops_per_example is not None:
        return float(experiment.flops_per_example(config))
    forward = adapters.forward_flops(components.model, components.sample_inputs())
    return None if forward is None else 3 * forward


def _writers(config, workdir: str, is_writer: bool, start_step: int) -> Writer:
    """metrics.jsonl and (unless turned off) TensorBoard event files; process 0 only."""
    writers = [JsonlWriter(os.path.join(workdir, "metrics.jsonl"), enabled=is_writer,
                           resume_step=start_step)]
    if is_writer and config.tensorboard:
        writers.append(TensorBoardWriter(os.path.join(workdir, "tensorboard")))
    return MultiWriter(writers)


class _TrainReport:
    """A log step's figures: the window's means (read one step late) and its times, speed
    and memory; figures reported once (compile time) go with the first."""

    def __init__(self, *, clock: throughput.WindowClock, guard: NonFiniteGuard, writer: Writer,
                 total_steps: int, device, model_flops_per_step: float | None,
                 weight_unit: str, device_count: int, log_every_steps: int,
                 ledger: goodput.Ledger):
        self.clock = clock
        self.guard = guard
        self.writer = writer
        self.total_steps = total_steps
        self.device = device  # memory_stats() is only for this process's devices
        self.peak_flops = throughput.peak_flops_per_s(device.device_kind)
        self.model_flops_per_step = model_flops_per_step
        self.weight_unit = weight_unit  # what the loss weights count (Task.weight_unit)
        self.device_count = device_count
        self.log_every_steps = log_every_steps
        self.ledger = ledger  # the job's goodput so far, reported with every window
        self.flops_per_step = self.compiled_bytes = None  # known once compiled
        self.once: dict[str, float] = {}
        self.latest: tuple[int, dict] | None = None  # (window's step, values) last reported
        self.count = 0  # windows reported so far

    def __call__(self, step: int, sums: dict, steps: int) -> None:
        self.guard.check(sums, step)
        means = window_means(sums, steps)
        del means[NONFINITE]  # counted in train/skipped_steps instead
        values = {f"train/{k}": v for k, v in means.items()}
        values["train/skipped_steps"] = float(self.guard.skipped)
        if steps != self.log_every_steps:  # cut short: by a stop, a resume or the end
            values["train/window_steps"] = float(steps)
        values.update(self.clock.lap(step))
        if self.weight_unit != "examples":  # e.g. real target tokens, never padding
            per_s = means[LOSS_WEIGHT] / values["train/step_time_s"]
            values[f"train/{self.weight_unit}_per_s"] = per_s
            values[f"train/{self.weight_unit}_per_s_per_device"] = per_s / self.device_count
        values.update(throughput.flops_metrics(self.flops_per_step, self.model_flops_per_step,
                                               values["train/step_time_s"], self.peak_flops))
        values.update(throughput.memory_metrics(self.device, self.compiled_bytes))
        values.update(self.ledger.metrics())
        values.update(self.once)
        self.once.clear()
        console.log_train(step, self.total_steps, values, throughput.eta_s(
            step, self.total_steps, values["train/step_time_s"]))
        self.writer.write(step, values)
        self.latest = (step, values)
        self.count += 1


def train_and_evaluate(config, workdir: str, experiment: Experiment, components: Components,
                       split: BatchSplit, devices=None,
                       hooks: list[Hook] | None = None) -> TrainResult:
    """Trains the experiment's `components` as configured on `devices` (default: all
    devices of all processes), running the experiment's `hooks` after their steps."""
    is_writer = jax.process_index() == 0

    # -- 1. Mesh and the batch layout ------------------------------------------
    mesh = mesh_lib.make_mesh(config.parallel.mesh, devices, config.parallel.hosts,
                              config.parallel.model_parallel)
    rows = mesh_lib.process_rows(mesh, split.global_batch_size)
    eval_batch_size = config.eval_batch_size or split.global_batch_size
    eval_rows = mesh_lib.process_rows(mesh, eval_batch_size)
    logging.info("mesh %s over %d devices in %d processes; global batch %d = %d per process "
                 "= %d per data-parallel device (%d) x %d accumulation steps of %d",
                 dict(mesh.shape), mesh.size, jax.process_count(), split.global_batch_size,
                 rows.stop - rows.start, split.per_device_batch_size,
                 split.data_parallel_size, split.grad_accum_steps, split.micro_batch_size)

    # -- 2. Data: this process's rows of each global batch -----------------------
    # A split that fits in memory is read once and batched by vectorised numpy; the
    # others stream through grain. Both give bitwise the same batches.
    workers = dict(num_threads=config.data.num_threads, num_workers=config.data.num_workers)
    train_split = splits.open_train(components.data, seed=config.seed,
                                    setting=config.data.in_memory, **workers)
    eval_split = splits.open_eval(components.data, setting=config.data.in_memory, **workers)

    # -- 3. Model, optimizer, backend and the initial state ----------------------
    learning_rate = optim.learning_rate_fn(config)
    backend = build_backend(config, mesh, components,
                            experiment.build_optimizer(config, learning_rate))
    checkpointer = Checkpointer(
        storage.join(workdir, CHECKPOINT_DIR),  # the Checkpointer makes a local path absolute
        every_steps=config.checkpoint.every_steps, max_to_keep=config.checkpoint.max_to_keep,
        wall_time=WallTimeCadence(config.checkpoint.every_minutes, config.log_every_steps),
        async_save=config.checkpoint["async"], best_metric=config.checkpoint.keep_best or None,
        best_mode=config.checkpoint.keep_best_mode)
    state = initial_state(backend, checkpointer, jax.random.key(config.seed),
                          components.sample_inputs(), config.checkpoint.init_from)
    start_step = int(jax.device_get(state.step))
    num_params = sum(x.size for x in jax.tree.leaves(state.params))
    logging.info("model has %s parameters; peak learning rate %.3g (lr_scaling=%s)",
                 f"{num_params:,}", optim.peak_learning_rate(config), config.lr_scaling)
    live = actions.LiveState(backend.from_global(state, consume=True))
    del state

    # -- 4. Input stream from the current step, writers, the watchdog, the hooks ---
    total_steps = config.total_steps
    batches = prefetch.Prefetcher(
        train_split.batches(global_batch_size=split.global_batch_size, rows=rows,
                            start_step=start_step, num_steps=total_steps - start_step),
        backend.put_batch)
    recent = RecentWrites()  # a step's records, for its hooks (HookInfo.written)
    writer = MultiWriter([_writers(config, workdir, is_writer, start_step), recent])
    clock = throughput.WindowClock(split.global_batch_size, mesh.size)
    ledger = goodput.Ledger(workdir, enabled=is_writer, start_step=start_step,
                            phases=clock.totals)
    watchdog = Watchdog(config.watchdog_timeout_s) if config.watchdog_timeout_s else None
    heartbeat = watchdog.heartbeat if watchdog else (lambda step: None)
    busy = watchdog.busy if watchdog else (lambda step: contextlib.nullcontext())
    profiler = StepProfiler(config.profile.start_step, config.profile.num_steps,
                            os.path.join(workdir, "profile", f"process_{jax.process_index()}"))
    guard = NonFiniteGuard(config.skip_nonfinite_steps, config.crash_on_nan,
                           checkpointer.latest_step)
    model_flops_per_step = _model_flops_per_example(experiment, config, components)
    if model_flops_per_step is not None:
        model_flops_per_step *= split.global_batch_size / mesh.size  # per device
    report = _TrainReport(clock=clock, guard=guard, writer=writer, total_steps=total_steps,
                          device=mesh.local_devices[0],
                          model_flops_per_step=model_flops_per_step,
                          weight_unit=components.task.weight_unit, device_count=mesh.size,
                          log_every_steps=config.log_every_steps, ledger=ledger)
    window = MetricWindow(backend.fetch, report)

    def run_eval(step, state) -> dict:
        with clock.timed("eval"):
            result = evaluate(backend, state, eval_split, global_batch_size=eval_batch_size,
                              rows=eval_rows, heartbeat=lambda: heartbeat(step))
        console.log_eval(step, result)
        writer.write(step, result)
        return result

    def save_global(step, eval_metrics) -> None:
        with busy(step):
            live.state = backend.with_global(live.state, functools.partial(
                checkpointer.save, step, metrics=eval_metrics, force=True))

    last_outputs = [None]  # the last dispatched step's metrics
    evaluation = actions.Evaluation(run_eval, window, live)
    checkpointing = actions.Checkpointing(checkpointer, save_global, window, guard,
                                          total_steps, lambda: clock.timed("checkpoint"))
    notice = PreemptionNotice()
    own = [Hook(actions.Profiling(profiler, lambda: last_outputs[0]), every=1, name="profile"),
           actions.log_hook(window, config.log_every_steps),
           Hook(evaluation, every=config.eval_every_steps, at_end=True, name="eval"),
           Hook(checkpointing, every=1, name="checkpoint"),
           Hook(actions.Preemption(notice, checkpointing, window), every=1, name="preemption")]
    hook_list = Hooks([*own, *(hooks or [])], total_steps, users_from=len(own))

    def info_for(step: int, reports_before: int) -> HookInfo:
        def new_metrics() -> dict | None:  # a window's means are new at one step only
            window.flush()
            return report.latest[1] if report.count > reports_before else None

        return HookInfo(step=step, workdir=workdir, is_writer=is_writer, total_steps=total_steps,
                        state_fn=lambda: backend.to_global(live.state),
                        metrics_fn=new_metrics, write_fn=writer.write,
                        write_text_fn=writer.write_text,
                        written_fn=lambda: list(recent.records))

    # -- 5. Compile ahead of time, then the loop ---------------------------------
    try:
        if start_step < total_steps:
            with clock.timed("data_wait"):
                first_batch = next(batches)
            t0 = time.monotonic()
            compiled, window_sums, window_flags = backend.compiled_window_step(
                live.state, first_batch)
            window.begin(window_sums, window_flags)
            del window_sums
            # The eval step too: compiling it at the first evaluation would stall the
            # loop (and the watchdog's heartbeats) for as long.
            backend.compile_eval_step(live.state, backend.put_batch(
                splits.eval_sample_batch(components.sample, eval_rows)))
            report.once["time/compile_s"] = compile_s = time.monotonic() - t0
            logging.info("compiled the train and eval steps in %.1f s", compile_s)
            report.compiled_bytes = _log_compiled(compiled)
            report.flops_per_step = (compiled.cost_analysis() or {}).get("flops")
            clock.start(start_step)
            profiler.before(start_step)
            if watchdog:
                watchdog.start()
        for step in range(start_step, total_steps):
            if step > start_step:
                with clock.timed("data_wait"):
                    batch = next(batches)
            else:
                batch = first_batch
            with profiler.annotate(step):
                live.state, metrics = compiled(live.state, batch, *window.inputs())
            window.stepped(metrics)  # the window's running sums, this step's included
            done = step + 1
            # At most one step in flight behind this one: the device always has the next
            # step queued, and the host never races so far ahead that a dispatch blocks
            # inside the runtime (holding the GIL, which would silence the watchdog).
            if last_outputs[0] is not None:
                jax.block_until_ready(last_outputs[0])
            last_outputs[0] = metrics
            heartbeat(done)
            ledger.step(done)
            reports_before = report.count
            window.flush()  # the previous log step's report, one step late
            hook_list.run(done, info_for(done, reports_before))
            recent.clear()
        window.flush()
    except HookError:
        window.flush()  # the report of the last log window is not lost
        raise
    finally:
        profiler.close()
        batches.close()
        notice.close()
        if watchdog:
            watchdog.stop()  # waiting for the last save may take longer than a step
        with clock.timed("checkpoint"):
            checkpointer.wait()
        checkpointer.close()
        writer.close()
        ledger.flush()
    final_eval = evaluation.last
    if not final_eval:  # resumed at the end: evaluate what was restored
        final_eval = run_eval(total_steps, live.state)
    ledger.finished(total_steps)
    return TrainResult(final_eval, backend.to_global(live.state, consume=True))
