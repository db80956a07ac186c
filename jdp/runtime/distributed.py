"""Joining a multi-process JAX job (`jax.distributed`) without ever waiting silently.

`initialize` decides how this process joins: explicit flags, else the JDP_*
variables the local launcher sets, else jax's own cluster auto-detection
(SLURM, Open MPI, Kubernetes, Cloud TPU), else a plain single process. Joining
is bounded by `timeout_s` and otherwise ends the process with one message
saying what to check. `check_same_across_processes` makes every process stop
with the same error when one of them runs a different config or library
version.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import json
import logging
import math
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from typing import NoReturn

import jax

from jdp.errors import first_line
from jdp.runtime import exit_codes, jax_compat, watchdog

logger = logging.getLogger(__name__)

# The coordination service declares a process dead after this long without a
# heartbeat, then aborts every process of the job (SIGABRT, thread dumps).
# Heartbeats come from the service client's own C++ thread, so a process busy
# compiling or blocked in a collective still sends them. jdp's Watchdog names a
# silent process after watchdog.SILENCE_LIMIT_S, well before this, and exits with
# a restartable status; this is the backstop when the Watchdog is off. jax's
# default of 100 s would leave such a job stuck that long.
HEARTBEAT_TIMEOUT_S = 60
# How long a finishing process waits at the exit barrier for the others. When
# it expires the service aborts *every* process, including one still
# legitimately finishing (a final checkpoint), so this keeps jax's generous
# default; dead peers are caught by the heartbeat long before.
SHUTDOWN_TIMEOUT_S = 300

# How long a process that failed waits for the others to fail too (one error everywhere:
# a bad config) before it ends without jax's exit barrier. The barrier would wait up to
# SHUTDOWN_TIMEOUT_S for a peer that is waiting for this process in a collective or in
# Orbax's barriers (up to 300 s): the launcher would learn of the failure only then.
FAILED_EXIT_WAIT_S = 10

ENV_COORDINATOR_ADDRESS = "JDP_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JDP_NUM_PROCESSES"
ENV_PROCESS_ID = "JDP_PROCESS_ID"

_FLAG_NAMES = ("--coordinator_address", "--num_processes", "--process_id")
_ENV_NAMES = (ENV_COORDINATOR_ADDRESS, ENV_NUM_PROCESSES, ENV_PROCESS_ID)

# Every process calls check_same_across_processes in the same order, so the
# n-th call of each meets the others' n-th call under the same keys.
_check_rounds = itertools.count()


@dataclasses.dataclass(frozen=True)
class Launch:
    """How this process joins the job, and where that was decided."""

    source: str  # where the settings came from, for messages ("flags", ...)
    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None

    @property
    def is_single_process(self) -> bool:
        return self.source == "single process" or self.num_processes == 1


def resolve_launch(
    coordinator_address: str | None,
    num_processes: int | None,
    process_id: int | None,
    environ: Mapping[str, str] = os.environ,
) -> Launch:
    """Explicit arguments, else JDP_* variables, else a detected cluster, else one process.

    Arguments and variables each count as a group: a partial group is an error,
    never completed from elsewhere. `num_processes=1` alone means one process,
    even inside a cluster allocation.
    """
    if (coordinator_address, num_processes, process_id) != (None, None, None):
        return _complete("flags", _FLAG_NAMES, coordinator_address, num_processes, process_id)
    env_values = [environ.get(name) or None for name in _ENV_NAMES]
    if env_values != [None, None, None]:
        address, count, index = env_values
        return _complete(
            "JDP_* environment variables",
            _ENV_NAMES,
            address,
            _parse_int(ENV_NUM_PROCESSES, count),
            _parse_int(ENV_PROCESS_ID, index),
        )
    cluster = _detect_cluster()
    if cluster is not None:
        return Launch(source=f"jax's {cluster.__name__} detection")  # jax fills in the values
    return Launch(source="single process")


def _parse_int(name: str, value: str | None) -> int | None:
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an integer.") from None


def _complete(
    source: str,
    names: tuple[str, str, str],
    coordinator_address: str | None,
    num_processes: int | None,
    process_id: int | None,
) -> Launch:
    """Checks one group of settings: all three, or num_processes=1 alone."""
    address_name, count_name, index_name = names
    if num_processes == 1 and process_id in (None, 0):
        return Launch(source, coordinator_address, num_processes=1, process_id=0)
    given = {address_name: coordinator_address, count_name: num_processes, index_name: process_id}
    missing = [name for name, value in given.items() if value is None]
    if missing:
        given_text = ", ".join(
            f"{name}={value}" for name, value in given.items() if value is not None
        )
        raise ValueError(
            f"Incomplete multi-process settings from {source}: got {given_text} but not "
            f"{' or '.join(missing)}. Set all three of {', '.join(names)}, or none of them "
            "to auto-detect a cluster or run as one process."
        )
    if num_processes < 1 or not 0 <= process_id < num_processes:
        raise ValueError(
            f"{index_name}={process_id} must be in 0..{num_processes - 1} "
            f"({count_name}={num_processes})."
        )
    host, _, port = coordinator_address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(
            f"{address_name}={coordinator_address!r} must be host:port, e.g. 10.0.0.1:1234."
        )
    return Launch(source, coordinator_address, num_processes, process_id)


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def loopback_bind_address(coordinator_address: str | None) -> str | None:
    """Where process 0's coordination service listens: on the loopback interface alone
    when the job's coordinator address is a loopback one (every process on this
    machine, as launch/local.py runs them), else None, jax's default of every
    interface, which the other hosts need to reach it."""
    if coordinator_address is None:
        return None
    host = coordinator_address.rpartition(":")[0].strip("[]")
    return coordinator_address if host in LOOPBACK_HOSTS else None


def _detect_cluster() -> type[jax_compat.ClusterEnv] | None:
    """The cluster environment a bare `jax.distributed.initialize()` would use, if any.

    The same choice as jax's `ClusterEnv.auto_detect_unset_distributed_params`:
    the first registered environment, in jax's order (Open MPI, SLURM, GCE TPU,
    GKE TPU, Kubernetes), that is not opt-in only (mpi4py) and is present.
    These read os.environ (and the TPU / Kubernetes metadata), not `environ`.
    """
    return next(
        (
            env
            for env in jax_compat.cluster_types()
            if not env.opt_in_only_method and env.is_env_present()
        ),
        None,
    )


def initialize(
    coordinator_address: str | None,
    num_processes: int | None,
    process_id: int | None,
    *,
    timeout_s: float = 300,
    environ: Mapping[str, str] = os.environ,
) -> None:
    """Joins the multi-process job, if there is one; call before any other use of jax.

    Ends the process (exit code `watchdog.EXIT_CODE`) with a message naming the
    coordinator, this process's id and the timeout when the job cannot be
    joined within `timeout_s`: jax itself would abort later with a bare
    DEADLINE_EXCEEDED. `environ` is where the JDP_* variables are read.
    """
    launch = resolve_launch(coordinator_address, num_processes, process_id, environ)
    if launch.is_single_process:
        logger.info("Running as a single process (%s).", launch.source)
        return
    # Cross-process collectives on the CPU backend; it must be chosen before the
    # backend starts, and it is ignored by the GPU and TPU backends.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    deadline = time.monotonic() + timeout_s
    with _ended_unless_done_within(timeout_s, lambda: _join_failure(launch, timeout_s),
                                   watchdog.EXIT_CODE):
        jax.distributed.initialize(
            launch.coordinator_address,
            launch.num_processes,
            launch.process_id,
            # With explicit values, jax must not restrict the visible devices from
            # SLURM or Open MPI variables it happens to find.
            cluster_detection_method=None if launch.num_processes is None else "deactivate",
            # jax's own limit, a backstop behind the timer: it aborts a few seconds
            # later than asked, without a useful message.
            initialization_timeout=math.ceil(timeout_s),
            heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_S,
            shutdown_timeout_seconds=SHUTDOWN_TIMEOUT_S,
            coordinator_bind_address=loopback_bind_address(launch.coordinator_address),
        )
    state = jax_compat.distributed_state()
    logger.info(
        "Joined the job as process %d of %d via coordinator %s (%s).",
        state.process_id,
        state.num_processes,
        state.coordinator_address,
        launch.source,
    )
    # Only process 0's count sizes the job; another process given a different
    # count would join anyway and misbehave later.
    check_same_across_processes(
        {"num_processes": str(state.num_processes)},
        timeout_s=max(deadline - time.monotonic(), 1.0),
    )


def _join_failure(launch: Launch, timeout_s: float) -> str:
    """The message for a job not joined in time, from what jax had resolved so far."""
    state = jax_compat.distributed_state()
    if state.coordinator_address is None:
        return (
            f"jdp: jax could not read the distributed settings from {launch.source} "
            f"within timeout_s={timeout_s:g} s. Check the cluster's metadata "
            "service, or pass --coordinator_address, --num_processes and --process_id."
        )
    count, index, address = state.num_processes, state.process_id, state.coordinator_address
    return (
        f"jdp: process {index} of {count} could not join the job at coordinator {address} "
        f"within timeout_s={timeout_s:g} s (settings from {launch.source}). Check that all "
        f"{count} processes were started, each with its own process id in 0..{count - 1}; that "
        f"process 0 is running and {address} is reachable from this host (host name, port, "
        "firewall); and that every process was given the same coordinator address and number "
        "of processes. If processes start far apart, raise the timeout."
    )


@contextlib.contextmanager
def ending_promptly_on_failure() -> Iterator[None]:
    """In a multi-process job, a failure in the body (an exception, or a SystemExit with
    a status other than 0 or PREEMPTED) ends this process within FAILED_EXIT_WAIT_S, its
    status unchanged, so that the launcher (or scheduler) stops and restarts the job at
    once. A single process, a finished run and a preempted one (every process saved
    at one step and leaves together) exit as usual."""
    try:
        yield
    except SystemExit as e:
        state = job_state()
        if e.code in (None, exit_codes.FINISHED, exit_codes.PREEMPTED) or state is None:
            raise
        if not isinstance(e.code, int):  # sys.exit("message"): Python prints it, status 1
            print(e.code, file=sys.stderr)
        _exit_after_failure(state, e.code if isinstance(e.code, int) else exit_codes.FAILED)
    except Exception:
        state = job_state()
        if state is None:
            raise
        traceback.print_exc()
        _exit_after_failure(state, exit_codes.FAILED)


def job_state():
    """jax.distributed's state (`.client`, `.process_id`, `.num_processes`) when this
    process is one of several in a job; None when it runs alone."""
    state = jax_compat.distributed_state()
    return None if state.client is None or state.num_processes == 1 else state


def _exit_after_failure(state, exit_code: int) -> NoReturn:
    """Waits (bounded) for every process of the job (`job_state()`) to fail, then exits
    without jax's exit barrier: process 0 serves the coordination service, which the
    others may still need to report the same error. When some do not fail in time, the
    message names them: they died (a peer gone cuts off this process's collectives, the
    usual reason it failed), hang, or cannot reach the coordinator."""
    client, me, count = state.client, state.process_id, state.num_processes
    # A coordinator that hangs (rather than dies, which ends this process) must not hold
    # it here either.
    hung = (f"jdp: process {me} of {count} failed and the coordinator did not answer within "
            f"{FAILED_EXIT_WAIT_S + 10} s; exiting with status {exit_code}")
    with _ended_unless_done_within(FAILED_EXIT_WAIT_S + 10, lambda: hung, exit_code):
        try:
            client.key_value_set(f"{_FAILED_KEY_DIR}{me}", "1", allow_overwrite=True)
            client.wait_at_barrier("jdp/failed", FAILED_EXIT_WAIT_S * 1000)
            message = ""
        except jax.errors.JaxRuntimeError:
            message = (f"jdp: process {me} of {count} failed; "
                       f"{_who_did_not_fail(client, me, count)}; exiting with status "
                       f"{exit_code} without waiting for them")
    watchdog.exit_now(message, exit_code)


@contextlib.contextmanager
def _ended_unless_done_within(seconds: float, message: Callable[[], str],
                              exit_code: int) -> Iterator[None]:
    """Ends the process (`watchdog.exit_now(message(), exit_code)`) if the block is still
    running after `seconds`: for calls into jax.distributed that may block without a
    bound. Once the block is left the timer is off, whatever the process does next."""
    timer = threading.Timer(seconds, lambda: watchdog.exit_now(message(), exit_code))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


# Where each failed process records its failure, so that one giving up on the others can
# name those that did not fail with it.
_FAILED_KEY_DIR = "jdp/failures/"


def _who_did_not_fail(client, me: int, count: int) -> str:
    """Which of the other processes did not record a failure within FAILED_EXIT_WAIT_S."""
    try:
        entries = client.key_value_dir_get(_FAILED_KEY_DIR)
    except jax.errors.JaxRuntimeError as e:
        return f"the coordinator did not say which others failed ({str(e).splitlines()[0]})"
    failed = {int(key.rsplit("/", 1)[1]) for key, _ in entries}
    missing = [index for index in range(count) if index != me and index not in failed]
    if not missing:
        return f"the others failed too, not all within {FAILED_EXIT_WAIT_S} s"
    names = ", ".join(str(index) for index in missing)
    return (f"process{'es' if len(missing) > 1 else ''} {names} did not fail with it within "
            f"{FAILED_EXIT_WAIT_S} s (died, hung, or cannot reach the coordinator: a process "
            "gone also cuts off the others' collectives; see its log)")


class MismatchError(ValueError):
    """Processes of one job run different configs or versions."""


def check_same_across_processes(values: dict[str, str], *, timeout_s: float = 60.0) -> None:
    """Raises on every process if any process's `values` differ from process 0's.

    Each process publishes a digest per field to the coordination service's
    key-value store; only when digests differ are the two full values fetched,
    so the cost stays small with many processes. Raises TimeoutError when not
    every process arrives within `timeout_s`. No-op for a single process.
    """
    state = job_state()
    if state is None:
        return
    client, me = state.client, state.process_id
    round_dir = f"jdp/same/{next(_check_rounds)}"
    digests = {name: hashlib.sha256(value.encode()).hexdigest() for name, value in values.items()}
    client.key_value_set(f"{round_dir}/values/{me}", json.dumps(values))
    client.key_value_set(f"{round_dir}/digests/{me}", json.dumps(digests))
    timeout_ms = max(int(timeout_s * 1000), 1)
    try:
        client.wait_at_barrier(f"{round_dir}/barrier", timeout_ms)
    except jax.errors.JaxRuntimeError as e:
        raise TimeoutError(
            f"Process {me}: not all {state.num_processes} processes reached the check that "
            f"their {', '.join(sorted(values))} agree within {timeout_s:g} s; a process is "
            f"missing, stuck or crashed earlier (see its log). ({first_line(e)})"
        ) from e
    by_process = {
        int(key.rsplit("/", 1)[1]): json.loads(value)
        for key, value in client.key_value_dir_get(f"{round_dir}/digests/")
    }
    for index in sorted(by_process):
        fields = sorted(
            name
            for name in by_process[0].keys() | by_process[index].keys()
            if by_process[0].get(name) != by_process[index].get(name)
        )
        if fields:
            first, other = (
                json.loads(client.blocking_key_value_get(f"{round_dir}/values/{i}", timeout_ms))
                for i in (0, index)
            )
            raise MismatchError(
                f"Process {index} differs from process 0 in {', '.join(map(repr, fields))}: "
                f"{_describe_difference(first.get(fields[0]), other.get(fields[0]), index)}. "
                "Every process must run the same config, jdp and jax: start them all with the "
                "same command line and environment."
            )


def leader_decides(key: str, decision: bool, *, timeout_s: float = 600.0) -> bool:
    """Process 0's `decision`, on every process: for choices made from what only one
    process can know the same way (its clock), which all must make alike (a save is a
    collective). Process 0 publishes it under `key` (unique per decision) in the
    coordination service; the others wait for it, while their devices run on. A single
    process decides alone."""
    state = job_state()
    if state is None:
        return decision
    if state.process_id == 0:
        state.client.key_value_set(key, "1" if decision else "0")
        return decision
    return state.client.blocking_key_value_get(key, int(timeout_s * 1000)) == "1"


_ABSENT = object()


def _describe_difference(first: str | None, other: str | None, index: int) -> str:
    """A short excerpt of how process `index`'s value differs from process 0's."""
    differences: list[tuple[str, object, object]] = []
    if first is not None and other is not None:
        with contextlib.suppress(ValueError):  # not JSON: compared as text below
            differences = _diff_json(json.loads(first), json.loads(other))
    if not differences:
        differences = [
            ("", _ABSENT if first is None else first, _ABSENT if other is None else other)
        ]
    path, value_0, value_i = differences[0]
    more = f" (and {len(differences) - 1} more differences)" if len(differences) > 1 else ""
    where = f"at {path!r} " if path else ""
    return (
        f"{where}process 0 has {_excerpt(value_0)}, process {index} has {_excerpt(value_i)}{more}"
    )


def _diff_json(first: object, other: object, path: str = "") -> list[tuple[str, object, object]]:
    """(dotted key path, one value, the other) for each difference between two JSON trees."""
    if isinstance(first, dict) and isinstance(other, dict):
        return [
            difference
            for key in sorted(first.keys() | other.keys())
            for difference in _diff_json(
                first.get(key, _ABSENT), other.get(key, _ABSENT), f"{path}.{key}" if path else key
            )
        ]
    return [] if first == other else [(path, first, other)]


def _excerpt(value: object, max_chars: int = 60) -> str:
    if value is _ABSENT:
        return "nothing"
    text = value if isinstance(value, str) else json.dumps(value)
    text = text if len(text) <= max_chars else text[: max_chars - 3] + "..."
    return repr(text) if isinstance(value, str) else text
