"""jdp's whole training loop against a minimal hand-written loop, in examples/s.

    python -m jdp.bench overhead [--model=tiny] [--steps=300] [--log_every=50]
    python -m jdp.bench overhead --config=experiments/gpt.py --model=tiny \
        --config.data.seq_len=64 --config.batch_size=12 --devices=1   # the LM line

`--config.FIELD=VALUE` overrides the experiment's config in both loops. A text
experiment's token store is prepared once, before the first pair, and shared by
every run (data.token_dir in the benchmark's scratch directory).

For each backend (pjit, pmap) and device count (1, 8), `--repeats` pairs of the two
loops, each first in every other pair, each pair loading both loops' programs anew,
`--pairs_per_process` pairs in each process (the device count is fixed before jax
starts):

- jdp: the experiment (default: the digits ViT) run through `jdp.main.run`, input
  pipeline, prefetch, step, window metrics, writers and watchdog included;
  examples/s over its metrics.jsonl windows after the first (which holds the
  first steps' warm-up);
- minimal: what a careful user writes by hand: the same model, init, optimizer,
  mesh and batches (taken from jdp's pipeline beforehand, held as numpy), a plain
  `jax.jit` step on a NamedSharding-sharded batch (pmap: `jax.pmap` with `pmean`),
  dispatched asynchronously with the loss read one step late, timed over the same
  steps after the same warm-up;
- with `--prepared_input`, a third run each pair: jdp's whole loop fed the minimal
  loop's batches, prepared beforehand, instead of its input pipeline's (their
  transfer to the devices stays in its prefetch thread). Its ratio is the loop's
  without the input's work; the difference from jdp's is the input pipeline's share.

On a 2-core CPU anything a host thread does (preprocessing, copies, Python per
step) is time the XLA step does not get, so the loop, not the step, is compared.

Why fresh programs for each pair: on XLA:CPU the same compiled program runs up to
~10% faster or slower from one load to the next with where its buffers and code land
in memory (address-space randomisation; with it turned off, repeated processes agree
within ~2%). Pairs that share loaded programs share that draw, which no number of
them averages out; pairs that load (from the persistent compilation cache) both
programs anew each draw anew, and their median ratio is the figure. A new load in
the same process draws as widely as a new process (the digits ViT's minimal pmap
loop: 8,100-10,100 examples/s over four loads in one process), and costs less than
starting one (~12 s a pair on nano against ~10 s more for a process), so a few
pairs share each process.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from jdp.bench import cpu_child_env, pair_order

_CHILD_FLAG = "--_child"
_DEFAULT_CONFIG = "experiments/vit.py"
TAKES_CONFIG_OVERRIDES = True  # `--config.FIELD=VALUE` after the options


def add_arguments(parser, name: str) -> None:
    parser.add_argument("--config", default=_DEFAULT_CONFIG, help="experiment file")
    parser.add_argument("--model", default="", help="model size (nano, tiny, ...); default: the "
                        "experiment's own. With the digits ViT's patch 2, tiny is ViT-Ti/2; "
                        "--config=experiments/gpt.py gives the LM line (tokens/s = examples/s "
                        "x data.seq_len, so the ratio is the same)")
    parser.add_argument("--steps", type=int, default=300, help="train steps per measurement")
    parser.add_argument("--log_every", type=int, default=50,
                        help="jdp's log window; the first window (and as many minimal steps) "
                        "is warm-up")
    parser.add_argument("--repeats", type=_count, default=12,
                        help="jdp/minimal pairs per config, each loading both loops' "
                        "programs anew (even: each loop first as often)")
    parser.add_argument("--pairs_per_process", type=_count, default=3,
                        help="pairs measured in each new process")
    parser.add_argument("--backends", default="pjit,pmap")
    parser.add_argument("--devices", default="1,8", help="simulated CPU device counts")
    parser.add_argument("--prepared_input", action="store_true",
                        help="also run jdp's loop fed batches prepared beforehand, as the "
                        "minimal loop is: the input pipeline's share of the gap")


def _count(text: str) -> int:
    """A count of pairs: a whole number of at least 1."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a count of pairs. Fix: pass a whole "
                                         f"number of at least 1.")
    return int(text)


