"""The estimate `--dry_run` prints: what one train step will cost before it runs.

Given numbers already read from the compiled step (memory and FLOPs from XLA, the
collectives from its HLO), this module does the arithmetic and writes the text: memory
per device against capacity, the gradient all-reduce against the parameter count, what
the model axis's collectives send (with `parallel.model_parallel`), and how the
gradient communication would scale to more devices. It compiles nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from jdp.dryrun.hlo import Collective
from jdp.parallel.reducers import GRADIENT_SCOPE  # the name scope of the step's reduction

_GRAD_BYTES_PER_PARAM = {"float32": 4, "bfloat16": 2, "float16": 2}
_FITS_FIXES = ("a smaller --config.batch_size or more --config.grad_accum_steps, "
               "--config.remat=full, --config.compute_dtype=bfloat16, "
               "--config.parallel.shard_optimizer_state=true (ZeRO-1) "
               "or --config.parallel.shard_params=true")


class PlanError(ValueError):
    """The compiled step cannot run as configured; the message is one line with the fix."""


class MemoryUnknown(PlanError):
    """XLA gave no memory analysis for the compiled step (some platforms give none)."""


@dataclasses.dataclass(frozen=True)
class ScalingRow:
    device_count: int
    bandwidth_gb_per_s: float
    communication_s: float
    efficiency: float | None  # None when the compute time is unknown


@dataclasses.dataclass
class PlanInputs:
    """Everything the plan reports, as plain numbers: memory and FLOPs are per device."""

    platform: str
    device_kind: str
    device_count: int
    process_count: int
    mesh_shape: dict[str, int]
    global_batch_size: int
    per_process_batch_size: int
    per_device_batch_size: int
    micro_batch_size: int  # examples per device in one accumulation micro-step
    grad_accum_steps: int
    num_params: int
    param_bytes: int
    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    alias_bytes: int = 0  # outputs that reuse a donated argument's buffer
    device_memory_bytes: int | None = None
    flops_per_step: float | None = None  # XLA's count for one device
    peak_flops_per_s: float | None = None
    step_time_s: float | None = None  # measured
    collectives: Sequence[Collective] = ()
    grad_reduce_dtype: str = "float32"
    metric_bytes: int = 0  # the task's metric sums, packed into the gradient all-reduce
    # A device's position in the mesh -> its host, with more than one host.
    host_of: dict[int, int] | None = None
    # What one device holds of the params and optimizer state (its shards).
    state_bytes_per_device: int | None = None
    model_parallel: int = 1  # devices along the model axis
    # A device's position in the mesh -> its data replica (the model group it is in).
    data_replica_of: dict[int, int] | None = None
    # Gradient values one device reduces: its model shard of each param (num_params / M
    # for the split ones); None: num_params.
    reduced_param_count: int | None = None

    @property
    def data_parallel_size(self) -> int:
        return self.device_count // self.model_parallel


def ring_all_reduce_s(num_bytes: float, device_count: int,
                      bandwidth_bytes_per_s: float) -> float:
    """Seconds for a bandwidth-bound ring all-reduce: each device sends and receives
    2 (N-1)/N of the buffer (a reduce-scatter then an all-gather); latency is ignored."""
    if device_count < 1:
        raise ValueError(f"device_count={device_count}: must be >= 1")
    if bandwidth_bytes_per_s <= 0:
        raise ValueError(f"bandwidth_bytes_per_s={bandwidth_bytes_per_s}: must be > 0")
    return 2 * (device_count - 1) / device_count * num_bytes / bandwidth_bytes_per_s


def _efficiency(compute_s: float, communication_s: float) -> float:
    total = compute_s + communication_s
    return compute_s / total if total > 0 else 1.0


def scaling(grad_bytes: float, compute_s: float | None,
            device_counts: Sequence[int] = (8, 64, 512),
            bandwidths_gb_per_s: Sequence[float] = (25, 100, 400)) -> list[ScalingRow]:
    """Gradient all-reduce time and efficiency = compute / (compute + communication) for
    each (device count, bandwidth), one row each, device count major.

    Weak scaling: the per-device batch, hence `compute_s`, stays fixed as devices are
    added. Communication is assumed not to overlap compute, so the cost is an upper
    bound. GB is 10^9 bytes, as link bandwidths are quoted.
    """
    rows = []
    for device_count in device_counts:
        for bandwidth in bandwidths_gb_per_s:
            communication_s = ring_all_reduce_s(grad_bytes, device_count, bandwidth * 1e9)
            efficiency = None if compute_s is None else _efficiency(compute_s, communication_s)
            rows.append(ScalingRow(device_count, bandwidth, communication_s, efficiency))
    return rows


def _outside_loop_all_reduces(collectives: Sequence[Collective]) -> list[Collective]:
    return [c for c in collectives if c.kind == "all-reduce" and not c.in_loop]


def _is_gradient_reduce(collective: Collective) -> bool:
    # FSDP reduces each gradient with a reduce-scatter, under the same scope.
    return (collective.kind in ("all-reduce", "reduce-scatter")
            and GRADIENT_SCOPE in collective.op_name)


def _reduced_bytes(collective: Collective) -> int:
    """The bytes a reduction sums: a reduce-scatter's input, an all-reduce's buffer."""
    if collective.kind == "reduce-scatter":
        return collective.operand_bytes or collective.bytes * (collective.group_size or 1)
    return collective.bytes


def gradient_all_reduce_bytes(collectives: Sequence[Collective]) -> int:
    """Bytes of the step's gradient all-reduce (gradients plus the packed metric sums).

    jdp issues it under the name scope `gradient_all_reduce`; HLO without that
    metadata falls back to the largest all-reduce outside loops. The program as
    lowered may split it into one op per gradient leaf: all of them count, and
    FSDP's reduce-scatters count with their inputs (the full gradients summed).
    """
    named = [c for c in collectives if _is_gradient_reduce(c)]
    if named:
        return sum(_reduced_bytes(c) for c in named)
    return max((c.bytes for c in _outside_loop_all_reduces(collectives)), default=0)


def other_all_reduces(collectives: Sequence[Collective]) -> list[Collective]:
    """All-reduces besides the gradient one (BatchNorm statistics, the model's own)."""
    reduces = [c for c in collectives if c.kind == "all-reduce"]
    if any(_is_gradient_reduce(c) for c in collectives):
        return [c for c in reduces if not _is_gradient_reduce(c)]
    outside = sorted(_outside_loop_all_reduces(reduces), key=lambda c: c.bytes)
    return outside[:-1] + [c for c in reduces if c.in_loop]


def expected_gradient_bytes(num_params: int, grad_reduce_dtype: str) -> int:
    """Bytes of all gradients in the reduction dtype: what the all-reduce should carry."""
    if grad_reduce_dtype not in _GRAD_BYTES_PER_PARAM:
        raise ValueError(f"grad_reduce_dtype={grad_reduce_dtype!r}: unknown; use one of "
                         f"{', '.join(map(repr, _GRAD_BYTES_PER_PARAM))}")
    return num_params * _GRAD_BYTES_PER_PARAM[grad_reduce_dtype]


def needed_bytes(inputs: PlanInputs) -> int:
    """Peak memory of the step on one device: donated state is aliased, so counted once."""
    return inputs.argument_bytes + inputs.output_bytes + inputs.temp_bytes - inputs.alias_bytes


def compute_time_s(inputs: PlanInputs) -> float | None:
    """The step's compute time: measured if given, else FLOPs / peak, else unknown."""
    if inputs.step_time_s is not None:
        return inputs.step_time_s
    if inputs.flops_per_step is not None and inputs.peak_flops_per_s:
        return inputs.flops_per_step / inputs.peak_flops_per_s
    return None


def check_fits(inputs: PlanInputs) -> None:
    """Raises PlanError when the step needs more memory per device than the device has."""
    capacity = inputs.device_memory_bytes
    needed = needed_bytes(inputs)
    if capacity is None or needed <= capacity:
        return
    raise PlanError(
        f"The train step needs {_size(needed)} per device ({_size(inputs.argument_bytes)} "
        f"arguments + {_size(inputs.output_bytes)} outputs + {_size(inputs.temp_bytes)} "
        f"temporaries - {_size(inputs.alias_bytes)} aliased) but the device "
        f"({inputs.device_kind}) has {_size(capacity)}. Fix: try {_FITS_FIXES}.")


def _size(num_bytes: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(num_bytes) >= scale:
            return f"{num_bytes / scale:.1f} {unit}"
    return f"{num_bytes:.0f} B"


def _duration(seconds: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-6:.3g} us"


def _devices_lines(inputs: PlanInputs) -> list[str]:
    mesh = ", ".join(f"{axis}={size}" for axis, size in inputs.mesh_shape.items())
    processes = f"{inputs.process_count} process{'' if inputs.process_count == 1 else 'es'}"
    if inputs.model_parallel == 1:
        devices = f"{inputs.device_count} x {inputs.per_device_batch_size} per device"
    else:  # the batch splits over the data axes only
        devices = (f"{inputs.data_parallel_size} data-parallel x "
                   f"{inputs.per_device_batch_size} per device (each row on the "
                   f"{inputs.model_parallel} devices of its model group)")
    return [f"Devices: {inputs.device_count} x {inputs.device_kind} ({inputs.platform}), "
            f"{processes}; mesh {mesh}",
            f"Batch: global {inputs.global_batch_size} = {inputs.process_count} x "
            f"{inputs.per_process_batch_size} per process = {devices}; per device "
            f"{inputs.grad_accum_steps} accumulation step(s) x micro-batch "
            f"{inputs.micro_batch_size}",
            f"Parameters: {inputs.num_params:,} ({inputs.param_bytes / 2**20:.2f} MiB)"]


def _memory_lines(inputs: PlanInputs) -> list[str]:
    needed = needed_bytes(inputs)
    capacity = inputs.device_memory_bytes
    against = ("capacity unknown (CPU)" if capacity is None else
               f"{100 * needed / capacity:.1f}% of {_size(capacity)}")
    return ["Memory per device:",
            f"  arguments {_size(inputs.argument_bytes)}, outputs {_size(inputs.output_bytes)}, "
            f"temporaries {_size(inputs.temp_bytes)}, aliased {_size(inputs.alias_bytes)}",
            f"  total {_size(needed)}: {against}"]


def _flops_line(inputs: PlanInputs) -> str:
    if inputs.flops_per_step is None:
        return "FLOPs per step per device: unknown (XLA gave no cost analysis)"
    line = f"FLOPs per step per device: {inputs.flops_per_step:.3g} (XLA's count)"
    if inputs.peak_flops_per_s:
        seconds = inputs.flops_per_step / inputs.peak_flops_per_s
        line += f", {_duration(seconds)} at the peak {inputs.peak_flops_per_s:.3g} FLOP/s"
    return line


def _collective_lines(collectives: Sequence[Collective]) -> list[str]:
    if not collectives:
        return ["Collectives: none (one device, or nothing to reduce)"]
    groups: dict[tuple, list[Collective]] = {}
    for c in collectives:
        groups.setdefault((c.kind, c.group_size, c.in_loop), []).append(c)
    lines = ["Collectives (per device, per step):"]
    for (kind, group_size, in_loop), ops in groups.items():
        sizes = sorted(c.bytes for c in ops)
        each = _size(sizes[0]) if sizes[0] == sizes[-1] else (
            f"{_size(sizes[0])} to {_size(sizes[-1])}")
        dtypes = ",".join(sorted(set().union(*(c.dtypes for c in ops))))
        devices = "groups unknown" if group_size is None else f"groups of {group_size}"
        where = "INSIDE A LOOP (runs every iteration)" if in_loop else "outside loops"
        lines.append(f"  {kind:<18} x{len(ops):<3} {each} each, {_size(sum(sizes))} total; "
                     f"{dtypes}; {devices}; {where}")
    return lines


def _host_lines(inputs: PlanInputs) -> list[str]:
    """With several hosts: what the step's collectives send inside hosts and across them
    (ring algorithms, the busiest device and host), and the state each device holds."""
    lines = []
    if inputs.state_bytes_per_device is not None:
        lines.append(f"Params and optimizer state per device: "
                     f"{_size(inputs.state_bytes_per_device)}")
    if inputs.host_of and len(set(inputs.host_of.values())) > 1 and inputs.collectives:
        traffic = [c.traffic(inputs.host_of) for c in inputs.collectives]
        inside = sum(t.intra_device_bytes for t in traffic)
        across = sum(t.cross_host_bytes for t in traffic)
        crossing = sum(1 for t in traffic if t.cross_host_bytes)
        lines.append(f"Per step: {_size(inside)} sent by a device inside its host, "
                     f"{_size(across)} leaving a host across hosts in {crossing} "
                     "collective(s) (ring algorithms; loop bodies counted once)")
    return lines


def over_model_axis(collective: Collective, data_replica_of: dict[int, int]) -> bool:
    """Whether each of the op's groups lies within one model group (one data replica):
    the model axis's own collectives (XLA's, for the layers split over it)."""
    groups = collective.replica_groups
    return bool(groups) and all(len({data_replica_of[d] for d in group}) == 1
                                for group in groups)


def _model_axis_lines(inputs: PlanInputs) -> list[str]:
    """With a model axis: what its collectives (XLA's, inside each model group) send."""
    if inputs.model_parallel == 1 or inputs.data_replica_of is None:
        return []
    ops = [c for c in inputs.collectives if over_model_axis(c, inputs.data_replica_of)]
    counts: dict[str, int] = {}
    for c in ops:
        counts[c.kind] = counts.get(c.kind, 0) + 1
    kinds = ", ".join(f"{count} {kind}" for kind, count in counts.items()) or "none"
    sent = sum(c.ring_bytes_sent(inputs.model_parallel) for c in ops)
    looped = sum(1 for c in ops if c.in_loop)
    return [f"Model axis: groups of {inputs.model_parallel} devices, each holding 1/"
            f"{inputs.model_parallel} of every split layer; per step {kinds} "
            f"({_size(sum(c.bytes for c in ops))} of results), {_size(sent)} sent per device "
            f"(ring algorithms{'; loop bodies counted once' if looped else ''})"]


def _gradient_lines(inputs: PlanInputs) -> tuple[list[str], int]:
    """The gradient all-reduce against the parameter count, and the bytes to scale."""
    total = gradient_all_reduce_bytes(inputs.collectives)
    scalars = inputs.metric_bytes if total else 0
    reduced = inputs.reduced_param_count or inputs.num_params
    expected = expected_gradient_bytes(reduced, inputs.grad_reduce_dtype)
    per_param = _GRAD_BYTES_PER_PARAM[inputs.grad_reduce_dtype]
    share = ("" if inputs.model_parallel == 1 else
             f" (a device's model shard of the {inputs.num_params:,}; over the data axes only)")
    lines = [f"Gradient all-reduce: {total:,} B ({_size(total)}), of which "
             f"{scalars:,} B metric sums: gradients {total - scalars:,} B",
             f"  expected {per_param} B x {reduced:,} parameters{share} "
             f"({inputs.grad_reduce_dtype}) = {expected:,} B"]
    others = other_all_reduces(inputs.collectives)
    if others:
        other_bytes = sum(c.bytes for c in others)
        lines.append(f"  {len(others)} other all-reduce(s) of {_size(other_bytes)} in all: "
                     "the model's own (BatchNorm's global-batch statistics) or XLA's (the "
                     "model axis's; global norms of sharded gradients)")
    if any(c.kind == "reduce-scatter" and _is_gradient_reduce(c) for c in inputs.collectives):
        lines.append("  as reduce-scatters (FSDP, ZeRO-1): each device keeps the sum of its "
                     "own shard")
    if total == 0:
        lines.append("  no all-reduce outside loops: scaling below uses the expected bytes")
        return lines, expected
    if abs(total - scalars - expected) > 0.01 * expected:
        lines.append("  differs from expected: XLA may reduce in another dtype (CPU reduces "
                     "bfloat16 in float32), or gradients travel in other collectives")
    return lines, total - scalars


def _scaling_lines(grad_bytes: int, compute_s: float | None) -> list[str]:
    rows = scaling(grad_bytes, compute_s)
    bandwidths = list(dict.fromkeys(row.bandwidth_gb_per_s for row in rows))
    header = "  devices" + "".join(f"{f'{b:g} GB/s':>22}" for b in bandwidths)
    lines = ["Gradient communication per step: ring all-reduce, bandwidth-bound, no overlap "
             "with compute (an upper bound on its cost)"]
    if compute_s is None:
        lines.append("  compute time cannot be estimated (no measured step time, and FLOPs or "
                     "peak FLOP/s unknown): communication times only")
    else:
        lines.append(f"  compute {_duration(compute_s)} per step, per-device batch held fixed "
                     "(weak scaling); time and efficiency = compute / (compute + communication)")
    lines.append(header)
    for device_count in dict.fromkeys(row.device_count for row in rows):
        cells = ""
        for row in rows:
            if row.device_count == device_count:
                cell = _duration(row.communication_s)
                if row.efficiency is not None:
                    cell += f" {100 * row.efficiency:5.1f}%"
                cells += f"{cell:>22}"
        lines.append(f"  {device_count:>7}{cells}")
    return lines


def format_plan(inputs: PlanInputs) -> str:
    """The multi-line pre-flight plan printed by `--dry_run`."""
    gradient_lines, grad_bytes = _gradient_lines(inputs)
    compute_s = compute_time_s(inputs)
    if inputs.step_time_s is not None:
        compute_source = f"Step time: {_duration(inputs.step_time_s)} measured"
    elif compute_s is not None:
        compute_source = f"Step time: {_duration(compute_s)} estimated from FLOPs / peak"
    else:
        compute_source = "Step time: unknown"
    return "\n".join([
        "Pre-flight plan",
        *_devices_lines(inputs),
        *_memory_lines(inputs),
        _flops_line(inputs),
        compute_source,
        *_collective_lines(inputs.collectives),
        *_model_axis_lines(inputs),
        *_host_lines(inputs),
        *gradient_lines,
        *_scaling_lines(grad_bytes, compute_s),
    ])
