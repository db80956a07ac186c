"""A report on one or more runs from their `metrics.jsonl`: plots, an HTML page and a summary.

    python -m jdp.report WORKDIR [WORKDIR ...] [--out DIR] [--names NAME ...]

Writes one PNG per panel (every run overlaid) and `index.html` into --out (default: the first
workdir's `report/`), and prints one summary row per run: final eval metrics, median
examples/s, wall time and the phase that took the most time. A run with a profile window
(`profile.num_steps`) also gets its step time split from the trace: compute, collectives
(exposed, and how much overlapped compute), host/input wait and idle. A run's goodput over
its whole life, restarts included (`jdp.observe.goodput`), is shown with the table of where
the rest of its time went. The computations are pure functions of a run's records, so
tests can check them without files.
"""

from __future__ import annotations

import argparse
import html
import json
import math
import os
import re
import statistics
import sys
from dataclasses import dataclass

import matplotlib

matplotlib.use("Agg")  # before pyplot: reports are made on machines without a display
import matplotlib.pyplot as plt  # noqa: E402

from jdp.config import paths  # noqa: E402
from jdp.observe import goodput, trace_phases  # noqa: E402
from jdp.observe.writers import metrics_lines  # noqa: E402
from jdp.runtime import storage  # noqa: E402
from jdp.runtime.exit_codes import BAD_CONFIG  # noqa: E402

Record = dict[str, float]  # one step's values, "step" included

# Metric names the trainer itself logs under train/ and eval/; every other name there is a
# task metric (accuracy, token_accuracy, mae, ...), so tasks can add their own.
_SYSTEM_METRICS = frozenset({
    "loss", "learning_rate", "grad_norm", "param_norm", "update_norm", "examples_per_s",
    "examples_per_s_per_device", "step_time_s", "data_wait_fraction",
    "tflops_per_s_per_device", "model_tflops_per_s_per_device", "mfu", "skipped_steps",
    "num_examples", "loss_weight", "tokens_per_s", "tokens_per_s_per_device"})
_FIGSIZE = (6, 3.5)
_DPI = 100


class ReportError(Exception):
    """Input the report cannot read; the message is one line naming the path."""


# -- Reading -----------------------------------------------------------------------------------

def parse_records(lines: list[str], path: str) -> list[Record]:
    """Records in step order, one per step, keeping the last value of each (step, key).

    A resumed run can repeat steps; the later line is the one the resumed run wrote. A last
    line cut short (an object with no closing newline: the run is still writing it) is ignored.
    """
    by_step: dict[int, Record] = {}
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            if _unfinished(line, is_last=number == len(lines)):
                break
            raise ReportError(f"{path}:{number} is not JSON ({e.msg}); expected one JSON "
                              "object per line, as jdp's training writes") from None
        step = record.get("step") if isinstance(record, dict) else None
        if not isinstance(step, int) or isinstance(step, bool):
            raise ReportError(f"{path}:{number} has no integer 'step'; expected one JSON "
                              "object per line with an integer 'step', as jdp's training writes")
        values = {k: float(v) for k, v in record.items()
                  if isinstance(v, (int, float)) and not isinstance(v, bool)}
        by_step.setdefault(step, {}).update(values, step=step)
    return [by_step[step] for step in sorted(by_step)]


def _unfinished(line: str, is_last: bool) -> bool:
    return is_last and not line.endswith("\n") and line.lstrip().startswith("{")


def read_records(workdir: str) -> list[Record]:
    """The records of a workdir's metrics (metrics.jsonl, or its chunks in a bucket);
    ReportError if they are missing or not JSON lines."""
    try:
        path, lines = metrics_lines(workdir)
    except (FileNotFoundError, IsADirectoryError) as e:
        raise ReportError(f"{e.filename or e} not found; pass the workdir of a training run "
                          "(the directory that holds metrics.jsonl)") from None
    except UnicodeDecodeError:
        raise ReportError(f"{workdir}'s metrics are not text; expected one JSON object per "
                          "line") from None
    return parse_records(lines, path)


def unique_names(names: list[str]) -> list[str]:
    """The names, with "-2", "-3", ... appended to repeats so each is distinct."""
    seen: set[str] = set()
    out = []
    for name in names:
        candidate, n = name, 1
        while candidate in seen:
            n += 1
            candidate = f"{name}-{n}"
        seen.add(candidate)
        out.append(candidate)
    return out


