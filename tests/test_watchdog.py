"""jdp.watchdog: a stalled, dead or unreachable process ends the others with a report.

Unit tests drive `check()` / `exchange()` with a fake clock and an in-memory
key-value store standing in for jax's coordination service; the slow tests
kill one of two real processes mid-training.
"""

from __future__ import annotations

import re
import signal
import time

import pytest
from test_distributed import free_port, join_args, run_processes, wait_all

from jdp.runtime import distributed, watchdog
from jdp.runtime.watchdog import Watchdog

TIMEOUT_S = 10.0


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class FakeStore:
    """The coordination service's key-value store, shared by the processes of a test."""

    def __init__(self) -> None:
        self.data: dict[str, str] = {}
        self.unreachable = False

    def key_value_set(self, key: str, value: str, allow_overwrite: bool = False) -> None:
        if self.unreachable:
            raise RuntimeError("UNAVAILABLE: failed to connect to the coordination service")
        assert allow_overwrite or key not in self.data
        self.data[key] = value

    def key_value_dir_get(self, key: str) -> list[tuple[str, str]]:
        if self.unreachable:
            raise RuntimeError("UNAVAILABLE: failed to connect to the coordination service")
        return sorted((k, v) for k, v in self.data.items() if k.startswith(key))


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def make_job(clock: FakeClock, count: int = 2) -> tuple[FakeStore, list[Watchdog]]:
    store = FakeStore()
    dogs = [
        Watchdog(TIMEOUT_S, clock=clock, kv_store=store, process_index=i, process_count=count)
        for i in range(count)
    ]
    return store, dogs


def single(clock: FakeClock) -> Watchdog:
    return Watchdog(TIMEOUT_S, clock=clock, process_index=0, process_count=1)


# -- one process -------------------------------------------------------------------------------


def test_nothing_is_judged_before_the_first_heartbeat(clock):
    dog = single(clock)
    clock.advance(1000.0)  # a long first compilation
    assert dog.check() is None


def test_quiet_while_heartbeats_arrive_within_the_timeout(clock):
    dog = single(clock)
    for step in range(100):
        dog.heartbeat(step)
        clock.advance(TIMEOUT_S)  # exactly at the limit is still fine
        assert dog.check() is None


def test_fires_when_this_process_stops_making_progress(clock):
    dog = single(clock)
    dog.heartbeat(41)
    dog.heartbeat(42)
    clock.advance(TIMEOUT_S + 0.5)
    report = dog.check()
    assert report is not None
    assert report.startswith("jdp watchdog: process 0 of 1 gives up at step 42")
    assert "process 0 (this process): no progress for 10.5 s after step 42" in report


# -- several processes, through the store -----------------------------------------------------


def beat_and_exchange(clock, beating, exchanging, seconds, first_step=0):
    """Simulates `seconds` one-second steps: `beating` heartbeat, `exchanging` talk to the store."""
    for step in range(first_step, first_step + seconds):
        clock.advance(1.0)
        for dog in beating:
            dog.heartbeat(step)
        for dog in exchanging:
            dog.exchange()


def test_quiet_while_every_process_progresses(clock):
    _, dogs = make_job(clock, count=3)
    for _ in range(5):
        beat_and_exchange(clock, dogs, dogs, seconds=20)
        assert [dog.check() for dog in dogs] == [None, None, None]


def test_names_a_peer_that_went_silent(clock):
    _, (dog0, dog1) = make_job(clock)
    beat_and_exchange(clock, [dog0, dog1], [dog0, dog1], seconds=30)  # steps 0..29
    # Process 1 dies; process 0 keeps publishing but, blocked in a collective, stops stepping.
    beat_and_exchange(clock, [], [dog0], seconds=10)
    assert dog0.check() is None
    beat_and_exchange(clock, [], [dog0], seconds=1)
    report = dog0.check()
    assert report is not None and "gives up at step 29" in report
    lines = report.splitlines()
    # Process 0 saw process 1's last record one exchange after it was written.
    assert lines[1].strip().startswith("process 1: silent for 10.0 s, last seen after step 29")
    assert lines[2].strip().startswith("process 0 (this process): no progress for 11.0 s")


def test_fires_on_a_silent_peer_even_while_this_process_progresses(clock):
    _, (dog0, dog1) = make_job(clock)
    beat_and_exchange(clock, [dog0, dog1], [dog0, dog1], seconds=5)
    beat_and_exchange(clock, [dog0], [dog0], seconds=11, first_step=5)
    assert dog0.check() is None
    beat_and_exchange(clock, [dog0], [dog0], seconds=1, first_step=16)
    report = dog0.check()
    assert report is not None and "process 1: silent for 11.0 s, last seen after step 4" in report
    assert "this process" not in report  # it did progress


