"""jdp.distributed: how a process joins a job, bounded joining, the cross-process check.

The multi-process tests start real jax processes over loopback (4 CPU devices
each, gloo); their helpers are shared with test_watchdog.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import jax
import pytest

from jdp.runtime import distributed, watchdog
from runs import free_port, stacks_then_kill, xla_flags

REPO = Path(__file__).resolve().parent.parent

# Variables by which jax would detect a cluster; cleared so tests are hermetic.
_CLUSTER_VARIABLES = ("OMPI_MCA_orte_hnp_uri", "KUBERNETES_SERVICE_HOST", "TPU_WORKER_HOSTNAMES")
_SLURM_TASK_1_OF_2 = {
    "SLURM_JOB_ID": "4242",
    "SLURM_STEP_NODELIST": "node[001-002]",
    "SLURM_NTASKS": "2",
    "SLURM_PROCID": "1",
    "SLURM_LOCALID": "0",
}


# -- helpers for multi-process tests ---------------------------------------------------------


@dataclasses.dataclass
class Child:
    popen: subprocess.Popen
    stdout_path: Path
    stderr_path: Path

    @property
    def stdout(self) -> str:
        return self.stdout_path.read_text()

    @property
    def stderr(self) -> str:
        return self.stderr_path.read_text()


@contextlib.contextmanager
def run_processes(
    code: str, argvs: list[list[str]], tmp_path: Path, *, devices: int = 4
) -> Iterator[list[Child]]:
    """Starts `python -c code *argv` per argv (jdp importable, `devices` CPU devices each);
    kills whatever is still running on the way out."""
    env = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith(("SLURM_", "JDP_", "JAX_")) and name not in _CLUSTER_VARIABLES
    }
    env.update(
        XLA_FLAGS=xla_flags(devices),
        JAX_PLATFORMS="cpu",
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),
        PYTHONUNBUFFERED="1",
    )
    children: list[Child] = []
    try:
        for i, argv in enumerate(argvs):
            out, err = tmp_path / f"process{i}.out", tmp_path / f"process{i}.err"
            with out.open("w") as out_file, err.open("w") as err_file:
                popen = subprocess.Popen(
                    [sys.executable, "-c", code, *argv],
                    stdout=out_file,
                    stderr=err_file,
                    env=env,
                    cwd=REPO,
                )
            children.append(Child(popen, out, err))
        yield children
    finally:
        for child in children:
            if child.popen.poll() is None:
                child.popen.kill()
            child.popen.wait(timeout=30)


def wait_all(children: list[Child], timeout_s: float) -> list[int]:
    """Exit codes, failing the test if any process is still running after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    codes = []
    for child in children:
        try:
            codes.append(child.popen.wait(timeout=max(deadline - time.monotonic(), 0.1)))
        except subprocess.TimeoutExpired:
            stacks_then_kill(child.popen)
            pytest.fail(f"process still running after {timeout_s} s:\n{child.stderr[-6000:]}")
    return codes


# A process that joins a job and optionally compares values; prints when it
# starts joining (time.monotonic is one clock for all processes on Linux).
_JOIN = """
import json, sys, time
args = json.loads(sys.argv[1])
from jdp.runtime import distributed
print("joining at", time.monotonic(), flush=True)
distributed.initialize(
    args["address"], args["num_processes"], args["process_id"], timeout_s=args["timeout_s"]
)
if "values" in args:
    distributed.check_same_across_processes(args["values"], timeout_s=30)
print("done", flush=True)
"""


def join_args(port: int, num_processes: int, process_id: int, **extra: object) -> list[str]:
    args = dict(address=f"127.0.0.1:{port}", num_processes=num_processes, process_id=process_id)
    return [json.dumps({"timeout_s": 20, **args, **extra})]


# -- resolving how to join ---------------------------------------------------------------------