# -- Summary -----------------------------------------------------------------------------------

def series(records: list[Record], key: str) -> tuple[list[int], list[float]]:
    """Steps and values of the records that have `key`."""
    pairs = [(int(r["step"]), r[key]) for r in records if key in r]
    return [s for s, _ in pairs], [v for _, v in pairs]


def task_metrics(records: list[Record]) -> list[str]:
    """Task metric names (without train/ or eval/) found in the records, sorted."""
    names = {key.split("/", 1)[1] for r in records for key in r
             if key.startswith(("train/", "eval/"))}
    return sorted(names - _SYSTEM_METRICS)


def final_eval(records: list[Record]) -> dict[str, float]:
    """The eval metrics of the last evaluation (eval/num_examples left out)."""
    for record in reversed(records):
        values = {k: v for k, v in record.items()
                  if k.startswith("eval/") and k != "eval/num_examples"}
        if values:
            return values
    return {}


def median_examples_per_s(records: list[Record]) -> float | None:
    _, values = series(records, "train/examples_per_s")
    return statistics.median(values) if values else None


def wall_time_s(records: list[Record]) -> float | None:
    _, values = series(records, "time/wall_s")
    return values[-1] if values else None


def phase_seconds(records: list[Record]) -> dict[str, float]:
    """Total seconds in step compute, data wait, evaluation and checkpointing.

    A log record's step_time_s is the mean over the window since the previous log step, so
    the window lasted step_time_s x (steps since then); data_wait_fraction of it was spent
    waiting for input, the rest computing.
    """
    phases = {"step": 0.0, "data wait": 0.0, "eval": 0.0, "checkpoint": 0.0}
    previous_log_step = 0
    for record in records:
        phases["eval"] += record.get("time/eval_s", 0.0)
        phases["checkpoint"] += record.get("time/checkpoint_s", 0.0)
        if "train/step_time_s" not in record:
            continue
        step = int(record["step"])
        window_s = record["train/step_time_s"] * max(step - previous_log_step, 1)
        wait_s = window_s * record.get("train/data_wait_fraction", 0.0)
        phases["step"] += window_s - wait_s
        phases["data wait"] += wait_s
        previous_log_step = step
    return phases


def slowest_phase(records: list[Record]) -> tuple[str, float, float] | None:
    """(phase, seconds, share of all phases' seconds) of the longest phase; None if untimed."""
    phases = phase_seconds(records)
    total_s = sum(phases.values())
    if total_s <= 0:
        return None
    name = max(phases, key=phases.__getitem__)
    return name, phases[name], phases[name] / total_s


def _number(value: float | None, fmt: str) -> str:
    return "" if value is None or math.isnan(value) else format(value, fmt)


def summary_row(records: list[Record], eval_keys: list[str]) -> list[str]:
    """One run's cells after its name: eval metrics, examples/s, wall time, slowest phase."""
    evals = final_eval(records)
    slowest = slowest_phase(records)
    phase = f"{slowest[0]} {slowest[2]:.0%} ({slowest[1]:.1f} s)" if slowest else ""
    return ([_number(evals.get(key), ".4f") for key in eval_keys]
            + [_number(median_examples_per_s(records), ".1f"),
               _number(wall_time_s(records), ".1f"), phase])


def summary_table(runs: dict[str, list[Record]]) -> tuple[list[str], list[list[str]]]:
    """Header and rows: one row per run, a column per eval metric any run has."""
    eval_keys = sorted({key for records in runs.values() for key in final_eval(records)})
    header = ["run", *eval_keys, "examples/s (median)", "wall time (s)", "slowest phase"]
    rows = [[name, *summary_row(records, eval_keys)] for name, records in runs.items()]
    return header, rows


def format_text_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True))
             for row in [header, *rows]]
    return "\n".join(line.rstrip() for line in lines)


def profile_phases(workdir: str) -> trace_phases.PhaseSplit | None:
    """The step-time split of the run's profile window; None when it traced none."""
    profile = storage.join(workdir, "profile")
    if storage.is_bucket(profile):  # the trace reader takes local paths only
        if not storage.isdir(profile):
            return None
        profile = storage.local_copy(profile)
    path = trace_phases.latest_trace(profile)
    return None if path is None else trace_phases.split_file(path)


