"""Where step time goes, read from the profiler trace of a run's profile window.

`profile.num_steps` makes the loop write a jax.profiler trace (an XSpace, `*.xplane.pb`)
of a few steps, each dispatch marked by a "train" step annotation. `split` reads it
with jax's own reader (`jax.profiler.ProfileData`) and divides each device's time over
the traced steps, from the first step's dispatch to the end of the last device work,
into:

- compute: the device ran an operation other than a collective;
- collectives: exposed (nothing else ran) and overlapped (compute ran meanwhile);
- host / input wait: the device had nothing to do and the next step was not yet
  dispatched (the host was waiting for input, or busy);
- idle: the device had nothing to do though the step was dispatched (launch gaps,
  waits between operations).

compute + exposed collectives + host wait + idle = the window, per device; the
figures are means over devices. Device work is every trace event with an `hlo_op`
stat (CPU: on the host's XLA threads, grouped by `device_ordinal`), or on a GPU
plane's stream lines; a collective is an all-reduce, all-gather, reduce-scatter,
all-to-all, collective-permute or NCCL kernel, by XLA's name for it or by jax's
(an XLA:CPU trace names each operation as the HLO instruction: `all-reduce.3` where
XLA combined psums, `psum.7` where jax's psum reached XLA as it is).
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re

_COLLECTIVE = re.compile(r"all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute"
                         r"|collective-broadcast|nccl"
                         r"|\b(psum|pmax|pmin|all_gather|reduce_scatter|all_to_all|ppermute)",
                         re.IGNORECASE)
STEP_ANNOTATION = "train"  # jdp.observe.profiling.StepProfiler's step name

Interval = tuple[float, float]


@dataclasses.dataclass(frozen=True)
class PhaseSplit:
    """One trace's split, in seconds per step (means over the devices)."""

    steps: int
    devices: int
    step_time_s: float
    compute_s: float
    collective_exposed_s: float
    collective_overlapped_s: float
    host_wait_s: float
    idle_s: float

    @property
    def collective_s(self) -> float:
        return self.collective_exposed_s + self.collective_overlapped_s

    def shares(self) -> dict[str, float]:
        """Each phase's share of the step time (the four parts sum to 1)."""
        total = self.step_time_s or 1.0
        return {"compute": self.compute_s / total,
                "collectives (exposed)": self.collective_exposed_s / total,
                "host/input wait": self.host_wait_s / total,
                "idle": self.idle_s / total}

    def overlap_fraction(self) -> float | None:
        """How much of the collectives' time ran alongside compute."""
        return self.collective_overlapped_s / self.collective_s if self.collective_s else None

    def as_dict(self) -> dict[str, float]:
        return {**dataclasses.asdict(self), "collective_s": self.collective_s,
                "collective_overlap_fraction": self.overlap_fraction()}


class TraceError(Exception):
    """A trace that cannot be split; the message names the file and why."""


def latest_trace(profile_dir: str) -> str | None:
    """The newest `*.xplane.pb` under a run's profile directory (process 0's first)."""
    for pattern in ("process_0/plugins/profile/*/*.xplane.pb", "**/*.xplane.pb"):
        paths = glob.glob(os.path.join(profile_dir, pattern), recursive=True)
        if paths:
            return max(paths, key=os.path.getmtime)
    return None


def split_file(path: str) -> PhaseSplit:
    """The phase split of one `*.xplane.pb` written by jax.profiler."""
    from jax.profiler import ProfileData

    try:
        profile = ProfileData.from_file(path)
    except Exception as e:  # the reader's C++ errors have no common type
        raise TraceError(f"{path} is not a jax.profiler trace ({e})") from e
    dispatches, device_events = _events(profile)
    if not dispatches:
        raise TraceError(f"{path} has no {STEP_ANNOTATION!r} step annotations; expected a "
                         "trace of jdp's profile window (profile.num_steps > 0)")
    if not device_events:
        raise TraceError(f"{path} has no device operations (no events with an hlo_op "
                         "stat or on a GPU stream)")
    return split(dispatches, device_events)


