"""Where metrics go: writers with one small interface (`write(step, metrics)`, `close()`).

`metrics.jsonl` and TensorBoard event files in the workdir, both written by
process 0 and flushed at every write, so a crash loses nothing logged.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from typing import Protocol


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


class TensorBoardWriter:
    """Scalars as TensorBoard event files in `logdir` (tensorboardX: no TensorFlow needed).

    A resumed run adds a new event file; TensorBoard shows the newest value of a step.
    """

    def __init__(self, logdir: str):
        from tensorboardX import SummaryWriter

        self._writer = SummaryWriter(logdir=logdir)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        for name, value in metrics.items():
            self._writer.add_scalar(name, float(value), global_step=int(step))
        self._writer.flush()

    def write_text(self, step: int, name: str, text: str) -> None:
        self._writer.add_text(name, text, global_step=int(step))
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class JsonlWriter:
    """Appends one JSON object per line, each with an integer `step`.

    On resume from step S the lines past S are dropped first, so a restarted
    run continues the file without duplicated or orphaned steps.
    """

    def __init__(self, path: str, *, enabled: bool, resume_step: int = 0):
        self.path = path
        self.enabled = enabled
        if enabled:
            self._truncate_after(resume_step)

    def _truncate_after(self, step: int) -> None:
        if not os.path.exists(self.path):
            return
        with open(self.path) as f:
            kept = [line for line in f if line.strip() and json.loads(line)["step"] <= step]
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(kept)
        os.replace(tmp, self.path)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": int(step), **{k: float(v) for k, v in metrics.items()}})
                    + "\n")

    def write_text(self, step: int, name: str, text: str) -> None:
        del step, name, text  # metrics.jsonl holds numbers only

    def close(self) -> None:
        pass  # every write opens, appends and closes the file


def read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]

