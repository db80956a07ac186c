"""The hook that feeds a tracker what the writers write: `tracking_hook(tracker)`.

It runs after every step on process 0, after the hooks before it (jdp puts the configured
trackers after the experiment's hooks), and sends each step's records together once the
step is complete: at step T's hooks every record of the steps before T has been written
(a log step's train report is written one step late), and at the last step all of them,
with the report's plots. Its first call also sends what earlier runs of the workdir wrote
to metrics.jsonl past the last step the tracker's backend holds, so a resumed run fills in
what a kill or a preemption cut off and no step is sent twice. The tracker's run id is
kept in <workdir>/trackers.json for the resumed run.

The tracker is called on a thread of its own, so a slow or unreachable backend never holds
the training loop; the end of training waits for it at most `END_WAIT_S`. A tracker that
raises, falls `MAX_BEHIND` steps behind or is still sending then gives one warning and is
off for the rest of the run; training goes on, metrics.jsonl keeps every record, and the
next resumed run sends what it missed.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import queue
import shutil
import tempfile
import threading

from absl import logging

from jdp.errors import first_line
from jdp.observe.writers import read_metrics
from jdp.runtime import storage
from jdp.track.tracker import StepRecord, Tracker
from jdp.train.hooks import Hook, HookInfo

RUN_IDS_FILE = "trackers.json"  # {tracker name: its run id}, in the workdir
MAX_BEHIND = 1000  # steps' records waiting for a tracker before it is turned off
END_WAIT_S = 120.0  # the end of training waits this long for a tracker (watchdog: 600 s)
# Trackers start one at a time. Starting loads wandb or mlflow, whose pydantic models run
# ast.parse, and ast.parse on two threads at once can fail in CPython 3.11 ("SystemError:
# AST constructor recursion depth mismatch"); the starts also share trackers.json.
_STARTING = threading.Lock()


def tracking_hook(tracker: Tracker) -> Hook:
    """A hook that sends `tracker` every record of the run (list it after the hooks that
    write)."""
    return Hook(TrackerFeed(tracker), every=1, name=f"tracker {tracker.name}")


@dataclasses.dataclass
class _Finish:
    """The last record (with the report's plots, drawn in `plots_dir`), then `finish()`."""

    record: StepRecord | None
    plots_dir: str


class TrackerFeed:
    """`fn(step, info)` of a tracking hook: gathers each step's records on the loop's thread
    and hands the complete ones to the thread that calls the tracker."""

    def __init__(self, tracker: Tracker):
        self.tracker = tracker
        self.pending: dict[int, dict[str, float | str]] = {}
        self.queue: queue.Queue = queue.Queue(maxsize=MAX_BEHIND)
        self.sender: threading.Thread | None = None
        self.off = False
        self._warned = threading.Lock()  # held by whoever warns: one warning

    def __call__(self, step: int, info: HookInfo) -> None:
        if not info.is_writer or self.off:
            return
        try:
            self._feed(step, info)
        except Exception as error:  # a tracker never stops training
            self._turn_off(f"at step {step} ({type(error).__name__}: {first_line(error)})")

    def _feed(self, step: int, info: HookInfo) -> None:
        if self.sender is None:
            # Loaded before any tracker's thread runs: matplotlib runs ast.parse as it loads.
            importlib.import_module("jdp.report")
            # What earlier runs of this workdir wrote: every step before this first one.
            self._add(_earlier_records(info.workdir, before=step))
            self.sender = threading.Thread(target=self._send, args=(info.workdir,),
                                           name=f"tracker {self.tracker.name}", daemon=True)
            self.sender.start()
        self._add(info.written)
        if step < info.total_steps:
            for record in self._complete(before=step):
                self._put(record)
        else:
            self._end(self._complete(before=step + 1), info.workdir)

    def _end(self, records: list[StepRecord], workdir: str) -> None:
        """The last records, the last with the report's plots; `finish()`; a bounded wait."""
        *earlier, last = records or [None]
        for record in earlier:
            self._put(record)
        plots_dir = tempfile.mkdtemp(prefix="jdp-report-")  # the tracker's thread removes it
        queued = False
        try:
            if last is not None:
                last.images = report_plots(workdir, plots_dir)
            queued = self._put(_Finish(last, plots_dir))
        finally:
            if not queued:
                shutil.rmtree(plots_dir, ignore_errors=True)
        if queued:
            self.sender.join(END_WAIT_S)
            if self.sender.is_alive():
                self._turn_off(f"at the end: still sending after {END_WAIT_S:g} s")

    def _add(self, records) -> None:
        for step, values in records:
            self.pending.setdefault(step, {}).update(
                (k, v) for k, v in values.items() if k != "step")

    def _complete(self, before: int) -> list[StepRecord]:
        """The pending steps below `before`, each as one record."""
        records = []
        for step in sorted(s for s in self.pending if s < before):
            values = self.pending.pop(step)
            records.append(StepRecord(
                step, metrics={k: v for k, v in values.items() if not isinstance(v, str)},
                texts={k: v for k, v in values.items() if isinstance(v, str)}))
        return records

    def _put(self, item) -> bool:
        """Hands `item` to the tracker's thread; False (and the tracker off) if it is
        `MAX_BEHIND` behind."""
        try:
            self.queue.put_nowait(item)
            return True
        except queue.Full:
            self._turn_off(f"{MAX_BEHIND} steps behind")
            return False

    def _send(self, workdir: str) -> None:
        """The tracker's thread: start, then every record past what the backend holds."""
        item = None
        try:
            with _STARTING:
                held_through = self._start(workdir)
            while not isinstance(item := self.queue.get(), _Finish):
                if item.step > held_through:
                    self.tracker.log(item)
                    held_through = item.step
            if item.record is not None and item.record.step > held_through:
                self.tracker.log(item.record)
            self.tracker.finish()
        except Exception as error:
            where = ("starting" if item is None else
                     f"at step {item.step}" if isinstance(item, StepRecord) else "finishing")
            self._turn_off(f"{where} ({type(error).__name__}: {first_line(error)})")
        finally:
            if isinstance(item, _Finish):
                shutil.rmtree(item.plots_dir, ignore_errors=True)

    def _start(self, workdir: str) -> int:
        path = storage.join(workdir, RUN_IDS_FILE)
        config = _read_json(storage.join(workdir, "config.json"), default={})
        known = _read_json(path, default={}).get(self.tracker.name)
        run_id, held_through = self.tracker.start(known, config)
        if run_id != known:
            _write_json(path, {**_read_json(path, default={}), self.tracker.name: run_id})
        return held_through

    def _turn_off(self, why: str) -> None:
        self.off = True
        if self._warned.acquire(blocking=False):  # never released: the first one warns
            logging.warning(
                "tracker %s failed %s; training goes on without it. metrics.jsonl keeps every "
                "record, and a resumed run sends the tracker what it missed.",
                self.tracker.name, why)


def _earlier_records(workdir: str, before: int) -> list[tuple[int, dict]]:
    """metrics.jsonl's records of the steps before `before` (none before the first write)."""
    try:
        records = read_metrics(workdir)
    except FileNotFoundError:
        return []
    return [(r["step"], r) for r in records if r["step"] < before]


def report_plots(workdir: str, out_dir: str) -> dict[str, str]:
    """The run's report plots (`python -m jdp.report`) drawn into `out_dir`, by name:
    {"report/loss": PATH, ...}."""
    from jdp import report  # matplotlib: only at the end of a tracked run

    name = os.path.basename(os.path.normpath(workdir))
    paths = report.write_report({name: report.read_records(workdir)}, out_dir)
    return {f"report/{os.path.splitext(os.path.basename(p))[0]}": p
            for p in paths if p.endswith(".png")}


def _read_json(path: str, default):
    if not storage.exists(path):
        return default
    with storage.open_file(path) as f:
        return json.load(f)


def _write_json(path: str, value) -> None:
    """Written whole: a local file replaced at once, a bucket object written at close."""
    staged = path if storage.is_bucket(path) else path + ".tmp"
    with storage.open_file(staged, "w") as f:
        json.dump(value, f, indent=2)
    if staged != path:
        os.replace(staged, path)