def _events(profile) -> tuple[list[float], dict[str, list[tuple[float, float, bool]]]]:
    """(start times of the step dispatches, device -> [(start, end, is_collective)]), in ns."""
    dispatches: list[float] = []
    devices: dict[str, list[tuple[float, float, bool]]] = {}
    for plane in profile.planes:
        gpu_plane = plane.name.startswith("/device:GPU")
        for line in plane.lines:
            on_stream = gpu_plane and line.name.startswith("Stream")
            for event in line.events:
                if event.name.startswith("end: ") or event.duration_ns <= 0:
                    continue
                stats = dict(event.stats)
                if event.name == STEP_ANNOTATION and "step_num" in stats:
                    dispatches.append(event.start_ns)
                    continue
                if not (on_stream or "hlo_op" in stats):
                    continue
                device = plane.name if gpu_plane else f"device {stats.get('device_ordinal', 0)}"
                label = f"{event.name} {stats.get('hlo_op', '')}"
                devices.setdefault(device, []).append(
                    (event.start_ns, event.end_ns, bool(_COLLECTIVE.search(label))))
    return sorted(dispatches), devices


def split(dispatches: list[float], device_events: dict[str, list[tuple[float, float, bool]]]
          ) -> PhaseSplit:
    """The split of a window that starts at the first dispatch and ends with the last
    device work; times in ns (pure, for tests)."""
    start = dispatches[0]
    end = max(e for events in device_events.values() for _, e, _ in events)
    window = (start, end)
    totals = dict.fromkeys(("compute", "exposed", "overlapped", "host", "idle"), 0.0)
    for events in device_events.values():
        compute = _clip(_union([(s, e) for s, e, c in events if not c]), window)
        collective = _clip(_union([(s, e) for s, e, c in events if c]), window)
        busy = _union(compute + collective)
        overlapped = _length(_intersect(compute, collective))
        totals["compute"] += _length(compute)
        totals["overlapped"] += overlapped
        totals["exposed"] += _length(collective) - overlapped
        host, idle = _gaps(busy, window, dispatches)
        totals["host"] += host
        totals["idle"] += idle
    n, steps = len(device_events), len(dispatches)
    per_step = 1e-9 / (n * steps)
    return PhaseSplit(steps=steps, devices=n, step_time_s=(end - start) * 1e-9 / steps,
                      compute_s=totals["compute"] * per_step,
                      collective_exposed_s=totals["exposed"] * per_step,
                      collective_overlapped_s=totals["overlapped"] * per_step,
                      host_wait_s=totals["host"] * per_step, idle_s=totals["idle"] * per_step)


def _gaps(busy: list[Interval], window: Interval, dispatches: list[float]
          ) -> tuple[float, float]:
    """(host wait, idle) in a device's free time: the part of a gap before a dispatch
    that falls in it is waiting for the host; the rest of the gap is idle."""
    host = idle = 0.0
    edges = [window[0], *[x for interval in busy for x in interval], window[1]]
    for gap_start, gap_end in zip(edges[0::2], edges[1::2], strict=True):
        if gap_end <= gap_start:
            continue
        inside = [d for d in dispatches if gap_start <= d < gap_end]
        waited = (max(inside) - gap_start) if inside else 0.0
        host += waited
        idle += gap_end - gap_start - waited
    return host, idle


def _union(intervals: list[Interval]) -> list[Interval]:
    merged: list[Interval] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _clip(intervals: list[Interval], window: Interval) -> list[Interval]:
    return [(max(s, window[0]), min(e, window[1])) for s, e in intervals
            if e > window[0] and s < window[1]]


def _intersect(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """The overlap of two sorted, disjoint interval lists."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def _length(intervals: list[Interval]) -> float:
    return sum(end - start for start, end in intervals)


def format_split(result: PhaseSplit) -> str:
    """One line: the step time and each phase's share."""
    shares = ", ".join(f"{name} {share:.0%}" for name, share in result.shares().items())
    overlap = result.overlap_fraction()
    overlapped = f"; {overlap:.0%} of collective time overlapped compute" if overlap else ""
    return (f"{result.step_time_s * 1e3:.1f} ms/step over {result.steps} traced steps, "
            f"{result.devices} devices: {shares}{overlapped}")
