"""The search: compile every candidate from shapes (in dominance order, so that candidates
with more remat or accumulation than one that fits are never compiled), drop those that
do not fit, time the others on the real loop within the budget, and keep the fastest.

    tune(config, config_path, workdir, Options(...))             # the space from `knobs`
    tune(config, config_path, workdir, candidates=[{...}, ...])  # explicit overrides

Every process runs the same search; process 0 decides each step (`agree`) and alone
writes. What is written, into `workdir`: `tune_table.txt` always, `tune.json` when a
winner was found; trials run in `workdir/tune_scratch/`, removed afterwards.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import jax
from absl import logging

from jdp import config as config_lib
from jdp import main as jdp_main
from jdp.config import paths, tuned
from jdp.config.checks import get
from jdp.data import splits, streamed
from jdp.errors import ConfigError, quoted
from jdp.experiment import components as components_lib
from jdp.experiment import loader
from jdp.experiment.loader import Experiment
from jdp.runtime import compile_cache, storage
from jdp.tune import agree, footprint, result, space, trial

SCRATCH_DIR = "tune_scratch"
# The default search: every knob that keeps the float32 trajectory but the model axis, which
# multiplies the candidates by the divisors of a host's devices (`--search` names it).
FLOAT32_KNOBS = tuple(k for k in space.KNOBS
                      if k not in (*space.NUMERICS_KNOBS, space.MODEL_PARALLEL))


@dataclasses.dataclass(frozen=True)
class Options:
    device_memory_bytes: int | None = None  # None: what the device reports
    memory_margin: float = 0.1  # the fraction of the capacity a candidate must leave free
    trial_steps: int = 20
    budget_s: float | None = None  # seconds of timed trials; None: no limit
    knobs: tuple[str, ...] = FLOAT32_KNOBS
    allow_numerics_change: bool = False  # also search compute_dtype and cross_host_reduce


@dataclasses.dataclass
class Outcome:
    rows: list[result.Row]
    winner: result.Row
    searched_keys: tuple[str, ...]
    table: str
    record: dict  # what tune.json holds


class NothingFits(ConfigError):
    """No candidate fits the devices; `table` is the table of what was compiled."""

    def __init__(self, message: str, table: str):
        super().__init__(message)
        self.table = table


@dataclasses.dataclass(frozen=True)
class _Setup:
    """What every step of one search uses."""

    config_path: str
    experiment: Experiment
    topo: space.Topology
    devices: list | None
    scratch: str  # trials' workdirs, removed at the end
    runtime: dict  # overrides for every compile and trial, not part of the result

    def configured(self, config, overrides: dict):
        return space.configured(config, {**overrides, **self.runtime})

    @property
    def token_dir(self) -> str:
        return self.runtime["data.token_dir"]


def _check(config, workdir: str, options: Options) -> None:
    if options.trial_steps < 2:
        raise ConfigError(f"--trial_steps={options.trial_steps}: a trial needs at least 2 "
                          "steps (the first window is not measured). Fix: pass 2 or more.")
    if not 0 <= options.memory_margin < 1:
        raise ConfigError(f"--memory_margin={options.memory_margin}: must be in [0, 1). Fix: "
                          "pass the fraction of device memory to keep free, e.g. 0.1.")
    if options.budget_s is not None and options.budget_s <= 0:
        raise ConfigError(f"--budget_s={options.budget_s}: must be > 0. Fix: pass the seconds "
                          "the timed trials may take, or leave it out for no limit.")
    if config.get("tune", ""):
        raise ConfigError(f"config.tune={config.tune!r}: the tuner starts from the untuned "
                          "config. Fix: drop --config.tune from the jdp.tune command.")
    if storage.is_bucket(workdir):
        raise ConfigError(f"--workdir={workdir!r}: the tuner writes to a local directory. "
                          "Fix: pass a local --workdir.")
    space.check_knobs(options.knobs, options.allow_numerics_change)


def _streams(components: components_lib.Components, config) -> bool:
    """Whether the training split streams through grain (input workers matter), asked of
    the trainer's own choice between memory and streaming."""
    train = splits.open_train(components.data, seed=config.seed,
                              setting=config.data.in_memory)
    return isinstance(train, streamed.StreamedTrain)


