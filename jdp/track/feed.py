"""The hook that feeds a tracker what the writers write: `tracking_hook(tracker)`.

It runs after every step on process 0, after the hooks before it (jdp puts the configured
trackers after the experiment's hooks), and sends each step's records together once the
step is complete: at step T's hooks every record of the steps before T has been written
(a log step's train report is written one step late), and at the last step all of them,
with the report's plots. Its first call also sends what earlier runs of the workdir wrote
to metrics.jsonl past the last step the tracker's backend holds, so a resumed run fills in
what a kill or a preemption cut off and no step is sent twice. The tracker's run id is
kept in <workdir>/trackers.json for the resumed run.

A tracker that raises gives one warning and is off for the rest of the run; training goes
on, metrics.jsonl keeps every record, and the next resumed run sends what it missed.
"""

from __future__ import annotations

import json
import os
import tempfile

from absl import logging

from jdp.errors import first_line
from jdp.observe.writers import read_metrics
from jdp.runtime import storage
from jdp.track.tracker import StepRecord, Tracker
from jdp.train.hooks import Hook, HookInfo

RUN_IDS_FILE = "trackers.json"  # {tracker name: its run id}, in the workdir


def tracking_hook(tracker: Tracker) -> Hook:
    """A hook that sends `tracker` every record of the run (list it after the hooks that
    write)."""
    return Hook(TrackerFeed(tracker), every=1, name=f"tracker {tracker.name}")


class TrackerFeed:
    """`fn(step, info)` of a tracking hook: the records not yet sent, by step, and whether
    the tracker is still on."""

    def __init__(self, tracker: Tracker):
        self.tracker = tracker
        self.held_through: int | None = None  # the backend's last step; None: not started
        self.pending: dict[int, dict[str, float | str]] = {}
        self.off = False

    def __call__(self, step: int, info: HookInfo) -> None:
        if not info.is_writer or self.off:
            return
        try:
            self._feed(step, info)
        except Exception as error:  # a tracker never stops training
            self.off = True
            logging.warning(
                "tracker %s failed at step %d (%s: %s); training goes on without it. "
                "metrics.jsonl keeps every record, and a resumed run sends the tracker what "
                "it missed.", self.tracker.name, step, type(error).__name__, first_line(error))

    def _feed(self, step: int, info: HookInfo) -> None:
        if self.held_through is None:
            self.held_through = self._start(info.workdir)
            # What earlier runs of this workdir wrote: every step before this first one.
            self._add(_earlier_records(info.workdir, before=step))
        self._add(info.written)
        if step < info.total_steps:
            self._send(before=step)
            return
        with tempfile.TemporaryDirectory(prefix="jdp-report-") as out:
            self._send(before=step + 1, images=report_plots(info.workdir, out))
            self.tracker.finish()

    def _start(self, workdir: str) -> int:
        run_ids = _read_json(storage.join(workdir, RUN_IDS_FILE), default={})
        config = _read_json(storage.join(workdir, "config.json"), default={})
        run_id, held_through = self.tracker.start(run_ids.get(self.tracker.name), config)
        if run_ids.get(self.tracker.name) != run_id:
            _write_json(storage.join(workdir, RUN_IDS_FILE), {**run_ids, self.tracker.name: run_id})
        return held_through

    def _add(self, records) -> None:
        for step, values in records:
            if step > self.held_through:
                self.pending.setdefault(step, {}).update(
                    (k, v) for k, v in values.items() if k != "step")

    def _send(self, before: int, images: dict[str, str] | None = None) -> None:
        """Sends the pending steps below `before`; `images` go with the last of them."""
        ready = sorted(s for s in self.pending if s < before)
        for step in ready:
            values = self.pending.pop(step)
            self.tracker.log(StepRecord(
                step, metrics={k: v for k, v in values.items() if not isinstance(v, str)},
                texts={k: v for k, v in values.items() if isinstance(v, str)},
                images=(images or {}) if step == ready[-1] else {}))
            self.held_through = step


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
