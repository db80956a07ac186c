"""Real SLURM jobs on a single-node cluster started on this machine.

The jobs find their peers through JAX's SLURM detection alone (no JDP_* or
JAX_* addressing variables), as on a real cluster. The cluster comes from
launch/slurm/start_local_cluster.sh; without SLURM installed, or when it
cannot be started, the tests skip, unless JDP_REQUIRE_SLURM=1 (CI, where
SLURM is installed on purpose) makes that a failure.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest

from jdp.runtime import exit_codes
from runs import losses, read_metrics, train, xla_flags

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
START_CLUSTER = REPO / "launch" / "slurm" / "start_local_cluster.sh"
SBATCH_SCRIPT = REPO / "launch" / "slurm" / "jdp.sbatch"
SUM_JOB = REPO / "tests" / "distributed_sum_job.py"
INSTALL = "apt-get update && apt-get install -y slurmctld slurmd slurm-client munge"

NUM_TASKS = 2
DEVICES_PER_TASK = 4
CLUSTER_START_TIMEOUT_S = 120
JOB_TIMEOUT_S = 120
# SLURM's own bound on each job, in minutes: a job outliving the test is cancelled anyway.
JOB_TIME_LIMIT_MIN = 5
FINAL_JOB_STATES = {
    "BOOT_FAIL",
    "CANCELLED",
    "COMPLETED",
    "DEADLINE",
    "FAILED",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "PREEMPTED",
    "TIMEOUT",
}

# Set by the job's tasks, or choosing how JAX joins them: none may leak in from this process.
LEAKING_PREFIXES = ("SLURM_", "SBATCH_", "SRUN_", "JDP_")
LEAKING_NAMES = ("JAX_COORDINATOR_ADDRESS", "JAX_COORDINATOR_PORT", "JAX_LOCAL_DEVICE_IDS")
KEPT_NAMES = ("JDP_COMPILE_CACHE_DIR",)  # the session's cache (conftest.py), not the user's


@dataclasses.dataclass(frozen=True)
class Job:
    """What srun runs in each task, and how its per-task output is checked."""

    argv: list[str]
    check: Callable[[dict[int, list[str]]], None]


def _check_sum_job(output_by_task: dict[int, list[str]]) -> None:
    devices = NUM_TASKS * DEVICES_PER_TASK
    for task in range(NUM_TASKS):
        expected = (
            f"process_index={task} process_count={NUM_TASKS} local_devices={DEVICES_PER_TASK} "
            f"global_devices={devices} sum={devices * (devices + 1) // 2}"
        )
        assert expected in output_by_task.get(task, []), output_by_task


def sum_job(workdir: Path) -> Job:
    return Job([sys.executable, str(SUM_JOB)], _check_sum_job)


TRAIN_OVERRIDES = ("--config.total_steps=6", "--config.warmup_steps=1",
                   "--config.log_every_steps=2", "--config.eval_every_steps=0",
                   "--config.batch_size=64")


def jdp_main_job(workdir: Path) -> Job:
    """The real trainer in 2 tasks x 4 devices; it must follow the 1 x 8 trajectory."""

    def check(output_by_task: dict[int, list[str]]) -> None:
        for task in range(NUM_TASKS):
            assert any(f"[p{task}] step 6/6" in line
                       for line in output_by_task.get(task, [])), output_by_task
        _, reference = train("experiments/vit.py", workdir.parent / "reference",
                             *TRAIN_OVERRIDES)
        got, expected = losses(read_metrics(workdir)), losses(reference)
        assert sorted(got) == sorted(expected) == [2, 4, 6]
        np.testing.assert_allclose([got[s] for s in (2, 4, 6)],
                                   [expected[s] for s in (2, 4, 6)], rtol=1e-5)

    argv = [sys.executable, "-m", "jdp.main", "--config=experiments/vit.py"]
    return Job([*argv, f"--workdir={workdir}", *TRAIN_OVERRIDES], check)


# The job the srun test runs: the real trainer.
JOB = jdp_main_job


def _unavailable(reason: str) -> None:
    if os.environ.get("JDP_REQUIRE_SLURM") == "1":
        pytest.fail(f"{reason} (JDP_REQUIRE_SLURM=1)")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def slurm_cluster() -> None:
    if shutil.which("srun") is None or shutil.which("sbatch") is None:
        _unavailable(f"SLURM is not installed (no srun/sbatch on PATH); install with: {INSTALL}")
    try:
        started = subprocess.run(
            ["bash", str(START_CLUSTER)],
            capture_output=True,
            text=True,
            timeout=CLUSTER_START_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        _unavailable(f"{START_CLUSTER.name} did not finish in {CLUSTER_START_TIMEOUT_S}s")
    if started.returncode != 0:
        _unavailable(
            f"could not start a local SLURM cluster ({START_CLUSTER.name} exited "
            f"{started.returncode}): {started.stderr.strip()[-500:]}"
        )


def _job_env() -> dict[str, str]:
    env = {
        name: value
        for name, value in os.environ.items()
        if name in KEPT_NAMES
        or (not name.startswith(LEAKING_PREFIXES) and name not in LEAKING_NAMES)
    }
    env.update(
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=xla_flags(DEVICES_PER_TASK),
        PYTHONUNBUFFERED="1",
    )
    return env


def _cancel(job: str) -> None:
    subprocess.run(["scancel", job], capture_output=True, timeout=30)


def _srun(argv: list[str], job_name: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """Runs srun to completion; cancels the job unless it succeeded in time."""
    succeeded = False
    try:
        result = subprocess.run(
            argv, env=env, cwd=REPO, capture_output=True, text=True, timeout=JOB_TIMEOUT_S
        )
        succeeded = result.returncode == 0
        return result
    finally:
        if not succeeded:
            _cancel(f"--name={job_name}")


class JobEnd(NamedTuple):
    state: str
    exit_code: int
    restarts: int  # times the job was requeued


def _submit(argv: list[str], env: dict[str, str]) -> str:
    """Submits a batch job; returns its id."""
    submitted = subprocess.run(
        ["sbatch", "--parsable", *argv],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=30,
    )
    if "Requested node configuration is not available" in submitted.stderr:
        _unavailable(f"this SLURM cluster cannot give the job GPUs: {submitted.stderr.strip()}")
    assert submitted.returncode == 0, f"sbatch failed: {submitted.stderr}"
    return submitted.stdout.strip().split(";")[0]


def _show_job(job_id: str) -> dict[str, str]:
    shown = subprocess.run(
        ["scontrol", "show", "job", "--oneliner", job_id],
        capture_output=True,
        text=True,
        timeout=30,
    ).stdout
    return dict(re.findall(r"\b(\w+)=(\S*)", shown))


REQUEUE_SETTLE_S = 3.0


def _wait_for_end(job_id: str) -> JobEnd:
    """Waits for a batch job to end, requeues included; returns how it ended.

    Polls `scontrol` itself: `sbatch --wait` polls only every 10 s. A requeued
    job may start only two minutes after its requeue; its start is moved to now,
    but not within REQUEUE_SETTLE_S of the requeue: slurmd revokes the old run's
    credential with a time in whole seconds, and a run started in the same second
    is killed as "Job credential revoked" (the job then ends FAILED).
    """
    deadline = time.monotonic() + JOB_TIMEOUT_S
    waiting_since = None  # when the job was first seen waiting for its begin time
    while time.monotonic() < deadline:
        job = _show_job(job_id)
        if job.get("JobState") in FINAL_JOB_STATES:
            exit_code = int(job["ExitCode"].split(":")[0])
            return JobEnd(job["JobState"], exit_code, int(job["Restarts"]))
        waiting = job.get("JobState") == "PENDING" and job.get("Reason") == "BeginTime"
        waiting_since = (waiting_since or time.monotonic()) if waiting else None
        if waiting and time.monotonic() - waiting_since >= REQUEUE_SETTLE_S:
            subprocess.run(
                ["scontrol", "update", f"JobId={job_id}", "StartTime=now"],
                capture_output=True,
                timeout=30,
            )
        time.sleep(0.2)
    _cancel(job_id)
    pytest.fail(f"batch job {job_id} did not finish in {JOB_TIMEOUT_S}s")


def _sbatch(argv: list[str], env: dict[str, str]) -> JobEnd:
    """Submits a batch job and waits for it to end."""
    return _wait_for_end(_submit(argv, env))


def _output_by_task(labelled_output: str) -> dict[int, list[str]]:
    """Splits `srun --label` output ("0: text") into each task's lines."""
    lines: dict[int, list[str]] = {}
    for match in re.finditer(r"^\s*(\d+): (.*)$", labelled_output, re.MULTILINE):
        lines.setdefault(int(match[1]), []).append(match[2])
    return lines


