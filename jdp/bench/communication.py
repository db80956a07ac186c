"""Communication per step and state per device: flat, two-level, bf16 and int8
cross-host reduction, ZeRO-1 and FSDP over every device and inside each host.

    python -m jdp.bench communication        # ViT-S/16 and ResNet-50 on 2 hosts x 4 devices
    python -m jdp.bench communication --intra_gb_s=900 --inter_gb_s=50
    python -m jdp.bench communication --model_axis   # GPT-2 small, model_parallel 1 .. 8

Each configuration's train step is lowered from shapes alone (nothing runs, so a
CPU with 8 simulated devices stands in for 2 hosts of 4 accelerators). The bytes
come from the collectives of the program as lowered, not as XLA:CPU compiles it:
XLA:CPU widens bfloat16 collectives to float32, which GPUs and TPUs do not, and
combines the flat reduction's per-leaf all-reduces into one, which changes no
bandwidth-bound byte count (tests/test_communication.py checks the compiled
two-level program's groups and bytes). The sharded modes (ZeRO-1, FSDP) are read
from the compiled program: XLA's partitioner inserts ZeRO-1's all-gather of the
updated params after lowering. For each collective: what the busiest device
sends inside its host and what leaves the busiest host, with ring algorithms
(`hlo.Collective.traffic`). The modelled time of a collective is the slower of
the two at the given bandwidths (a device's inside its host, a host's across
hosts); a step's communication is the sum over its collectives, as the reduction
runs them one after another. Compute and its overlap with communication are not
modelled: the figure is the communication time alone. `--model_axis`: a GPT's step
at each `model_parallel` on one host (`model_axis.py`): what a device sends over the
model axis and over the data axes per step, read from the compiled float32 program.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import optax

from jdp import DATA_AXIS
from jdp.bench import model_axis
from jdp.dryrun import hlo
from jdp.dryrun.lowering import compile_to_read, lower_from_shapes
from jdp.experiment import adapters
from jdp.experiment.task import classification
from jdp.models import resnet, vit
from jdp.parallel import StepOptions, compiler_options, make_backend
from jdp.parallel import mesh as mesh_lib
from jdp.parallel.mesh import make_mesh
from jdp.parallel.two_level import param_count

MIB = 2**20
GB = 1e9
# name -> StepOptions fields
REDUCTIONS = {
    "flat": {},
    "two_level": {"reduction": "two_level"},
    "bf16": {"reduction": "two_level", "cross_host_reduce": "bfloat16"},
    "int8": {"reduction": "two_level", "cross_host_reduce": "int8"},
    "zero1": {"shard_optimizer_state": True},
    "zero1_host": {"shard_optimizer_state": "host"},
    "fsdp": {"shard_params": True},
    "fsdp_host": {"shard_params": "host"},
    "fsdp_host_int8": {"shard_params": "host", "cross_host_reduce": "int8"},
}
# A host mode and the mode over every device it replaces.
HOST_MODES = {"zero1_host": "zero1", "fsdp_host": "fsdp", "fsdp_host_int8": "fsdp"}
# Read from the compiled program: the all-gathers of ZeRO-1's updated params are
# inserted by XLA's partitioner, after lowering (float32 only, so nothing is widened).
COMPILED = {"zero1", "zero1_host", "fsdp", "fsdp_host"}


def add_arguments(parser, name: str) -> None:
    parser.add_argument("--models", default="vit:small,resnet:50",
                        help="comma-separated family:size, e.g. vit:small,resnet:50")
    parser.add_argument("--image_size", type=int, default=224)
    parser.add_argument("--num_classes", type=int, default=1000)
    parser.add_argument("--hosts", type=int, default=2, help="hosts the devices are split into")
    parser.add_argument("--intra_gb_s", type=float, default=400.0,
                        help="bandwidth of one device inside its host, GB/s")
    parser.add_argument("--inter_gb_s", type=float, default=25.0,
                        help="bandwidth of one host to the others, GB/s")
    model_axis.add_arguments(parser)


def _model(spec: str, args):
    family, size = spec.split(":")
    if family == "vit":
        return adapters.from_linen(vit(size, num_classes=args.num_classes, patch_size=16,
                                       pool="cls"))
    if family == "resnet":
        return adapters.from_linen(resnet(size, num_classes=args.num_classes,
                                          bn_axis_name=DATA_AXIS))
    raise SystemExit(f"--models: unknown family {family!r} in {spec!r}; use vit or resnet")


def step_traffic(model, example: dict, hosts: int, reduction: str, *,
                 tx: optax.GradientTransformation | None = None,
                 as_run_here: bool = False) -> tuple[list[hlo.Traffic], int, int]:
    """(traffic of each collective of the step for batches of `example`s over every
    device split into `hosts`, gradient bytes in float32, bytes of params and optimizer
    state one device holds). `as_run_here`: every program read as compiled for this
    machine's devices with the run's own XLA options (what a CPU run sends, bfloat16
    widened), not only those in COMPILED."""
    mesh = make_mesh(hosts=hosts)
    options = StepOptions(**REDUCTIONS[reduction])
    if as_run_here:
        options = dataclasses.replace(options, compiler_options=compiler_options(
            jax.default_backend(), "none", options.shard_params))
    backend = make_backend("pjit", mesh, model, classification(), tx or optax.adamw(1e-3),
                           options)
    lowered, state = lower_from_shapes(backend, (example["image"][None],), example, mesh.size)
    grad_bytes = param_count(state.params) * 4
    if as_run_here:
        program = lowered.compile(options.compiler_options).as_text()
    elif reduction in COMPILED:
        program = compile_to_read(lowered).as_text()
    else:
        program = lowered.as_text(dialect="hlo")
    host_of = mesh_lib.host_of(mesh)
    state_bytes = mesh_lib.device_bytes((state.params, state.opt_state))
    return [op.traffic(host_of) for op in hlo.collectives(program)], grad_bytes, state_bytes


def run_model_axis(args) -> None:
    """Bytes a device sends per step over the model axis and the data axes, at each
    model_parallel, at the same global batch (float32: XLA:CPU widens bfloat16)."""
    setting = model_axis.setting(args, "float32", "none")
    intra = args.intra_gb_s * GB
    for model_parallel, row in model_axis.rows(setting):
        if isinstance(row, str):
            print(f"model_parallel={model_parallel}: refused: {row}", flush=True)
            continue
        total = row.model_axis_sent + row.data_axis_sent
        print(f"model_parallel={model_parallel} {setting.describe(model_parallel)}: over the "
              "model axis "
              f"{row.model_axis_sent / MIB:.1f} MiB in {row.model_axis_ops} collectives, over "
              f"the data axes {row.data_axis_sent / MIB:.1f} MiB per device per step; state "
              f"{row.state_bytes / MIB:.0f} MiB per device; modelled "
              f"{total / intra * 1e3:.2f} ms at {args.intra_gb_s:g} GB/s", flush=True)


def run(args) -> None:
    if args.model_axis:
        run_model_axis(args)
        return
    intra, inter = args.intra_gb_s * GB, args.inter_gb_s * GB
    local = jax.device_count() // args.hosts
    print(f"{args.hosts} hosts x {local} devices; modelled at {args.intra_gb_s:g} GB/s per "
          f"device inside a host, {args.inter_gb_s:g} GB/s per host across hosts", flush=True)
    speedups, over_all_devices = {}, {}
    example = {"image": np.zeros((args.image_size, args.image_size, 3), np.float32),
               "label": np.zeros((), np.int32)}
    for spec in args.models.split(","):
        model = _model(spec, args)
        times = {}
        for reduction in REDUCTIONS:
            traffic, grad_bytes, state_bytes = step_traffic(model, example, args.hosts,
                                                            reduction)
            inside = sum(t.intra_device_bytes for t in traffic)
            across = sum(t.cross_host_bytes for t in traffic)
            times[reduction] = time_s = sum(t.time_s(intra, inter) for t in traffic)
            speedups[(spec, reduction)] = times["flat"] / time_s
            line = (f"{spec:12s} {reduction:14s} gradients {grad_bytes / MIB:7.1f} MiB: inside "
                    f"a host {inside / MIB:7.1f} MiB per device, across hosts "
                    f"{across / MIB:7.1f} MiB per host; state {state_bytes / MIB:7.1f} MiB per "
                    f"device; modelled {time_s * 1e3:7.2f} ms, {times['flat'] / time_s:.2f}x "
                    "flat")
            if reduction in HOST_MODES:
                base = HOST_MODES[reduction]
                over_all_devices[(spec, reduction)] = times[base] / time_s
                line += f", {times[base] / time_s:.2f}x {base}"
            print(line, flush=True)
    summary = ", ".join(f"{spec} {reduction} {speedups[(spec, reduction)]:.2f}x"
                        for spec, reduction in speedups if reduction != "flat")
    print(f"communication: modelled speed-up over flat: {summary}")
    print("communication: host modes over the same sharding across every device: " + ", ".join(
        f"{spec} {mode} {value:.2f}x {HOST_MODES[mode]}"
        for (spec, mode), value in over_all_devices.items()))