def run(args) -> None:
    if args.steps < 2 * args.log_every:
        raise SystemExit(f"--steps={args.steps} leaves no log window after the first "
                         f"(--log_every={args.log_every}). Fix: --steps >= 2 x --log_every.")
    backends, device_counts = args.backends.split(","), [int(n) for n in args.devices.split(",")]
    ratios, prepared_ratios = [], []
    with tempfile.TemporaryDirectory(prefix="jdp-bench-overhead-") as cache_dir:
        for backend in backends:
            for devices in device_counts:
                measured = _measure_in_children(args, backend, devices, cache_dir)
                jdp, minimal = _medians(measured)
                ratios.append(jdp / minimal)
                if args.prepared_input:
                    prepared, _ = _medians(measured, "prepared")
                    prepared_ratios.append(prepared / minimal)
                print(f"{backend} {devices} device(s), {_describe(measured)}", flush=True)
    worst_of = f"worst of {'/'.join(backends)} x {'/'.join(map(str, device_counts))} devices"
    if prepared_ratios:
        print(f"overhead, input prepared beforehand: jdp loop / minimal loop examples/s = "
              f"{min(prepared_ratios):.3f} ({worst_of})")
    print(f"overhead: jdp loop / minimal loop examples/s = {min(ratios):.3f} ({worst_of})")


def _describe(measured: dict) -> str:
    """One configuration's figures: the medians, every repeat, and the ratios."""
    jdp, minimal = _medians(measured)
    text = (f"{measured['workload']}: jdp loop {jdp:.0f} examples/s (waiting for input "
            f"{100 * measured['input_wait']:.0f}% of the time), minimal loop {minimal:.0f} "
            f"(medians of {_rounded(measured['jdp'])} and {_rounded(measured['minimal'])}; "
            f"last window's loss {measured['jdp_loss']:.4f} and "
            f"{measured['minimal_loss']:.4f}): ratio {jdp / minimal:.3f} (median of the "
            f"pairs' ratios {_paired(measured, 'jdp'):.3f})")
    if "prepared" not in measured:
        return text
    prepared = statistics.median(measured["prepared"])
    return (f"{text}; input prepared beforehand: jdp loop {prepared:.0f} (median of "
            f"{_rounded(measured['prepared'])}; last window's loss "
            f"{measured['prepared_loss']:.4f}): ratio {prepared / minimal:.3f} (median of "
            f"the pairs' ratios {_paired(measured, 'prepared'):.3f}), the input pipeline's "
            f"share {_input_share(measured):.3f}")


def _input_share(measured: dict) -> float:
    """What jdp's input pipeline costs, as a fraction of the minimal loop's examples/s:
    the median over pairs of (prepared - jdp) / minimal, each pair back to back (the
    medians of the three loops, each over its own slow spells, can even give it the
    wrong sign)."""
    return statistics.median((prepared - jdp) / minimal for jdp, prepared, minimal in zip(
        measured["jdp"], measured["prepared"], measured["minimal"], strict=True))


def _paired(measured: dict, loop: str) -> float:
    """The median of the pairs' ratios of `loop` to the minimal loop: robust to a load
    that changes between repeats, as each pair ran back to back."""
    return statistics.median(a / b for a, b in zip(measured[loop], measured["minimal"],
                                                   strict=True))


def _medians(measured: dict, loop: str = "jdp") -> tuple[float, float]:
    """The median examples/s of `loop` (jdp's loop, or it with the input prepared) and of
    the minimal loop."""
    return statistics.median(measured[loop]), statistics.median(measured["minimal"])


def _rounded(values: list[float]) -> str:
    return "/".join(f"{v:.0f}" for v in values)