@pytest.fixture
def no_cluster(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in _CLUSTER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


JDP_ENV = {
    "JDP_COORDINATOR_ADDRESS": "10.0.0.1:1234",
    "JDP_NUM_PROCESSES": "4",
    "JDP_PROCESS_ID": "3",
}


def test_explicit_arguments_win_over_environment_and_cluster(no_cluster):
    for name, value in _SLURM_TASK_1_OF_2.items():
        no_cluster.setenv(name, value)
    launch = distributed.resolve_launch("127.0.0.1:5000", 2, 1, JDP_ENV)
    assert launch == distributed.Launch("flags", "127.0.0.1:5000", 2, 1)


def test_environment_wins_over_cluster_detection(no_cluster):
    for name, value in _SLURM_TASK_1_OF_2.items():
        no_cluster.setenv(name, value)
    launch = distributed.resolve_launch(None, None, None, JDP_ENV)
    assert (launch.coordinator_address, launch.num_processes, launch.process_id) == (
        "10.0.0.1:1234",
        4,
        3,
    )


def test_detected_slurm_cluster_is_left_to_jax(no_cluster):
    for name, value in _SLURM_TASK_1_OF_2.items():
        no_cluster.setenv(name, value)
    launch = distributed.resolve_launch(None, None, None, {})
    assert launch.source == "jax's SlurmCluster detection"
    assert launch.coordinator_address is None and not launch.is_single_process


def test_nothing_set_and_no_cluster_is_a_single_process(no_cluster):
    assert distributed.resolve_launch(None, None, None, {}).is_single_process


def test_num_processes_one_alone_is_a_single_process_even_in_a_cluster(no_cluster):
    for name, value in _SLURM_TASK_1_OF_2.items():
        no_cluster.setenv(name, value)
    assert distributed.resolve_launch(None, 1, None, {}).is_single_process


@pytest.mark.parametrize(
    "arguments, environ, missing",
    [
        (("127.0.0.1:5000", None, None), {}, "--num_processes or --process_id"),
        ((None, 2, 1), JDP_ENV, "--coordinator_address"),  # never completed from JDP_*
        ((None, None, None), {"JDP_NUM_PROCESSES": "2", "JDP_PROCESS_ID": "0"}, "JDP_COORDINATOR"),
    ],
)
def test_partial_settings_name_what_is_missing(no_cluster, arguments, environ, missing):
    with pytest.raises(ValueError, match=f"Incomplete multi-process settings.*not {missing}"):
        distributed.resolve_launch(*arguments, environ)


@pytest.mark.parametrize(
    "arguments, message",
    [
        (("127.0.0.1:5000", 2, 2), r"--process_id=2 must be in 0..1"),
        (("127.0.0.1", 2, 0), r"--coordinator_address='127.0.0.1' must be host:port"),
    ],
)
def test_invalid_settings_name_the_value(no_cluster, arguments, message):
    with pytest.raises(ValueError, match=message):
        distributed.resolve_launch(*arguments, {})


def test_non_integer_environment_value_is_named(no_cluster):
    with pytest.raises(ValueError, match="JDP_NUM_PROCESSES='two' is not an integer"):
        distributed.resolve_launch(None, None, None, {**JDP_ENV, "JDP_NUM_PROCESSES": "two"})


def test_single_process_does_not_start_jax_distributed(no_cluster):
    calls = []
    no_cluster.setattr(jax.distributed, "initialize", lambda *a, **k: calls.append((a, k)))
    distributed.initialize(None, None, None, environ={})
    assert calls == []


def test_cluster_is_joined_by_bare_jax_initialize_with_jdp_timeouts(no_cluster):
    for name, value in _SLURM_TASK_1_OF_2.items():
        no_cluster.setenv(name, value)
    calls = []
    no_cluster.setattr(jax.distributed, "initialize", lambda *a, **k: calls.append((a, k)))
    distributed.initialize(None, None, None, timeout_s=12.5, environ={})
    [(args, kwargs)] = calls
    assert args == (None, None, None) and kwargs["cluster_detection_method"] is None
    assert kwargs["initialization_timeout"] == 13
    assert kwargs["heartbeat_timeout_seconds"] == distributed.HEARTBEAT_TIMEOUT_S


def test_explicit_settings_turn_off_jax_cluster_detection(no_cluster):
    for name, value in _SLURM_TASK_1_OF_2.items():
        no_cluster.setenv(name, value)  # would make jax restrict the visible devices
    calls = []
    no_cluster.setattr(jax.distributed, "initialize", lambda *a, **k: calls.append((a, k)))
    distributed.initialize(None, None, None, environ=JDP_ENV)
    [(args, kwargs)] = calls
    assert args == ("10.0.0.1:1234", 4, 3) and kwargs["cluster_detection_method"] == "deactivate"
    assert kwargs["coordinator_bind_address"] is None  # jax's default: every interface


@pytest.mark.parametrize("address, bind", [
    ("127.0.0.1:1234", "127.0.0.1:1234"), ("localhost:80", "localhost:80"),
    ("[::1]:1234", "[::1]:1234"), ("10.0.0.1:1234", None), ("node-0:1234", None), (None, None)])
def test_a_loopback_coordinator_listens_on_loopback_only(address, bind):
    """Processes of one machine (launch/local.py) are served on the loopback interface,
    not on every interface of the machine; other hosts need jax's default."""
    assert distributed.loopback_bind_address(address) == bind


def test_check_same_is_a_no_op_for_one_process():
    distributed.check_same_across_processes({"config": "{}"})


class _FailingJob:
    """jax.distributed's state and client for a process of `count` whose failure the
    processes in `failed` also record; the barrier gives up unless all of them did."""

    def __init__(self, me: int, count: int, failed: set[int]):
        self.process_id, self.num_processes, self.client = me, count, self
        self.store = {f"jdp/failures/{index}": "1" for index in failed}

    def key_value_set(self, key: str, value: str, allow_overwrite: bool = False) -> None:
        self.store[key] = value

    def key_value_dir_get(self, prefix: str) -> list[tuple[str, str]]:
        return [(key, value) for key, value in self.store.items() if key.startswith(prefix)]

    def wait_at_barrier(self, barrier_id: str, timeout_ms: int) -> None:
        if len(self.key_value_dir_get("jdp/failures/")) < self.num_processes:
            raise jax.errors.JaxRuntimeError(f"DEADLINE_EXCEEDED: Barrier timed out: {barrier_id}")


@pytest.mark.parametrize("failed, named", [
    ({1, 2, 3}, None), ({2}, "processes 1, 3 did not fail"), ({1, 2}, "process 3 did not fail")])
def test_a_failed_process_names_the_processes_that_did_not_fail_with_it(
        monkeypatch, failed, named):
    """The survivor of a peer killed mid-collective fails too (gloo: connection closed by
    peer); its exit must name the peer, not only say that the others did not fail."""
    exits = []

    def exit_now(message: str, exit_code: int) -> None:
        exits.append((message, exit_code))
        raise SystemExit(exit_code)

    monkeypatch.setattr(watchdog, "exit_now", exit_now)
    monkeypatch.setattr(distributed, "job_state", lambda: _FailingJob(0, 4, failed))
    threads_before = set(threading.enumerate())
    with pytest.raises(SystemExit), distributed.ending_promptly_on_failure():
        raise RuntimeError("Gloo all-reduce failed: Connection closed by peer")
    [(message, code)] = exits
    assert code == 1
    # The backstop against a hung coordinator must not outlive the wait it guards: it
    # would end the process 20 s later (here: a pytest worker) whatever it was doing.
    started = set(threading.enumerate()) - threads_before
    for thread in started:
        thread.join(timeout=5)
    assert not [thread for thread in started if thread.is_alive()]
    if named is None:
        assert message == ""
    else:
        assert message.startswith(f"jdp: process 0 of 4 failed; {named} with it within 10 s")
        assert message.endswith("exiting with status 1 without waiting for them")


# -- multi-process -------------------------------------------------------------------------------


@pytest.mark.slow
def test_unreachable_coordinator_fails_within_timeout_with_message(tmp_path):
    port = free_port()  # nobody serves it
    argv = join_args(port, 2, 1, timeout_s=3)
    with run_processes(_JOIN, [argv], tmp_path) as [child]:
        [code] = wait_all([child], timeout_s=60)
        ended = time.monotonic()
    assert code == watchdog.EXIT_CODE, child.stderr
    joining_at = float(child.stdout.split()[2])
    assert ended - joining_at < 3 + 2, "gave up later than timeout_s allows"
    for part in (f"coordinator 127.0.0.1:{port}", "process 1 of 2", "timeout_s=3", "reachable"):
        assert part in child.stderr


@pytest.mark.slow
def test_process_with_a_different_process_count_stops_every_process(tmp_path):
    port = free_port()
    argvs = [join_args(port, 2, 0), join_args(port, 3, 1)]
    with run_processes(_JOIN, argvs, tmp_path) as children:
        codes = wait_all(children, timeout_s=90)
    for child, code in zip(children, codes, strict=True):
        assert code != 0
        assert "Process 1 differs from process 0 in 'num_processes'" in child.stderr
        assert "process 0 has 2, process 1 has 3" in child.stderr


VALUES = {"config": json.dumps({"batch_size": 128, "model": {"width": 64}}), "jax": jax.__version__}


@pytest.mark.slow
def test_processes_with_the_same_values_pass_the_check(tmp_path):
    port = free_port()
    argvs = [join_args(port, 2, i, values=VALUES) for i in range(2)]
    with run_processes(_JOIN, argvs, tmp_path) as children:
        codes = wait_all(children, timeout_s=90)
    assert codes == [0, 0], [child.stderr[-2000:] for child in children]
    assert all(child.stdout.rstrip().endswith("done") for child in children)


@pytest.mark.slow
def test_a_different_config_stops_every_process_naming_the_field(tmp_path):
    port = free_port()
    other = {**VALUES, "config": json.dumps({"batch_size": 256, "model": {"width": 64}})}
    argvs = [join_args(port, 2, 0, values=VALUES), join_args(port, 2, 1, values=other)]
    with run_processes(_JOIN, argvs, tmp_path) as children:
        codes = wait_all(children, timeout_s=90)
    for child, code in zip(children, codes, strict=True):
        assert code != 0
        assert "Process 1 differs from process 0 in 'config'" in child.stderr
        assert "at 'batch_size' process 0 has 128, process 1 has 256" in child.stderr
