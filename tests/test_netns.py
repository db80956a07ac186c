"""Emulated hosts (launch/netns.py): network namespaces joined by a shaped link. The
testbed is made and deleted whole, also after its owner is killed; a job of 2 hosts x 4
devices over it follows the trajectory of 1 process of 8 devices; a link cut in the
middle of training, still down when the job restarts, and a flapping link end in bounded
exits with the documented status and a restart to the same final state.

Needs root (network namespaces): skipped elsewhere, with the reason; CI runs as root."""

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest

from jdp.runtime import exit_codes
from runs import (
    REPO,
    checkpoint_arrays,
    load_netns,
    logged_steps,
    losses,
    main_command,
    main_env,
    read_metrics,
    stacks_then_kill,
    train,
    wait_for,
)

netns = load_netns()
_UNAVAILABLE = netns.unavailable_reason()
pytestmark = pytest.mark.skipif(_UNAVAILABLE is not None, reason=_UNAVAILABLE or "")

NETNS = os.path.join(REPO, "launch", "netns.py")
VIT = "experiments/vit.py"
TRAIN = ("--config.total_steps=16", "--config.warmup_steps=1", "--config.log_every_steps=1",
         "--config.eval_every_steps=0", "--config.batch_size=64",
         "--config.checkpoint.every_steps=4")
# A slow link: an all-reduce of the ViT's gradients (0.3 MB) takes a good part of a step,
# so a cut lands in one or stops the next.
RATE_MBIT = 20
# watchdog_timeout_s=60: a silent peer is still named after 10 s (watchdog.SILENCE_LIMIT_S),
# while a slow start on a loaded machine is no false alarm. A process that cannot reach the
# coordinator gives up joining after 20 s.
LIMITS = ("--config.watchdog_timeout_s=60", "--distributed_timeout_s=20")


def owned_by(owner: int) -> list[str]:
    """The namespaces and /etc/netns entries of the testbed of process `owner`."""
    names = set(netns.existing_namespaces())
    if os.path.isdir(netns.NETNS_ETC):
        names |= set(os.listdir(netns.NETNS_ETC))
    return sorted(name for name in names if name.startswith(f"{netns.PREFIX}{owner}-"))


def test_a_testbed_joins_its_hosts_by_a_counted_link_and_leaves_nothing():
    with netns.testbed(2, rate_mbit=200) as bed:
        assert owned_by(os.getpid()) == [bed.namespace(0), bed.namespace(1), bed.switch]
        # Inside each host this machine's name is the host's own address: what jax's CPU
        # collectives (gloo) advertise to the other processes.
        for host in (0, 1):
            resolved = subprocess.run(bed.command(host, ["getent", "hosts",
                                                         socket.gethostname()]),
                                      capture_output=True, text=True, check=True).stdout
            assert resolved.split()[0] == bed.address(host)
        before = bed.link_bytes(1)
        payload = 1_000_000
        server = subprocess.Popen(bed.command(0, [sys.executable, "-c", (
            "import socket; s = socket.create_server(('198.18.0.1', 9999)); c, _ = s.accept()\n"
            "n = 0\nwhile (b := c.recv(65536)): n += len(b)\nprint(n)")]),
            stdout=subprocess.PIPE, text=True)
        try:
            subprocess.run(bed.command(1, [sys.executable, "-c", (
                "import socket, time\n"
                "for _ in range(100):\n"
                "    try: c = socket.create_connection(('198.18.0.1', 9999)); break\n"
                "    except OSError: time.sleep(0.05)\n"
                f"c.sendall(bytes({payload})); c.close()")]), check=True, timeout=60)
            assert int(server.communicate(timeout=60)[0]) == payload
        finally:
            server.kill()
        after = bed.link_bytes(1)
        assert payload <= after.sent - before.sent < 1.2 * payload  # plus the headers
    assert owned_by(os.getpid()) == []


def test_a_killed_testbed_is_deleted_by_the_next_one():
    """SIGKILL to the launcher's process group leaves its testbed (no `finally` runs);
    making the next testbed deletes it, namespaces and /etc/netns entries."""
    launcher = subprocess.Popen([sys.executable, NETNS, "--num_processes=2", "--", "sleep",
                                 "600"], cwd=REPO, start_new_session=True,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: len(owned_by(launcher.pid)) == 3, 30, "the launcher's testbed")
    finally:
        os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait()
    assert len(owned_by(launcher.pid)) == 3
    with netns.testbed(1, rate_mbit=None):
        assert owned_by(launcher.pid) == []


