"""`python -m jdp.tune`: at a capacity the configured run does not fit, the tuner picks one
that does and trains the same model; what does not fit is never timed; dominated
candidates are never compiled; the ranking is by measured speed; the budget stops
trials; a saved result is applied by jdp.main only to the config it was tuned for."""

import json
import logging
import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

from jdp import main as jdp_main
from jdp.config import tuned
from jdp.config.checks import get
from jdp.errors import ConfigError
from jdp.experiment import loader
from jdp.runtime import compile_cache
from jdp.tune import footprint, result
from jdp.tune.search import Options, tune
from runs import REPO, RTOL, load_config, losses, main_env, run_two_processes, train

VIT = "experiments/vit.py"
# Logged at every step, so that the tuned run's losses can be compared step by step.
# 8 examples a device: enough activations that remat lowers the footprint below the
# configured run's (with 4, the CPU reduction's packed gradient buffers decide the
# peak and remat saves nothing), so the search below has two survivors to time.
TINY = ("--config.batch_size=64", "--config.total_steps=20", "--config.warmup_steps=2",
        "--config.log_every_steps=1", "--config.eval_every_steps=0")


_LOGS: dict[str, list[str]] = {}  # what a module fixture's run logged, by fixture


class _Log(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.fixture(scope="module")
def searched(tmp_path_factory):
    """One search over remat x accumulation at a capacity one byte below the configured
    run's footprint, with a budget so small that only the first survivor is timed; into
    a compilation cache of its own, its compiles logged (`cache_hits`)."""
    root = tmp_path_factory.mktemp("search")
    config = load_config(VIT, *TINY, f"--config.compile_cache_dir={root / 'cache'}")
    configured_bytes = footprint.measure(config, loader.load(VIT)).needed_bytes
    options = Options(device_memory_bytes=configured_bytes - 1, memory_margin=0.0,
                      trial_steps=10, budget_s=1e-3, knobs=("remat", "grad_accum_steps"))
    workdir = root / "tune"
    log = _Log()
    logging.getLogger().addHandler(log)
    try:
        with jax.log_compiles():
            outcome = tune(config, VIT, str(workdir), options)
    finally:
        logging.getLogger().removeHandler(log)
    _LOGS["search"] = log.lines
    yield outcome, options, workdir
    compile_cache.enable(compile_cache.resolve_dir(""))  # later tests: the session's cache


def _row(outcome, status_start):
    return [row for row in outcome.rows if row.status.startswith(status_start)]


def test_the_tuner_picks_a_configuration_that_fits_where_the_configured_one_does_not(searched):
    outcome, options, _ = searched
    configured = [row for row in outcome.rows if row.note == "as configured"]
    assert [row.status for row in configured] == ["does not fit"]
    assert outcome.winner.fits
    assert outcome.winner.footprint_bytes < options.device_memory_bytes
    assert outcome.winner.rate > 0


def test_a_candidate_above_the_capacity_is_never_timed(searched):
    outcome, options, _ = searched
    too_big = [row for row in outcome.rows if row.fits is False]
    assert too_big
    for row in too_big:
        assert row.footprint_bytes > options.device_memory_bytes
        assert row.timing is None and row.status == "does not fit"
    assert "does not fit" in outcome.table


def test_more_remat_or_accumulation_than_a_fitting_candidate_is_not_compiled(searched):
    outcome, _, _ = searched
    by_index = {row.candidate.index: row for row in outcome.rows}
    dominated = _row(outcome, "not compiled: dominated by #")
    assert dominated
    for row in dominated:
        fit = by_index[int(row.status.rsplit("#", 1)[1])]
        assert fit.fits and row.footprint_bytes is None
        assert row.candidate.remat_rank >= fit.candidate.remat_rank
        assert row.candidate.grad_accum_steps >= fit.candidate.grad_accum_steps


def test_no_trial_starts_past_the_budget_and_the_last_ends_within_one_trial_of_it(searched):
    outcome, options, _ = searched
    timed = [row.timing for row in outcome.rows if row.timing]
    assert len(timed) == 1  # the first always runs, so that the winner is measured
    assert _row(outcome, "not timed: budget")
    longest_s = max(t.length_s for t in timed)
    assert max(t.start_s + t.length_s for t in timed) <= options.budget_s + longest_s


def test_a_trial_reads_its_step_from_the_cache_its_footprint_compile_wrote(searched):
    """The footprint is compiled with the trial's settings, so the trial's step is the
    same program: each timed trial is a cache hit, and nothing else is."""
    outcome, _, _ = searched
    timed = [row for row in outcome.rows if row.timing]
    hits = [line for line in _LOGS["search"]
            if line.startswith("Persistent compilation cache hit for 'jit_train_step'")]
    assert len(hits) == len(timed) == 1, hits


def test_the_result_is_written_and_the_scratch_trials_removed(searched):
    outcome, _, workdir = searched
    saved = json.loads((workdir / result.TUNE_FILE).read_text())
    assert saved["winner"]["overrides"] == outcome.winner.candidate.overrides
    assert saved["searched_keys"] == ["grad_accum_steps", "remat"]
    assert len(saved["candidates"]) == len(outcome.rows)
    assert (workdir / result.TABLE_FILE).read_text().strip() == outcome.table
    assert sorted(os.listdir(workdir)) == sorted([result.TABLE_FILE, result.TUNE_FILE])


@pytest.fixture(scope="module")
def tuned_run(searched, tmp_path_factory):
    _, _, workdir = searched
    run_dir = tmp_path_factory.mktemp("tuned")
    _, records = train(VIT, run_dir, *TINY, f"--config.tune={workdir / result.TUNE_FILE}")
    return records, run_dir


def test_the_tuned_run_trains_the_configured_runs_model(tuned_run, tmp_path):
    records, _ = tuned_run
    _, reference = train(VIT, tmp_path, *TINY)  # the configured run: CPUs have no limit
    got, expected = losses(records), losses(reference)
    assert sorted(got) == sorted(expected) == list(range(1, 21))
    np.testing.assert_allclose([got[s] for s in sorted(got)],
                               [expected[s] for s in sorted(expected)], rtol=RTOL)


def test_the_resolved_config_records_the_tune_file_and_its_values(searched, tuned_run):
    outcome, _, workdir = searched
    _, run_dir = tuned_run
    saved = json.loads((run_dir / "config.json").read_text())
    assert saved["tune"] == str(workdir / result.TUNE_FILE)
    for key, value in outcome.winner.candidate.overrides.items():
        assert saved[key] == value
    assert outcome.winner.candidate.overrides != {"remat": "none", "grad_accum_steps": 1}


def test_a_result_tuned_for_another_config_is_refused_in_one_line(searched):
    _, _, workdir = searched
    path = workdir / result.TUNE_FILE
    config = load_config(VIT, *TINY, "--config.grad_clip_norm=1.0", f"--config.tune={path}")
    with pytest.raises(ConfigError) as error:
        jdp_main.run(config, VIT, "/nonexistent/never-written")
    assert "\n" not in str(error.value)
    assert ("grad_clip_norm is 1.0 here but was 0.0 when tuned. Fix: rerun python -m "
            "jdp.tune") in str(error.value)


def test_a_missing_tune_file_is_refused_in_one_line(tmp_path):
    config = load_config(VIT, *TINY, f"--config.tune={tmp_path / 'absent.json'}")
    with pytest.raises(ConfigError, match=r"config\.tune=.*absent\.json'?: no such file\. Fix:"):
        jdp_main.run(config, VIT, "/nonexistent/never-written")


def tune_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "jdp.tune", *args]


