"""Several processes on one machine as several hosts, when something goes wrong: a dead
host stops the others with a report, SIGTERM to one saves on all, processes with
different configs refuse to start, a killed process is restarted and the job ends as if
uninterrupted, and a job that lost a host resumes smaller on the same example stream."""

import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from jdp.runtime import exit_codes
from runs import (
    REPO,
    checkpoint_arrays,
    free_port,
    logged_steps,
    losses,
    main_command,
    main_env,
    read_metrics,
    run_killing_one_trainer,
    run_two_processes,
    train,
)

pytestmark = pytest.mark.slow

VIT = "experiments/vit.py"


def start_processes(workdir, per_process_args, devices_per_process=4, experiment=VIT):
    port = free_port()
    children = []
    for index, extra in enumerate(per_process_args):
        env = main_env(devices_per_process, JDP_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                       JDP_NUM_PROCESSES=str(len(per_process_args)), JDP_PROCESS_ID=str(index))
        log = open(workdir / f"p{index}.log", "w")
        children.append(subprocess.Popen(
            [sys.executable, "-m", "jdp.main", f"--config={experiment}", f"--workdir={workdir}",
             *extra], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT))
    return children


def wait_for_step(step, workdir, children, timeout_s=240):
    deadline = time.monotonic() + timeout_s
    while max(logged_steps(workdir), default=0) < step:
        assert time.monotonic() < deadline and all(c.poll() is None for c in children), \
            (workdir / "p0.log").read_text()[-3000:]
        time.sleep(0.05)


def stop_all(children):
    for child in children:
        if child.poll() is None:
            child.kill()
        child.wait()


def test_a_killed_process_makes_the_other_exit_with_a_report(tmp_path):
    timeout_s = 10
    args = ["--config.total_steps=100000", "--config.log_every_steps=1",
            f"--config.watchdog_timeout_s={timeout_s}", "--config.batch_size=64"]
    children = start_processes(tmp_path, [args, args])
    try:
        wait_for_step(3, tmp_path, children)
        children[1].send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        children[0].wait(timeout=timeout_s + 30)
        elapsed = time.monotonic() - killed_at
    finally:
        stop_all(children)
    log = (tmp_path / "p0.log").read_text()
    assert children[0].returncode != 0
    assert elapsed <= timeout_s + 30
    # The report names the missing process (or jax's own heartbeat check fired first).
    assert "process 1" in log, log[-3000:]


def test_sigterm_to_one_process_saves_on_all_at_one_step_and_exits_76(tmp_path):
    args = ["--config.total_steps=100000", "--config.log_every_steps=1",
            "--config.batch_size=64"]
    children = start_processes(tmp_path, [args, args])
    try:
        wait_for_step(3, tmp_path, children)
        children[1].send_signal(signal.SIGTERM)
        codes = [child.wait(timeout=120) for child in children]
    finally:
        stop_all(children)
    logs = [(tmp_path / f"p{i}.log").read_text() for i in range(2)]
    assert codes == [exit_codes.PREEMPTED] * 2, [log[-2000:] for log in logs]
    steps = [int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()]
    assert len(steps) == 1 and steps[0] >= 3
    for log in logs:
        assert f"saved a checkpoint at step {steps[0]}" in log


def test_processes_with_different_configs_stop_at_start_naming_the_field(tmp_path):
    children = start_processes(tmp_path, [["--config.seed=0"], ["--config.seed=1"]],
                               devices_per_process=1)
    try:
        codes = [child.wait(timeout=120) for child in children]
    finally:
        stop_all(children)
    assert all(code != 0 for code in codes), codes
    for index in range(2):
        log = (tmp_path / f"p{index}.log").read_text()
        assert "Process 1 differs from process 0 in 'config'" in log, log[-3000:]
        assert "seed" in log
    assert not os.path.exists(tmp_path / "config.json")


# The shipped ViT, whose model cannot be built on process 1: a failure of one process
# before training starts, where the watchdog does not yet judge anyone.
FAILS_ON_PROCESS_1 = """
import importlib.util

import jax

_spec = importlib.util.spec_from_file_location("shipped_vit", {vit!r})
_vit = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_vit)
get_config = _vit.get_config


def build_model(config, *, num_classes):
    if jax.process_index() == 1:
        raise RuntimeError("no model on process 1")
    return _vit.build_model(config, num_classes=num_classes)
"""


def test_a_process_that_fails_at_start_ends_the_job_within_seconds(tmp_path):
    """Its peer waits for it in a collective or a barrier: the failing process exits
    without jax's exit barrier (which would wait for that peer for 300 s), so the
    launcher sees its status at once and stops the other. Past 150 s the job is killed
    and the test fails."""
    experiment = tmp_path / "fails_on_process_1.py"
    experiment.write_text(FAILS_ON_PROCESS_1.format(vit=os.path.join(REPO, VIT)))
    proc = run_two_processes(main_command(f"--config={experiment}", f"--workdir={tmp_path}/run",
                                          "--config.batch_size=64"), timeout=150)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "[p1] RuntimeError: no model on process 1" in proc.stderr, proc.stderr[-3000:]
    assert "process 1 exited with status 1" in proc.stderr


