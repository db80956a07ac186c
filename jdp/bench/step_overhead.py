"""jdp's compiled train step against a minimal jit step, without the loop around them.

    python -m jdp.bench step_overhead [--model=nano] [--batch_size=64] [--devices=1,8]

`overhead` compares whole loops; this compares only the programs. Both steps get the
same model (ViT, classification), AdamW, batch and mesh, their batch already on the
devices, and are dispatched with one step in flight behind the newest, as the train
loop does:

- jdp: the step the loop runs (`Backend.compiled_window_step`, pjit backend): the
  explicit gradient reduction inside `shard_map`, the update skipped when not finite,
  the gradient, update and parameter norms and the logging window's running sums
  (AdamW at a constant rate in both, so no schedule is reported);
- minimal: `jax.jit` of loss, grad and AdamW update with a NamedSharding batch, the
  gradient all-reduce left to GSPMD, the loss its only output.

The repeats alternate between the two, each first in every other repeat, and the
medians are compared, so a machine that changes speed during the run moves both.
Each repeat compiles both programs anew (after the first, from a persistent
compilation cache in a temporary directory): on XLA:CPU two compiles of one program
in one process run up to ~8% apart, with where their code and buffers land, so
repeats of the same two executables would all share one draw.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

import jax
import optax

from jdp.bench import pair_order, steps
from jdp.bench.overhead import minimal_train_step
from jdp.parallel.mesh import batch_sharding, make_mesh, replicated
from jdp.runtime import compile_cache


def add_arguments(parser, name: str) -> None:
    steps.add_model_arguments(parser)
    parser.set_defaults(model="nano", steps=60, repeats=6)  # even: each first as often
    parser.add_argument("--devices", default=[1, 8], type=_device_counts,
                        help="comma-separated device counts to measure (default 1,8; those "
                             "above jax.device_count() are left out)")


def _device_counts(text: str) -> list[int]:
    """`--devices`' value: positive integers separated by commas (argparse reports the
    error as the flag's, exit 2)."""
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        counts = []
    if not counts or any(count < 1 for count in counts):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a list of device counts. Fix: pass positive integers "
            "separated by commas, e.g. --devices=1,8")
    return counts


def run(args) -> None:
    counts = [n for n in args.devices if n <= jax.device_count()]
    if not counts:
        print(f"--devices={','.join(map(str, args.devices))}: this process has "
              f"{jax.device_count()} devices. Fix: name counts up to it "
              "(XLA_FLAGS=--xla_force_host_platform_device_count=N simulates N on a CPU).",
              file=sys.stderr)
        raise SystemExit(2)
    model, tx = steps.vit_model(args.model), optax.adamw(1e-3)
    batch_np = steps.random_batch(args.batch_size)
    ratios = {}
    with tempfile.TemporaryDirectory(prefix="jdp-bench-step-overhead-") as cache_dir, \
            compile_cache.enabled(cache_dir):
        for count in counts:
            rates = _measure(model, tx, jax.devices()[:count], batch_np, args)
            jdp_rate, minimal_rate = (statistics.median(rates[k]) for k in ("jdp", "minimal"))
            ratios[count] = jdp_rate / minimal_rate
            print(f"{count} device(s), ViT-{args.model}, global batch {args.batch_size}: jdp "
                  f"step {jdp_rate:.0f} examples/s, minimal step {minimal_rate:.0f} "
                  f"(medians of {args.repeats} x {args.steps} steps)", flush=True)
    print("step_overhead: jdp step / minimal step examples/s = " + ", ".join(
        f"{ratio:.3f} ({count} device{'s' if count > 1 else ''})"
        for count, ratio in ratios.items()))


def _measure(model, tx, devices, batch_np, args) -> dict[str, list[float]]:
    """Both steps' examples/s per repeat on `devices`, each repeat with both programs
    compiled anew."""
    rates = {"jdp": [], "minimal": []}
    for repeat in range(args.repeats):
        jdp_step, jdp_carry = _jdp(model, tx, devices, batch_np)
        minimal_step, minimal_carry = _minimal(model, tx, devices, batch_np, jdp_carry[0])
        carries = {"jdp": jdp_carry, "minimal": minimal_carry}
        stepped = {"jdp": jdp_step, "minimal": minimal_step}
        for name in pair_order(repeat):
            rate, carries[name] = _rate(stepped[name], carries[name], args.steps,
                                        args.batch_size)
            rates[name].append(rate)
    return rates


def _jdp(model, tx, devices, batch_np):
    """(step, carry) of the step jdp's loop runs: carry = (state, window sums)."""
    backend, state, batch = steps.jdp_backend(model, tx, devices, batch_np)
    compiled, sums, flags = backend.compiled_window_step(state, batch)
    keep = flags[1]  # add to the window's sums, as every step of a window but its first

    def step(carry):
        state, sums = compiled(carry[0], batch, carry[1], keep)
        return (state, sums), sums

    return step, (state, sums)


def _minimal(model, tx, devices, batch_np, jdp_state):
    """(step, carry) of a plain jit step from jdp's initial values: carry = the state."""
    mesh = make_mesh(devices=devices)

    def loss_fn(params, model_state, batch):
        logits, _ = model.apply(params, model_state, (batch["image"],), True,
                                jax.random.key(0))
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()

    params, model_state = jax.device_put(
        jax.device_get((jdp_state.params, jdp_state.model_state)), replicated(mesh))
    state = (params, model_state, jax.jit(tx.init, out_shardings=replicated(mesh))(params))
    batch = jax.device_put(batch_np, batch_sharding(mesh))
    compiled = jax.jit(minimal_train_step(loss_fn, tx), donate_argnums=0).lower(
        state, batch).compile()
    return lambda state: compiled(state, batch), state


def _rate(step, carry, num_steps: int, batch_size: int):
    """(examples/s over `num_steps`, carry): after one warm-up step, with one step in
    flight behind the newest, as the train loop runs."""
    carry, previous = step(carry)
    jax.block_until_ready(previous)
    previous, start = None, time.perf_counter()
    for _ in range(num_steps):
        carry, output = step(carry)
        if previous is not None:
            jax.block_until_ready(previous)
        previous = output
    jax.block_until_ready((carry, previous))
    return batch_size * num_steps / (time.perf_counter() - start), carry
