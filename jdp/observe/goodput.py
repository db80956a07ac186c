"""Goodput: where a job's wall time went over its whole life, restarts included.

Process 0 writes one record when an attempt (one start of the trainer) begins, one per
step, and one when the attempt finishes, to `<workdir>/goodput.jsonl`, each flushed as
it is written, so a process killed at any moment loses none; the file is never
truncated (metrics.jsonl is, to the resumed step). `Accounting` reads the records in
order and gives each second of the job's life to one cause:

- productive: the steps that moved the job forward, each step counted once;
- compilation: an attempt's start to its first step (restoring, compiling), for the
  first attempt and any attempt after a finished one;
- data wait, checkpoint stalls, evaluation: as the loop times them (`WindowClock`);
- failures: from the last step of an attempt that did not finish (killed, failed,
  preempted) to the first step of the next, plus the steps recomputed after its
  restore (every step up to the furthest one reached before);
- other: after the last step, what none of the above covers.

Goodput is productive / total. The time between a finished attempt and a later one
(say, the same run continued to more steps) is not the job's, and is left out.

In a bucket, where objects cannot be appended to, the records travel in chunks
(`goodput/<attempt>-<n>.jsonl`), one at most every CHUNK_EVERY_S seconds and one at
the end: a killed process loses the records since its last chunk, which then count as
time lost to the failure.
"""

from __future__ import annotations

import errno
import json
import os
import time
from collections.abc import Mapping

from jdp.runtime import storage

GOODPUT_FILE = "goodput.jsonl"
GOODPUT_CHUNKS = "goodput"  # in a bucket: goodput/<attempt>-<n>.jsonl
CHUNK_EVERY_S = 30.0
# The loop's timed phases (`WindowClock.PHASES`) -> the cause they are.
PHASE_CAUSES = {"data_wait": "data_wait", "eval": "evaluation", "checkpoint": "checkpoint"}
# Each cause, as the report names it.
CAUSES = {"productive": "productive steps", "compilation": "start-up and compilation",
          "data_wait": "data wait", "checkpoint": "checkpoint stalls",
          "evaluation": "evaluation", "failures": "lost to failures", "other": "other"}


class GoodputError(ValueError):
    """Records that cannot be read; the message names the file and line."""


class Accounting:
    """The job's wall time so far by cause, fed one record at a time (`add`)."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(CAUSES, 0.0)
        self.attempts = 0
        self.failures = 0  # attempts that ended without finishing, then were followed
        self.recomputed_steps = 0
        self.furthest_step = -1  # the furthest step any attempt reached
        self._started_at = 0.0  # this attempt's start
        self._last_at: float | None = None  # this attempt's last record (None: no step yet)
        self._phases = dict.fromkeys(PHASE_CAUSES, 0.0)  # this attempt's totals so far
        self._finished = False
        self._lost_since: float | None = None  # the last step of an attempt cut short

    @property
    def total_s(self) -> float:
        return sum(self.seconds.values())

    @property
    def goodput(self) -> float:
        return self.seconds["productive"] / self.total_s if self.total_s > 0 else 0.0

    def add(self, record: Mapping[str, float]) -> None:
        if "attempt" in record:
            self._start(record["start"])
        elif "end" in record:
            self._spend(record["end"], record, "other")
            self._finished = True
        else:
            self._step(int(record["step"]), record["t"], record)

    def _start(self, at: float) -> None:
        if self.attempts and not self._finished:
            self.failures += 1
            self._lost_since = self._started_at if self._last_at is None else self._last_at
        else:
            self._lost_since = None
        self.attempts += 1
        self._started_at, self._last_at, self._finished = at, None, False
        self._phases = dict.fromkeys(PHASE_CAUSES, 0.0)

    def _step(self, step: int, at: float, phases: Mapping[str, float]) -> None:
        recomputed = step <= self.furthest_step
        self.recomputed_steps += recomputed
        if self._last_at is None:  # the attempt's first step: what came before it
            if self._lost_since is not None:
                self.seconds["failures"] += at - self._lost_since
            else:
                self.seconds["compilation"] += at - self._started_at
            self._last_at = at
            self._phases = {phase: phases.get(phase, 0.0) for phase in PHASE_CAUSES}
        elif recomputed:
            self._spend(at, phases, "failures", whole=True)
        else:
            self._spend(at, phases, "productive")
        self.furthest_step = max(self.furthest_step, step)

    def _spend(self, at: float, phases: Mapping[str, float], rest: str,
               whole: bool = False) -> None:
        """The time since the attempt's last record: its timed phases to their causes
        (all of it to `rest` when `whole`), the remainder to `rest`."""
        since = self._started_at if self._last_at is None else self._last_at
        elapsed = at - since
        for phase, cause in PHASE_CAUSES.items():
            spent = phases.get(phase, self._phases[phase]) - self._phases[phase]
            self._phases[phase] += spent
            if not whole:
                self.seconds[cause] += spent
                elapsed -= spent
        self.seconds[rest] += elapsed
        self._last_at = at

    def metrics(self) -> dict[str, float]:
        """`goodput/*` figures for metrics.jsonl and TensorBoard."""
        return {"goodput/goodput": self.goodput, "goodput/total_s": self.total_s,
                **{f"goodput/{cause}_s": seconds for cause, seconds in self.seconds.items()},
                "goodput/failures": float(self.failures),
                "goodput/recomputed_steps": float(self.recomputed_steps)}


def account(records: list[dict]) -> Accounting:
    accounting = Accounting()
    for record in records:
        accounting.add(record)
    return accounting


class Ledger:
    """Process 0's records of one attempt, and the accounting of the job so far (earlier
    attempts' records read back at the start). Other processes (`enabled=False`) keep
    nothing. `phases` holds the loop's phase totals of this attempt in seconds, kept up to
    date by the loop (`WindowClock.totals`)."""

    def __init__(self, workdir: str, *, enabled: bool, start_step: int,
                 phases: Mapping[str, float], clock=time.time):
        self.enabled = enabled
        self._phases = phases
        self._clock = clock
        self.accounting = Accounting()
        if not enabled:
            return
        earlier = read_records(workdir, missing_ok=True)
        for record in earlier:
            self.accounting.add(record)
        attempt = self.accounting.attempts + 1
        self._out = (_BucketChunks(storage.join(workdir, GOODPUT_CHUNKS), attempt, clock)
                     if storage.is_bucket(workdir) else _LocalFile(
                         os.path.join(workdir, GOODPUT_FILE)))
        self._write({"attempt": attempt, "start": clock(), "step": start_step})

    def step(self, step: int) -> None:
        """Records step `step`, dispatched with the one before it complete."""
        if self.enabled:
            self._write({"step": step, "t": self._clock(), **self._phases})

    def flush(self) -> None:
        """Writes what is held back (in a bucket), e.g. when the attempt is cut short."""
        if self.enabled:
            self._out.flush()

    def finished(self, step: int) -> None:
        """Records the attempt's end after its last step (`step`), the job trained."""
        if self.enabled:
            self._write({"end": self._clock(), "step": step, **self._phases})
            self._out.close()

    def metrics(self) -> dict[str, float]:
        return self.accounting.metrics() if self.enabled else {}

    def _write(self, record: dict) -> None:
        record = {k: round(v, 4) if isinstance(v, float) else v for k, v in record.items()}
        self.accounting.add(record)
        self._out.add(json.dumps(record) + "\n")