def _job_name() -> str:
    return f"jdp-test-{uuid.uuid4().hex[:8]}"


def test_srun_tasks_form_one_jax_job(slurm_cluster, tmp_path):
    job, name = JOB(tmp_path / "workdir"), _job_name()
    (tmp_path / "workdir").mkdir()
    srun = [
        "srun",
        f"--job-name={name}",
        "--nodes=1",
        f"--ntasks={NUM_TASKS}",
        f"--time={JOB_TIME_LIMIT_MIN}",
        "--immediate=60",  # fail, not queue, when the cluster cannot take the job
        "--kill-on-bad-exit=1",
        "--label",
    ]
    result = _srun([*srun, *job.argv], name, _job_env())

    assert result.returncode == 0, f"srun exited {result.returncode}:\n{result.stderr[-3000:]}"
    job.check(_output_by_task(result.stdout + result.stderr))


def _run_sbatch_script(tmp_path: Path, layout: list[str]) -> dict[int, list[str]]:
    """sbatch jdp.sbatch with `python` replaced by a recorder that runs the sum job.

    Returns each task's lines: how the script called python, the GPU
    variables the task saw, then the sum job's output.
    """
    recorder, tasks_dir = tmp_path / "python", tmp_path / "tasks"
    tasks_dir.mkdir()
    recorder.write_text(
        "#!/bin/sh\n"
        f'out="{tasks_dir}/$SLURM_PROCID"\n'
        'echo "argv=$*" >"$out"\n'
        'echo "cuda_visible_devices=$CUDA_VISIBLE_DEVICES" >>"$out"\n'
        'echo "jax_local_device_ids=$JAX_LOCAL_DEVICE_IDS" >>"$out"\n'
        f'exec {sys.executable} {SUM_JOB} >>"$out" 2>&1\n'
    )
    recorder.chmod(0o755)
    output = tmp_path / "job.out"
    sbatch = [
        f"--output={output}",
        "--nodes=1",
        f"--time={JOB_TIME_LIMIT_MIN}",
        *layout,
        str(SBATCH_SCRIPT),
        "experiments/vit.py",
        str(tmp_path / "workdir"),
        "--config.total_steps=3",
    ]
    end = _sbatch(sbatch, dict(_job_env(), JDP_PYTHON=str(recorder)))
    output_by_task = {int(f.name): f.read_text().splitlines() for f in tasks_dir.iterdir()}
    job_output = output.read_text() if output.exists() else ""
    assert end == ("COMPLETED", 0, 0), f"{job_output[-3000:]}\n{output_by_task}"
    return output_by_task