def _measure_in_children(args, backend: str, devices: int, cache_dir: str) -> dict:
    """What `_child` measured over `--repeats` pairs, `--pairs_per_process` in each new
    process with `devices` simulated CPU devices: both loops' examples/s per pair, in
    pair order."""
    pairs = []
    for first in range(0, args.repeats, args.pairs_per_process):
        count = min(args.pairs_per_process, args.repeats - first)
        pairs += _pairs_in_child(args, backend, devices, cache_dir, first, count)
    loops = ("jdp", "minimal", "prepared") if "prepared" in pairs[0] else ("jdp", "minimal")
    return {**{loop: [p[loop] for p in pairs] for loop in loops},
            "input_wait": statistics.median(p["input_wait"] for p in pairs),
            **{f"{loop}_loss": pairs[-1][f"{loop}_loss"] for loop in loops},
            "workload": pairs[-1]["workload"]}


def _pairs_in_child(args, backend: str, devices: int, cache_dir: str, first: int,
                    count: int) -> list[dict]:
    """What `_child` measured for pairs `first` to `first + count - 1` in a new process."""
    argv = [sys.executable, "-m", "jdp.bench.overhead", _CHILD_FLAG, f"--backend={backend}",
            f"--cache_dir={cache_dir}", f"--config={os.path.abspath(args.config)}",
            f"--model={args.model}", f"--steps={args.steps}", f"--log_every={args.log_every}",
            f"--first_pair={first}", f"--pairs={count}",
            *(["--prepared_input"] if args.prepared_input else []),
            *getattr(args, "config_overrides", [])]
    proc = subprocess.run(argv, capture_output=True, text=True, env=cpu_child_env(devices))
    if proc.returncode != 0:
        raise RuntimeError(f"the measuring process ({backend}, {devices} devices, pairs "
                           f"{first}-{first + count - 1}) exited {proc.returncode}: "
                           f"{proc.stderr.strip()[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# -- in the child process ----------------------------------------------------------


def _overrides(args) -> list[str]:
    """The user's overrides, then the experiment shortened to `--steps`, evaluated and
    saved only after the last log window, on `--backend`, its compiled programs cached
    across repeats, a text experiment's token store kept in the scratch directory."""
    overrides = [*args.config_overrides,
                 f"--config.total_steps={args.steps}", f"--config.log_every_steps={args.log_every}",
                 "--config.eval_every_steps=0", "--config.checkpoint.every_steps=0",
                 "--config.checkpoint.every_minutes=0",
                 f"--config.parallel.backend={args.backend}",
                 f"--config.compile_cache_dir={args.cache_dir}"]
    if args.model:
        overrides.append(f"--config.model.size={args.model}")
    return overrides


def _with_token_dir(config, cache_dir: str):
    """A text experiment's store in the scratch directory, shared by every run of the
    benchmark (prepared by the first, reused after), unless the user named one."""
    from jdp.data.text import lm

    if lm.uses_text(config.data) and not config.data.token_dir:
        with config.unlocked():
            config.data.token_dir = os.path.join(cache_dir, "tokens")
    return config


def _load(args):
    from jdp.main import load_config

    config = load_config(args.config, *_overrides(args))
    with config.unlocked():  # a short run keeps a valid schedule (warmup < total)
        config.warmup_steps = min(config.warmup_steps, args.steps // 2)
    return _with_token_dir(config, args.cache_dir)


def _jdp_run(config, config_path: str, workdir: str | None = None
             ) -> tuple[float, float, float]:
    """(examples/s, fraction of the time spent waiting for input, last window's mean loss)
    of one whole `jdp.main.run` in a new workdir (a temporary one unless given), over the
    windows after the first."""
    from jdp import main as jdp_main
    from jdp.observe.writers import read_jsonl

    if workdir is None:
        with tempfile.TemporaryDirectory(prefix="jdp-bench-overhead-run-") as scratch:
            return _jdp_run(config, config_path, scratch)
    jdp_main.run(config, config_path, workdir)
    windows = [r for r in read_jsonl(os.path.join(workdir, "metrics.jsonl"))
               if "train/examples_per_s" in r]
    timed = windows[1:]  # the first window holds the warm-up
    steps = [b["step"] - a["step"] for a, b in zip(windows, timed, strict=False)]
    seconds = [n * w["train/step_time_s"] for n, w in zip(steps, timed, strict=True)]
    waited = sum(s * w["train/data_wait_fraction"] for s, w in zip(seconds, timed, strict=True))
    return (config.batch_size * sum(steps) / sum(seconds), waited / sum(seconds),
            windows[-1]["train/loss"])


def _real_batches(config, built) -> list[dict]:
    """jdp's own global batches for the whole run, as host numpy: equal content."""
    from jdp.data import streamed

    stream = streamed.example_stream(built.data.train, built.data.preprocess_for(train=True),
                                     config.seed)
    return list(streamed.train_batches(
        stream, global_batch_size=config.batch_size, rows=slice(0, config.batch_size),
        start_step=0, num_steps=config.total_steps, num_threads=config.data.num_threads))


def _loss_fn(built):
    """The task's objective (its weighted mean loss) of the model on a batch as the host
    ships it; the data's device half of the preprocessing (uint8 -> normalised float32)
    runs first, as in jdp."""
    import jax

    from jdp.experiment import task as task_lib

    model, task, device_preprocess = built.model, built.task, built.data.device_preprocess

    def loss_fn(params, model_state, batch):
        if device_preprocess is not None:
            batch = device_preprocess(batch)
        outputs, _ = model.apply(params, model_state, task.model_inputs(batch), True,
                                 jax.random.key(0))
        total, weight = task_lib.weighted_sums(task.objective(outputs, batch))[task_lib.LOSS]
        return total / weight

    return loss_fn


def minimal_train_step(loss_fn, tx):
    """The hand-written step, `(params, model_state, opt_state), batch -> (that state
    updated, loss)`: loss, gradients and the optimizer update, nothing else. Jitted
    with a NamedSharding batch, GSPMD inserts the gradient reduction."""
    import jax
    import optax

    def train_step(state, batch):
        params, model_state, opt_state = state
        loss, grads = jax.value_and_grad(loss_fn)(params, model_state, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), model_state, opt_state), loss

    return train_step


def _minimal_pjit(built, tx, seed: int):
    """(init, step, put, read) of one jit, GSPMD inserting the gradient reduction."""
    import jax

    from jdp.parallel.mesh import batch_sharding, make_mesh, replicated

    mesh = make_mesh()

    def init():
        params, model_state = jax.jit(built.model.init, out_shardings=replicated(mesh))(
            jax.random.key(seed), built.sample_inputs())
        return params, model_state, jax.jit(tx.init, out_shardings=replicated(mesh))(params)

    sharding = batch_sharding(mesh)
    step = jax.jit(minimal_train_step(_loss_fn(built), tx), donate_argnums=0)
    return init, step, lambda batch: jax.device_put(batch, sharding), float


def _minimal_pmap(built, tx, seed: int):
    """(init, step, put, read) of a pmap step: one replica per device, an explicit pmean."""
    import jax
    import numpy as np
    import optax

    count = jax.device_count()
    loss_fn = _loss_fn(built)

    def init():
        params, model_state = jax.device_get(jax.jit(built.model.init)(jax.random.key(seed),
                                                                       built.sample_inputs()))
        state = (params, model_state, jax.device_get(jax.jit(tx.init)(params)))
        return jax.tree.map(lambda x: np.broadcast_to(x, (count, *np.shape(x))), state)

    def train_step(state, batch):
        params, model_state, opt_state = state
        loss, grads = jax.value_and_grad(loss_fn)(params, model_state, batch)
        grads, loss = jax.lax.pmean((grads, loss), "batch")
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), model_state, opt_state), loss

    step = jax.pmap(train_step, axis_name="batch", donate_argnums=0)

    def put(batch):
        return {key: value.reshape(count, -1, *value.shape[1:]) for key, value in batch.items()}

    return init, step, put, lambda loss: float(loss[0])


