"""The digits ViT written by hand, without jdp's trainer: the end-to-end benchmark's baseline.

    python -m jdp.bench.minimal_vit [--model=nano --steps=600 --batch_size=128 ...]

What a careful user writes: the digits read whole into memory (through jdp's own
TFDS builder, so the data are the same), the same ViT, AdamW with a warmup-cosine
schedule and label smoothing, a shuffled epoch at a time, one `jax.jit` step on a
batch sharded over every device with NamedSharding, the loss read one step late,
and one evaluation of the test split at the end. Its defaults are the digits
experiment's (experiments/vit.py); it prints `final accuracy A` last.
"""

from __future__ import annotations

import argparse
import sys


def _arguments(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m jdp.bench.minimal_vit")
    parser.add_argument("--model", default="nano")
    parser.add_argument("--patch_size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--batch_size", type=int, default=128)
    parser.add_argument("--learning_rate", type=float, default=3e-3)
    parser.add_argument("--warmup_steps", type=int, default=60)
    parser.add_argument("--weight_decay", type=float, default=1e-4)
    parser.add_argument("--label_smoothing", type=float, default=0.1)
    parser.add_argument("--log_every", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def load_split(split: str):
    """(images normalised to -1..1 as float32 NHWC, int32 labels) of a digits split."""
    import numpy as np

    from jdp.data import digits, tfds_source

    data_dir = tfds_source.resolve_data_dir("")
    digits.prepare(data_dir)
    source = digits.Digits(data_dir=data_dir).as_data_source(split=split)
    examples = [source[i] for i in range(len(source))]
    images = np.stack([e["image"] for e in examples]).astype(np.float32) / 255.0
    return (images - 0.5) / 0.5, np.asarray([e["label"] for e in examples], np.int32)


def main(argv: list[str]) -> None:
    args = _arguments(argv)
    import flax.linen as nn
    import jax
    import numpy as np
    import optax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jdp.models.vit import vit

    train_x, train_y = load_split("train")
    test_x, test_y = load_split("test")
    mesh = Mesh(np.asarray(jax.devices()), ("data",))
    rows, replicated = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())

    model = vit(args.model, num_classes=10, patch_size=args.patch_size, pool="gap")
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.learning_rate, args.warmup_steps,
                                                  args.steps, 0.0)
    tx = optax.adamw(schedule, weight_decay=args.weight_decay,
                     mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p))
    key = jax.random.key(args.seed)
    params = jax.jit(lambda: nn.unbox(model.init({"params": key, "dropout": key},
                                                 train_x[:1] * 0, train=False))["params"],
                     out_shardings=replicated)()
    opt_state = jax.jit(tx.init, out_shardings=replicated)(params)

    def loss_fn(params, images, labels):
        logits = model.apply({"params": params}, images, train=True)
        targets = optax.smooth_labels(jax.nn.one_hot(labels, 10), args.label_smoothing)
        return optax.softmax_cross_entropy(logits, targets).mean()

    @jax.jit
    def train_step(params, opt_state, images, labels):
        loss, grads = jax.value_and_grad(loss_fn)(params, images, labels)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    @jax.jit
    def correct(params, images, labels):
        return jax.numpy.argmax(model.apply({"params": params}, images, train=False), -1) == labels

    rng, order, previous = np.random.default_rng(args.seed), np.zeros(0, int), None
    for step in range(1, args.steps + 1):
        if len(order) < args.batch_size:  # a new shuffled epoch
            order = np.concatenate([order, rng.permutation(len(train_x))])
        index, order = order[:args.batch_size], order[args.batch_size:]
        images, labels = jax.device_put((train_x[index], train_y[index]), rows)
        params, opt_state, loss = train_step(params, opt_state, images, labels)
        if previous is not None:  # read one step late: the device always has a step queued
            previous_loss = float(previous)
            if (step - 1) % args.log_every == 0:
                print(f"step {step - 1}: loss {previous_loss:.4f}", flush=True)
        previous = loss
    print(f"step {args.steps}: loss {float(previous):.4f}", flush=True)

    # Evaluation: the test split padded to a multiple of the device count.
    pad = -len(test_x) % len(jax.devices())
    images = np.concatenate([test_x, np.zeros((pad, *test_x.shape[1:]), np.float32)])
    labels = np.concatenate([test_y, np.zeros(pad, np.int32)])
    hits = np.asarray(correct(params, *jax.device_put((images, labels), rows)))[:len(test_x)]
    print(f"final accuracy {hits.mean():.4f}")


if __name__ == "__main__":
    main(sys.argv[1:])
