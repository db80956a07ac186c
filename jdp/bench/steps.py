"""The train step's speed over devices, and the ViT and step helpers other benchmarks share.

    python -m jdp.bench scaling      # examples/s of the same model at 1, 2, 4, 8 devices
"""

from __future__ import annotations

import statistics
import time

import jax
import numpy as np
import optax

from jdp.experiment import adapters
from jdp.experiment.task import classification
from jdp.models import vit
from jdp.parallel import StepOptions, make_backend
from jdp.parallel.mesh import make_mesh


def vit_model(size: str) -> adapters.Model:
    return adapters.from_linen(vit(size, num_classes=10, patch_size=4, pool="gap"))


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
    scaling(args)


def add_model_arguments(parser) -> None:
    parser.add_argument("--model", default="tiny", help="ViT size (nano, tiny, small, ...)")
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