def _visible_gpus(task_output: list[str]) -> list[str]:
    (line,) = [line for line in task_output if line.startswith("cuda_visible_devices=")]
    return [gpu for gpu in line.split("=", 1)[1].split(",") if gpu]


def test_sbatch_script_one_task_per_gpu(slurm_cluster, tmp_path):
    output = _run_sbatch_script(tmp_path, [f"--ntasks-per-node={NUM_TASKS}"])

    _check_sum_job(output)
    workdir = tmp_path / "workdir"
    for task in range(NUM_TASKS):
        assert (
            f"argv=-m jdp.main --config=experiments/vit.py --workdir={workdir} "
            "--config.total_steps=3"
        ) in output[task]
        # Each task sees only its own GPU (the default --gpus-per-task=1), as device 0.
        assert len(_visible_gpus(output[task])) == 1
        assert "jax_local_device_ids=0" in output[task]


def test_sbatch_script_one_task_per_node(slurm_cluster, tmp_path):
    output = _run_sbatch_script(tmp_path, ["--ntasks-per-node=1", "--gpus-per-task=4"])

    assert set(output) == {0}
    assert len(_visible_gpus(output[0])) == 4
    # All four GPUs the task sees, not only the one JAX's SLURM detection would pick.
    assert "jax_local_device_ids=0,1,2,3" in output[0]
    devices = DEVICES_PER_TASK
    assert (
        f"process_index=0 process_count=1 local_devices={devices} "
        f"global_devices={devices} sum={devices * (devices + 1) // 2}"
    ) in output[0]