def profile_table(splits: dict[str, trace_phases.PhaseSplit]) -> tuple[list[str], list[list[str]]]:
    """Header and rows: per run, ms per traced step and each phase's share of it."""
    phases = ["compute", "collectives (exposed)", "host/input wait", "idle"]
    header = ["run", "ms/step (traced)", *phases, "collectives overlapped"]
    rows = []
    for name, result in splits.items():
        overlap = result.overlap_fraction()
        rows.append([name, f"{result.step_time_s * 1e3:.1f}",
                     *[f"{result.shares()[phase]:.0%}" for phase in phases],
                     "" if overlap is None else f"{overlap:.0%}"])
    return header, rows


# -- Plots -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Panel:
    """One figure: the metric keys it draws (train as lines, eval as dashed markers)."""

    filename: str
    title: str
    keys: tuple[str, ...]


def panels_for(runs: dict[str, list[Record]]) -> list[Panel]:
    """The panels at least one run has a value for, loss first, then each task metric."""
    metrics = sorted({name for records in runs.values() for name in task_metrics(records)})
    safe_names = unique_names([re.sub(r"[^A-Za-z0-9_.-]", "_", name) for name in metrics])
    candidates = [Panel("loss.png", "loss", ("train/loss", "eval/loss"))]
    candidates += [Panel(f"metric_{safe}.png", name, (f"train/{name}", f"eval/{name}"))
                   for name, safe in zip(metrics, safe_names, strict=True)]
    candidates += [
        Panel("learning_rate.png", "learning rate", ("train/learning_rate",)),
        Panel("throughput.png", "throughput (examples/s)", ("train/examples_per_s",)),
        Panel("tokens.png", "throughput (real target tokens/s)", ("train/tokens_per_s",)),
        Panel("mfu.png", "model FLOPs utilisation", ("train/mfu",)),
        Panel("data_wait.png", "data-wait fraction", ("train/data_wait_fraction",)),
        Panel("step_time.png", "step time (s)", ("train/step_time_s",)),
    ]
    return [panel for panel in candidates
            if any(key in r for key in panel.keys for records in runs.values() for r in records)]


def _line_label(run: str, key: str, panel: Panel, several_runs: bool) -> str:
    split = key.split("/", 1)[0]
    if not several_runs:
        return split
    return f"{run} {split}" if len(panel.keys) > 1 else run


def plot_panel(panel: Panel, runs: dict[str, list[Record]], path: str) -> None:
    several_runs = len(runs) > 1
    fig, ax = plt.subplots(figsize=_FIGSIZE, dpi=_DPI)
    try:
        for index, (run, records) in enumerate(runs.items()):
            for key in panel.keys:
                steps, values = series(records, key)
                if not steps:
                    continue
                style = ({"linestyle": "--", "marker": "o", "markersize": 3}
                         if key.startswith("eval/") else {"linewidth": 1.2})
                ax.plot(steps, values, color=f"C{index % 10}",
                        label=_line_label(run, key, panel, several_runs), **style)
        ax.set_title(panel.title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if len(ax.get_lines()) > 1:
            ax.legend(fontsize="small")
        fig.tight_layout()
        fig.savefig(path)
    finally:
        plt.close(fig)  # many panels x many reports: pyplot would keep every figure alive


# -- Page --------------------------------------------------------------------------------------

def html_table(header: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(cell)}</th>" for cell in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(cell)}</td>" for cell in row) + "</tr>\n"
                   for row in rows)
    return f"<table>\n<tr>{head}</tr>\n{body}</table>"


def index_html(header: list[str], rows: list[list[str]], panels: list[Panel],
               after_summary: str = "") -> str:
    figures = "".join(f'<h2>{html.escape(p.title)}</h2>\n'
                      f'<img src="{html.escape(p.filename)}" alt="{html.escape(p.title)}">\n'
                      for p in panels)
    return ("<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>jdp report</title>\n"
            "<style>body{font-family:sans-serif} td,th{padding:2px 8px;text-align:left}"
            "</style></head>\n<body>\n<h1>Summary</h1>\n"
            f"{html_table(header, rows)}\n{after_summary}{figures}</body></html>\n")


# -- Command line ------------------------------------------------------------------------------

