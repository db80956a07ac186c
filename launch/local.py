"""Start N processes of one multi-process JAX job on this machine.

    python launch/local.py --num_processes=2 --devices_per_process=4 -- \\
        python -m jdp.main --config=experiments/vit.py --workdir=runs/vit

Each process gets JDP_COORDINATOR_ADDRESS (127.0.0.1 and a free port, or
--port), JDP_NUM_PROCESSES and JDP_PROCESS_ID. `--devices_per_process=K`
makes it a CPU job with K devices per process (JAX_PLATFORMS=cpu and
`--xla_force_host_platform_device_count=K` added to XLA_FLAGS);
`--gpus_per_process=G` instead gives process i the GPUs i*G .. i*G+G-1 through
CUDA_VISIBLE_DEVICES (indexing into an existing CUDA_VISIBLE_DEVICES list).

Every output line is prefixed with the process index (`[p0] `; stderr stays on
stderr). SIGINT/SIGTERM are forwarded to all processes once; a second one
kills them. When a process fails the others are terminated, then killed
after --grace_s. The exit status is the first failing process's exit code
(128 + N for death by signal N) in the last run, or 0 when all succeed.

`--max_restarts=N` (like torchrun's): after a failure, a preemption (76) or a
lost peer (75), all processes are started again with the same command, so the
run resumes from its newest checkpoint, up to N times; each start gets a fresh
free port unless --port fixes one. The statuses in jdp.exit_codes.PERMANENT
(bad config, non-finite loss) would only repeat and end the launcher at once,
as does a signal to the launcher itself.

`--min_processes=M` (elastic, like torchrun's `--nnodes=M:N`): a restart after
a failure other than a preemption leaves out one process, as if the host of
the one that failed were lost, down to M processes. jdp continues the same
example stream with the same global batch on the devices that remain (the
global batch must still divide them, or the restart fails with status 2).

launch/netns.py runs the same job with each process in an emulated host of its own,
the hosts joined by a shaped link (a test and benchmark tool).

Standard library and jdp.runtime.exit_codes (which imports nothing), so it starts fast.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import BinaryIO

from jdp.runtime import exit_codes
from jdp.runtime.cpu_devices import cpu_device_env

POLL_INTERVAL_S = 0.05
# How the launcher names an exit status in its messages.
STATUS_MEANINGS = {
    exit_codes.FAILED: "failed",
    exit_codes.BAD_CONFIG: "bad config",
    exit_codes.NONFINITE: "non-finite loss",
    exit_codes.PEER_LOST: "peer lost",
    exit_codes.PREEMPTED: "preempted",
}


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """Splits `[options] -- command...` and parses the options."""
    parser = argparse.ArgumentParser(
        prog="launch/local.py",
        description="Start N processes of a multi-process JAX job on this machine.",
        usage="%(prog)s --num_processes=N [options] -- command [args...]",
    )
    parser.add_argument("--num_processes", type=int, required=True)
    devices = parser.add_mutually_exclusive_group()
    devices.add_argument(
        "--devices_per_process", type=int, help="CPU devices per process (sets JAX_PLATFORMS=cpu)"
    )
    devices.add_argument("--gpus_per_process", type=int, help="GPUs per process")
    parser.add_argument(
        "--port", type=int, default=0, help="coordinator port on 127.0.0.1 (default: a free one)"
    )
    parser.add_argument(
        "--grace_s",
        type=float,
        default=10.0,
        help="seconds between terminating and killing the others after a failure",
    )
    parser.add_argument(
        "--max_restarts",
        type=int,
        default=0,
        help="times to start all processes again after a failure that may not repeat",
    )
    parser.add_argument(
        "--min_processes",
        type=int,
        default=None,
        help="restart with one process fewer after each failure, down to this many "
        "(default: --num_processes, never fewer)",
    )
    argv = list(argv)
    if "--" not in argv:
        parser.error("missing '-- command ...' after the options")
    split = argv.index("--")
    args, command = parser.parse_args(argv[:split]), argv[split + 1 :]
    if not command:
        parser.error("empty command after '--'")
    for name in ("num_processes", "devices_per_process", "gpus_per_process"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name} must be at least 1, got {value}")
    if args.max_restarts < 0:
        parser.error(f"--max_restarts must be at least 0, got {args.max_restarts}")
    if args.min_processes is None:
        args.min_processes = args.num_processes
    if not 1 <= args.min_processes <= args.num_processes:
        parser.error(
            f"--min_processes must be between 1 and --num_processes={args.num_processes}, "
            f"got {args.min_processes}"
        )
    return args, command


def free_port() -> int:
    # Another program may take it before the coordinator binds: rare on loopback.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def gpu_slice(process_id: int, gpus_per_process: int, visible: str | None) -> str:
    """CUDA_VISIBLE_DEVICES for one process: its block of the visible GPUs."""
    start, stop = process_id * gpus_per_process, (process_id + 1) * gpus_per_process
    if visible is None:
        return ",".join(str(i) for i in range(start, stop))
    ids = [i for i in visible.split(",") if i]
    if stop > len(ids):
        raise ValueError(
            f"process {process_id} needs GPUs {start}..{stop - 1} but "
            f"CUDA_VISIBLE_DEVICES={visible!r} lists {len(ids)}; "
            "lower --num_processes or --gpus_per_process"
        )
    return ",".join(ids[start:stop])


def process_env(
    base: Mapping[str, str],
    process_id: int,
    num_processes: int,
    coordinator_address: str,
    devices_per_process: int | None = None,
    gpus_per_process: int | None = None,
) -> dict[str, str]:
    """The environment of process `process_id`."""
    env = dict(base)
    env.update(
        JDP_COORDINATOR_ADDRESS=coordinator_address,
        JDP_NUM_PROCESSES=str(num_processes),
        JDP_PROCESS_ID=str(process_id),
        # Unbuffered, so lines arrive as they are printed and survive a kill.
        PYTHONUNBUFFERED="1",
    )
    if devices_per_process is not None:
        env.update(cpu_device_env(base, devices_per_process))
    if gpus_per_process is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu_slice(
            process_id, gpus_per_process, base.get("CUDA_VISIBLE_DEVICES")
        )
    return env


def _die_with_parent_hook() -> Callable[[], None] | None:
    """A preexec_fn that makes a child get SIGKILL when the launcher dies.

    Even a SIGKILLed launcher then leaves no orphan holding the coordinator
    port or a device. Linux only; prctl is looked up here, not in the child.
    """
    if not sys.platform.startswith("linux"):
        return None
    prctl, pr_set_pdeathsig = ctypes.CDLL(None, use_errno=True).prctl, 1
    return lambda: prctl(pr_set_pdeathsig, int(signal.SIGKILL))


def _copy_lines(source: BinaryIO, sink: BinaryIO, prefix: bytes, lock: threading.Lock) -> None:
    for line in iter(source.readline, b""):
        if not line.endswith(b"\n"):
            line += b"\n"
        with lock:
            try:
                sink.write(prefix + line)
                sink.flush()
            except BrokenPipeError:
                pass  # keep reading, or the child blocks on a full pipe
    source.close()


# How one process is started: its command line and its environment.
Start = tuple[Sequence[str], Mapping[str, str]]


class ProcessGroup:
    """The N child processes, their output pumps, and stopping them together."""

    def __init__(self, starts: Sequence[Start]) -> None:
        self.processes: list[subprocess.Popen[bytes]] = []
        self._pumps: list[threading.Thread] = []
        preexec_fn = _die_with_parent_hook()
        for command, env in starts:
            self.processes.append(
                subprocess.Popen(
                    command,
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    # Own session: a terminal's Ctrl-C reaches only the launcher,
                    # which forwards it exactly once, to the child's whole group.
                    start_new_session=True,
                    preexec_fn=preexec_fn,
                )
            )
        # Pumps start after every fork: preexec_fn is only safe without other threads.
        lock = threading.Lock()
        for index, process in enumerate(self.processes):
            prefix = f"[p{index}] ".encode()
            for source, sink in ((process.stdout, sys.stdout), (process.stderr, sys.stderr)):
                pump = threading.Thread(
                    target=_copy_lines, args=(source, sink.buffer, prefix, lock), daemon=True
                )
                pump.start()
                self._pumps.append(pump)

    def signal_all(self, signum: int) -> None:
        for process in self.processes:
            if process.poll() is None:
                try:
                    os.killpg(process.pid, signum)
                except ProcessLookupError:
                    pass  # exited between poll and kill

    def running(self) -> bool:
        return any(p.poll() is None for p in self.processes)

    def first_failure(self) -> tuple[int, int] | None:
        """(index, exit status) of the first process found failed, or None."""
        for index, process in enumerate(self.processes):
            if process.poll() not in (None, 0):
                return index, exit_status(process.returncode)
        return None

    def wait_all(self, timeout_s: float | None) -> bool:
        """Waits until all have exited or timeout_s passed; True if all exited."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while self.running():
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(POLL_INTERVAL_S)
        return True

    def stop(self, grace_s: float) -> None:
        """SIGTERM to all, then SIGKILL to those still running after grace_s."""
        self.signal_all(signal.SIGTERM)
        if not self.wait_all(grace_s):
            self.signal_all(signal.SIGKILL)
            self.wait_all(None)

    def drain_output(self, timeout_s: float = 5.0) -> None:
        # A grandchild may hold a pipe open after its parent exited; don't wait forever.
        for pump in self._pumps:
            pump.join(timeout_s)