@pytest.mark.parametrize("flags, message", [
    (["--rate_mbit=0", "--num_processes=2"], "--rate_mbit must be positive, got 0"),
    ([f"--num_processes={netns.MAX_HOSTS + 1}"], f"a testbed has at most {netns.MAX_HOSTS}"),
])
def test_bad_launcher_options_stop_it_before_anything_is_made(flags, message):
    launcher = subprocess.Popen([sys.executable, NETNS, *flags, "--", "true"], cwd=REPO,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, stderr = launcher.communicate(timeout=60)
    assert launcher.returncode == exit_codes.BAD_CONFIG
    assert message in stderr
    assert owned_by(launcher.pid) == []


class Job:
    """`launch/netns.py` running `python -m jdp.main` on 2 emulated hosts of 4 devices,
    its stderr read as it comes (a job blocked on a full pipe would look like a hang)."""

    def __init__(self, workdir, *launcher_flags: str, timeout_s: float = 300):
        self.workdir = workdir
        self.deadline = time.monotonic() + timeout_s
        command = [sys.executable, NETNS, f"--rate_mbit={RATE_MBIT}", "--num_processes=2",
                   "--devices_per_process=4", *launcher_flags, "--",
                   *main_command(f"--config={VIT}", f"--workdir={workdir}", *TRAIN, *LIMITS)]
        self.process = subprocess.Popen(command, cwd=REPO, env=main_env(),
                                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                        text=True)
        self.bed = netns.Testbed(2, owner=self.process.pid)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=lambda: self.lines.extend(self.process.stderr),
                                        daemon=True)
        self._reader.start()

    def wait_until(self, condition, what: str) -> None:
        """Until `condition()`; fails (the job's processes killed, its stderr shown) when
        the job ends first or the deadline passes."""
        while not condition():
            if self.process.poll() is not None or time.monotonic() > self.deadline:
                self.fail(f"the job {'ended' if self.process.poll() is not None else 'hung'} "
                          f"before {what}")
            time.sleep(0.05)

    def said(self, text: str) -> bool:
        return any(text in line for line in self.lines)

    def step(self) -> int:
        return max(logged_steps(self.workdir), default=0)

    def finish(self) -> int:
        remaining = self.deadline - time.monotonic()
        try:
            self.process.wait(timeout=max(remaining, 1))
        except subprocess.TimeoutExpired:
            self.fail("the job did not end")
        self._reader.join(timeout=30)
        return self.process.returncode

    def fail(self, what: str):
        stacks_then_kill(self.process)
        self._reader.join(timeout=30)
        pytest.fail(f"{what}; its stderr ends:\n{''.join(self.lines)[-6000:]}")


@pytest.fixture(scope="module")
def over_the_link(tmp_path_factory):
    """An uninterrupted 2 x 4 run over the shaped link: the reference of the failures."""
    workdir = tmp_path_factory.mktemp("over_the_link")
    job = Job(workdir)
    assert job.finish() == 0, "".join(job.lines)[-4000:]
    return workdir, "".join(job.lines)


def train_steps(workdir) -> list[int]:
    return [r["step"] for r in read_metrics(workdir) if "train/loss" in r]