def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m jdp.report", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workdirs", nargs="+", metavar="WORKDIR",
                        help="a training run's workdir (holds metrics.jsonl)")
    parser.add_argument("--out", help="where to write the report (default: WORKDIR/report "
                                      "of the first workdir; ./report for a gs:// one)")
    parser.add_argument("--names", nargs="+", metavar="NAME",
                        help="one name per workdir (default: the workdirs' base names)")
    args = parser.parse_args(argv)
    args.workdirs = [paths.absolute(workdir) for workdir in args.workdirs]
    if args.out:
        args.out = paths.absolute(args.out)
    if args.names is not None and len(args.names) != len(args.workdirs):
        parser.error(f"--names has {len(args.names)} names for {len(args.workdirs)} "
                     "workdirs; give one name per workdir")
    return args


def read_goodput(workdir: str) -> goodput.Accounting | None:
    """The accounting of a workdir's goodput records; None for a run without them (one
    trained before jdp kept them); ReportError for records that cannot be read."""
    try:
        return goodput.account(goodput.read_records(workdir))
    except FileNotFoundError:
        return None
    except (goodput.GoodputError, UnicodeDecodeError) as e:
        raise ReportError(str(e) if isinstance(e, goodput.GoodputError)
                          else f"{workdir}'s goodput records are not text") from None


def goodput_text(accountings: dict[str, goodput.Accounting]) -> str:
    """Each run's goodput line and badput table."""
    return "\n\n".join(f"{name}: {goodput.summary(accounting)}\n"
                        f"{format_text_table(*goodput.table(accounting))}"
                        for name, accounting in accountings.items())


def write_report(runs: dict[str, list[Record]], out_dir: str,
                 splits: dict[str, trace_phases.PhaseSplit] | None = None,
                 goodputs: dict[str, goodput.Accounting] | None = None) -> list[str]:
    """Writes the PNGs and index.html into out_dir; returns the paths written. `splits`:
    the profile windows' step-time splits, `goodputs` the runs' goodput, by run name."""
    os.makedirs(out_dir, exist_ok=True)
    panels = panels_for(runs)
    paths = []
    for panel in panels:
        paths.append(os.path.join(out_dir, panel.filename))
        plot_panel(panel, runs, paths[-1])
    header, rows = summary_table(runs)
    paths.append(os.path.join(out_dir, "index.html"))
    profile = (f"<h1>Step time from the profile</h1>\n{html_table(*profile_table(splits))}\n"
               if splits else "")
    profile += "".join(f"<h1>Goodput of {html.escape(name)}</h1>\n<p>"
                       f"{html.escape(goodput.summary(accounting))}</p>\n"
                       f"{html_table(*goodput.table(accounting))}\n"
                       for name, accounting in (goodputs or {}).items())
    with open(paths[-1], "w") as f:
        f.write(index_html(header, rows, panels, profile))
    return paths


def _default_out(workdir: str) -> str:
    # The plots are written with local files; a bucket run's report goes to ./report.
    return "report" if storage.is_bucket(workdir) else os.path.join(workdir, "report")


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    storage.configure()  # before any GCS client is imported
    default_names = [os.path.basename(os.path.normpath(w)) for w in args.workdirs]
    names = unique_names(args.names or default_names)
    try:
        runs = {name: read_records(workdir)
                for name, workdir in zip(names, args.workdirs, strict=True)}
        goodputs = {name: accounting for name, workdir in zip(names, args.workdirs, strict=True)
                    if (accounting := read_goodput(workdir)) is not None}
    except ReportError as e:
        print(f"error: {e}", file=sys.stderr)
        return BAD_CONFIG
    splits = {}
    for name, workdir in zip(names, args.workdirs, strict=True):
        try:
            split = profile_phases(workdir)
        except trace_phases.TraceError as e:
            print(f"warning: no step-time split for {name}: {e}", file=sys.stderr)
            continue
        if split is not None:
            splits[name] = split
    out_dir = args.out or _default_out(args.workdirs[0])
    paths = write_report(runs, out_dir, splits, goodputs)
    print(format_text_table(*summary_table(runs)))
    if splits:
        print("\nstep time from the profile window:")
        print(format_text_table(*profile_table(splits)))
    if goodputs:
        print("\n" + goodput_text(goodputs))
    print(f"wrote {len(paths) - 1} plots and {paths[-1]}", file=sys.stderr)
    return 0
