"""Checkpoint mechanics: saving, finding and restoring the train state with Orbax.

Owns the on-disk checkpoints of a run (`<directory>/<step>/default/`): asynchronous,
atomic saves from every process, at its own cadence (`every_steps`, plus the saves the
trainer forces at the end and at preemption); which step to resume from (only complete
ones count); retention (newest N, or best N by a metric plus the newest); restoring onto
any mesh and sharding. It does not decide when to evaluate or stop, and keeps no data
position (that follows from the step).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import itertools
import operator
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping

import jax
import orbax.checkpoint as ocp
from absl import logging
from etils import epath
from orbax.checkpoint.checkpoint_manager import DEFAULT_ITEM_NAME

from jdp.checkpoint import layout, packing
from jdp.checkpoint.layout import CheckpointError, CheckpointSaveError, PyTree
from jdp.errors import ConfigError, first_line
from jdp.runtime import distributed, storage

# Orbax's replica-parallel saving splits every replicated array into one slice per
# replica (to spread the writing over hosts) and dispatches a device slice op for
# each, before an async save may return: 4,752 ops for ViT-S + AdamW on 8 devices,
# 0.72 s of the 0.73 s the loop stalled (a device-to-host copy of all 244 MiB takes
# 9 ms). Arrays below this size are written whole by their first replica instead.
_MIN_REPLICA_SLICE_BYTES = 4 * 2**20


_CADENCES = itertools.count()


class WallTimeCadence:
    """Saves every `minutes` of wall time since the last save (or the first step), decided
    at steps that are multiples of `check_every_steps`: every process must save at the
    same step, so process 0's clock decides for all (`agree`, through the coordination
    service; one exchange per checked step, off the devices' path). `clock` is
    injectable for tests."""

    def __init__(self, minutes: float, check_every_steps: int, *,
                 clock: Callable[[], float] = time.monotonic,
                 agree: Callable[[str, bool], bool] = distributed.leader_decides) -> None:
        if minutes < 0:
            raise ValueError(f"checkpoint every_minutes ({minutes}) must be >= 0 (0: off).")
        self.seconds = 60.0 * minutes
        self.check_every_steps = max(1, check_every_steps)
        self._clock = clock
        self._agree = agree
        # Keys unique to this cadence: a process may train several runs in one job (tuner
        # trials), and every process makes its cadences in the same order.
        self._keys = f"jdp/checkpoint/time/{next(_CADENCES)}"
        self._since: float | None = None  # the clock at the last save or the first check

    def due(self, step: int) -> bool:
        if self.seconds <= 0:
            return False
        if self._since is None:  # starts with the first step, not before the compile
            self._since = self._clock()
        if step % self.check_every_steps:
            return False
        return self._agree(f"{self._keys}/{step}",
                           self._clock() - self._since >= self.seconds)

    def saved(self) -> None:
        self._since = self._clock()


class _TransferWatch:
    """Tells a save's caller when Orbax has copied the save's jax.Arrays to the host.

    Orbax reports each array's device-to-host copy (`on_transfer_end`) before it starts
    the writing and its own bookkeeping (threads, an event loop, futures: about half of
    an async save's time in the caller). Once every array is on the host, the caller may
    go on and donate the state's buffers; the rest of `CheckpointManager.save` finishes
    on the checkpointer's thread. One save is watched at a time (process-wide, like
    Orbax's handler registry)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._one_at_a_time = threading.Lock()
        self._remaining = 0
        self._done: threading.Event | None = None

    @contextlib.contextmanager
    def watching(self, arrays: int, done: threading.Event):
        with self._one_at_a_time:
            with self._lock:
                self._remaining, self._done = arrays, done
                if arrays == 0:
                    done.set()
            try:
                yield
            finally:
                with self._lock:
                    self._remaining, self._done = 0, None

    def key_priority(self, keypath):  # Orbax's default: copied before save returns
        return _SYNCHRONOUS

    def on_transfer_end(self, keypath) -> None:
        with self._lock:
            if self._done is None:
                return
            self._remaining -= 1
            if self._remaining <= 0:
                self._done.set()

    def on_transfer_start(self, keypath) -> None:
        pass

    def on_write_start(self, keypath) -> None:
        pass

    def on_write_end(self, keypath) -> None:
        pass


_TRANSFERS = _TransferWatch()
try:  # Orbax's transfer callbacks (not public); without them a save returns when Orbax's does
    from orbax.checkpoint._src.serialization.types import TransferPriority

    _SYNCHRONOUS = TransferPriority.SYNCHRONOUS
except ImportError:
    _SYNCHRONOUS = None


def _register_array_handler() -> None:
    """Orbax's handler for jax.Array, with replica-parallel saving only for big arrays
    and the transfers reported to `_TRANSFERS` (process-wide: Orbax keeps one registry;
    the on-disk format is unchanged)."""
    try:  # the default handler's metadata store; not public in Orbax
        from orbax.checkpoint._src.metadata import array_metadata_store

        store = array_metadata_store.Store()
    except ImportError:
        store = None
    ocp.type_handlers.register_type_handler(
        jax.Array,
        ocp.type_handlers.ArrayHandler(
            array_metadata_store=store,
            min_slice_bytes_for_replica_parallel=_MIN_REPLICA_SLICE_BYTES,
            **({"callback": _TRANSFERS} if _SYNCHRONOUS is not None else {}),
        ),
        override=True,
    )


def _remove_unfinished_saves(root: epath.Path) -> None:
    """Process 0 removes the leftovers of saves killed midway (a rerun of that step would
    replace its own), and no process lists the steps before it is done.

    Orbax's own clean-up runs on a thread of process 0 while every process checks whether
    the directory exists to decide whether to take part in process 0's broadcast of the
    steps. In a gs:// bucket a directory exists only while it holds an object, so removing
    the one unfinished save it held could land between two processes' checks: one waited
    in the broadcast, the other at the next barrier, until Orbax's barrier timeout.
    """
    if jax.process_index() == 0:
        for leftover in ocp.path.step.all_temporary_paths(root):
            leftover.get().rmtree()
    ocp.multihost.sync_global_processes(
        "jdp:checkpoint:unfinished_saves_removed", processes=set(range(jax.process_count())))


class Checkpointer:
    """Saves and restores the train state of one run; every process makes the same calls.

    Atomicity comes from Orbax: a save is written to `<step>.orbax-checkpoint-tmp` and
    renamed to `<step>` by process 0 once every process has written its shards, so a
    killed job leaves only a tmp directory, which is never listed and which the next
    Checkpointer on the directory removes. In a gs:// bucket, which cannot rename, a step
    counts once process 0 has written its `commit_success.txt` (Orbax's commit file).
    Old checkpoints are deleted only after the newer one is committed (Orbax runs deletion
    after the commit, and skips it if the save failed).
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        every_steps: int,
        max_to_keep: int | None,
        async_save: bool = True,
        best_metric: str | None = None,
        best_mode: str = "max",
        wall_time: WallTimeCadence | None = None,
    ) -> None:
        if every_steps < 0:
            raise ValueError(
                f"checkpoint every_steps ({every_steps}) must be >= 0 (0: only forced saves)."
            )
        if max_to_keep is not None and max_to_keep < 1:
            raise ValueError(
                f"checkpoint max_to_keep ({max_to_keep}) must be >= 1, or None to keep all."
            )
        if best_mode not in ("max", "min"):
            raise ValueError(f"checkpoint best_mode ({best_mode!r}) must be 'max' or 'min'.")
        _register_array_handler()
        self._every_steps = every_steps
        self._wall_time = wall_time
        self._best_metric = best_metric
        best_fn = None if best_metric is None else operator.itemgetter(best_metric)
        root = epath.Path(storage.absolute(directory))
        # Orbax's barriers through jax's distributed client (naming every process makes
        # them so; over one process they are skipped), not its default, a collective on
        # every device: the saves below pass barriers on a thread of their own, and
        # device collectives there would meet the train step's in a different order on
        # each process. Orbax creates the directory only without such a list.
        root.mkdir(parents=True, exist_ok=True)
        _remove_unfinished_saves(root)
        options = ocp.CheckpointManagerOptions(
            preservation_policy=_preservation_policy(max_to_keep, best_fn, best_mode),
            # Orbax writes the metrics next to each step (and reads them back on restart)
            # only when best_fn is set.
            best_fn=best_fn,
            best_mode=best_mode,
            enable_async_checkpointing=async_save,
            # Done above, before any process lists the steps.
            cleanup_tmp_directories=False,
            # Process 0 lists the steps and broadcasts them, so all processes agree.
            single_host_load_and_broadcast=True,
            create=False,
            multiprocessing_options=ocp.options.MultiprocessingOptions(
                active_processes=set(range(jax.process_count()))),
        )
        self._manager = ocp.CheckpointManager(root, options=options)
        # An async save returns once its arrays are on the host; the rest of Orbax's
        # save runs on this thread, the only one that calls the manager while a save
        # starts (every other method first joins it), so every process still passes
        # Orbax's barriers in one order.
        self._worker = (concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="jdp-checkpoint") if async_save else None)
        self._starting: tuple[int, concurrent.futures.Future] | None = None

    def due(self, step: int) -> bool:
        """Whether `step` is one of this checkpointer's periodic saves (by steps, or by
        wall time). Ask once per step: a wall-time decision is taken when asked."""
        by_steps = self._every_steps > 0 and step % self._every_steps == 0
        by_time = self._wall_time is not None and self._wall_time.due(step)
        return by_steps or by_time

    @property
    def directory(self) -> epath.Path:
        return self._manager.directory

    def steps(self) -> list[int]:
        """The complete checkpoints' steps, newest first."""
        self.wait()
        return sorted(self._manager.all_steps(), reverse=True)

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, None if there is none.

        Waits for a save in flight: Orbax lists a step as soon as its save starts.
        """
        self.wait()
        return self._manager.latest_step()

    def save(
        self,
        step: int,
        state: PyTree,
        *,
        metrics: dict[str, float] | None = None,
        force: bool = False,
    ) -> bool:
        """Starts saving `state` if `step` is a multiple of every_steps (> 0) or `force`.

        Returns whether a save started; a step already saved is not saved again. The
        state's device buffers are copied to host before this returns, so the caller may
        donate or overwrite them; the writing and the rest of Orbax's save continue in
        the background, and a failure after the copy is raised by the next call
        (`save`, `wait`, `close`).
        """
        if not (force or self.due(step)):
            return False
        self._join()
        if step in self._manager.all_steps():
            return False
        if self._wall_time is not None:
            self._wall_time.saved()
        if metrics is not None:
            check_best_metric(self._best_metric, metrics)
            metrics = {name: float(value) for name, value in metrics.items()}  # JSON-able
        # force=True: the decision above is ours, the same on every process without I/O
        # (Orbax's own policy would also save the first step of every run).
        try:
            tree, custom_metadata = packing.pack(state)
            args = ocp.args.StandardSave(tree, custom_metadata=custom_metadata)
            if self._worker is None:
                return self._manager.save(step, args=args, metrics=metrics, force=True)
        except Exception as error:  # the previous save's failure surfaces here too
            raise self._save_failed(step, error) from error
        on_host = threading.Event()
        arrays = sum(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(tree))

        def start() -> bool:
            try:
                with _TRANSFERS.watching(arrays, on_host):
                    return self._manager.save(step, args=args, metrics=metrics, force=True)
            finally:
                on_host.set()  # also when it failed before the copy, or was not watched

        self._starting = (step, self._worker.submit(start))
        on_host.wait()
        if self._starting[1].done():
            self._join()  # a failure before the copy is raised here, as a sync save's
        return True

    def _join(self) -> None:
        """Waits for the save being started on the worker thread to return from Orbax's
        save (not for its writing); raises its failure."""
        if self._starting is None:
            return
        step, job = self._starting
        self._starting = None
        try:
            job.result()
        except Exception as error:
            raise self._save_failed(step, error) from error

    def restore(self, step: int, abstract_state: PyTree, *,
                fresh: Mapping[str, Callable[[], PyTree]] | None = None) -> PyTree:
        """The state saved at `step`, placed with the shardings in `abstract_state`.

        `abstract_state` is the state's pytree of `jax.ShapeDtypeStruct`s with `.sharding`;
        they may differ from the saved ones (another mesh, device or process count).
        `fresh` names top-level fields of the state that belong to the topology and
        options that saved them (the gradient reduction's error-feedback residuals):
        where the checkpoint's arrays there differ from `abstract_state`'s, they stay
        on disk and the field is made by `fresh[field]()` instead, with a warning.
        """
        self.wait()  # a step whose save is in flight is restorable once committed
        steps = self._manager.all_steps()
        if step not in steps:
            raise CheckpointError(
                f"No complete checkpoint for step {step} in {self.directory} (complete "
                f"steps: {sorted(steps)}); restore one of those."
            )
        item_dir = self.directory / str(step) / DEFAULT_ITEM_NAME
        saved, index = layout.saved_layout(item_dir)
        expected = layout.expected_shapes(abstract_state)
        reset = [field for field in fresh or {}
                 if layout.within(saved, field) != layout.within(expected, field)]
        layout.check_matches(layout.without(saved, reset), layout.without(expected, reset),
                             item_dir)
        try:
            if not reset:
                if index is None:  # saved before small arrays were packed
                    return self._manager.restore(
                        step, args=ocp.args.StandardRestore(abstract_state))
                with contextlib.closing(ocp.PyTreeCheckpointHandler()) as handler:
                    return packing.restore(handler, item_dir, abstract_state, index)
            target = {field.name: getattr(abstract_state, field.name)
                      for field in dataclasses.fields(abstract_state) if field.name not in reset}
            with contextlib.closing(ocp.PyTreeCheckpointHandler()) as handler:
                if index is not None:
                    restored = packing.restore(handler, item_dir, target, index)
                else:
                    restored = handler.restore(item_dir, args=ocp.args.PyTreeRestore(
                        item=target,
                        restore_args=ocp.checkpoint_utils.construct_restore_args(target),
                        partial_restore=True))
        except Exception as error:  # typically array files damaged behind intact metadata
            raise layout.unreadable(item_dir, error) from error
        for field in reset:
            logging.warning(
                "checkpoint step %d: its %s (%s) belongs to another topology or reduction "
                "than this run's (%s); starting it afresh", step, field,
                layout.within(saved, field) or "absent", layout.within(expected, field) or "none")
        return abstract_state.replace(**restored, **{field: fresh[field]() for field in reset})

    def wait(self) -> None:
        """Blocks until the save in flight is committed; raises if it failed."""
        self._join()
        try:
            self._manager.wait_until_finished()
        except Exception as error:
            raise self._save_failed(None, error) from error

    def _save_failed(self, step: int | None, error: Exception) -> CheckpointSaveError:
        reason = first_line(error)
        # Orbax deletes old steps only after a new one is committed: none was. After a
        # failure the manager's list may miss committed steps, and the disk may not yet
        # show one whose commit is still in flight: both count.
        on_disk = {int(path.name) for path in self.directory.iterdir() if path.name.isdigit()}
        kept = sorted(on_disk | set(self._manager.all_steps()))
        which = f"step {step}" if step is not None else "a checkpoint"
        return CheckpointSaveError(
            f"saving {which} into {self.directory} failed ({type(error).__name__}: {reason}). "
            f"The checkpoints already there are intact (steps {kept or 'none'}). Fix: free "
            "space or fix the permissions of that directory, then rerun to resume.")

    def close(self) -> None:
        try:
            self._join()
        finally:
            self._manager.close()
            if self._worker is not None:
                self._worker.shutdown()


def check_best_metric(best_metric: str | None, metrics: Iterable[str]) -> None:
    """`checkpoint.keep_best` must name one of the metrics evaluation reports (and passes
    to `save`); the trainer checks it at start, before anything is written."""
    if best_metric and best_metric not in metrics:
        names = ", ".join(map(repr, sorted(metrics)))
        raise ConfigError(
            f"config.checkpoint.keep_best={best_metric!r}: {best_metric!r} is not among the "
            f"metrics passed to save (evaluation reports {names}). Fix: use one of them.")


def _preservation_policy(
    max_to_keep: int | None, best_fn: Callable | None, best_mode: str
) -> ocp.checkpoint_managers.PreservationPolicy:
    """The newest `max_to_keep`; with a metric, the best `max_to_keep` by it and the newest."""
    if best_fn is None:
        return ocp.checkpoint_managers.LatestN(n=max_to_keep)
    # The newest is kept whatever its metric: it is where a killed job resumes. Saves
    # without metrics (e.g. at preemption) go once a newer one exists.
    best = ocp.checkpoint_managers.BestN(
        get_metric_fn=best_fn,
        reverse=best_mode == "min",
        n=max_to_keep,
        keep_checkpoints_without_metrics=False,
    )
    return ocp.checkpoint_managers.AnyPreservationPolicy(
        [ocp.checkpoint_managers.LatestN(n=1), best]
    )