def test_a_silent_peer_is_named_within_the_silence_limit_whatever_timeout_s(clock):
    # With the default timeout_s=600, jax's coordination service would abort every process
    # (SIGABRT, no report) long before 600 s: silence is judged after SILENCE_LIMIT_S.
    store = FakeStore()
    dogs = [Watchdog(600.0, clock=clock, kv_store=store, process_index=i, process_count=2)
            for i in range(2)]
    beat_and_exchange(clock, dogs, dogs, seconds=30)
    limit = int(watchdog.SILENCE_LIMIT_S)
    # Process 0 sees process 1's last record one exchange after it was written.
    beat_and_exchange(clock, [dogs[0]], [dogs[0]], seconds=limit + 1, first_step=30)
    assert dogs[0].check() is None
    beat_and_exchange(clock, [dogs[0]], [dogs[0]], seconds=1, first_step=31 + limit)
    report = dogs[0].check()
    assert report is not None
    assert f"process 1: silent for {limit + 1}.0 s, last seen after step 29" in report
    assert limit < distributed.HEARTBEAT_TIMEOUT_S / 2  # jax's own verdict comes much later


def test_a_peer_alive_but_stuck_is_judged_by_timeout_s_not_the_silence_limit(clock):
    store = FakeStore()
    dogs = [Watchdog(60.0, clock=clock, kv_store=store, process_index=i, process_count=2)
            for i in range(2)]
    beat_and_exchange(clock, dogs, dogs, seconds=5)
    beat_and_exchange(clock, [dogs[0]], dogs, seconds=61, first_step=5)  # 1 publishes, no steps
    assert dogs[0].check() is None
    beat_and_exchange(clock, [dogs[0]], dogs, seconds=1, first_step=66)
    assert "process 1: alive but no progress for 61.0 s" in dogs[0].check()


def test_a_peer_still_compiling_is_judged_by_timeout_s(clock):
    store = FakeStore()
    dogs = [Watchdog(60.0, clock=clock, kv_store=store, process_index=i, process_count=2)
            for i in range(2)]
    beat_and_exchange(clock, [dogs[0]], [dogs[0]], seconds=60)  # 1 has not started its watchdog
    assert dogs[0].check() is None


def test_names_a_peer_alive_but_stuck(clock):
    _, (dog0, dog1) = make_job(clock)
    beat_and_exchange(clock, [dog0, dog1], [dog0, dog1], seconds=5)
    beat_and_exchange(clock, [dog0], [dog0, dog1], seconds=12, first_step=5)
    report = dog0.check()
    assert report is not None
    assert "process 1: alive but no progress for 11.0 s after step 4" in report


def test_names_a_peer_that_never_reported(clock):
    _, (dog0, _) = make_job(clock)
    beat_and_exchange(clock, [dog0], [dog0], seconds=12)
    report = dog0.check()
    assert report is not None
    assert "process 1: has not reported since this process's first step" in report


def test_reports_an_unreachable_coordinator(clock):
    store, (dog0, dog1) = make_job(clock)
    beat_and_exchange(clock, [dog0, dog1], [dog0, dog1], seconds=5)
    store.unreachable = True
    beat_and_exchange(clock, [dog0, dog1], [dog0, dog1], seconds=10, first_step=5)
    assert dog0.check() is None
    beat_and_exchange(clock, [dog0, dog1], [dog0, dog1], seconds=1, first_step=15)
    report = dog0.check()
    assert report is not None
    assert "coordinator (jax.distributed service): unreachable for 11.0 s" in report
    assert "UNAVAILABLE: failed to connect" in report
    assert "process 1" not in report  # its record is unknown, not stale


def test_a_stopped_peer_is_not_judged(clock):
    _, (dog0, dog1) = make_job(clock)
    beat_and_exchange(clock, [dog0, dog1], [dog0, dog1], seconds=5)
    dog1.exchange(stopped=True)  # left its loop, e.g. waiting for the final checkpoint
    beat_and_exchange(clock, [dog0], [dog0], seconds=100, first_step=5)
    assert dog0.check() is None


# -- the threads and the exit ---------------------------------------------------------------


def test_the_monitor_thread_calls_on_timeout_once():
    reports: list[str] = []
    dog = Watchdog(
        0.2, on_timeout=reports.append, process_index=0, process_count=1, poll_interval_s=0.01
    )
    with dog:
        dog.heartbeat(7)
        time.sleep(0.6)
    assert len(reports) == 1 and "gives up at step 7" in reports[0]


_STALL = """
import threading, time
from jdp.runtime.watchdog import Watchdog

def a_collective_that_never_completes():
    time.sleep(60)

threading.Thread(target=time.sleep, args=(60,), name="saver", daemon=True).start()
dog = Watchdog(0.5).start()
dog.heartbeat(3)
a_collective_that_never_completes()
"""