def _minimal_run(loop, batches: list[dict], warmup_steps: int, batch_size: int):
    """(examples/s after `warmup_steps`, mean loss of the last window) of the minimal loop."""
    init, step, put, read = loop
    state, losses, previous = init(), [], None
    for index, batch in enumerate(batches):
        if index == warmup_steps:  # start timing with nothing queued
            losses.append(read(previous))
            previous, start = None, time.perf_counter()
        state, loss = step(state, put(batch))
        if previous is not None:
            losses.append(read(previous))  # one step late: the device has the next queued
        previous = loss
    losses.append(read(previous))
    seconds = time.perf_counter() - start
    return batch_size * (len(batches) - warmup_steps) / seconds, losses


def _order(pair: int, prepared_input: bool) -> tuple[str, ...]:
    """The loops of pair `pair` in the order they run: `pair_order`'s, and the prepared
    run last in even pairs and first in odd ones, so that each side of both ratios runs
    first as often and the minimal loop always between jdp's two."""
    order = pair_order(pair)
    if not prepared_input:
        return order
    return (*order, "prepared") if pair % 2 == 0 else ("prepared", *order)


class _PreparedTrain:
    """A training split (`jdp.data.splits.TrainSplit`) whose global batches were prepared
    beforehand: what the minimal loop is fed, for jdp's loop without its input's work."""

    def __init__(self, batches: list[dict]):
        self._batches = batches

    def batches(self, *, global_batch_size: int, rows: slice, start_step: int,
                num_steps: int):
        for batch in self._batches[start_step:start_step + num_steps]:
            assert len(next(iter(batch.values()))) == global_batch_size
            yield {key: value[rows] for key, value in batch.items()}


