"""The "never hang" guarantee: a dead or stuck process ends every other one with a report.

A `Watchdog` watches this process's training-loop heartbeats and, in a
multi-process job, every other process's, published through the key-value
store of jax.distributed's coordination service. When a process stops making
progress for `timeout_s`, or the coordinator stops answering, it writes one
report to stderr, followed by where each of this process's threads was (the
collective or barrier it waits in), and ends the process with `os._exit`: the
main thread may be blocked inside a collective that will never complete, so
raising would not be enough.

Policy: nothing is judged before this process's first heartbeat (the first
compilation may take minutes). From then on every process must keep making
progress, so `timeout_s` must exceed the longest gap between heartbeats in a
healthy run: the slowest step, an evaluation pass without heartbeats, a
compilation after the first step (compile the eval step ahead of time), and
the difference in start-up (compile) time between processes.

Silence is judged sooner than a stall: a process whose watchdog thread stops
publishing (it died, or its host went away), or a coordinator that stops
answering, is reported after `min(timeout_s, SILENCE_LIMIT_S)`, whatever
`timeout_s` is. jax's coordination service declares such a process dead later
(`distributed.HEARTBEAT_TIMEOUT_S`) and then aborts every survivor with
SIGABRT and thread dumps; speaking first makes jdp's report, and its
restartable exit status, what the user and the scheduler see.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import NoReturn, Protocol

from jdp.runtime import exit_codes, jax_compat

# os.EX_TEMPFAIL: the job failed because a process or the coordinator went
# missing or stuck; restarting (from the last checkpoint) may succeed.
EXIT_CODE = exit_codes.PEER_LOST

_KEY_DIR = "jdp/watchdog/"

# A live process publishes every poll interval (at most 2 s), so 10 s of silence
# is 5 missed records: it died or cannot reach the coordinator. Well below
# distributed.HEARTBEAT_TIMEOUT_S, after which jax aborts every process itself.
SILENCE_LIMIT_S = 10.0


def exit_now(message: str, exit_code: int = EXIT_CODE) -> NoReturn:
    """Writes `message` (if any) to stderr and ends the process at once, from any thread.

    `os._exit` skips atexit handlers on purpose: jax's handler waits for the
    other processes at a shutdown barrier, which is what we cannot afford.
    """
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or broken; the report matters more
            pass
    try:
        if message:
            os.write(2, (message.rstrip("\n") + "\n").encode("utf-8", "replace"))
    finally:
        os._exit(exit_code)


def thread_stacks() -> str:
    """Where each of this process's threads is, the main thread first: its name and its
    stack (most recent call last), each frame as file, line and function. The calling
    thread is left out. Source lines are not read: a stuck file system (the one the
    packages live on) must not stop the watchdog from ending the process."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    frames = [(names.get(ident, f"0x{ident:x}"), frame)
              for ident, frame in sys._current_frames().items()
              if ident != threading.get_ident()]
    frames.sort(key=lambda named: (named[0] != "MainThread", named[0]))
    return "\n".join(
        f"Thread {name} (most recent call last):\n" + "\n".join(reversed([
            f'  File "{f.f_code.co_filename}", line {line}, in {f.f_code.co_name}'
            for f, line in traceback.walk_stack(frame)]))
        for name, frame in frames)


def give_up(report: str) -> NoReturn:
    """The watchdog's end of a process: its report, then where this process's threads
    were (what a stuck process waits in), then `exit_now`."""
    try:
        stacks = thread_stacks()
    except Exception as e:  # the report and the exit matter more
        stacks = f"(not available: {type(e).__name__}: {e})"
    exit_now(f"{report}\nWhere this process's threads were when it gave up:\n{stacks}")


class KeyValueStore(Protocol):
    """The part of jax's coordination-service client (`DistributedRuntimeClient`) used here."""

    def key_value_set(self, key: str, value: str, allow_overwrite: bool = False) -> None: ...

    def key_value_dir_get(self, key: str) -> list[tuple[str, str]]: ...


@dataclasses.dataclass(frozen=True)
class _PeerView:
    """What this process last saw of another process, and when (by this process's clock)."""

    step: int
    beats: int
    seq: int
    stopped: bool
    seq_changed_at: float  # its watchdog thread is alive while this advances
    beats_changed_at: float  # its training loop is alive while this advances


