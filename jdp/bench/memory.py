"""Per-device memory and communication of the train step: replicated, ZeRO-1 and FSDP,
over every device and inside each host (`--hosts`, default 2 virtual hosts); with
`--model_axis`, a GPT's step at each `model_parallel` instead (`model_axis.py`).

    python -m jdp.bench memory --model=base   # ViT-B/16 at 224, bf16, one example per device
    python -m jdp.bench memory --model_axis   # GPT-2 small at model_parallel 1, 2, 4, 8

Read from XLA's `memory_analysis()` and the collectives of the step compiled
from shapes alone (nothing is allocated), so it runs on a CPU for any device
count. Communication is what each device sends per step with ring algorithms.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jdp.bench import model_axis
from jdp.dryrun import hlo
from jdp.dryrun.lowering import compile_to_read, lower_from_shapes
from jdp.experiment import adapters
from jdp.experiment.task import classification
from jdp.models import vit
from jdp.parallel import StepOptions, compiler_options, make_backend
from jdp.parallel.mesh import make_mesh

MIB = 2**20
# name -> StepOptions fields
LAYOUTS = {
    "replicated": {},
    "zero1": {"shard_optimizer_state": True},
    "zero1_host": {"shard_optimizer_state": "host"},
    "fsdp": {"shard_params": True},
    "fsdp_host": {"shard_params": "host"},
}


def add_arguments(parser, name: str) -> None:
    parser.add_argument("--model", default="base", help="ViT size (nano, tiny, small, base, ...)")
    parser.add_argument("--image_size", type=int, default=224)
    parser.add_argument("--patch_size", type=int, default=16)
    parser.add_argument("--num_classes", type=int, default=1000)
    parser.add_argument("--per_device_batch_size", type=int, default=1)
    parser.add_argument("--dtype", default="bfloat16", help="compute dtype")
    parser.add_argument("--remat", default="none", help="none, full, ...")
    parser.add_argument("--hosts", type=int, default=2,
                        help="hosts the devices are split into (the host modes need 2 or more)")
    model_axis.add_arguments(parser)


def step_memory(args, layout: str) -> tuple[int, int, float]:
    """(argument bytes, temporary bytes, bytes sent) per device of the compiled train step."""
    mesh = make_mesh(hosts=args.hosts)
    model = adapters.from_linen(vit(args.model, num_classes=args.num_classes,
                                    patch_size=args.patch_size, pool="cls",
                                    dtype=jnp.dtype(args.dtype), remat=args.remat))
    layout_options = LAYOUTS[layout]
    options = StepOptions(compiler_options=compiler_options(
        jax.devices()[0].platform, args.remat, layout_options.get("shard_params", False)),
        **layout_options)
    backend = make_backend("pjit", mesh, model, classification(), optax.adamw(1e-3), options)
    example = {"image": np.zeros((args.image_size, args.image_size, 3), np.float32),
               "label": np.zeros((), np.int32)}
    lowered, _ = lower_from_shapes(backend, (example["image"][None],), example,
                                   args.per_device_batch_size * mesh.size)
    compiled = compile_to_read(lowered, options.compiler_options)
    memory = compiled.memory_analysis()
    sent = sum(op.ring_bytes_sent(mesh.size) for op in hlo.collectives(compiled.as_text()))
    return memory.argument_size_in_bytes, memory.temp_size_in_bytes, sent


def run_model_axis(args) -> None:
    """Per device at each model_parallel, at the same global batch."""
    setting = model_axis.setting(args, args.dtype, args.remat)
    totals = {}
    for model_parallel, row in model_axis.rows(setting):
        if isinstance(row, str):
            print(f"model_parallel={model_parallel}: refused: {row}", flush=True)
            continue
        totals[model_parallel] = row.argument_bytes + row.temp_bytes
        print(f"model_parallel={model_parallel} {setting.describe(model_parallel)}: arguments "
              f"{row.argument_bytes / MIB:.0f} MiB (params and optimizer state "
              f"{row.state_bytes / MIB:.0f} MiB) + temporaries {row.temp_bytes / MIB:.0f} MiB "
              "per device", flush=True)
    ratios = ", ".join(f"M={m} {total / totals[1]:.3f}" for m, total in totals.items() if m > 1)
    print(f"memory: arguments + temporaries per device against model_parallel=1: {ratios}")


def run(args) -> None:
    if args.model_axis:
        run_model_axis(args)
        return
    if args.hosts < 1 or jax.device_count() % args.hosts:
        print(f"--hosts={args.hosts}: this process has {jax.device_count()} devices, which "
              f"{args.hosts} hosts do not divide. Fix: --hosts=1, or more devices "
              "(XLA_FLAGS=--xla_force_host_platform_device_count=8 simulates 8 on a CPU).",
              file=sys.stderr)
        raise SystemExit(2)
    totals = {}
    for layout in LAYOUTS:
        if layout.endswith("_host") and args.hosts < 2:
            continue
        arguments, temporaries, sent = step_memory(args, layout)
        totals[layout] = arguments + temporaries
        print(f"{layout:10s} ViT-{args.model}/{args.patch_size} at {args.image_size}, "
              f"{args.dtype}, {args.per_device_batch_size} example(s) per device on "
              f"{jax.device_count()} devices: arguments {arguments / MIB:.0f} MiB + "
              f"temporaries {temporaries / MIB:.0f} MiB per device; sends "
              f"{sent / MIB:.0f} MiB per device per step", flush=True)
    ratios = ", ".join(f"{layout} {totals[layout] / totals['replicated']:.3f}"
                       for layout in totals if layout != "replicated")
    print(f"memory: arguments + temporaries per device against replicated: {ratios}")
