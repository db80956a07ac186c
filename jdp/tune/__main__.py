"""The tuner, the same command on every host:

    python -m jdp.tune --config=experiments/vit.py[:ARG] --workdir=DIR [--config.KEY=VALUE ...]
        [--device_memory_gib=80] [--memory_margin=0.1] [--trial_steps=20] [--budget_s=600]
        [--search=grad_accum_steps,remat,...] [--allow_numerics_change]

Searches the fastest configuration that fits at the config's global batch, model, data and
seed: compiles each candidate from shapes, drops those above the device's memory less the
margin, times the rest on the real loop. Prints the table of every candidate and the
winner's `--config.` overrides; writes the table to DIR/tune_table.txt and the result to
DIR/tune.json, which `python -m jdp.main ... --config.tune=DIR/tune.json` applies. When
nothing fits, it exits 2 with one line and writes only the table.
"""

from __future__ import annotations

import functools
import os
import sys

import jax
from absl import app, flags

from jdp import main as jdp_main
from jdp.config import paths
from jdp.dryrun.estimate import PlanError
from jdp.errors import ConfigError
from jdp.runtime import distributed
from jdp.tune import result, space
from jdp.tune.search import FLOAT32_KNOBS, NothingFits, Options, tune

_MARGIN = flags.DEFINE_float(
    "memory_margin", 0.1, "The fraction of device memory a candidate must leave free: XLA's "
    "memory analysis leaves out the runtime's own buffers (prefetched batches, collective "
    "scratch, fragmentation).")
_TRIAL_STEPS = flags.DEFINE_integer(
    "trial_steps", 20, "Steps of each timed trial (after its compile; the first log window is "
    "not measured).")
_BUDGET = flags.DEFINE_float(
    "budget_s", None, "Seconds for the timed trials: no trial starts that would end later (at "
    "the mean length so far); the first always runs. Default: no limit.")
_SEARCH = flags.DEFINE_list(
    "search", list(FLOAT32_KNOBS), f"The knobs to search, of {', '.join(space.KNOBS)}; the "
    "others stay as configured.")
_NUMERICS = flags.DEFINE_bool(
    "allow_numerics_change", False, "Also search compute_dtype=bfloat16 and compressed "
    "cross-host reductions, which leave the float32 trajectory (marked * in the table).")

_TUNE_FLAGS = (_MARGIN, _TRIAL_STEPS, _BUDGET, _SEARCH, _NUMERICS)


def _options() -> Options:
    knobs = list(_SEARCH.value)
    if _NUMERICS.value and _SEARCH.present == 0:  # the default list grows with the flag
        knobs += list(space.NUMERICS_KNOBS)
    memory_gib = flags.FLAGS.device_memory_gib
    return Options(device_memory_bytes=None if memory_gib is None else int(memory_gib * 2**30),
                   memory_margin=_MARGIN.value, trial_steps=_TRIAL_STEPS.value,
                   budget_s=_BUDGET.value, knobs=tuple(knobs),
                   allow_numerics_change=_NUMERICS.value)


def main(argv) -> None:
    if flags.FLAGS.dry_run or flags.FLAGS.step_time_s is not None:
        jdp_main.fail("--dry_run and --step_time_s are jdp.main's. Fix: leave them out; the "
                      "tuner compiles every candidate from shapes itself.")
    config_path = jdp_main.start_up(argv)
    with distributed.ending_promptly_on_failure():
        try:
            outcome = tune(flags.FLAGS.config, config_path, flags.FLAGS.workdir, _options())
        except NothingFits as e:
            print(e.table)
            jdp_main.fail(str(e))
        except (ConfigError, PlanError, distributed.MismatchError) as e:
            jdp_main.fail(str(e))
    print(outcome.table)
    print(f"winner #{outcome.winner.candidate.index}: "
          f"{result.command_line(outcome.winner.candidate.overrides)}")
    if jax.process_index() == 0:  # the only writer
        path = os.path.join(paths.absolute(flags.FLAGS.workdir), result.TUNE_FILE)
        print(f"wrote {path}; train with it: python -m jdp.main --config=... --workdir=... "
              f"--config.tune={path}")
    sys.stdout.flush()


if __name__ == "__main__":
    flags.mark_flag_as_required("config")
    app.run(main, flags_parser=functools.partial(
        jdp_main._parse_flags, known_flags=(*jdp_main._JDP_FLAGS, *_TUNE_FLAGS)))
