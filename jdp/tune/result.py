"""A search's outcome: one row per candidate, the table, `tune.json`, and applying a saved
result to a config (`--config.tune=FILE`, which `jdp.main` reads before validation).

`tune.json` holds every candidate, the winner's overrides, and the fixed part of the
config that was tuned (every key but the searched ones) with its fingerprint: a result
applies only to the config it was measured for.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import TYPE_CHECKING

from jdp.config.resume import flatten
from jdp.errors import ConfigError

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


def fixed_part(config, searched_keys) -> dict:
    """The config as flat {key: value}, less the searched keys and `tune` itself."""
    flat = flatten(json.loads(config.to_json_best_effort()))
    return {key: value for key, value in sorted(flat.items())
            if key not in searched_keys and key != "tune"}


def fingerprint(fixed: dict) -> str:
    return hashlib.sha256(json.dumps(fixed, sort_keys=True).encode()).hexdigest()


def result_record(rows: list[Row], winner: Row, *, searched_keys, fixed: dict,
                  settings: dict) -> dict:
    """What tune.json holds."""
    return {"winner": {"index": winner.candidate.index, "overrides": winner.candidate.overrides,
                       "command_line": command_line(winner.candidate.overrides)},
            "searched_keys": sorted(searched_keys), "fingerprint": fingerprint(fixed),
            "fixed": fixed, "settings": settings,
            "candidates": [row.record() for row in rows]}


def _read(path: str) -> dict:
    fix = "pass the tune.json that python -m jdp.tune wrote into its --workdir, or rerun it"
    try:
        with open(path) as f:
            saved = json.load(f)
        saved["winner"]["overrides"], saved["searched_keys"], saved["fixed"]  # noqa: B018
    except FileNotFoundError:
        raise ConfigError(f"config.tune={path!r}: no such file. Fix: {fix}.") from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"config.tune={path!r}: not a readable tune result "
                          f"({type(e).__name__}: {e}). Fix: {fix}.") from None
    return saved


def _first_difference(saved: dict, current: dict) -> tuple[str, object, object]:
    absent = "<absent>"
    for key in sorted(saved.keys() | current.keys()):
        if saved.get(key, absent) != current.get(key, absent):
            return key, saved.get(key, absent), current.get(key, absent)
    raise AssertionError("fingerprints differ but no key does")


def apply(config) -> dict:
    """Applies the result named by `config.tune` (if any) to `config` in place, after
    checking that it was tuned for this config; returns the overrides applied. The
    searched keys are set to the winner's values, whatever they were."""
    path = config.get("tune", "")
    if not path:
        return {}
    saved = _read(path)
    current = fixed_part(config, saved["searched_keys"])
    if fingerprint(current) != saved["fingerprint"]:
        key, then, now = _first_difference(saved["fixed"], current)
        raise ConfigError(
            f"config.tune={path!r} was tuned for another config: {key} is {now!r} here but "
            f"was {then!r} when tuned. Fix: rerun python -m jdp.tune with this config, or "
            f"pass --config.{key}={then}.")
    overrides = saved["winner"]["overrides"]
    config.update_from_flattened_dict(overrides)
    return overrides
