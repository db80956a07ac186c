"""A search's outcome: one row per candidate, the table and `tune.json`.

`tune.json` holds every candidate, the winner's overrides, and the fixed part of the
config that was tuned with its fingerprint (`jdp.config.tuned`, which also applies a
saved result): a result applies only to the config it was measured for.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from jdp.config.tuned import fingerprint

if TYPE_CHECKING:
    from jdp.tune.space import Candidate
    from jdp.tune.trial import Timing

TUNE_FILE = "tune.json"
TABLE_FILE = "tune_table.txt"
NUMERICS_MARK = "*"
# Short names for the table's settings column; other keys are shown whole.
_SHORT = {"parallel.backend": "backend", "parallel.shard_optimizer_state": "zero1",
          "parallel.shard_params": "fsdp", "parallel.reduction": "reduction",
          "parallel.cross_host_reduce": "cross_host", "grad_accum_steps": "accum",
          "compute_dtype": "dtype", "data.num_workers": "workers",
          "data.num_threads": "threads"}


@dataclasses.dataclass
class Row:
    """One candidate's fate: compiled or not, its footprint, whether it fits, its trial."""

    candidate: Candidate
    status: str = ""  # "does not fit", "not compiled: dominated by #k", "not timed: budget"
    footprint_bytes: int | None = None
    fits: bool | None = None  # None: not compiled
    timing: Timing | None = None
    note: str = ""  # "as configured", "the winner's program"

    @property
    def rate(self) -> float | None:
        speed = self.timing and self.timing.speed
        return speed.rate if speed else None

    def record(self) -> dict:
        speed = self.timing and self.timing.speed
        return {"index": self.candidate.index, "overrides": self.candidate.overrides,
                "numerics_change": self.candidate.numerics_change, "status": self.status,
                "footprint_bytes": self.footprint_bytes, "fits": self.fits,
                "examples_per_s": speed.examples_per_s if speed else None,
                "tokens_per_s": speed.tokens_per_s if speed else None,
                "mfu": speed.mfu if speed else None,
                "trial_start_s": self.timing.start_s if self.timing else None,
                "trial_length_s": self.timing.length_s if self.timing else None,
                "note": self.note}


def command_line(overrides: dict) -> str:
    """`--config.KEY=VALUE ...` as jdp.main takes them (booleans lower-case)."""
    def text(value) -> str:
        return str(value).lower() if isinstance(value, bool) else str(value)

    return " ".join(f"--config.{key}={text(value)}" for key, value in overrides.items())


def _settings(overrides: dict) -> str:
    return " ".join(f"{_SHORT.get(key, key)}={value}" for key, value in overrides.items())


def memory_text(num_bytes: int | None) -> str:
    return "unknown" if num_bytes is None else f"{num_bytes / 2**20:.2f} MiB"


def _memory(row: Row) -> str:
    return "-" if row.fits is None else memory_text(row.footprint_bytes)  # - : not compiled


def _fits(row: Row) -> str:
    return {None: "-", True: "yes", False: "no"}[row.fits]


def _speed_cells(row: Row, unit: str) -> tuple[str, str]:
    speed = row.timing and row.timing.speed
    if not speed:
        return "-", "-"
    rate = speed.tokens_per_s if unit == "tokens" else speed.examples_per_s
    return f"{rate:,.0f}", "-" if speed.mfu is None else f"{100 * speed.mfu:.1f}%"


def table(rows: list[Row], *, unit: str, capacity_line: str, winner: Row | None) -> str:
    """Every candidate: settings, per-device memory, fits, speed, MFU, and what became of it."""
    header = ("#", "settings", "memory/device", "fits", f"{unit}/s", "MFU", "status")
    cells = []
    for row in rows:
        mark = NUMERICS_MARK if row.candidate.numerics_change else ""
        status = "fastest" if row is winner else row.status
        cells.append((f"{row.candidate.index}{mark}", _settings(row.candidate.overrides),
                      _memory(row), _fits(row), *_speed_cells(row, unit),
                      "; ".join(part for part in (status, row.note) if part)))
    widths = [max(len(line[i]) for line in [header, *cells]) for i in range(len(header))]
    lines = ["  ".join(value.ljust(width) for value, width in zip(line, widths, strict=True))
             .rstrip() for line in [header, *cells]]
    lines.append(capacity_line)
    if any(row.candidate.numerics_change for row in rows):
        lines.append(f"{NUMERICS_MARK} changes the numerics: not the float32 trajectory of "
                     "the config as given")
    return "\n".join(lines)


def result_record(rows: list[Row], winner: Row, *, searched_keys, fixed: dict,
                  settings: dict) -> dict:
    """What tune.json holds."""
    return {"winner": {"index": winner.candidate.index, "overrides": winner.candidate.overrides,
                       "command_line": command_line(winner.candidate.overrides)},
            "searched_keys": sorted(searched_keys), "fingerprint": fingerprint(fixed),
            "fixed": fixed, "settings": settings,
            "candidates": [row.record() for row in rows]}