RESTARTED = ("--config.total_steps=12", "--config.warmup_steps=1", "--config.log_every_steps=1",
             "--config.eval_every_steps=0", "--config.batch_size=64",
             "--config.checkpoint.every_steps=4", "--config.watchdog_timeout_s=60")
# watchdog_timeout_s=60: a peer that dies is still named after 10 s of silence
# (watchdog.SILENCE_LIMIT_S), while a slow start on a loaded 2-core machine (the
# first step took 4.8 s in CI) is no false alarm that spends the restarts.


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    """An uninterrupted 2 x 4 run with checkpoints at steps 4, 8 and 12."""
    workdir = tmp_path_factory.mktemp("two_processes")
    proc = run_two_processes(main_command(f"--config={VIT}", f"--workdir={workdir}", *RESTARTED),
                             timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return workdir


def test_a_killed_process_is_restarted_and_the_run_ends_as_if_uninterrupted(two_processes,
                                                                             tmp_path):
    """kill -9 of one of 2 processes under launch/local.py --max_restarts=2: the job
    restarts from its newest checkpoint by itself and ends bitwise where an
    uninterrupted 2-process run ends, each step logged once."""
    workdir = tmp_path / "killed"
    returncode, stderr = run_killing_one_trainer(
        (f"--config={VIT}", f"--workdir={workdir}", *RESTARTED), max_restarts=2,
        reached=lambda: max(logged_steps(workdir), default=0) >= 6)
    launcher_lines = "\n".join(line for line in stderr.splitlines()
                               if line.startswith("launch/local.py") or "watchdog" in line)
    assert returncode == 0, launcher_lines + "\n" + stderr[-3000:]
    assert "restart 1 of 2" in stderr
    train_steps = [r["step"] for r in read_metrics(workdir) if "train/loss" in r]
    assert train_steps == list(range(1, 13))  # each step once, none lost
    expected = checkpoint_arrays(two_processes, 12)
    got = checkpoint_arrays(workdir, 12)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(a, b)


SLOW_STEPS = """
import importlib.util
import time

from jdp.hooks import Hook

_spec = importlib.util.spec_from_file_location("shipped_vit", {vit!r})
_vit = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_vit)
get_config, build_model = _vit.get_config, _vit.build_model


def build_hooks(config):
    return [Hook(lambda step, info: time.sleep(0.5), every=1)]
"""


def test_ctrl_c_to_one_process_saves_on_both_and_the_rerun_ends_bitwise_as_uninterrupted(
        two_processes, tmp_path):
    workdir = tmp_path
    slow = tmp_path / "slow_vit.py"  # the same training, its steps slowed by a hook
    slow.write_text(SLOW_STEPS.format(vit=os.path.join(REPO, VIT)))
    children = start_processes(workdir, [RESTARTED] * 2, experiment=slow)
    try:
        wait_for_step(5, workdir, children)
        children[1].send_signal(signal.SIGINT)  # as Ctrl-C in that process's terminal
        codes = [child.wait(timeout=120) for child in children]
    finally:
        stop_all(children)
    logs = [(workdir / f"p{i}.log").read_text() for i in range(2)]
    assert codes == [exit_codes.PREEMPTED] * 2, [log[-2000:] for log in logs]
    assert "Traceback" not in logs[1]
    stopped = max(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())
    assert 5 <= stopped < 12
    assert f"interrupted (Ctrl-C): saved a checkpoint at step {stopped}" in logs[1]
    assert f"saved a checkpoint at step {stopped}" in logs[0]  # the same step on both
    rerun = run_two_processes(main_command(f"--config={VIT}", f"--workdir={workdir}",
                                           *RESTARTED), timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    train_steps = [r["step"] for r in read_metrics(workdir) if "train/loss" in r]
    assert train_steps == list(range(1, 13))  # each step once, none lost
    for a, b in zip(jax.tree.leaves(checkpoint_arrays(workdir, 12)),
                    jax.tree.leaves(checkpoint_arrays(two_processes, 12)), strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_two_process_run_resumes_on_one_process_of_four_devices(two_processes, tmp_path):
    """Elastic shrink: a host lost, the job restarted smaller continues the same
    example stream with the same global batch."""
    workdir = tmp_path / "one"
    shutil.copytree(two_processes / "checkpoints" / "4", workdir / "checkpoints" / "4")
    shutil.copy(two_processes / "config.json", workdir / "config.json")
    _, records = train(VIT, workdir, *RESTARTED, devices=jax.devices()[:4])
    got, expected = losses(records), losses(read_metrics(two_processes))
    assert sorted(got) == list(range(5, 13))
    np.testing.assert_allclose([got[s] for s in sorted(got)],
                               [expected[s] for s in sorted(got)], rtol=1e-5)
