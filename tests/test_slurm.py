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
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from runs import losses, read_metrics, train

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
        if not name.startswith(LEAKING_PREFIXES) and name not in LEAKING_NAMES
    }
    env.update(
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=f"--xla_force_host_platform_device_count={DEVICES_PER_TASK}",
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


def _sbatch(argv: list[str], env: dict[str, str]) -> tuple[str, int]:
    """Submits a batch job and waits for it; returns its final state and exit code.

    Polls `scontrol` itself: `sbatch --wait` polls only every 10 s.
    """
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
    job_id = submitted.stdout.strip().split(";")[0]
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while time.monotonic() < deadline:
        shown = subprocess.run(
            ["scontrol", "show", "job", "--oneliner", job_id],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
        state = re.search(r"\bJobState=(\S+)", shown)
        if state and state[1] in FINAL_JOB_STATES:
            return state[1], int(re.search(r"\bExitCode=(\d+):", shown)[1])
        time.sleep(0.2)
    _cancel(job_id)
    pytest.fail(f"batch job {job_id} did not finish in {JOB_TIMEOUT_S}s")


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
    state, exit_code = _sbatch(sbatch, dict(_job_env(), JDP_PYTHON=str(recorder)))
    output_by_task = {int(f.name): f.read_text().splitlines() for f in tasks_dir.iterdir()}
    job_output = output.read_text() if output.exists() else ""
    assert (state, exit_code) == ("COMPLETED", 0), f"{job_output[-3000:]}\n{output_by_task}"
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
