"""Several processes on one machine as several hosts (gloo over loopback): the same
trajectory as one process, a dead host stops the others with a report, and processes
with different configs refuse to start."""

import os
import shutil
import signal
import socket
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
    logged_steps,
    losses,
    main_env,
    read_metrics,
    run_killing_one_trainer,
    train,
)

pytestmark = pytest.mark.slow

VIT = "experiments/vit.py"
TRAIN = ("--config.total_steps=8", "--config.warmup_steps=1", "--config.log_every_steps=2",
         "--config.eval_every_steps=0", "--config.batch_size=64")


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """1 process x 8 devices, with checkpoints at steps 4 and 8."""
    workdir = tmp_path_factory.mktemp("one")
    return (*train(VIT, workdir, *TRAIN, "--config.checkpoint.every_steps=4"), workdir)


def launch_local(workdir, devices_per_process, *overrides, experiment=VIT, settings=TRAIN):
    return subprocess.run(
        [sys.executable, "launch/local.py", "--num_processes=2",
         f"--devices_per_process={devices_per_process}", "--", sys.executable, "-m",
         "jdp.main", f"--config={experiment}", f"--workdir={workdir}", *settings, *overrides],
        cwd=REPO, env=main_env(), capture_output=True, text=True, timeout=300)


def assert_params_match(saved, reference_params):
    for (path, leaf), ref_leaf in zip(jax.tree_util.tree_flatten_with_path(saved)[0],
                                      jax.tree.leaves(jax.device_get(reference_params)),
                                      strict=True):
        if "['key']['bias']" not in jax.tree_util.keystr(path):  # see test_equivalence.py
            np.testing.assert_allclose(leaf, ref_leaf, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", ["pjit", "pmap"])
def test_two_processes_of_four_devices_follow_one_process_of_eight(one_process, tmp_path,
                                                                   backend):
    workdir = tmp_path / "two"
    # pjit with the two-level reduction (reduce-scatter in each process, all-reduce
    # across them, all-gather), streaming through grain with input worker processes,
    # each process's workers making only its rows; pmap batches from memory, as the
    # one-process reference does, which reduces flat.
    options = {"pjit": ("--config.data.in_memory=false", "--config.data.num_workers=2",
                        "--config.parallel.reduction=two_level", "--config.parallel.mesh=hybrid"),
               "pmap": ("--config.data.num_workers=0",)}
    proc = launch_local(workdir, 4, f"--config.parallel.backend={backend}", *options[backend])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[p0]" in proc.stderr and "[p1]" in proc.stderr
    reference_result, reference, _ = one_process
    got, expected = losses(read_metrics(workdir)), losses(reference)
    assert sorted(got) == sorted(expected) == [2, 4, 6, 8]
    np.testing.assert_allclose([got[s] for s in sorted(got)],
                               [expected[s] for s in sorted(expected)], rtol=1e-5)
    assert_params_match(checkpoint_arrays(workdir, 8)["params"], reference_result.state.params)


def test_int8_across_two_processes_matches_two_virtual_hosts_in_one(tmp_path):
    """The compressed cross-host reduction across real processes (all-to-all and
    all-gather of int8 over gloo) computes what it computes between 2 virtual hosts
    of one process."""
    int8 = ("--config.parallel.reduction=two_level", "--config.parallel.cross_host_reduce=int8")
    reference_result, reference = train(VIT, tmp_path / "one", *TRAIN, *int8,
                                        "--config.parallel.hosts=2")
    proc = launch_local(tmp_path / "two", 4, *int8)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got, expected = losses(read_metrics(tmp_path / "two")), losses(reference)
    assert sorted(got) == sorted(expected) == [2, 4, 6, 8]
    np.testing.assert_allclose([got[s] for s in sorted(got)],
                               [expected[s] for s in sorted(expected)], rtol=1e-5)
    # Where float rounding differs by ~1e-7 (the in-host sums run in another process
    # layout), an int8 rounding can fall the other way: that value's residual moves
    # by a whole int8 step and a few params by ~5e-6.
    saved = checkpoint_arrays(tmp_path / "two", 8)
    for leaf, ref_leaf in zip(jax.tree.leaves(saved["params"]),
                              jax.tree.leaves(jax.device_get(reference_result.state.params)),
                              strict=True):
        np.testing.assert_allclose(leaf, ref_leaf, rtol=1e-4, atol=1e-4)
    for name in ("shard", "chunk"):
        residual, ref_residual = saved["residuals"][name], np.asarray(
            reference_result.state.residuals[name])
        assert np.abs(ref_residual).max() > 0
        # measured: 0.1-0.4% moved; a wrong cross-process exchange moves most of them
        assert np.mean(np.isclose(residual, ref_residual, rtol=1e-4, atol=1e-4)) > 0.98


def test_weighted_lm_loss_on_two_processes_follows_one_process(tmp_path):
    """Answer tokens weigh 1, the rest 0: each host holds a different token count."""
    lm = "experiments/lm.py"
    settings = ("--config.model.size=nano", "--config.data.num_eval=64",
                "--config.eval_batch_size=64", *TRAIN)
    reference_result, reference = train(lm, tmp_path / "one", *settings)
    proc = launch_local(tmp_path / "two", 4, experiment=lm, settings=settings)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got, expected = losses(read_metrics(tmp_path / "two")), losses(reference)
    assert sorted(got) == sorted(expected) == [2, 4, 6, 8]
    np.testing.assert_allclose([got[s] for s in sorted(got)],
                               [expected[s] for s in sorted(expected)], rtol=1e-5)
    assert_params_match(checkpoint_arrays(tmp_path / "two", 8)["params"],
                        reference_result.state.params)


@pytest.mark.parametrize("devices, sharding", [
    # FSDP over all 4 devices: params gathered and gradients reduce-scattered across
    # the processes.
    (2, ("--config.parallel.mesh=hybrid", "--config.parallel.shard_params=true")),
    # Hybrid sharding: FSDP inside each process, one sum of each device's 1/4 of the
    # gradient across them per optimizer step.
    (4, ("--config.parallel.shard_params=host",)),
], ids=["fsdp", "fsdp_inside_hosts"])
def test_a_one_process_checkpoint_resumes_sharded_on_two_processes(one_process, tmp_path,
                                                                   devices, sharding):
    """Replicated state saved by one process, restored sharded over 2 processes: the
    same trajectory."""
    reference_result, reference, reference_dir = one_process
    workdir = tmp_path / "moved"
    shutil.copytree(reference_dir / "checkpoints" / "4", workdir / "checkpoints" / "4")
    shutil.copy(reference_dir / "config.json", workdir / "config.json")
    proc = launch_local(workdir, devices, *sharding, "--config.checkpoint.every_steps=4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resuming from" in proc.stderr
    assert f"over {2 * devices} devices in 2 processes" in proc.stderr
    got, expected = losses(read_metrics(workdir)), losses(reference)
    assert sorted(got) == [6, 8]
    np.testing.assert_allclose([got[6], got[8]], [expected[6], expected[8]], rtol=1e-5)
    assert_params_match(checkpoint_arrays(workdir, 8)["params"], reference_result.state.params)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_processes(workdir, per_process_args, devices_per_process=4):
    port = free_port()
    children = []
    for index, extra in enumerate(per_process_args):
        env = main_env(devices_per_process, JDP_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                       JDP_NUM_PROCESSES=str(len(per_process_args)), JDP_PROCESS_ID=str(index))
        log = open(workdir / f"p{index}.log", "w")
        children.append(subprocess.Popen(
            [sys.executable, "-m", "jdp.main", f"--config={VIT}", f"--workdir={workdir}",
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
    children = start_processes(tmp_path, [args, args], devices_per_process=2)
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
    proc = launch_local(workdir, 4, settings=RESTARTED)
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
