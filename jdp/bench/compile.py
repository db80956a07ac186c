"""How long the first step waits for its compile: an empty compilation cache against a warm one.

    python -m jdp.bench compile --model=tiny

Each measurement is a fresh process (jax also keeps compiled programs in memory),
timing `compiled_train_step`: trace and lower (which no cache saves), then compile or
read from the cache. A repeat is a new cache directory: one process fills it (cold),
one reads it (warm).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time

_CHILD_FLAG = "--_child"


def add_arguments(parser, name: str) -> None:
    parser.add_argument("--model", default="tiny", help="ViT size (nano, tiny, small, ...)")
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="cold + warm pairs")
    parser.add_argument("--backend", default="pjit", choices=("pjit", "pmap"))


def run(args) -> None:
    times = {"cold": [], "warm": []}
    for repeat in range(1, args.repeats + 1):
        with tempfile.TemporaryDirectory(prefix="jdp-bench-compile-") as cache_dir:
            for kind in times:  # cold fills the new directory, warm reads it
                measured = _measure_in_child(args, cache_dir)
                seconds = measured["lower_s"] + measured["compile_s"]
                times[kind].append(seconds)
                print(f"{kind} ViT-{args.model} batch {args.batch_size} {args.backend} "
                      f"(repeat {repeat}): train step ready in {seconds:.2f} s (trace and "
                      f"lower {measured['lower_s']:.2f} s, compile {measured['compile_s']:.2f} "
                      f"s, {measured['cache_hits']} cache hit(s))", flush=True)
    cold, warm = statistics.median(times["cold"]), statistics.median(times["warm"])
    print(f"median over {args.repeats}: cold {cold:.2f} s, warm {warm:.2f} s")
    print(f"compile: cold first-step compile s / warm = {cold / warm:.2f}")


def _measure_in_child(args, cache_dir: str) -> dict:
    """What `_child` measured in a new process: lower_s, compile_s, cache_hits."""
    argv = [sys.executable, "-m", "jdp.bench.compile", _CHILD_FLAG, f"--cache_dir={cache_dir}",
            f"--model={args.model}", f"--batch_size={args.batch_size}",
            f"--backend={args.backend}"]
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"the measuring process exited {proc.returncode}: "
                           f"{proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _child(argv: list[str]) -> None:
    """Compiles the step once with the cache in `--cache_dir`; prints the times as JSON."""
    parser = argparse.ArgumentParser()
    parser.add_argument(_CHILD_FLAG, action="store_true")
    parser.add_argument("--cache_dir", required=True)
    add_arguments(parser, "compile")
    args = parser.parse_args(argv)

    import jax
    import optax

    from jdp.bench import steps
    from jdp.runtime import compile_cache

    compile_cache.enable(args.cache_dir)  # as jdp.main does, before anything compiles
    hits = []
    jax.monitoring.register_event_listener(
        lambda event, **_: hits.append(event) if event.endswith("/cache_hits") else None)
    model, tx = steps.vit_model(args.model), optax.adamw(1e-3)
    backend, state, batch = steps.jdp_backend(model, tx, jax.devices(),
                                              steps.random_batch(args.batch_size), args.backend)
    hits.clear()  # count the step's hits only, not the state initialisation's
    # backend.compiled_train_step in its two halves, timed apart.
    start = time.perf_counter()
    lowered = backend.lowered_train_step(state, batch)
    lowered_at = time.perf_counter()
    lowered.compile(backend.options.compiler_options)
    print(json.dumps({"lower_s": lowered_at - start, "compile_s": time.perf_counter() - lowered_at,
                      "cache_hits": len(hits)}))


if __name__ == "__main__":
    _child(sys.argv[1:])