def assert_same_end(workdir, reference):
    """Each step logged once, and bitwise the final state of the uninterrupted run."""
    assert train_steps(workdir) == list(range(1, 17))
    assert losses(read_metrics(workdir)) == losses(read_metrics(reference))
    for a, b in zip(jax.tree.leaves(checkpoint_arrays(workdir, 16)),
                    jax.tree.leaves(checkpoint_arrays(reference, 16)), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_two_hosts_over_the_link_follow_one_process_of_eight_devices(over_the_link, tmp_path):
    workdir, stderr = over_the_link
    _, reference = train(VIT, tmp_path / "one", *TRAIN)
    got, expected = losses(read_metrics(workdir)), losses(reference)
    assert sorted(got) == sorted(expected) == list(range(1, 17))
    np.testing.assert_allclose([got[s] for s in sorted(got)],
                               [expected[s] for s in sorted(expected)], rtol=1e-5)
    # The gradients crossed the link: a flat all-reduce's ring sends 2 (8 - 1) / 8 of
    # them out of each host per step (the processes advertised their hosts' addresses).
    params = checkpoint_arrays(workdir, 16)["params"]
    gradient_bytes = sum(leaf.size * 4 for leaf in jax.tree.leaves(params))
    sent_mib = [float(line.split(" sent ")[1].split(" MiB")[0]) for line in stderr.splitlines()
                if line.startswith("launch/netns.py: host ")]
    assert len(sent_mib) == 2
    assert min(sent_mib) * 2**20 > 16 * 1.75 * gradient_bytes


@pytest.mark.slow
def test_a_link_cut_mid_run_and_down_at_the_restart_ends_in_bounded_exits_then_recovers(
        over_the_link, tmp_path):
    """Host 1's link goes down at step 6, in the middle of the all-reduces: both processes
    give up within the watchdog's silence limit (status 75). The restart starts with the
    link still down: neither process can join, and both give up after
    --distributed_timeout_s (status 75). With the link back, the next restart resumes
    from step 4's checkpoint and ends where the uninterrupted run ends."""
    workdir = tmp_path / "cut"
    job = Job(workdir, "--max_restarts=3")
    job.wait_until(lambda: job.step() >= 6, "step 6")
    job.bed.set_link(1, up=False)
    job.wait_until(lambda: job.said("restart 1 of 3"), "the first exit")
    job.wait_until(lambda: job.said("restart 2 of 3"), "the exits at the restart's join")
    job.bed.set_link(1, up=True)
    assert job.finish() == 0, "".join(job.lines)[-4000:]
    stderr = "".join(job.lines)
    assert "jdp watchdog: process 1 of 2 gives up" in stderr
    assert "exited with status 75 (peer lost); restart 1 of 3" in stderr
    assert "could not join the job at coordinator 198.18.0.1:" in stderr
    assert "exited with status 75 (peer lost); restart 2 of 3" in stderr
    assert not job.said("restart 3 of 3")
    assert_same_end(workdir, over_the_link[0])


@pytest.mark.slow
def test_a_flapping_link_stalls_the_job_but_loses_nothing(over_the_link, tmp_path):
    """Down for a second, up for a second, three times: TCP resends what was lost, no
    process gives up, and the run is bitwise the uninterrupted one."""
    workdir = tmp_path / "flapping"
    job = Job(workdir, "--max_restarts=1")
    job.wait_until(lambda: job.step() >= 2, "step 2")
    steps_at_cuts = []
    for _ in range(3):
        steps_at_cuts.append(job.step())
        job.bed.set_link(1, up=False)
        time.sleep(1)
        job.bed.set_link(1, up=True)
        time.sleep(1)
    assert job.finish() == 0, "".join(job.lines)[-4000:]
    assert max(steps_at_cuts) < 16, steps_at_cuts  # every cut came while it trained
    assert not job.said("restart")
    assert_same_end(workdir, over_the_link[0])


@pytest.mark.slow
def test_the_network_benchmark_counts_the_bytes_its_model_predicts(capsys):
    """`python -m jdp.bench network` at a tiny size: each reduction measured on both
    hosts, the link's byte counters as the model predicts them, the summary last."""
    from jdp.bench.__main__ import main

    main(["network", "--modes=flat,int8", "--rates_mbit=1000", "--width=256", "--steps=1",
          "--repeats=1", "--warmup=1"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert re.match(r"^network: measured speed-up over flat: 1000 Mbit/s int8 \d+\.\d\dx$",
                    lines[-1]), lines[-5:]
    for mode in ("flat", "int8"):
        [row] = [line for line in lines if re.match(rf"^\s*1000 Mbit/s {mode} ", line)]
        counted, modelled = map(float, re.search(
            r"link\s+(\d+\.\d+) MiB/step \(modelled\s+(\d+\.\d+)\)", row).groups())
        assert counted == pytest.approx(modelled, rel=0.1), row


@pytest.mark.slow
def test_a_network_benchmark_job_that_measures_nothing_is_stopped_and_its_testbed_deleted():
    """A job that never reports (here: one given less time than its first compile) is not
    waited for forever: it is stopped after the silence limit, with one message, and
    leaves no namespace behind."""
    from jdp.bench.__main__ import main

    before = set(netns.existing_namespaces())
    with pytest.raises(SystemExit, match=r"measured nothing for 2 s before .*killed"):
        main(["network", "--modes=flat", "--rates_mbit=1000", "--width=256", "--steps=1",
              "--repeats=1", "--warmup=1", "--silence_limit_s=2"])
    assert set(netns.existing_namespaces()) <= before