def exit_status(returncode: int) -> int:
    """A shell-style exit status: 128 + N for death by signal N."""
    return 128 - returncode if returncode < 0 else returncode


def status_meaning(status: int) -> str:
    """What a process's exit status says, in a few words: "preempted", "killed by SIGKILL"."""
    if status in STATUS_MEANINGS:
        return STATUS_MEANINGS[status]
    if status > 128:
        try:
            return f"killed by {signal.Signals(status - 128).name}"
        except ValueError:
            pass
    return "failed"


def wait_for_first_failure(group: ProcessGroup) -> tuple[int, int] | None:
    """Waits until a process fails or all have exited; (index, status) of the failure."""
    while group.running():
        failure = group.first_failure()
        if failure is not None:
            return failure
        time.sleep(POLL_INTERVAL_S)
    return group.first_failure()  # all exited between two polls


def run(
    starts: Callable[[int], Sequence[Start]],
    grace_s: float,
    max_restarts: int = 0,
    num_processes: int = 1,
    min_processes: int | None = None,
) -> int:
    """Runs the processes to completion, restarting them up to max_restarts times.

    `starts(n)` gives the command line and environment of each of n processes, for
    each start (a fresh port each time). A restart after a failure other than a preemption
    starts one process fewer while more than `min_processes` remain. Returns the
    launcher's exit status.
    """
    min_processes = num_processes if min_processes is None else min_processes
    signals_received: list[int] = []
    group: ProcessGroup | None = None

    def on_signal(signum: int, _frame: object) -> None:
        signals_received.append(signum)
        if group is not None:
            # The first signal is forwarded (preemption: let them save); a second kills.
            group.signal_all(signum if len(signals_received) == 1 else signal.SIGKILL)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        restarts = 0
        while True:
            group = ProcessGroup(starts(num_processes))
            if signals_received:  # arrived while the processes were being started
                group.signal_all(signals_received[0])
            # The first failure seen wins over the statuses of the processes it stops.
            failure = wait_for_first_failure(group)
            if failure is None:
                group.drain_output()
                return 0
            index, status = failure
            # A signalled launcher is being stopped itself: its children's statuses
            # (76 after saving) are for whoever stops it, not a reason to restart.
            restart = (
                not signals_received
                and status not in exit_codes.PERMANENT
                and restarts < max_restarts
            )
            shrink = restart and status != exit_codes.PREEMPTED and num_processes > min_processes
            if not signals_received:
                next_step = _next_step(status, restart, restarts, max_restarts)
                if shrink:
                    next_step += (
                        f" with {num_processes - 1} process{'es' if num_processes > 2 else ''} "
                        "(its host counted as lost; "
                        f"--min_processes={min_processes})"
                    )
                print(
                    f"launch/local.py: process {index} exited with status {status} "
                    f"({status_meaning(status)}); {next_step}",
                    file=sys.stderr,
                    flush=True,
                )
            group.stop(grace_s)
            group.drain_output()
            if not restart or signals_received:  # signals_received: also during the stop
                return status
            restarts += 1
            num_processes -= shrink
    finally:
        if group is not None and group.running():  # e.g. an exception above
            group.signal_all(signal.SIGKILL)
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _next_step(status: int, restart: bool, restarts: int, max_restarts: int) -> str:
    """The end of the launcher's line about a failure: what it does next."""
    if restart:
        return f"restart {restarts + 1} of {max_restarts}"
    if max_restarts == 0:
        return "stopping the others"
    if status in exit_codes.PERMANENT:
        return "stopping the others; not restarting, since it would fail the same way again"
    return f"stopping the others; no restarts left ({max_restarts} used)"


