"""Wall time to the final accuracy: the default jdp command against a minimal script.

    python -m jdp.bench overhead_e2e [--devices=8] [--repeats=4]

`--repeats` pairs, each command first in every other pair, each a fresh process
timed from its start to its exit: `python -m jdp.main --config=experiments/vit.py`
(the digits ViT with all its evaluations, checkpoint and writers, and an empty
compilation cache: a first run), and `python -m jdp.bench.minimal_vit`, the same
data, model, optimizer, schedule, steps and batch written by hand. Compile, data
preparation and evaluation are in both; both report the final test accuracy.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time

from jdp.bench import cpu_child_env, pair_order
from jdp.observe.writers import read_jsonl


def add_arguments(parser, name: str) -> None:
    parser.add_argument("--config", default="experiments/vit.py",
                        help="a digits ViT experiment file (what minimal_vit can mirror)")
    parser.add_argument("--steps", type=int, default=0,
                        help="train steps (default: the experiment's own, 600)")
    parser.add_argument("--repeats", type=int, default=4,
                        help="jdp/minimal pairs (even: each command first as often)")
    parser.add_argument("--devices", type=int, default=8, help="simulated CPU devices")


def run(args) -> None:
    overrides = _overrides(args.config, args.steps)
    minimal_args = _minimal_arguments(args.config, overrides)
    env = cpu_child_env(args.devices)
    walls = {"jdp": [], "minimal": []}

    def time_jdp() -> tuple[float, float]:
        with tempfile.TemporaryDirectory(prefix="jdp-bench-e2e-") as scratch:
            return _time_jdp(args.config, overrides, scratch, env)

    timers = {"jdp": time_jdp, "minimal": lambda: _time_minimal(minimal_args, env)}
    for repeat in range(1, args.repeats + 1):
        timed = {name: timers[name]() for name in pair_order(repeat - 1)}
        (jdp_s, jdp_accuracy), (minimal_s, minimal_accuracy) = timed["jdp"], timed["minimal"]
        walls["jdp"].append(jdp_s)
        walls["minimal"].append(minimal_s)
        print(f"repeat {repeat}, {args.devices} devices: jdp {jdp_s:.1f} s to final accuracy "
              f"{jdp_accuracy:.4f}, minimal {minimal_s:.1f} s to {minimal_accuracy:.4f}",
              flush=True)
    jdp, minimal = statistics.median(walls["jdp"]), statistics.median(walls["minimal"])
    print(f"median over {args.repeats}: jdp {jdp:.1f} s, minimal {minimal:.1f} s")
    print(f"overhead_e2e: jdp wall time to final accuracy / minimal = {jdp / minimal:.3f}")


def _overrides(config_path: str, steps: int) -> list[str]:
    """The default command as is, or shortened to `steps` (warmup within them)."""
    if not steps:
        return []
    from jdp.main import load_config

    warmup = min(load_config(config_path).warmup_steps, steps // 2)
    return [f"--config.total_steps={steps}", f"--config.warmup_steps={warmup}"]


def _minimal_arguments(config_path: str, overrides: list[str]) -> list[str]:
    """minimal_vit's flags, read off the config jdp runs, so both train the same thing."""
    from jdp.experiment import optim
    from jdp.main import load_config

    config = load_config(config_path, *overrides)
    mirrored = {"data.name": "digits", "data.augment": False, "grad_clip_norm": 0.0,
                "compute_dtype": "float32", "model.dropout_rate": 0.0, "grad_accum_steps": 1}
    for field, value in mirrored.items():
        section, _, key = field.rpartition(".")
        actual = (config[section] if section else config)[key]
        if actual != value:
            raise SystemExit(f"--config={config_path}: {field}={actual!r}, which "
                             f"jdp.bench.minimal_vit does not mirror (it needs {value!r}). Fix: "
                             "benchmark the digits ViT (experiments/vit.py).")
    return [f"--model={config.model.size}", f"--patch_size={config.model.patch_size}",
            f"--steps={config.total_steps}", f"--batch_size={config.batch_size}",
            f"--learning_rate={optim.peak_learning_rate(config)}",
            f"--warmup_steps={config.warmup_steps}", f"--weight_decay={config.weight_decay}",
            f"--label_smoothing={config.label_smoothing}",
            f"--log_every={config.log_every_steps}", f"--seed={config.seed}"]


def _timed(argv: list[str], env: dict) -> tuple[float, str]:
    """(seconds from start to exit, stdout) of a process that must succeed."""
    start = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {proc.returncode}: "
                           f"{proc.stderr.strip()[-3000:]}")
    return seconds, proc.stdout


def _time_jdp(config_path: str, overrides: list[str], scratch: str,
              env: dict) -> tuple[float, float]:
    workdir = os.path.join(scratch, "workdir")
    env = {**env, "JDP_COMPILE_CACHE_DIR": os.path.join(scratch, "compile_cache")}
    seconds, _ = _timed([sys.executable, "-m", "jdp.main", f"--config={config_path}",
                         f"--workdir={workdir}", *overrides], env)
    records = read_jsonl(os.path.join(workdir, "metrics.jsonl"))
    return seconds, [r["eval/accuracy"] for r in records if "eval/accuracy" in r][-1]


def _time_minimal(minimal_args: list[str], env: dict) -> tuple[float, float]:
    seconds, stdout = _timed([sys.executable, "-m", "jdp.bench.minimal_vit", *minimal_args], env)
    last = stdout.strip().splitlines()[-1]  # "final accuracy A"
    return seconds, float(last.split()[-1])
