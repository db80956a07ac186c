"""Where metrics go: writers with one small interface (`write(step, metrics)`, `close()`).

`metrics.jsonl` and TensorBoard event files in the workdir, both written by
process 0 and flushed at every write, so a crash loses nothing logged. In a bucket,
where objects cannot be appended to, the lines of metrics.jsonl are numbered chunk
objects instead, one per write (a log window, an evaluation); `read_metrics` reads
either layout back in order.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from collections.abc import Iterable
from typing import Protocol

from jdp.runtime import storage

METRICS_FILE = "metrics.jsonl"
METRICS_CHUNKS = "metrics"  # in a bucket: metrics/<step>-<n>.jsonl, one object per write


class Writer(Protocol):
    def write(self, step: int, metrics: dict[str, float]) -> None: ...

    def write_text(self, step: int, name: str, text: str) -> None:
        """Text (a model's sample) where the writer shows text; numbers-only writers skip it."""

    def close(self) -> None: ...


class MultiWriter:
    """Writes every record to each of `writers`."""

    def __init__(self, writers: Iterable[Writer]):
        self.writers = list(writers)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        for writer in self.writers:
            writer.write(step, metrics)

    def write_text(self, step: int, name: str, text: str) -> None:
        for writer in self.writers:
            writer.write_text(step, name, text)

    def close(self) -> None:
        for writer in self.writers:
            writer.close()


class RecentWrites:
    """Keeps what it is given until `clear()`: `(step, values)` records in the order written,
    a text as a string value (`{name: text}`). The loop gives it every record of a step, and
    the step's hooks read them (`HookInfo.written`)."""

    def __init__(self):
        self.records: list[tuple[int, dict[str, float | str]]] = []

    def write(self, step: int, metrics: dict[str, float]) -> None:
        self.records.append((int(step), {k: float(v) for k, v in metrics.items()}))

    def write_text(self, step: int, name: str, text: str) -> None:
        self.records.append((int(step), {name: text}))

    def clear(self) -> None:
        self.records = []

    def close(self) -> None:
        pass


class TensorBoardWriter:
    """Scalars as TensorBoard event files in `logdir` (tensorboardX: no TensorFlow needed).

    A resumed run adds a new event file; TensorBoard shows the newest value of a step.
    For a bucket the events are written to a local directory and copied up at every
    flush (an object is written whole, as tensorboardX's own gs:// writer does too; that
    one also uploads again when garbage-collected, which can block an exiting process).
    """

    def __init__(self, logdir: str):
        from tensorboardX import SummaryWriter

        self._bucket_dir = logdir if storage.is_bucket(logdir) else None
        self._local_dir = (storage.staging_dir("tensorboard") if self._bucket_dir
                           else logdir)
        self._writer = SummaryWriter(logdir=self._local_dir)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        for name, value in metrics.items():
            self._writer.add_scalar(name, float(value), global_step=int(step))
        self._flush()

    def write_text(self, step: int, name: str, text: str) -> None:
        self._writer.add_text(name, text, global_step=int(step))
        self._flush()

    def _flush(self) -> None:
        self._writer.flush()
        if self._bucket_dir:
            storage.upload(self._local_dir, self._bucket_dir)

    def close(self) -> None:
        self._writer.close()
        if self._bucket_dir:
            storage.upload(self._local_dir, self._bucket_dir)
            shutil.rmtree(self._local_dir, ignore_errors=True)


class JsonlWriter:
    """One JSON object per line, each with an integer `step`: appended to `path` on a
    local disk, one chunk object per write in a bucket (`_LocalLines`, `_BucketChunks`).

    On resume from step S the lines past S are dropped first, so a restarted
    run continues the file without duplicated or orphaned steps.
    """

    def __init__(self, path: str, *, enabled: bool, resume_step: int = 0):
        self.path = path
        self.enabled = enabled
        self._lines = (_BucketChunks(_chunk_dir(path)) if storage.is_bucket(path)
                       else _LocalLines(path))
        if enabled:
            self._lines.drop_after(resume_step)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        self._lines.add(int(step), json.dumps(
            {"step": int(step), **{k: float(v) for k, v in metrics.items()}}) + "\n")

    def write_text(self, step: int, name: str, text: str) -> None:
        del step, name, text  # metrics.jsonl holds numbers only

    def close(self) -> None:
        pass  # every write is complete when it returns


class _LocalLines:
    """metrics.jsonl on a local disk: each line appended, the file opened and closed."""

    def __init__(self, path: str):
        self.path = path

    def drop_after(self, step: int) -> None:
        if not os.path.exists(self.path):
            return
        with open(self.path) as f:
            kept = [line for line in f if line.strip() and json.loads(line)["step"] <= step]
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(kept)
        os.replace(tmp, self.path)

    def add(self, step: int, line: str) -> None:
        with open(self.path, "a") as f:
            f.write(line)


class _BucketChunks:
    """metrics.jsonl in a bucket: `<directory>/<step>-<n>.jsonl`, one object per write,
    each written whole. The names sort in the order the lines were written."""

    def __init__(self, directory: str):
        self.directory = directory
        self._written: dict[int, int] = {}  # chunks per step so far

    def drop_after(self, step: int) -> None:
        for name in storage.listdir(self.directory):
            chunk_step = _chunk_step(name)
            if chunk_step is None:
                continue
            if chunk_step > step:
                storage.remove(storage.join(self.directory, name))
            else:
                self._written[chunk_step] = self._written.get(chunk_step, 0) + 1

    def add(self, step: int, line: str) -> None:
        index = self._written.get(step, 0)
        with storage.open_file(storage.join(self.directory, _chunk_name(step, index)), "w") as f:
            f.write(line)
        self._written[step] = index + 1


def _chunk_dir(path: str) -> str:
    return storage.join(os.path.dirname(path), METRICS_CHUNKS)


def _chunk_name(step: int, index: int) -> str:
    return f"{step:012d}-{index:04d}.jsonl"


def _chunk_step(name: str) -> int | None:
    stem, dash, _ = name.partition("-")
    return int(stem) if dash and stem.isdigit() and name.endswith(".jsonl") else None


def metrics_lines(workdir: str) -> tuple[str, list[str]]:
    """(where, lines) of a workdir's metrics in the order written, from metrics.jsonl or,
    in a bucket, its chunks; FileNotFoundError naming the path when there are none."""
    if not storage.is_bucket(workdir):
        path = os.path.join(workdir, METRICS_FILE)
        with open(path, encoding="utf-8") as f:
            return path, f.readlines()
    directory = storage.join(workdir, METRICS_CHUNKS)
    names = [name for name in storage.listdir(directory) if _chunk_step(name) is not None]
    if not names:
        raise FileNotFoundError(errno.ENOENT, "no metrics chunks", directory + "/")
    lines = []
    for name in sorted(names):
        with storage.open_file(storage.join(directory, name)) as f:
            lines += f.readlines()
    return directory + "/", lines


def read_metrics(workdir: str) -> list[dict]:
    """Every metrics record of a run, in the order written, on a local disk or a bucket."""
    return [json.loads(line) for line in metrics_lines(workdir)[1] if line.strip()]


def read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