def _measure(config, candidate: space.Candidate, options: Options, setup: _Setup) -> list:
    """Process 0's [footprint bytes, reported capacity, error]: a candidate whose compile
    fails (a bug on one path should not end the search) is reported, not raised.

    Compiled with the trial's settings (a shorter schedule, the same memory): the program
    is then the trial's own, and the trial's compile a hit in the compilation cache."""
    settings = trial.trial_settings(config, options.trial_steps)
    try:
        measured = footprint.measure(
            setup.configured(config, {**candidate.overrides, **settings}),
            setup.experiment, setup.devices, workdir=setup.token_dir)
        found = [measured.needed_bytes, measured.reported_capacity_bytes, None]
    except Exception as e:  # noqa: BLE001 - any failure of this one candidate's compile
        logging.exception("tune: compiling #%d from shapes failed", candidate.index)
        found = [None, None, quoted(e)]
    return agree.from_process_0(found)


def _compile_pass(config, candidates: list[space.Candidate], options: Options,
                  setup: _Setup) -> tuple[list[result.Row], footprint.Capacity]:
    """Rows for every candidate, compiled in order unless dominated, with their fit."""
    capacity = footprint.Capacity(options.device_memory_bytes, options.memory_margin)
    dominance = space.Dominance()
    rows = []
    for candidate in candidates:
        row = result.Row(candidate)
        rows.append(row)
        dominant = dominance.dominated_by(candidate)
        if dominant is not None:
            row.status = f"not compiled: dominated by #{dominant.index}"
            continue
        needed, reported, error = _measure(config, candidate, options, setup)
        if error:
            row.status = f"not compiled: failed ({error})"
            continue
        if capacity.capacity_bytes is None and reported is not None:
            capacity = dataclasses.replace(capacity, capacity_bytes=reported)
        row.footprint_bytes, row.fits = needed, capacity.fits(needed)
        logging.info("tune: #%d %s: %s per device, %s", candidate.index,
                     result.command_line(candidate.overrides), result.memory_text(needed),
                     "fits" if row.fits else "does not fit")
        if row.fits:
            dominance.fits(candidate)
        else:
            row.status = "does not fit"
    return rows, capacity


def _capacity_line(capacity: footprint.Capacity) -> str:
    if capacity.capacity_bytes is None:
        return "capacity: unknown (the device reports none; pass --device_memory_gib): " \
               "every candidate fits"
    return (f"capacity: {capacity.capacity_bytes / 2**20:.2f} MiB per device, "
            f"{capacity.usable_bytes / 2**20:.2f} MiB usable at a margin of "
            f"{100 * capacity.margin:g}%")


def _nothing_fits(rows: list[result.Row], capacity: footprint.Capacity,
                  options: Options) -> str:
    compiled = [row for row in rows if row.footprint_bytes is not None]
    if not compiled:
        return (f"no candidate compiled: {rows[0].status} for #1, the first. Fix: check the "
                "config with python -m jdp.main --dry_run.")
    smallest = min(compiled, key=lambda row: row.footprint_bytes)
    fixes = ["a smaller --config.batch_size"]
    if not options.allow_numerics_change:
        fixes.append("--allow_numerics_change (compute_dtype=bfloat16)")
    fixes.append("more devices")
    return (
        f"no candidate fits: the smallest footprint is {smallest.footprint_bytes / 2**20:.2f} "
        f"MiB per device (#{smallest.candidate.index}: "
        f"{result.command_line(smallest.candidate.overrides)}) against "
        f"{capacity.usable_bytes / 2**20:.2f} MiB usable of "
        f"{capacity.capacity_bytes / 2**20:.2f} MiB (margin {100 * capacity.margin:g}%). "
        f"Fix: {', '.join(fixes)}.")


def _time(rows: list[result.Row], budget: trial.Budget, run_one) -> None:
    """Times each row in turn while the budget allows (process 0's clock decides)."""
    for row in rows:
        if not agree.from_process_0(budget.allows_another()):
            row.status = "not timed: budget"
            continue
        try:
            row.timing = budget.timed(lambda row=row: run_one(row.candidate))
        except trial.TrialFailed as e:
            row.status = f"not timed: the trial failed ({e})"
            continue
        row.status = "timed" if row.timing.speed else "not timed: the trial logged nothing"


def _input_rows(winner: result.Row, config, first_index: int) -> list[result.Row]:
    """The winner's program with each other input setting: the same footprint."""
    rows = []
    for offset, option in enumerate(space.input_options(config)):
        candidate = dataclasses.replace(winner.candidate, index=first_index + offset,
                                        overrides={**winner.candidate.overrides, **option})
        rows.append(result.Row(candidate, footprint_bytes=winner.footprint_bytes,
                               fits=winner.fits,
                               note=f"the program of #{winner.candidate.index}"))
    return rows


def _mark_as_configured(rows: list[result.Row], config) -> None:
    for row in rows:
        if all(get(config, key) == value for key, value in row.candidate.overrides.items()):
            row.note = "as configured"