@pytest.mark.slow
def test_a_stalled_process_exits_with_the_report_and_where_its_threads_wait(tmp_path):
    with run_processes(_STALL, [[]], tmp_path, devices=1) as [child]:
        [code] = wait_all([child], timeout_s=30)
    assert code == watchdog.EXIT_CODE
    report, _, stacks = child.stderr.partition("Where this process's threads were when it gave up:")
    assert "jdp watchdog: process 0 of 1 gives up at step 3" in report
    # The main thread first, in the call it was stuck in; then the others by name, the
    # watchdog's own monitor (which writes this) left out.
    main, saver = stacks.split("Thread saver (most recent call last):")
    assert main.strip().startswith("Thread MainThread (most recent call last):")
    assert "in a_collective_that_never_completes" in main
    assert "in run" in saver and "jdp-watchdog-monitor" not in stacks


# -- killing one of two real processes --------------------------------------------------------

# Two processes, 4 CPU devices each, summing a global array over all 8 devices
# every step (a cross-process all-reduce), with a Watchdog heartbeating each step.
_TRAIN = """
import json, sys, time
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jdp.runtime import distributed
from jdp.runtime.watchdog import Watchdog
args = json.loads(sys.argv[1])
distributed.initialize(args["address"], args["num_processes"], args["process_id"], timeout_s=60)
sharding = NamedSharding(Mesh(np.array(jax.devices()), ("data",)), PartitionSpec("data"))
x = jax.make_array_from_callback((8,), sharding, lambda index: np.ones((8,), np.float32)[index])
total = jax.jit(jnp.sum)
with Watchdog(timeout_s=args["watchdog_timeout_s"]) as dog:
    for step in range(100_000):
        assert float(total(x)) == 8.0
        dog.heartbeat(step)
        print("step", step, flush=True)
        time.sleep(0.05)
"""


def last_step(stdout: str) -> int:
    steps = re.findall(r"^step (\d+)$", stdout, re.MULTILINE)
    return int(steps[-1]) if steps else -1


# jdp's default: the silence of a dead process must be reported long before this, and before
# jax's coordination service aborts the survivor (distributed.HEARTBEAT_TIMEOUT_S).
DEFAULT_TIMEOUT_S = 600.0


def signal_mid_training(
    tmp_path, victim: int, signum: int = signal.SIGKILL
) -> tuple[int, float, str, int]:
    """Sends `signum` to process `victim` after both ran 50 steps; returns the survivor's exit
    code, seconds from the signal to its exit, its stderr and the last step it printed."""
    port = free_port()
    argvs = [join_args(port, 2, i, watchdog_timeout_s=DEFAULT_TIMEOUT_S) for i in range(2)]
    with run_processes(_TRAIN, argvs, tmp_path) as children:
        deadline = time.monotonic() + 120
        # Long enough that every watchdog has published progress a few times.
        while min(last_step(child.stdout) for child in children) < 50:
            assert time.monotonic() < deadline, [child.stderr[-2000:] for child in children]
            assert all(child.popen.poll() is None for child in children)
            time.sleep(0.2)
        children[victim].popen.send_signal(signum)
        signalled_at = time.monotonic()
        survivor = children[1 - victim]
        [code] = wait_all([survivor], timeout_s=distributed.HEARTBEAT_TIMEOUT_S + 30)
        return code, time.monotonic() - signalled_at, survivor.stderr, last_step(survivor.stdout)


@pytest.mark.slow
def test_killing_a_process_ends_the_other_with_a_report(tmp_path):
    code, took_s, stderr, step = signal_mid_training(tmp_path, victim=1)
    # jdp's report and restartable status, not jax's abort (SIGABRT, status 134).
    assert code == watchdog.EXIT_CODE, stderr[-3000:]
    assert took_s < distributed.HEARTBEAT_TIMEOUT_S
    assert f"jdp watchdog: process 0 of 2 gives up at step {step}" in stderr
    assert "process 1: silent for" in stderr
    assert "Terminating process because the JAX distributed service" not in stderr


@pytest.mark.slow
def test_killing_the_coordinator_ends_the_other_process(tmp_path):
    # jax notices first: the survivor's coordination-service client loses its
    # connection and aborts the process (SIGABRT) within about a second.
    code, took_s, stderr, _ = signal_mid_training(tmp_path, victim=0)
    assert code != 0 and took_s < distributed.HEARTBEAT_TIMEOUT_S
    assert "leader task was preempted/died" in stderr or "gives up at step" in stderr


@pytest.mark.slow
def test_a_frozen_coordinator_is_reported_unreachable(tmp_path):
    # A stopped process keeps its connections open, so calls to it hang instead of failing.
    code, took_s, stderr, step = signal_mid_training(tmp_path, victim=0, signum=signal.SIGSTOP)
    assert code == watchdog.EXIT_CODE, stderr[-3000:]
    assert took_s < distributed.HEARTBEAT_TIMEOUT_S
    assert f"jdp watchdog: process 1 of 2 gives up at step {step}" in stderr
    assert "coordinator (jax.distributed service): unreachable for" in stderr