class _LocalFile:
    """goodput.jsonl on a local disk, open for appending; every line flushed at once."""

    def __init__(self, path: str):
        self._file = open(path, "a", encoding="utf-8")  # open while the attempt runs

    def add(self, line: str) -> None:
        self._file.write(line)
        self._file.flush()

    def flush(self) -> None:
        pass  # every line is flushed as it is added

    def close(self) -> None:
        self._file.close()


class _BucketChunks:
    """goodput.jsonl in a bucket: `<directory>/<attempt>-<n>.jsonl`, a chunk of the lines
    since the last one at most every CHUNK_EVERY_S and at the end. The names sort in the
    order the lines were written."""

    def __init__(self, directory: str, attempt: int, clock):
        self.directory, self.attempt, self._clock = directory, attempt, clock
        self._lines: list[str] = []
        self._count = 0
        self._written_at = clock()

    def add(self, line: str) -> None:
        self._lines.append(line)
        if self._count == 0 or self._clock() - self._written_at >= CHUNK_EVERY_S:
            self.flush()

    def close(self) -> None:
        self.flush()

    def flush(self) -> None:
        if not self._lines:
            return
        name = f"{self.attempt:06d}-{self._count:06d}.jsonl"
        with storage.open_file(storage.join(self.directory, name), "w") as f:
            f.writelines(self._lines)
        self._lines, self._count, self._written_at = [], self._count + 1, self._clock()


def read_records(workdir: str, *, missing_ok: bool = False) -> list[dict]:
    """A workdir's goodput records in the order written (goodput.jsonl, or its chunks in a
    bucket). A last line cut short (the process was killed while writing it) is left
    out; any other line that is not a record raises GoodputError naming it. Missing:
    FileNotFoundError, or [] with `missing_ok`."""
    try:
        where, lines = _lines(workdir)
    except FileNotFoundError:
        if missing_ok:
            return []
        raise
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            if number == len(lines) and not line.endswith("\n"):
                break
            raise GoodputError(f"{where}:{number} is not JSON ({e.msg}); goodput records "
                               "are one JSON object per line, as jdp's training writes "
                               "them") from None
        if not isinstance(record, dict) or not ({"attempt", "step", "end"} & set(record)):
            raise GoodputError(f"{where}:{number} is not a goodput record (an attempt's "
                               "start, a step or an end)")
        records.append(record)
    return records


def _lines(workdir: str) -> tuple[str, list[str]]:
    if not storage.is_bucket(workdir):
        path = os.path.join(workdir, GOODPUT_FILE)
        with open(path, encoding="utf-8") as f:
            return path, f.readlines()
    directory = storage.join(workdir, GOODPUT_CHUNKS)
    names = sorted(name for name in (storage.listdir(directory)
                                     if storage.isdir(directory) else [])
                   if name.endswith(".jsonl"))
    if not names:
        raise FileNotFoundError(errno.ENOENT, "no goodput chunks", directory + "/")
    lines = []
    for name in names:
        with storage.open_file(storage.join(directory, name)) as f:
            lines += f.readlines()
    return directory + "/", lines


def table(accounting: Accounting) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the badput table: each cause's seconds and share of the total,
    productive first."""
    total = accounting.total_s
    rows = [[CAUSES[cause], f"{seconds:.1f}", f"{seconds / total:.1%}" if total else ""]
            for cause, seconds in accounting.seconds.items()]
    return ["cause", "seconds", "share"], rows


def summary(accounting: Accounting) -> str:
    """One line: goodput, the total, attempts, failures and recomputed steps."""
    return (f"goodput {accounting.goodput:.1%} ({accounting.seconds['productive']:.1f} s "
            f"productive of {accounting.total_s:.1f} s over {accounting.attempts} "
            f"attempt{'s' if accounting.attempts != 1 else ''}; {accounting.failures} "
            f"failure{'s' if accounting.failures != 1 else ''}, "
            f"{accounting.recomputed_steps} steps recomputed)")