def test_when_nothing_fits_it_exits_2_in_one_line_and_writes_only_the_table(tmp_path):
    workdir = tmp_path / "tune"
    proc = subprocess.run(
        tune_command(f"--config={VIT}", f"--workdir={workdir}", "--config.batch_size=16",
                     "--search=grad_accum_steps", f"--device_memory_gib={1 / 2**20}"),
        cwd=REPO, env=main_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    error = proc.stderr.strip().splitlines()[-1]
    assert error.startswith("jdp: error: no candidate fits: the smallest footprint is ")
    assert "against 0.00 MiB usable of 0.00 MiB" in error
    assert "Fix: a smaller --config.batch_size, --allow_numerics_change" in error
    assert "more devices" in error
    assert os.listdir(workdir) == [result.TABLE_FILE]
    assert (workdir / result.TABLE_FILE).read_text().count("does not fit") == 2


# A user's experiment: the shipped ViT, whose training source sleeps per example when
# `input_delay_s` is set, so that a streamed candidate is slower by construction.
SLOW_INPUT_EXPERIMENT = '''
    import dataclasses
    import importlib.util
    import time

    from jdp.data import default

    _spec = importlib.util.spec_from_file_location("shipped_vit", {vit!r})
    vit = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(vit)
    build_model = vit.build_model


    def get_config(arg=None):
        config = vit.get_config(arg)
        config.input_delay_s = 0.0
        return config


    class SlowSource:
        def __init__(self, source, delay_s):
            self.source, self.delay_s = source, delay_s

        def __len__(self):
            return len(self.source)

        def __getitem__(self, index):
            time.sleep(self.delay_s)
            return self.source[index]


    def build_data(config):
        data = default.build(config)
        return dataclasses.replace(data, train=SlowSource(data.train, config.input_delay_s))
'''


def test_the_ranking_is_by_measured_speed(tmp_path):
    experiment = tmp_path / "slow_input.py"
    experiment.write_text(textwrap.dedent(SLOW_INPUT_EXPERIMENT.format(
        vit=os.path.join(REPO, VIT))))
    slow = {"input_delay_s": 0.02, "data.in_memory": "false"}  # first: not won by order
    fast = {"input_delay_s": 0.0, "data.in_memory": "true"}
    # 40 steps: more than the batches grain and the prefetcher buffer during the compile.
    outcome = tune(load_config(str(experiment), *TINY), str(experiment),
                   str(tmp_path / "tune"), Options(trial_steps=40), candidates=[slow, fast])
    assert [row.candidate.overrides for row in outcome.rows] == [slow, fast]
    assert all(row.status == "timed" for row in outcome.rows)
    assert outcome.winner.candidate.overrides == fast
    assert outcome.rows[0].rate < outcome.rows[1].rate


@pytest.mark.slow
def test_two_processes_agree_on_the_winner_and_only_process_0_writes(tmp_path):
    workdir = tmp_path / "tune"
    proc = run_two_processes(tune_command(f"--config={VIT}", f"--workdir={workdir}", *TINY,
                                          "--search=reduction", "--trial_steps=8"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    winners = sorted(line for line in proc.stdout.splitlines() if "winner #" in line)
    assert [line.split(" ", 1)[0] for line in winners] == ["[p0]", "[p1]"]
    assert winners[0].split(" ", 1)[1] == winners[1].split(" ", 1)[1]
    wrote = [line for line in proc.stdout.splitlines() if "wrote " in line]
    assert [line.split(" ", 1)[0] for line in wrote] == ["[p0]"]
    saved = json.loads((workdir / result.TUNE_FILE).read_text())
    assert winners[0].endswith(saved["winner"]["command_line"])
    assert sorted(os.listdir(workdir)) == sorted([result.TABLE_FILE, result.TUNE_FILE])


def test_a_result_applies_at_another_seed_learning_rate_and_split(searched):
    outcome, _, workdir = searched
    config = load_config(VIT, *TINY, "--config.seed=17", "--config.learning_rate=0.01",
                         "--config.data.train_split=train[:50%]",
                         f"--config.tune={workdir / result.TUNE_FILE}")
    assert tuned.apply(config) == outcome.winner.candidate.overrides


def test_a_text_result_binds_to_the_model_and_batch_not_to_the_corpus():
    gpt = "experiments/gpt.py"
    base = tuned.fixed_part(load_config(gpt), ["remat"])
    other_corpus = tuned.fixed_part(load_config(
        gpt, "--config.data.text_files=/data/**/*.md", "--config.data.eval_fraction=0.2",
        "--config.data.eval_text_files=/data/held_out.txt", "--config.seed=17",
        "--config.data.token_dir=/data/tokens"), ["remat"])
    assert tuned.fingerprint(other_corpus) == tuned.fingerprint(base)
    for changed in ("--config.model.size=small", "--config.batch_size=64",
                    "--config.data.seq_len=64", "--config.data.tokenizer=bytes"):
        assert tuned.fingerprint(tuned.fixed_part(load_config(gpt, changed), ["remat"])) != \
            tuned.fingerprint(base), changed


def test_a_result_still_applies_to_a_longer_run_with_other_logging_and_saving(searched):
    outcome, _, workdir = searched
    config = load_config(VIT, *TINY, "--config.total_steps=5000", "--config.warmup_steps=200",
                         "--config.log_every_steps=100", "--config.checkpoint.every_steps=500",
                         f"--config.tune={workdir / result.TUNE_FILE}")
    assert tuned.apply(config) == outcome.winner.candidate.overrides
    for key, value in outcome.winner.candidate.overrides.items():
        assert get(config, key) == value