def job_envs(args: argparse.Namespace, num_processes: int,
             coordinator_host: str = "127.0.0.1") -> list[dict[str, str]]:
    """The environments of the `num_processes` processes of one start, for the options of
    `parse_args`, with the coordinator (process 0) at `coordinator_host`."""
    # A fresh port per start: the previous coordinator's may still be held.
    coordinator_address = f"{coordinator_host}:{args.port or free_port()}"
    return [
        process_env(
            os.environ,
            process_id,
            num_processes,
            coordinator_address,
            args.devices_per_process,
            args.gpus_per_process,
        )
        for process_id in range(num_processes)
    ]


def launch(args: argparse.Namespace, starts: Callable[[int], Sequence[Start]]) -> int:
    """`run` with the options of `parse_args`: the launcher's exit status, 2 for a GPU
    split that cannot be made, 127 for a command that cannot be started."""
    try:
        starts(args.num_processes)  # reports an impossible GPU split before anything starts
    except ValueError as error:
        print(f"launch/local.py: {error}", file=sys.stderr)
        return exit_codes.BAD_CONFIG
    try:
        return run(
            starts,
            args.grace_s,
            args.max_restarts,
            args.num_processes,
            args.min_processes,
        )
    except OSError as error:  # the command could not be started
        print(f"launch/local.py: cannot run {error.filename!r}: {error.strerror}",
              file=sys.stderr)
        return 127


def main(argv: Sequence[str] | None = None) -> int:
    args, command = parse_args(sys.argv[1:] if argv is None else argv)
    return launch(args, lambda num_processes: [
        (command, env) for env in job_envs(args, num_processes)])


if __name__ == "__main__":
    sys.exit(main())
