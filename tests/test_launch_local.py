"""launch/local.py: N local processes of one job, prefixed output, failing together."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from jdp.runtime import exit_codes
from runs import load_launch_script

REPO = Path(__file__).resolve().parents[1]
LAUNCHER = REPO / "launch" / "local.py"
SUM_JOB = REPO / "tests" / "distributed_sum_job.py"
TIMEOUT_S = 60
# Bounds a launcher that should stop within seconds, so a hang fails the test quickly.
STOP_TIMEOUT_S = 20


@pytest.fixture
def launch():
    """Starts the launcher running `python -c script` in each process.

    Whatever a test leaves running is killed; the children die with it.
    """
    started: list[subprocess.Popen] = []

    def start(*options: str, script: str) -> subprocess.Popen:
        command = [sys.executable, str(LAUNCHER), *options, "--", sys.executable, "-c", script]
        started.append(
            subprocess.Popen(
                command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO
            )
        )
        return started[-1]

    yield start
    for launcher in started:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()


def _pid_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


@pytest.mark.slow
def test_two_processes_of_four_devices_compute_a_cross_process_sum():
    # An inherited device count (conftest sets 8) must be replaced, other flags kept.
    env = dict(
        os.environ,
        XLA_FLAGS="--xla_cpu_enable_fast_math=false --xla_force_host_platform_device_count=8",
    )
    result = subprocess.run(
        [sys.executable, str(LAUNCHER), "--num_processes=2", "--devices_per_process=4", "--"]
        + [sys.executable, str(SUM_JOB)],
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    for index in (0, 1):
        expected = (
            f"[p{index}] process_index={index} process_count=2 "
            "local_devices=4 global_devices=8 sum=36"
        )
        assert expected in lines, result.stdout


def test_a_failing_process_stops_the_others_and_sets_the_exit_code(launch, tmp_path):
    script = textwrap.dedent(f"""
        import os, sys, time
        index = os.environ["JDP_PROCESS_ID"]
        open(os.path.join({str(tmp_path)!r}, "pid" + index), "w").write(str(os.getpid()))
        print("started", flush=True)
        if index == "1":
            time.sleep(1)
            sys.exit(3)
        time.sleep(600)
    """)
    start = time.monotonic()
    launcher = launch("--num_processes=2", script=script)
    stdout, stderr = launcher.communicate(timeout=STOP_TIMEOUT_S)
    elapsed_s = time.monotonic() - start

    assert launcher.returncode == 3, stderr
    assert elapsed_s < 15, f"launcher took {elapsed_s:.1f}s to stop the sleeping process"
    assert "[p0] started" in stdout.splitlines() and "[p1] started" in stdout.splitlines()
    sleeper_pid = int((tmp_path / "pid0").read_text())
    assert not _pid_alive(sleeper_pid)


def test_a_process_ignoring_sigterm_is_killed_after_the_grace_period(launch):
    script = textwrap.dedent("""
        import os, signal, sys, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if os.environ["JDP_PROCESS_ID"] == "1":
            time.sleep(1)
            sys.exit(3)
        time.sleep(600)
    """)
    start = time.monotonic()
    launcher = launch("--num_processes=2", "--grace_s=1", script=script)
    _, stderr = launcher.communicate(timeout=STOP_TIMEOUT_S)

    assert launcher.returncode == 3, stderr
    assert time.monotonic() - start < 15


def test_sigterm_is_forwarded_to_every_process(launch, tmp_path):
    # Each process reports readiness by a file, then exits 0 on SIGTERM (like
    # a preempted jdp run that saved): the launcher must forward it and exit 0.
    script = textwrap.dedent(f"""
        import os, signal, sys, time
        def on_term(signum, frame):
            print("got SIGTERM", flush=True)
            sys.exit(0)
        signal.signal(signal.SIGTERM, on_term)
        open(os.path.join({str(tmp_path)!r}, "ready" + os.environ["JDP_PROCESS_ID"]), "w")
        time.sleep(600)
    """)
    launcher = launch("--num_processes=2", script=script)
    deadline = time.monotonic() + TIMEOUT_S
    while not all((tmp_path / f"ready{i}").exists() for i in (0, 1)):
        assert time.monotonic() < deadline and launcher.poll() is None, "processes never started"
        time.sleep(0.05)
    launcher.send_signal(signal.SIGTERM)
    stdout, stderr = launcher.communicate(timeout=STOP_TIMEOUT_S)

    assert launcher.returncode == 0, stderr
    assert {"[p0] got SIGTERM", "[p1] got SIGTERM"} <= set(stdout.splitlines())


def test_each_process_gets_its_own_id_and_the_shared_coordinator(launch):
    script = (
        "import os; print(os.environ['JDP_PROCESS_ID'], os.environ['JDP_NUM_PROCESSES'],"
        " os.environ['JDP_COORDINATOR_ADDRESS'])"
    )
    launcher = launch("--num_processes=3", "--port=12345", script=script)
    stdout, stderr = launcher.communicate(timeout=STOP_TIMEOUT_S)

    assert launcher.returncode == 0, stderr
    assert sorted(stdout.splitlines()) == [f"[p{i}] {i} 3 127.0.0.1:12345" for i in range(3)]


def _restarting_job(tmp_path: Path, first_run_status: int) -> str:
    """Process 1 exits `first_run_status` on its first run, process 0 waits to be stopped.

    Every start appends "process_id coordinator_address num_processes" to
    tmp_path/starts; on a later run every process exits 0.
    """
    return textwrap.dedent(f"""
        import os, sys, time
        starts, index = os.path.join({str(tmp_path)!r}, "starts"), os.environ["JDP_PROCESS_ID"]

        def started(process_id):
            if not os.path.exists(starts):
                return False
            return any(line.split()[0] == process_id for line in open(starts))

        first_run = not started(index)
        with open(starts, "a") as f:
            print(index, os.environ["JDP_COORDINATOR_ADDRESS"], os.environ["JDP_NUM_PROCESSES"],
                  file=f)
        if not first_run:
            sys.exit(0)
        if index == "1":
            while not started("0"):  # so that process 0's first start is on record
                time.sleep(0.01)
            sys.exit({first_run_status})
        time.sleep(600)
    """)


def _starts(tmp_path: Path) -> list[tuple[str, str]]:
    """(process id, coordinator address) of every start, in order."""
    lines = (tmp_path / "starts").read_text().splitlines()
    return [tuple(line.split()[:2]) for line in lines]


def _job_sizes(tmp_path: Path) -> list[str]:
    """JDP_NUM_PROCESSES of every start, in order."""
    return [line.split()[2] for line in (tmp_path / "starts").read_text().splitlines()]


def _restart_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("launch/local.py:")]


@pytest.mark.parametrize("status", sorted(exit_codes.RESTARTABLE))
def test_a_lost_peer_or_preemption_restarts_every_process_and_the_rerun_finishes(
    launch, tmp_path, status
):
    launcher = launch(
        "--num_processes=2", "--max_restarts=2", script=_restarting_job(tmp_path, status)
    )
    _, stderr = launcher.communicate(timeout=STOP_TIMEOUT_S)

    assert launcher.returncode == 0, stderr
    assert sorted(process for process, _ in _starts(tmp_path)) == ["0", "0", "1", "1"]
    meaning = "peer lost" if status == exit_codes.PEER_LOST else "preempted"
    assert _restart_lines(stderr) == [
        f"launch/local.py: process 1 exited with status {status} ({meaning}); restart 1 of 2"
    ]


def test_min_processes_restarts_without_the_failed_process_host(launch, tmp_path):
    launcher = launch(
        "--num_processes=2",
        "--min_processes=1",
        "--max_restarts=2",
        script=_restarting_job(tmp_path, exit_codes.FAILED),
    )
    _, stderr = launcher.communicate(timeout=STOP_TIMEOUT_S)

    assert launcher.returncode == 0, stderr
    # The rerun is one process, numbered 0 of 1: jdp continues the same stream on its devices.
    assert [process for process, _ in _starts(tmp_path)][2:] == ["0"]
    assert _job_sizes(tmp_path) == ["2", "2", "1"]
    assert _restart_lines(stderr) == [
        "launch/local.py: process 1 exited with status 1 (failed); restart 1 of 2 with "
        "1 process (its host counted as lost; --min_processes=1)"
    ]


def test_a_preemption_restarts_every_process_even_with_min_processes(launch, tmp_path):
    launcher = launch(
        "--num_processes=2",
        "--min_processes=1",
        "--max_restarts=1",
        script=_restarting_job(tmp_path, exit_codes.PREEMPTED),
    )
    _, stderr = launcher.communicate(timeout=STOP_TIMEOUT_S)

    assert launcher.returncode == 0, stderr
    assert _job_sizes(tmp_path) == ["2", "2", "2", "2"]


def test_each_restart_gets_a_fresh_coordinator_port(launch, tmp_path):
    launcher = launch(
        "--num_processes=2", "--max_restarts=1", script=_restarting_job(tmp_path, 75)
    )
    _, stderr = launcher.communicate(timeout=STOP_TIMEOUT_S)

    assert launcher.returncode == 0, stderr
    starts = _starts(tmp_path)
    first_run, second_run = {a for _, a in starts[:2]}, {a for _, a in starts[2:]}
    # Shared by the processes of one run, different between runs.
    assert len(first_run) == len(second_run) == 1
    assert first_run != second_run


def test_a_fixed_port_is_kept_across_restarts(launch, tmp_path):
    launcher = launch(
        "--num_processes=2",
        "--max_restarts=1",
        "--port=12346",
        script=_restarting_job(tmp_path, 75),
    )
    _, stderr = launcher.communicate(timeout=STOP_TIMEOUT_S)

    assert launcher.returncode == 0, stderr
    assert {address for _, address in _starts(tmp_path)} == {"127.0.0.1:12346"}


def _counting_job(tmp_path: Path, status_or_signal: str) -> str:
    """One line in tmp_path/runs per start, then `sys.exit(...)` or `os.kill(...)`."""
    return textwrap.dedent(f"""
        import os, signal, sys
        print("run", file=open(os.path.join({str(tmp_path)!r}, "runs"), "a"))
        {status_or_signal}
    """)


def _runs(tmp_path: Path) -> int:
    return len((tmp_path / "runs").read_text().splitlines())


def test_a_job_that_keeps_failing_ends_with_its_status_after_max_restarts(launch, tmp_path):
    launcher = launch(
        "--num_processes=1", "--max_restarts=2", script=_counting_job(tmp_path, "sys.exit(1)")
    )
    _, stderr = launcher.communicate(timeout=STOP_TIMEOUT_S)

    assert launcher.returncode == exit_codes.FAILED, stderr
    assert _runs(tmp_path) == 3
    assert _restart_lines(stderr) == [
        "launch/local.py: process 0 exited with status 1 (failed); restart 1 of 2",
        "launch/local.py: process 0 exited with status 1 (failed); restart 2 of 2",
        "launch/local.py: process 0 exited with status 1 (failed); "
        "stopping the others; no restarts left (2 used)",
    ]


def test_a_process_killed_by_a_signal_is_restarted(launch, tmp_path):
    script = _counting_job(tmp_path, "os.kill(os.getpid(), signal.SIGKILL)")
    launcher = launch("--num_processes=1", "--max_restarts=1", script=script)
    _, stderr = launcher.communicate(timeout=STOP_TIMEOUT_S)

    assert launcher.returncode == 128 + signal.SIGKILL, stderr
    assert _runs(tmp_path) == 2
    assert "(killed by SIGKILL); restart 1 of 1" in stderr


@pytest.mark.parametrize("status", sorted(exit_codes.PERMANENT))
def test_a_permanent_failure_is_not_restarted(launch, tmp_path, status):
    script = _counting_job(tmp_path, f"sys.exit({status})")
    launcher = launch("--num_processes=1", "--max_restarts=2", script=script)
    _, stderr = launcher.communicate(timeout=STOP_TIMEOUT_S)

    assert launcher.returncode == status, stderr
    assert _runs(tmp_path) == 1
    assert "not restarting" in stderr and "restart 1" not in stderr


def test_a_signal_to_the_launcher_is_not_answered_by_a_restart(launch, tmp_path):
    # The processes exit 76 (preempted) on SIGTERM, as jdp does after saving: the
    # launcher is being stopped itself and must pass 76 on, not start them again.
    script = textwrap.dedent(f"""
        import os, signal, sys, time
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(76))
        open(os.path.join({str(tmp_path)!r}, "ready" + os.environ["JDP_PROCESS_ID"]), "w")
        time.sleep(600)
    """)
    launcher = launch("--num_processes=2", "--max_restarts=2", script=script)
    deadline = time.monotonic() + TIMEOUT_S
    while not all((tmp_path / f"ready{i}").exists() for i in (0, 1)):
        assert time.monotonic() < deadline and launcher.poll() is None, "processes never started"
        time.sleep(0.05)
    launcher.send_signal(signal.SIGTERM)
    _, stderr = launcher.communicate(timeout=STOP_TIMEOUT_S)

    assert launcher.returncode == exit_codes.PREEMPTED, stderr
    assert "restart" not in stderr
    assert sorted(path.name for path in tmp_path.iterdir()) == ["ready0", "ready1"]


def test_max_restarts_must_not_be_negative():
    with pytest.raises(SystemExit):
        load_launch_script().parse_args(["--num_processes=1", "--max_restarts=-1", "--", "true"])


@pytest.mark.parametrize("value", ["0", "3"])
def test_min_processes_must_be_between_1_and_num_processes(value):
    with pytest.raises(SystemExit):
        load_launch_script().parse_args(
            ["--num_processes=2", f"--min_processes={value}", "--", "true"])


def test_device_count_flag_is_appended_or_replaced():
    from jdp.runtime.cpu_devices import cpu_device_env, with_device_count

    assert with_device_count("", 4) == "--xla_force_host_platform_device_count=4"
    assert (
        with_device_count("--a=1 --xla_force_host_platform_device_count=8 --b", 2)
        == "--a=1 --b --xla_force_host_platform_device_count=2"
    )
    assert cpu_device_env({"XLA_FLAGS": "--a=1", "OTHER": "x"}, 2) == {
        "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--a=1 --xla_force_host_platform_device_count=2"}


def test_gpu_slices_index_into_the_visible_gpus():
    launcher = load_launch_script()
    assert launcher.gpu_slice(1, 2, None) == "2,3"
    assert launcher.gpu_slice(1, 2, "4,5,6,7") == "6,7"
    with pytest.raises(ValueError, match="lists 4"):
        launcher.gpu_slice(2, 2, "4,5,6,7")
