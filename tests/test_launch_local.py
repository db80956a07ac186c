"""launch/local.py: N local processes of one job, prefixed output, failing together."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LAUNCHER = REPO / "launch" / "local.py"
SUM_JOB = REPO / "tests" / "distributed_sum_job.py"
TIMEOUT_S = 60
# Bounds a launcher that should stop within seconds, so a hang fails the test quickly.
STOP_TIMEOUT_S = 20


def _load_launcher():
    spec = importlib.util.spec_from_file_location("launch_local", LAUNCHER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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


def test_device_count_flag_is_appended_or_replaced():
    launcher = _load_launcher()
    assert launcher.with_device_count("", 4) == "--xla_force_host_platform_device_count=4"
    assert (
        launcher.with_device_count("--a=1 --xla_force_host_platform_device_count=8 --b", 2)
        == "--a=1 --b --xla_force_host_platform_device_count=2"
    )


def test_gpu_slices_index_into_the_visible_gpus():
    launcher = _load_launcher()
    assert launcher.gpu_slice(1, 2, None) == "2,3"
    assert launcher.gpu_slice(1, 2, "4,5,6,7") == "6,7"
    with pytest.raises(ValueError, match="lists 4"):
        launcher.gpu_slice(2, 2, "4,5,6,7")