# Stand-ins for `python -m jdp.main` in the requeue tests: each run of each
# task first appends "task restart_count" to DIR/runs, then does one of these.
EXIT_ON_SIGTERM_IN_FIRST_RUN = """
    marker = DIR / f"stopped.{task}"
    if not marker.exists():
        def on_sigterm(signum, frame):
            marker.touch()  # jdp saves a checkpoint here
            sys.exit(STATUS)
        signal.signal(signal.SIGTERM, on_sigterm)
        (DIR / f"ready.{task}").touch()
        time.sleep(JOB_TIMEOUT_S)
        sys.exit(1)  # no SIGTERM came
"""
# Every task exits STATUS, as every survivor of a lost peer does. The tasks meet first,
# and a task that srun ends (--kill-on-bad-exit sends SIGTERM to the others when the
# first exits) reports STATUS too, not 143: the step's status must not depend on which
# task a loaded machine ran first.
EXIT_ALWAYS = """
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(STATUS))
    run = os.environ.get("SLURM_RESTART_COUNT", "0")
    (DIR / f"exiting.{run}.{task}").touch()
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while (len(list(DIR.glob(f"exiting.{run}.*"))) < int(os.environ["SLURM_NTASKS"])
           and time.monotonic() < deadline):
        time.sleep(0.01)
    sys.exit(STATUS)
"""
# The first run of each task does EXIT_ALWAYS (so the race above cannot decide the
# step's status either), the second exits 0.
EXIT_ON_FIRST_RUN = """
    marker = DIR / f"stopped.{task}"
    if not marker.exists():
        marker.touch()
""" + textwrap.indent(EXIT_ALWAYS, "    ")


def _requeue_job(tmp_path: Path, behaviour: str, status: int, **env: str) -> tuple[str, Path]:
    """Submits jdp.sbatch with 2 tasks running a stand-in; returns the job id and its output."""
    stand_in = tmp_path / "python"
    stand_in.write_text(
        f"#!{sys.executable}\n"
        + textwrap.dedent(f"""
            import os, signal, sys, time
            from pathlib import Path
            DIR, STATUS, JOB_TIMEOUT_S = Path({str(tmp_path)!r}), {status}, {JOB_TIMEOUT_S}
            task = os.environ["SLURM_PROCID"]
            with open(DIR / "runs", "a") as runs:
                print(task, os.environ.get("SLURM_RESTART_COUNT", "0"), file=runs)
        """)
        + textwrap.dedent(behaviour)
        + "sys.exit(0)\n"
    )
    stand_in.chmod(0o755)
    output = tmp_path / "job.out"
    sbatch = [
        f"--output={output}",
        "--nodes=1",
        f"--ntasks-per-node={NUM_TASKS}",
        f"--time={JOB_TIME_LIMIT_MIN}",
        str(SBATCH_SCRIPT),
        "experiments/vit.py",
        str(tmp_path / "workdir"),
    ]
    return _submit(sbatch, dict(_job_env(), JDP_PYTHON=str(stand_in), **env)), output


def _runs(tmp_path: Path) -> list[str]:
    """"task restart_count" for each run of each task, sorted."""
    return sorted((tmp_path / "runs").read_text().splitlines())


def _both_runs_of_both_tasks() -> list[str]:
    return sorted(f"{task} {restarts}" for task in range(NUM_TASKS) for restarts in (0, 1))