@contextlib.contextmanager
def _train_split_replaced_by(batches: list[dict]):
    """jdp's loop, while in the block, opens `batches` as its training split."""
    from jdp.data import splits

    opened = splits.open_train
    splits.open_train = lambda data, **options: _PreparedTrain(batches)
    try:
        yield
    finally:
        splits.open_train = opened


def _child(argv: list[str]) -> None:
    """Pairs `--first_pair` to `--first_pair + --pairs - 1` of jdp and the minimal loop,
    each in `_order(pair, ...)` and loading the loops' programs anew; prints the pairs'
    examples/s as a JSON list."""
    parser = argparse.ArgumentParser()
    parser.add_argument(_CHILD_FLAG, action="store_true")
    parser.add_argument("--backend", required=True, choices=("pjit", "pmap"))
    parser.add_argument("--cache_dir", required=True)
    parser.add_argument("--first_pair", type=int, required=True)
    parser.add_argument("--pairs", type=int, required=True)
    add_arguments(parser, "overhead")
    args, overrides = parser.parse_known_args(argv)
    args.config_overrides = overrides

    from jdp.experiment import components, loader, optim

    config = _load(args)
    exp = loader.load(args.config)
    built = components.build(exp, config, workdir=args.cache_dir)
    batches = _real_batches(config, built)
    tx = exp.build_optimizer(config, optim.learning_rate_fn(config))
    make_loop = _minimal_pjit if args.backend == "pjit" else _minimal_pmap
    workload = (f"{os.path.basename(args.config)} model {config.model.get('size', '')}, "
                f"batch {config.batch_size}, {args.steps} steps"
                + (f", {' '.join(args.config_overrides)}" if args.config_overrides else ""))
    pairs = []
    for pair in range(args.first_pair, args.first_pair + args.pairs):
        outcome = {"workload": workload}
        for name in _order(pair, args.prepared_input):
            if name == "jdp":  # jdp.main.run builds and loads its step anew
                outcome["jdp"], outcome["input_wait"], outcome["jdp_loss"] = _jdp_run(
                    config, args.config)
            elif name == "prepared":
                with _train_split_replaced_by(batches):
                    outcome["prepared"], _, outcome["prepared_loss"] = _jdp_run(
                        config, args.config)
            else:  # new jitted functions: loaded anew
                outcome["minimal"], losses = _minimal_run(make_loop(built, tx, config.seed),
                                                          batches, args.log_every,
                                                          config.batch_size)
                outcome["minimal_loss"] = statistics.mean(losses[-args.log_every:])
        pairs.append(outcome)
    print(json.dumps(pairs))


if __name__ == "__main__":
    _child(sys.argv[1:])
