"""Nothing is lost: a killed run resumes bitwise, SIGTERM saves and exits 76, a checkpoint
resumes on another topology and backend, incomplete checkpoints are skipped, and bad
resume inputs fail with a clear error."""

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import jax
import numpy as np
import pytest

from jdp.runtime import exit_codes
from runs import (
    REPO,
    checkpoint_arrays,
    load_config,
    logged_steps,
    losses,
    main_env,
    read_metrics,
    run_main,
    start_main,
    train,
    wait_for,
)

VIT = "experiments/vit.py"
RUN = ("--config=experiments/vit.py", "--config.total_steps=40", "--config.warmup_steps=4",
       "--config.log_every_steps=1", "--config.eval_every_steps=0",
       "--config.checkpoint.every_steps=20", "--config.batch_size=64")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted 40-step run, in a subprocess like the interrupted ones."""
    workdir = tmp_path_factory.mktemp("reference")
    proc = run_main(*RUN, f"--workdir={workdir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return workdir


def assert_bitwise_equal(tree, ref_tree):
    for leaf, ref_leaf in zip(jax.tree.leaves(tree), jax.tree.leaves(ref_tree), strict=True):
        np.testing.assert_array_equal(leaf, ref_leaf)


def assert_same_losses_and_no_duplicates(workdir, reference):
    steps = [r["step"] for r in read_metrics(workdir) if "train/loss" in r]
    assert steps == sorted(set(steps)), "a resumed run must not log a step twice"
    assert losses(read_metrics(workdir)) == losses(read_metrics(reference))


def test_sigkill_after_a_checkpoint_then_rerun_is_bitwise_identical(reference, tmp_path):
    workdir = tmp_path / "run"
    proc = start_main(*RUN, f"--workdir={workdir}", stdout=subprocess.DEVNULL,
                      stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: (workdir / "checkpoints" / "20").exists()
                 and max(logged_steps(workdir), default=0) >= 21, 240, "step 21")
        proc.kill()
    finally:
        proc.kill()
        proc.wait()
    assert not (workdir / "checkpoints" / "40").exists(), "killed too late to test a resume"
    rerun = run_main(*RUN, f"--workdir={workdir}")
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "resuming from" in rerun.stderr
    assert_same_losses_and_no_duplicates(workdir, reference)
    assert_bitwise_equal(checkpoint_arrays(workdir, 40), checkpoint_arrays(reference, 40))


def test_sigterm_saves_where_it_is_and_exits_76_then_resumes(reference, tmp_path):
    workdir = tmp_path / "run"
    proc = start_main(*RUN, f"--workdir={workdir}", stdout=subprocess.DEVNULL,
                      stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: max(logged_steps(workdir), default=0) >= 5, 240, "step 5")
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == exit_codes.PREEMPTED, stderr[-3000:]  # "resume me"
    saved = sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())
    assert saved and 5 <= saved[-1] < 40, saved
    assert "preempted" in stderr
    rerun = run_main(*RUN, f"--workdir={workdir}")
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert_same_losses_and_no_duplicates(workdir, reference)
    assert_bitwise_equal(checkpoint_arrays(workdir, 40), checkpoint_arrays(reference, 40))


def logged_windows(workdir, log_every_steps: int) -> list[int]:
    """Every step that the train records' windows cover, in order (a window cut short
    says how many steps it has: train/window_steps)."""
    covered = []
    for record in read_metrics(workdir):
        if "train/loss" in record:
            steps = int(record.get("train/window_steps", log_every_steps))
            covered += range(record["step"] - steps + 1, record["step"] + 1)
    return covered


def saved_steps(workdir) -> list[int]:
    return sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())


def test_ctrl_c_saves_where_it_is_exits_76_in_one_line_and_no_step_goes_unlogged(reference,
                                                                                 tmp_path):
    workdir = tmp_path / "run"
    proc = start_main(*RUN, "--config.log_every_steps=3", f"--workdir={workdir}",
                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: max(logged_steps(workdir), default=0) >= 6, 240, "step 6")
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == exit_codes.PREEMPTED, stderr[-3000:]
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr
    stopped = saved_steps(workdir)[-1]
    assert 6 <= stopped < 40
    assert stderr.strip().splitlines()[-1] == (
        f"jdp: interrupted (Ctrl-C): saved a checkpoint at step {stopped}; rerun the same "
        "command to resume")
    # The window the stop cut short is reported at the stop, so the resumed run's first
    # window starts right after it.
    assert max(logged_steps(workdir)) == stopped
    rerun = run_main(*RUN, "--config.log_every_steps=3", f"--workdir={workdir}")
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert logged_windows(workdir, 3) == list(range(1, 41))  # every step once
    assert_bitwise_equal(checkpoint_arrays(workdir, 40), checkpoint_arrays(reference, 40))


SLOW_STOPPING_SAVE = """
    import time
    from jdp.train import actions

    real_call = actions.Preemption.__call__

    def slow(self, step, info):
        if self.notice.reached(step):
            time.sleep(120)  # the stop's save, on slow storage
        return real_call(self, step, info)

    actions.Preemption.__call__ = slow