def _fastest(rows: list[result.Row]) -> result.Row:
    timed = [row for row in rows if row.rate is not None]
    if not timed:
        raise RuntimeError("jdp.tune: no trial logged a training window; see the trials' "
                           "log above")
    return max(timed, key=lambda row: row.rate)


def _write(workdir: str, name: str, text: str) -> None:
    if jax.process_index() == 0:
        os.makedirs(workdir, exist_ok=True)
        with open(os.path.join(workdir, name), "w") as f:
            f.write(text + "\n")


def tune(config, config_path: str, workdir: str, options: Options = Options(), *,
         candidates: list[dict] | None = None, devices=None) -> Outcome:
    """Searches `options.knobs` (or exactly `candidates`, lists of overrides) for the
    fastest configuration of `config` that fits; writes the table and tune.json into
    `workdir`. Raises NothingFits (a ConfigError, after writing the table) when nothing
    fits."""
    workdir = paths.absolute(workdir)
    paths.make_absolute(config)
    _check(config, workdir, options)
    device_count = jax.device_count() if devices is None else len(devices)
    config_lib.validate(config, device_count, jax.process_count())
    compile_cache.enable(compile_cache.resolve_dir(config.compile_cache_dir))
    scratch = os.path.join(workdir, SCRATCH_DIR)
    # Text data keeps its token store in the scratch dir unless it has a place of its own.
    setup = _Setup(config_path, loader.load(config_path),
                   space.topology(config, device_count, jax.process_count()), devices,
                   scratch, {"data.token_dir": config.data.token_dir
                             or os.path.join(scratch, "tokens")})
    try:
        return _search(config, workdir, options, candidates, setup)
    finally:
        agree.barrier("jdp.tune done")
        shutil.rmtree(scratch, ignore_errors=True)


def _search(config, workdir: str, options: Options, explicit: list[dict] | None,
            setup: _Setup) -> Outcome:
    # -- 1. The candidates -------------------------------------------------------
    base = components_lib.build(setup.experiment, setup.configured(config, {}),
                                workdir=setup.token_dir)
    unit = "tokens" if base.task.weight_unit == "tokens" else "examples"
    input_searched = (explicit is None and space.INPUT_KNOB in options.knobs
                      and _streams(base, config))
    knobs = options.knobs
    if base.model.axis_names(base.sample_inputs()) is None:  # nothing to split over a model axis
        knobs = tuple(knob for knob in knobs if knob != space.MODEL_PARALLEL)
    overrides_list = explicit if explicit is not None else space.search_space(
        config, knobs, setup.topo, input_searched)
    candidates = space.make_candidates(config, overrides_list, setup.topo)
    if not candidates:
        raise ConfigError("no legal candidate: every combination searched fails validation. "
                          "Fix: search other knobs (--search) or check the config with "
                          "python -m jdp.main --dry_run.")
    searched_keys = tuple(sorted({key for c in candidates for key in c.overrides}))

    # -- 2. Compile from shapes, in dominance order -------------------------------
    rows, capacity = _compile_pass(config, candidates, options, setup)
    _mark_as_configured(rows, config)

    def text(winner=None) -> str:
        return result.table(rows, unit=unit, capacity_line=_capacity_line(capacity),
                            winner=winner)

    if not any(row.fits for row in rows):
        _write(workdir, result.TABLE_FILE, text())
        raise NothingFits(_nothing_fits(rows, capacity, options), text())

    # -- 3. Time the survivors, then the winner's input settings ------------------
    budget = trial.Budget(options.budget_s)
    settings = trial.trial_settings(config, options.trial_steps)

    def run_one(candidate: space.Candidate) -> trial.Speed | None:
        return trial.run_trial(
            lambda c, wd: jdp_main.run(c, setup.config_path, wd, devices=setup.devices),
            setup.configured(config, {**candidate.overrides, **settings}),
            os.path.join(setup.scratch, f"trial_{candidate.index}"))

    _time([row for row in rows if row.fits], budget, run_one)
    winner = _fastest(rows)
    if input_searched:
        more = _input_rows(winner, config, len(rows) + 1)
        rows.extend(more)
        _time(more, budget, run_one)
        winner = _fastest(rows)

    # -- 4. Write ---------------------------------------------------------------
    record = result.result_record(
        rows, winner, searched_keys=searched_keys,
        fixed=tuned.fixed_part(config, searched_keys),
        settings={**dataclasses.asdict(options), "capacity_bytes": capacity.capacity_bytes,
                  "usable_bytes": capacity.usable_bytes, "unit": unit,
                  "experiment": setup.config_path})
    _write(workdir, result.TABLE_FILE, text(winner))
    _write(workdir, result.TUNE_FILE, json.dumps(record, indent=2))
    return Outcome(rows, winner, searched_keys, text(winner), record)