class Watchdog:
    """Ends this process with a report when any process of the job stops making progress.

    Call `heartbeat(step)` from the training loop after each step is dispatched
    and at other host-side points of long phases (evaluation batches). Use as a
    context manager, or `start()` / `stop()`. Call `stop()` before anything
    that may legitimately block longer than `timeout_s` without heartbeats
    (waiting for the final checkpoint); a stopped process is no longer judged
    by the others.

    Args:
      timeout_s: longest time any process may go without progress.
      clock: monotonic seconds; injectable so the timing logic is testable.
      on_timeout: called with the report instead of `give_up` (print it, then the
        threads' stacks, and exit).
      kv_store, process_index, process_count: the job; by default jax's
        coordination-service client and this process's place in the job.
      poll_interval_s: how often to publish, read the others and check;
        by default a tenth of `timeout_s` (between 0.5 and 2 s).
    """

    def __init__(
        self,
        timeout_s: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        on_timeout: Callable[[str], None] | None = None,
        kv_store: KeyValueStore | None = None,
        process_index: int | None = None,
        process_count: int | None = None,
        poll_interval_s: float | None = None,
    ):
        if timeout_s <= 0:
            raise ValueError(f"Watchdog timeout_s must be positive, got {timeout_s}.")
        state = jax_compat.distributed_state()  # the job as jax.distributed set it up
        self.timeout_s = timeout_s
        self._clock = clock
        self._on_timeout = on_timeout or give_up
        self._process_index = state.process_id if process_index is None else process_index
        self._process_count = state.num_processes if process_count is None else process_count
        if kv_store is None and self._process_count > 1:
            kv_store = state.client
            if kv_store is None:
                raise RuntimeError(
                    f"Watchdog for process {self._process_index} of {self._process_count} needs "
                    "jax.distributed to be initialized first (jdp.distributed.initialize)."
                )
        self._kv_store = kv_store
        self.poll_interval_s = poll_interval_s or min(max(timeout_s / 10, 0.5), 2.0)
        # How long another process or the coordinator may go without a word.
        self.silence_limit_s = min(timeout_s, SILENCE_LIMIT_S)

        # Written by the caller's thread (heartbeat) and by the exchange thread;
        # each is one attribute assignment of an immutable value.
        self._last_beat: tuple[int, int, float] | None = None  # (step, beats, time)
        self._first_beat_at: float | None = None
        self._peers: dict[int, _PeerView] = {}
        self._published = 0
        self._kv_ok_at = clock()
        self._kv_error = ""
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []

    # -- the training loop's side -------------------------------------------

    def heartbeat(self, step: int) -> None:
        """Records progress: cheap enough to call after every step."""
        now = self._clock()
        beats = 1 if self._last_beat is None else self._last_beat[1] + 1
        if self._first_beat_at is None:
            self._first_beat_at = now
        self._last_beat = (step, beats, now)

    @contextlib.contextmanager
    def busy(self, step: int, limit_s: float | None = None):
        """Keeps beating while the caller waits on something slow but alive (a checkpoint
        save waiting for the previous one, slow storage), for at most `limit_s` (default
        10 x timeout_s): a wait longer than that is a hang, and is reported as one."""
        limit_s = 10 * self.timeout_s if limit_s is None else limit_s
        done = threading.Event()
        started = self._clock()

        def beat() -> None:
            while not done.wait(self.poll_interval_s / 2):
                if self._clock() - started > limit_s:
                    return
                self.heartbeat(step)

        thread = threading.Thread(target=beat, name="jdp-watchdog-busy", daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()
            self.heartbeat(step)

    def start(self) -> Watchdog:
        if self._threads:
            raise RuntimeError("Watchdog.start() was called twice.")
        loops = {"jdp-watchdog-monitor": self._monitor_loop}
        if self._kv_store is not None:
            loops["jdp-watchdog-exchange"] = self._exchange_loop
        for name, loop in loops.items():
            thread = threading.Thread(target=loop, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self) -> None:
        """Stops watching; the others then stop judging this process."""
        self._stopping.set()
        for thread in self._threads:
            # Bounded: the exchange thread may be stuck in a call to a dead coordinator.
            thread.join(timeout=self.poll_interval_s + 5.0)
        self._threads = []

    def __enter__(self) -> Watchdog:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # -- one round of each thread; public so tests can drive them with a fake clock

    def exchange(self, *, stopped: bool = False) -> None:
        """Publishes this process's progress and reads everyone else's."""
        assert self._kv_store is not None
        step, beats, _ = self._last_beat or (-1, 0, 0.0)
        self._published += 1
        record = {"step": step, "beats": beats, "seq": self._published, "stopped": stopped}
        try:
            self._kv_store.key_value_set(
                f"{_KEY_DIR}{self._process_index}", json.dumps(record), allow_overwrite=True
            )
            entries = self._kv_store.key_value_dir_get(_KEY_DIR)
        except Exception as e:  # any failure means "unreachable", judged by how long it lasts
            self._kv_error = f"{type(e).__name__}: {str(e)[:300]}"
            return
        now = self._clock()
        peers = dict(self._peers)
        for key, value in entries:
            index = int(key.rsplit("/", 1)[1])
            if index == self._process_index:
                continue
            seen = json.loads(value)
            old = peers.get(index)
            peers[index] = _PeerView(
                step=seen["step"],
                beats=seen["beats"],
                seq=seen["seq"],
                stopped=seen["stopped"],
                seq_changed_at=now if old is None or old.seq != seen["seq"] else old.seq_changed_at,
                beats_changed_at=(
                    now if old is None or old.beats != seen["beats"] else old.beats_changed_at
                ),
            )
        self._peers = peers
        self._kv_ok_at = now
        self._kv_error = ""

    def check(self) -> str | None:
        """The report to give if some process has stalled for `timeout_s`, else None."""
        if self._last_beat is None or self._first_beat_at is None:
            return None  # before the first step: compilation may take minutes
        step, _, beat_at = self._last_beat
        now = self._clock()
        armed_at = self._first_beat_at

        def age(since: float) -> float:
            # Nothing counts from before this process's first step.
            return now - max(since, armed_at)

        me = self._process_index
        # (rank, age_s, limit_s, line): missing processes first, stuck ones next, this one last.
        findings = [
            (
                2,
                now - beat_at,
                self.timeout_s,
                f"process {me} (this process): no progress for "
                f"{now - beat_at:.1f} s after step {step}",
            )
        ]
        notes = []  # listed in a report, never a reason for one
        unreachable = age(self._kv_ok_at) if self._kv_store is not None else 0.0
        if unreachable > self.silence_limit_s / 2:
            # The others' records are then unknown, not stale: blame only the coordinator.
            findings.append(
                (
                    0,
                    unreachable,
                    self.silence_limit_s,
                    f"coordinator (jax.distributed service): "
                    f"unreachable for {unreachable:.1f} s ({self._kv_error or 'no answer'})",
                )
            )
        else:
            for index in range(self._process_count):
                peer = self._peers.get(index)
                if index == me:
                    continue
                if peer is not None and peer.stopped:
                    notes.append(f"process {index}: left its training loop at step {peer.step}")
                elif (finding := self._judge_peer(index, peer, age)) is not None:
                    findings.append(finding)
        if all(age_s <= limit_s for _, age_s, limit_s, _ in findings):
            return None
        findings.sort(key=lambda finding: (finding[0], -finding[1]))
        lines = [line for _, age_s, limit_s, line in findings if age_s > limit_s / 2] + notes
        return "\n".join(
            [
                f"jdp watchdog: process {me} of {self._process_count} gives up at step {step} "
                f"(limits: no progress for timeout_s={self.timeout_s:g} s, silence for "
                f"{self.silence_limit_s:g} s):"
            ]
            + [f"  {line}" for line in lines]
            + [
                "A collective waits for every process, so one missing or stuck process stops "
                "all of them; look at the log of the first process listed. Exiting with code "
                f"{EXIT_CODE}."
            ]
        )

    def _judge_peer(
        self, index: int, peer: _PeerView | None, age: Callable[[float], float]
    ) -> tuple[int, float, float, str] | None:
        """A finding (rank, age_s, limit_s, line) about another process, or None while it
        looks healthy."""
        quiet = self.silence_limit_s
        if peer is None:
            # Its watchdog starts after its first compilation, which may take longer than
            # this one's: judged by timeout_s, like any difference in start-up time.
            line = f"process {index}: has not reported since this process's first step"
            return 0, age(-math.inf), self.timeout_s, line
        silent, stalled = age(peer.seq_changed_at), age(peer.beats_changed_at)
        where = f"after step {peer.step}" if peer.beats else "before its first step"
        # A healthy peer's record changes every poll interval, far below the silence limit.
        if silent > quiet / 2:
            line = f"process {index}: silent for {silent:.1f} s, last seen {where}"
            return 0, silent, quiet, f"{line} (it died, or its host is unreachable)"
        if stalled > self.timeout_s / 2:
            line = f"process {index}: alive but no progress for {stalled:.1f} s {where}"
            return 1, stalled, self.timeout_s, line
        return None

    # -- the threads ----------------------------------------------------------

    def _monitor_loop(self) -> None:
        while not self._stopping.wait(self.poll_interval_s):
            report = self.check()
            if report is not None:
                self._stopping.set()
                self._on_timeout(report)
                return

    def _exchange_loop(self) -> None:
        while not self._stopping.is_set():
            self.exchange()
            self._stopping.wait(self.poll_interval_s)
        self.exchange(stopped=True)