"""


def test_a_second_ctrl_c_stops_at_once_and_the_complete_checkpoints_resume(reference,
                                                                           tmp_path):
    workdir = tmp_path / "run"
    script = tmp_path / "patched_main.py"
    script.write_text(textwrap.dedent(SLOW_STOPPING_SAVE) + textwrap.dedent("""
        from absl import app
        from jdp import main
        app.run(main.main, flags_parser=main._parse_flags)
        """))
    args = (*RUN, "--config.checkpoint.every_steps=4", f"--workdir={workdir}")
    with open(tmp_path / "stderr.txt", "w") as log:
        proc = subprocess.Popen([sys.executable, str(script), *args], cwd=REPO,
                                env={**main_env(), "PYTHONPATH": REPO},
                                stdout=subprocess.DEVNULL, stderr=log)
    try:
        wait_for(lambda: saved_steps_if_any(workdir) and max(logged_steps(workdir),
                                                                default=0) >= 6, 240, "step 6")
        proc.send_signal(signal.SIGINT)
        wait_for(lambda: "saving a checkpoint at the next step" in
                 (tmp_path / "stderr.txt").read_text(), 60, "the first Ctrl-C's notice")
        time.sleep(1.0)  # inside the (slow) stop
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)  # at once: not after the 120 s save
    finally:
        proc.kill()
        proc.wait()
    stderr = (tmp_path / "stderr.txt").read_text()
    assert proc.returncode == exit_codes.INTERRUPTED, stderr[-3000:]
    assert stderr.strip().splitlines()[-1].startswith("jdp: interrupted again")
    assert "Traceback" not in stderr
    kept = saved_steps(workdir)
    assert kept and kept[-1] % 4 == 0  # the periodic ones; the stop's save never began
    rerun = run_main(*args)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"checkpoints/{kept[-1]}" in rerun.stderr  # resumed from the newest complete one
    assert_bitwise_equal(checkpoint_arrays(workdir, 40), checkpoint_arrays(reference, 40))


def saved_steps_if_any(workdir) -> list[int]:
    return saved_steps(workdir) if (workdir / "checkpoints").exists() else []


def test_a_run_killed_after_a_wall_time_save_resumes_from_it(reference, tmp_path):
    workdir = tmp_path / "run"
    # Every 0.3 s: the 40 steps took under 1.2 s on jax 0.12.1, and a 1.2 s cadence saved
    # only at the end.
    args = (*RUN, "--config.checkpoint.every_steps=0", "--config.checkpoint.every_minutes=0.005",
            "--config.log_every_steps=2", f"--workdir={workdir}")
    proc = start_main(*args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: saved_steps_if_any(workdir), 240, "a wall-time checkpoint")
        proc.kill()
    finally:
        proc.kill()
        proc.wait()
    saved = saved_steps(workdir)
    assert saved[-1] < 40, "killed too late to test a resume"
    assert all(step % 2 == 0 for step in saved)  # decided at log steps
    rerun = run_main(*args)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"checkpoints/{saved[-1]}" in rerun.stderr and "resuming from" in rerun.stderr
    assert_bitwise_equal(checkpoint_arrays(workdir, 40), checkpoint_arrays(reference, 40))


def workdir_at_step_20(reference, tmp_path, name):
    """A copy of the reference run as it was after its step-20 checkpoint."""
    workdir = tmp_path / name
    (workdir / "checkpoints").mkdir(parents=True)
    shutil.copytree(reference / "checkpoints" / "20", workdir / "checkpoints" / "20")
    shutil.copy(reference / "config.json", workdir / "config.json")
    with open(workdir / "metrics.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in read_metrics(reference) if r["step"] <= 20)
    return workdir


@pytest.mark.parametrize("backend,device_count", [("pjit", 4), ("pmap", 8), ("pmap", 2)])
def test_a_checkpoint_resumes_on_another_topology_and_backend(reference, tmp_path, backend,
                                                             device_count):
    workdir = workdir_at_step_20(reference, tmp_path, "moved")
    # A crash during the save of step 40 leaves a tmp directory behind; it is skipped.
    (workdir / "checkpoints" / "40.orbax-checkpoint-tmp").mkdir()
    overrides = [a for a in RUN if not a.startswith("--config=")]
    result, records = train(VIT, workdir, *overrides, f"--config.parallel.backend={backend}",
                            devices=jax.devices()[:device_count])
    reference_losses = losses(read_metrics(reference))
    resumed = losses(records)
    assert sorted(resumed) == list(range(1, 41))
    np.testing.assert_allclose([resumed[s] for s in range(21, 41)],
                               [reference_losses[s] for s in range(21, 41)], rtol=1e-5)
    final = checkpoint_arrays(reference, 40)["params"]
    for (path, leaf), ref_leaf in zip(
            jax.tree_util.tree_flatten_with_path(jax.device_get(result.state.params))[0],
            jax.tree.leaves(final), strict=True):
        if "['key']['bias']" not in jax.tree_util.keystr(path):  # see test_equivalence.py
            np.testing.assert_allclose(leaf, ref_leaf, rtol=1e-5, atol=1e-6)


def test_a_workdir_of_another_config_is_refused_and_left_alone(reference, tmp_path):
    workdir = workdir_at_step_20(reference, tmp_path, "other")
    before = sorted(p.name for p in workdir.rglob("*"))
    proc = run_main(*RUN, f"--workdir={workdir}", "--config.seed=7", "--config.batch_size=128")
    assert proc.returncode == 2
    message = proc.stderr.strip().splitlines()[-1]
    assert "seed: 0 -> 7" in message and "batch_size: 64 -> 128" in message
    assert "new --workdir" in message
    assert sorted(p.name for p in workdir.rglob("*")) == before


@pytest.mark.parametrize("path", ["absolute", "relative"])
def test_init_from_loads_params_and_starts_at_step_0(reference, tmp_path, path, monkeypatch):
    init_from = reference
    if path == "relative":
        monkeypatch.chdir(reference.parent)
        init_from = reference.name
    result, records = train(os.path.join(REPO, VIT), tmp_path / "finetune",
                            *[a for a in RUN[1:]], "--config.total_steps=2",
                            "--config.warmup_steps=1", f"--config.checkpoint.init_from={init_from}")
    assert min(r["step"] for r in records) == 1
    # One step from the reference's params: close to them, far from a fresh init.
    reference_params = checkpoint_arrays(reference, 40)["params"]
    kernel = np.asarray(result.state.params["head"]["kernel"])
    assert np.abs(kernel - reference_params["head"]["kernel"]).max() < 0.05


def test_evaluate_reproduces_the_final_evaluation_and_takes_another_split(reference):
    from jdp.evaluate import evaluate_run

    final = [r for r in read_metrics(reference) if "eval/accuracy" in r][-1]
    again = evaluate_run(reference)
    np.testing.assert_allclose(again["eval/loss"], final["eval/loss"], rtol=1e-6)
    assert again["eval/accuracy"] == final["eval/accuracy"]
    part = evaluate_run(reference, changes={"data.eval_split": "train[:10%]"},
                        devices=jax.devices()[:2])
    assert part["eval/num_examples"] != final["eval/num_examples"]
    assert part["eval/loss"] != pytest.approx(final["eval/loss"])


def test_init_from_a_path_with_no_checkpoint_fails_clearly(tmp_path):
    proc = run_main(*RUN, f"--workdir={tmp_path / 'run'}",
                    f"--config.checkpoint.init_from={tmp_path / 'nowhere'}")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert str(tmp_path / "nowhere") in proc.stderr.strip().splitlines()[-1]


def test_init_from_a_different_model_names_the_parameter_and_shapes(reference, tmp_path):
    proc = run_main(*RUN, f"--workdir={tmp_path / 'run'}", "--config.model.size=tiny",
                    f"--config.checkpoint.init_from={reference}")
    assert proc.returncode == 2, proc.stderr[-3000:]
    message = proc.stderr.strip().splitlines()[-1]
    assert "params/encoder_block_0/LayerNorm_0/bias is (64,) in the checkpoint but (192,) " \
        "in the model" in message


def test_a_checkpoint_of_another_model_is_refused_before_the_init_is_compiled(
        reference, tmp_path, monkeypatch):
    """init_from's params are read against the abstract state: a mismatch fails before
    the model's init is compiled and run (which, for a large model, takes minutes)."""
    from jdp import main as jdp_main
    from jdp.checkpoint import CheckpointError
    from jdp.parallel import backends

    def init_global(*args, **kwargs):
        raise AssertionError("the init ran before init_from's checkpoint was checked")

    monkeypatch.setattr(backends.Backend, "init_global", init_global)
    config = load_config(VIT, *RUN[1:], "--config.model.size=tiny",
                         f"--config.checkpoint.init_from={reference}")
    with pytest.raises(CheckpointError, match=r"LayerNorm_0/bias is \(64,\) in the checkpoint"):
        jdp_main.run(config, VIT, str(tmp_path / "run"))


def test_a_changed_total_steps_resumes_and_says_what_it_does_to_the_schedule(tmp_path,
                                                                              monkeypatch):
    from jdp import main as jdp_main
    from jdp.checkpoint import CHECKPOINT_DIR
    from jdp.checkpoint.resume import check_resumable

    saved = json.loads(load_config(VIT).to_json())
    (tmp_path / CHECKPOINT_DIR).mkdir()
    (tmp_path / "config.json").write_text(json.dumps(saved))
    warnings = []
    monkeypatch.setattr(jdp_main.logging, "warning",
                        lambda message, *args: warnings.append(message % args))
    check_resumable(str(tmp_path), saved)  # the same config: nothing to say
    assert warnings == []
    check_resumable(str(tmp_path), {**saved, "total_steps": 2 * saved["total_steps"]})
    [warning] = warnings
    assert f"resuming with total_steps {2 * saved['total_steps']} instead of " \
        f"{saved['total_steps']}" in warning and "learning-rate schedule" in warning