@pytest.mark.parametrize("status", sorted(exit_codes.RESTARTABLE))
def test_sbatch_script_requeues_a_preempted_or_peer_lost_job_which_then_completes(
    slurm_cluster, tmp_path, status
):
    job_id, output = _requeue_job(tmp_path, EXIT_ON_FIRST_RUN, status)
    end = _wait_for_end(job_id)

    job_output = output.read_text()
    assert end == ("COMPLETED", 0, 1), job_output[-3000:]
    # The second run saw SLURM's restart count: the same job, run again.
    assert _runs(tmp_path) == _both_runs_of_both_tasks()
    assert f"jdp: the step exited {status} (" in job_output
    assert f"requeueing job {job_id} (1 of at most 10)" in job_output
    assert "jdp: run 2 of this job (requeued 1 time(s))" in job_output


def _wait_for_tasks(job_id: str, tmp_path: Path) -> None:
    """Waits until every task of the stand-in job handles SIGTERM."""
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while not all((tmp_path / f"ready.{task}").exists() for task in range(NUM_TASKS)):
        if time.monotonic() > deadline:
            _cancel(job_id)
            pytest.fail(f"the tasks of job {job_id} did not start in {JOB_TIMEOUT_S}s")
        time.sleep(0.1)


@pytest.mark.parametrize(
    "scancel",
    [
        # What --signal=TERM@120 does before the time limit: the tasks, not the batch shell.
        ["--signal=TERM"],
        # Only the batch shell (as --signal=B:TERM would): the script passes it on.
        ["--batch", "--signal=TERM"],
    ],
    ids=["steps", "batch_shell"],
)
def test_sigterm_lets_the_tasks_save_and_the_job_is_requeued(slurm_cluster, tmp_path, scancel):
    job_id, output = _requeue_job(
        tmp_path, EXIT_ON_SIGTERM_IN_FIRST_RUN, exit_codes.PREEMPTED
    )
    _wait_for_tasks(job_id, tmp_path)
    subprocess.run(["scancel", *scancel, job_id], check=True, timeout=30)
    end = _wait_for_end(job_id)

    job_output = output.read_text()
    assert end == ("COMPLETED", 0, 1), job_output[-3000:]
    # Both tasks handled SIGTERM (srun, signalled, would have SIGKILLed them).
    assert all((tmp_path / f"stopped.{task}").exists() for task in range(NUM_TASKS))
    assert _runs(tmp_path) == _both_runs_of_both_tasks()


def test_a_cancelled_job_stays_cancelled_though_its_tasks_saved(slurm_cluster, tmp_path):
    job_id, output = _requeue_job(
        tmp_path, EXIT_ON_SIGTERM_IN_FIRST_RUN, exit_codes.PREEMPTED
    )
    _wait_for_tasks(job_id, tmp_path)
    subprocess.run(["scancel", job_id], check=True, timeout=30)
    end = _wait_for_end(job_id)

    job_output = output.read_text()
    assert end == ("CANCELLED", exit_codes.PREEMPTED, 0), job_output[-3000:]
    assert "not running; not requeueing" in job_output
    assert _runs(tmp_path) == ["0 0", "1 0"]


def test_sbatch_script_does_not_requeue_a_bad_config(slurm_cluster, tmp_path):
    job_id, output = _requeue_job(tmp_path, EXIT_ALWAYS, exit_codes.BAD_CONFIG)
    end = _wait_for_end(job_id)

    assert end == ("FAILED", exit_codes.BAD_CONFIG, 0), output.read_text()[-3000:]
    assert _runs(tmp_path) == ["0 0", "1 0"]


def test_sbatch_script_requeues_at_most_jdp_max_requeues_times(slurm_cluster, tmp_path):
    job_id, output = _requeue_job(
        tmp_path, EXIT_ALWAYS, exit_codes.PEER_LOST, JDP_MAX_REQUEUES="1"
    )
    end = _wait_for_end(job_id)

    job_output = output.read_text()
    assert end == ("FAILED", exit_codes.PEER_LOST, 1), job_output[-3000:]
    assert _runs(tmp_path) == _both_runs_of_both_tasks()
    assert "already requeued 1 time(s) (JDP_MAX_REQUEUES=1); not requeueing" in job_output
