"""Never a broken state on disk, and no false alarms: a non-finite step is never saved
and stops the run with one line (exit 3) unless the config allows skipping it; a save
slower than the watchdog's timeout does not stop a healthy job."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from jdp.runtime import exit_codes
from runs import REPO, checkpoint_arrays, main_env, read_metrics, run_main

VIT = "experiments/vit.py"


def _saved_steps(workdir):
    directory = workdir / "checkpoints"
    if not directory.exists():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())


def test_a_diverging_run_never_saves_a_non_finite_state(tmp_path):
    workdir = tmp_path / "run"
    proc = run_main(f"--config={VIT}", f"--workdir={workdir}", "--config.learning_rate=1e5",
                    "--config.warmup_steps=0", "--config.total_steps=40",
                    "--config.batch_size=64", "--config.log_every_steps=5",
                    "--config.checkpoint.every_steps=5")
    assert proc.returncode == exit_codes.NONFINITE, proc.stderr[-3000:]
    last_line = proc.stderr.strip().splitlines()[-1]
    assert "jdp: error:" in last_line and "not finite at step" in last_line
    assert "Fix:" in last_line and "Traceback" not in proc.stderr
    for step in _saved_steps(workdir):
        state = checkpoint_arrays(workdir, step)
        for leaf in [*jax_leaves(state["params"]), *jax_leaves(state["opt_state"])]:
            assert np.isfinite(leaf).all(), f"checkpoint {step} holds a non-finite value"


def jax_leaves(tree):
    import jax

    return [np.asarray(x) for x in jax.tree.leaves(tree)]


# 64 examples, batch 16: 4 steps an epoch, so the one poisoned example (index 5) is in
# exactly one of the first 4 steps.
POISONED_EXPERIMENT = '''
    """digits-like random images, one of which is NaN."""
    import flax.linen as nn
    import numpy as np

    from jdp.config import defaults
    from jdp.data import Data


    def get_config(arg=None):
        config = defaults()
        config.batch_size, config.total_steps, config.warmup_steps = 16, 4, 0
        config.log_every_steps, config.eval_batch_size = 1, 16
        config.checkpoint.every_steps = 2
        return config


    class Source:
        def __init__(self, poison):
            self.poison = poison

        def __len__(self):
            return 64

        def __getitem__(self, index):
            image = np.random.default_rng(index).random(8).astype(np.float32)
            if self.poison and index == 5:
                image[0] = np.nan
            return {"image": image, "label": np.int32(index % 2)}


    def build_data(config):
        return Data(Source(poison=True), Source(poison=False), num_classes=2)


    class Model(nn.Module):
        num_classes: int

        @nn.compact
        def __call__(self, x, train):
            return nn.Dense(self.num_classes)(nn.relu(nn.Dense(16)(x)))


    def build_model(config, *, num_classes):
        return Model(num_classes)
'''


@pytest.fixture
def poisoned(tmp_path):
    path = tmp_path / "poisoned.py"
    path.write_text(textwrap.dedent(POISONED_EXPERIMENT))
    return path


def test_one_poisoned_batch_stops_the_run_naming_its_step(poisoned, tmp_path):
    workdir = tmp_path / "run"
    proc = run_main(f"--config={poisoned}", f"--workdir={workdir}")
    assert proc.returncode == exit_codes.NONFINITE, proc.stderr[-3000:]
    last_line = proc.stderr.strip().splitlines()[-1]
    assert "not finite at step" in last_line and "skip_nonfinite_steps" in last_line


def test_skip_nonfinite_steps_drops_the_bad_update_counts_it_and_goes_on(poisoned, tmp_path):
    workdir = tmp_path / "run"
    proc = run_main(f"--config={poisoned}", f"--workdir={workdir}",
                    "--config.skip_nonfinite_steps=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    train = [r for r in read_metrics(workdir) if "train/loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    bad = [r["step"] for r in train if not np.isfinite(r["train/loss"])]
    assert len(bad) == 1  # exactly the step that drew example 5
    assert [r["train/skipped_steps"] for r in train] == [
        float(r["step"] >= bad[0]) for r in train]
    for step in _saved_steps(workdir):
        assert all(np.isfinite(x).all()
                   for x in jax_leaves(checkpoint_arrays(workdir, step)["params"]))


def run_patched_main(tmp_path, patch: str, *args: str) -> subprocess.CompletedProcess:
    """`python -m jdp.main ARGS` as a user runs it, with a fault injected by `patch`
    (Python source run before jdp.main is imported)."""
    script = tmp_path / "patched_main.py"
    script.write_text(textwrap.dedent(patch) + textwrap.dedent("""
        from absl import app
        from jdp import main
        app.run(main.main, flags_parser=main._parse_flags)
        """))
    return subprocess.run([sys.executable, str(script), *args], cwd=REPO,
                          env={**main_env(), "PYTHONPATH": REPO}, capture_output=True,
                          text=True, timeout=300)


SLOW_SAVE = """
    import time
    from jdp import checkpoint

    real_save = checkpoint.Checkpointer.save

    def slow_save(self, step, *args, **kwargs):
        if step == 4:
            time.sleep(5.0)  # slow storage: longer than the watchdog's timeout
        return real_save(self, step, *args, **kwargs)

    checkpoint.Checkpointer.save = slow_save
