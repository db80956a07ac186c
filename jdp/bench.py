"""Benchmarks: programs that print figures, compared as ratios within one run.

    python -m jdp.bench overhead     # jdp's train step vs a minimal hand-written jax.jit step
    python -m jdp.bench scaling      # examples/s of the same model at 1, 2, 4, 8 devices
    python -m jdp.bench checkpoint   # how long a save stalls training: async vs synchronous

Each prints one line per measurement and a summary; `--model`, `--batch_size`,
`--steps` and `--repeats` size them. On a CPU machine, simulate devices with
XLA_FLAGS=--xla_force_host_platform_device_count=8.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import jax
import numpy as np
import optax

from jdp import modeling
from jdp.checkpoint import Checkpointer
from jdp.mesh import batch_sharding, make_mesh, replicated
from jdp.models import vit
from jdp.parallel import StepOptions, make_backend


def _model(size: str) -> modeling.Model:
    return modeling.from_linen(vit(size, num_classes=10, patch_size=4, pool="gap"))


def _batch(global_batch_size: int, image_size: int = 32) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"image": rng.normal(size=(global_batch_size, image_size, image_size, 3))
            .astype(np.float32),
            "label": rng.integers(0, 10, size=(global_batch_size,)).astype(np.int32)}


def _time_steps(step, state, batch, steps: int) -> tuple[float, object]:
    """Seconds per step over `steps` dispatches, synchronised only at the end."""
    state, metrics = step(state, batch)  # warm up
    jax.block_until_ready(metrics)
    start = time.perf_counter()
    for _ in range(steps):
        state, metrics = step(state, batch)
    jax.block_until_ready((state, metrics))
    return (time.perf_counter() - start) / steps, state


def _jdp_step(model, tx, devices, batch_np, backend="pjit"):
    backend_ = make_backend(backend, make_mesh(devices=devices), model, tx, StepOptions())
    state = backend_.from_global(backend_.init_global(jax.random.key(0),
                                                      batch_np["image"][:1]))
    batch = backend_.put_batch(batch_np)
    return backend_.compiled_train_step(state, batch), state, batch


def _minimal_step(model, tx, devices, batch_np):
    """What a user would write by hand: one jit, GSPMD inserts the reduction."""
    mesh = make_mesh(devices=devices)
    params, model_state = jax.jit(model.init, out_shardings=replicated(mesh))(
        jax.random.key(0), batch_np["image"][:1])
    opt_state = jax.jit(tx.init, out_shardings=replicated(mesh))(params)
    batch = jax.device_put(batch_np, batch_sharding(mesh))

    def loss_fn(p, images, labels):
        logits, _ = model.apply(p, model_state, images, True, jax.random.key(0))
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    @jax.jit
    def step(carry, batch):
        p, o = carry
        loss, grads = jax.value_and_grad(loss_fn)(p, batch["image"], batch["label"])
        updates, o = tx.update(grads, o, p)
        return (optax.apply_updates(p, updates), o), loss

    return step, (params, opt_state), batch


def overhead(args) -> None:
    model, tx = _model(args.model), optax.adamw(1e-3)
    batch_np = _batch(args.batch_size)
    devices = jax.devices()
    steps = {"jdp": _jdp_step(model, tx, devices, batch_np),
             "minimal": _minimal_step(model, tx, devices, batch_np)}
    times = {name: [] for name in steps}
    for _ in range(args.repeats):  # interleaved, so drift hits both alike
        for name, (step, state, batch) in steps.items():
            seconds, state = _time_steps(step, state, batch, args.steps)
            steps[name] = (step, state, batch)
            times[name].append(seconds)
    for name, values in times.items():
        print(f"{name:8s} ViT-{args.model} batch {args.batch_size} on {len(devices)} devices: "
              f"median {1000 * statistics.median(values):.2f} ms/step over {args.repeats} x "
              f"{args.steps} steps")
    ratio = statistics.median(times["jdp"]) / statistics.median(times["minimal"])
    print(f"overhead: jdp step time / minimal jax.jit step time = {ratio:.3f}")


def scaling(args) -> None:
    model, tx = _model(args.model), optax.adamw(1e-3)
    batch_np = _batch(args.batch_size)
    counts = [n for n in (1, 2, 4, 8, 16, 32) if n <= jax.device_count()]
    throughput = {}
    for count in counts:
        step, state, batch = _jdp_step(model, tx, jax.devices()[:count], batch_np)
        samples = []
        for _ in range(args.repeats):
            seconds, state = _time_steps(step, state, batch, args.steps)  # state is donated
            samples.append(seconds)
        throughput[count] = args.batch_size / statistics.median(samples)
        print(f"{count} devices: {throughput[count]:.0f} examples/s "
              f"(ViT-{args.model}, global batch {args.batch_size})")
    base = throughput[counts[0]]
    print("scaling vs 1 device: " + ", ".join(
        f"{n}: {throughput[n] / base:.2f}x" for n in counts))


def checkpoint(args) -> None:
    model, tx = _model(args.model), optax.adamw(1e-3)
    backend = make_backend("pjit", make_mesh(), model, tx, StepOptions())
    state = backend.init_global(jax.random.key(0), _batch(1)["image"])
    size_mib = sum(x.nbytes for x in jax.tree.leaves(state)) / 2**20
    stalls = {}
    for mode in ("async", "sync"):
        with tempfile.TemporaryDirectory() as directory:
            checkpointer = Checkpointer(directory, every_steps=1, max_to_keep=2,
                                        async_save=mode == "async")
            stalls[mode] = []
            for step in range(1, args.repeats + 1):
                jax.block_until_ready(state)
                start = time.perf_counter()
                checkpointer.save(step, state)
                stalls[mode].append(time.perf_counter() - start)  # the loop waits this long
                checkpointer.wait()  # let the write finish before the next sample
            checkpointer.close()
        print(f"{mode:5s} save of {size_mib:.1f} MiB (ViT-{args.model} + AdamW): training "
              f"stalls a median {1000 * statistics.median(stalls[mode]):.1f} ms "
              f"over {args.repeats} saves")
    ratio = statistics.median(stalls["async"]) / statistics.median(stalls["sync"])
    print(f"checkpoint: async stall / synchronous stall = {ratio:.3f}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m jdp.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("benchmark", choices=["overhead", "scaling", "checkpoint"])
    parser.add_argument("--model", default="tiny", help="ViT size (nano, tiny, small, ...)")
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    print(f"jax {jax.__version__}, {jax.device_count()} {jax.devices()[0].platform} devices, "
          f"{os.cpu_count()} CPU cores")
    {"overhead": overhead, "scaling": scaling, "checkpoint": checkpoint}[args.benchmark](args)


if __name__ == "__main__":
    main()
