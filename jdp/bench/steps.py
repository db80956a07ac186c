"""The train step's speed: jdp against a minimal hand-written loop, and scaling over devices.

    python -m jdp.bench overhead     # jdp's train step vs a minimal hand-written jax.jit step
    python -m jdp.bench scaling      # examples/s of the same model at 1, 2, 4, 8 devices
"""

from __future__ import annotations

import statistics
import time

import jax
import numpy as np
import optax

from jdp import modeling
from jdp.mesh import batch_sharding, make_mesh, replicated
from jdp.models import vit
from jdp.parallel import StepOptions, make_backend
from jdp.task import classification


def vit_model(size: str) -> modeling.Model:
    return modeling.from_linen(vit(size, num_classes=10, patch_size=4, pool="gap"))


def random_batch(global_batch_size: int, image_size: int = 32) -> dict[str, np.ndarray]:
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


def jdp_backend(model, tx, devices, batch_np, backend="pjit"):
    """(backend, initial state, batch on the devices): everything jdp's step needs but its
    compile."""
    backend_ = make_backend(backend, make_mesh(devices=devices), model, classification(), tx,
                            StepOptions())
    state = backend_.from_global(backend_.init_global(jax.random.key(0),
                                                      (batch_np["image"][:1],)))
    return backend_, state, backend_.put_batch(batch_np)


def _jdp_step(model, tx, devices, batch_np, backend="pjit"):
    backend_, state, batch = jdp_backend(model, tx, devices, batch_np, backend)
    return backend_.compiled_train_step(state, batch), state, batch


def _minimal_step(model, tx, devices, batch_np):
    """What a user would write by hand: one jit, GSPMD inserts the reduction."""
    mesh = make_mesh(devices=devices)
    params, model_state = jax.jit(model.init, out_shardings=replicated(mesh))(
        jax.random.key(0), (batch_np["image"][:1],))
    opt_state = jax.jit(tx.init, out_shardings=replicated(mesh))(params)
    batch = jax.device_put(batch_np, batch_sharding(mesh))

    def loss_fn(p, images, labels):
        logits, _ = model.apply(p, model_state, (images,), True, jax.random.key(0))
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    @jax.jit
    def step(carry, batch):
        p, o = carry
        loss, grads = jax.value_and_grad(loss_fn)(p, batch["image"], batch["label"])
        updates, o = tx.update(grads, o, p)
        return (optax.apply_updates(p, updates), o), loss

    return step, (params, opt_state), batch


def overhead(args) -> None:
    model, tx = vit_model(args.model), optax.adamw(1e-3)
    batch_np = random_batch(args.batch_size)
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
    model, tx = vit_model(args.model), optax.adamw(1e-3)
    batch_np = random_batch(args.batch_size)
    counts = [n for n in (1, 2, 4, 8, 16, 32)
              if n <= min(jax.device_count(), args.max_devices or jax.device_count())]
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


def add_arguments(parser, name: str) -> None:
    add_model_arguments(parser)
    if name == "scaling":
        parser.add_argument("--max_devices", type=int, default=0,
                            help="measure up to this many devices (default: all)")


def run(args) -> None:
    {"overhead": overhead, "scaling": scaling}[args.benchmark](args)


def add_model_arguments(parser) -> None:
    parser.add_argument("--model", default="tiny", help="ViT size (nano, tiny, small, ...)")
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