"""


def test_a_save_slower_than_the_watchdog_timeout_is_no_false_alarm(tmp_path):
    workdir = tmp_path / "run"
    proc = run_patched_main(
        tmp_path, SLOW_SAVE, f"--config={VIT}", f"--workdir={workdir}",
        "--config.total_steps=8", "--config.warmup_steps=1", "--config.batch_size=64",
        "--config.checkpoint.every_steps=4", "--config.watchdog_timeout_s=2",
        "--config.log_every_steps=4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "gives up" not in proc.stderr  # the watchdog's report
    assert _saved_steps(workdir) == [4, 8]
    assert os.path.exists(workdir / "metrics.jsonl")


STORAGE_RUN = ("--config.batch_size=64", "--config.warmup_steps=1", "--config.log_every_steps=4",
               "--config.eval_every_steps=0", "--config.checkpoint.every_steps=4")


def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(tmp_path):
    workdir = tmp_path / "run"
    first = run_main(f"--config={VIT}", f"--workdir={workdir}", *STORAGE_RUN,
                     "--config.total_steps=12")
    assert first.returncode == 0, first.stderr[-3000:]
    assert _saved_steps(workdir) == [4, 8, 12]
    files = [p for p in (workdir / "checkpoints" / "12").rglob("*") if p.is_file()]
    largest = max(files, key=lambda p: p.stat().st_size)
    with open(largest, "r+b") as f:  # a torn write: the file ends half-way
        f.truncate(largest.stat().st_size // 2)
    rerun = run_main(f"--config={VIT}", f"--workdir={workdir}", *STORAGE_RUN,
                     "--config.total_steps=16")
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "skipping checkpoint step 12" in rerun.stderr
    assert "resuming from" in rerun.stderr and "/checkpoints/8" in rerun.stderr
    assert (workdir / "checkpoints" / "12").exists()  # skipped, never deleted by jdp
    train_steps = [r["step"] for r in read_metrics(workdir) if "train/loss" in r]
    assert train_steps == [4, 8, 12, 16]  # 12 again, after resuming at 8; each once


FAILING_SAVE = """
    import errno
    import orbax.checkpoint as ocp

    real_save = ocp.CheckpointManager.save

    def save(self, step, *args, **kwargs):
        if step >= 8:  # the disk fills up after the first checkpoint
            raise OSError(errno.ENOSPC, "No space left on device", str(self.directory))
        return real_save(self, step, *args, **kwargs)

    ocp.CheckpointManager.save = save
"""


def test_a_failing_save_stops_loudly_and_the_previous_checkpoint_still_restores(tmp_path):
    workdir = tmp_path / "run"
    proc = run_patched_main(tmp_path, FAILING_SAVE, f"--config={VIT}", f"--workdir={workdir}",
                            *STORAGE_RUN, "--config.total_steps=12")
    assert proc.returncode == exit_codes.FAILED, proc.stderr[-3000:]
    last_line = proc.stderr.strip().splitlines()[-1]
    assert "saving step 8" in last_line and str(workdir / "checkpoints") in last_line
    assert "No space left" in last_line and "steps [4]" in last_line
    assert "Traceback" not in proc.stderr
    assert _saved_steps(workdir) == [4]
    state = checkpoint_arrays(workdir, 4)
    assert int(state["step"]) == 4
