"""The prepared GPU check: jax-API tests, step speed and MFU, settings on/off, memory, phases.

    python -m jdp.bench gpu --out=DIR [--wheels=DIR] [--smoke]

In order, each part's figures written to DIR/gpu_bench.json and a table to
DIR/gpu_bench.txt as soon as they exist (a run cut short keeps what it measured):

1. `--wheels=DIR`: installs the wheels there first (`pip install --no-index`), the
   packages a GPU host's image lacks (launch/wheelhouse.py builds that folder);
2. jdp's tests of the jax APIs (parallel, equivalence, checkpoint, the LM task, the jax
   internals) in a subprocess with 8 simulated CPU devices;
3. per workload (ViT-B/16 at 224 px and GPT-2 small, bf16, synthetic batches of real
   shape) and per GPU-settings arm (jdp's defaults on / off), in a fresh process:
   jdp's whole loop and a hand-written `jax.jit` loop on the same batches
   (jdp.bench.overhead's machinery), examples/s (tokens/s), step time, MFU against
   the device's bf16 peak, the dry run's per-device memory plan against the device's
   measured peak, and, with the settings on, the step-time split of a profile window
   (jdp.observe.trace_phases).

`--smoke` runs the same code paths on CPU with tiny shapes and one quick test module.
Nothing here may import a package the GPU host lacks before the wheels are installed:
this module imports only the standard library at the top.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import types

_CHILD_FLAG = "--_child"
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_SYNTHETIC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "synthetic.py")
JAX_API_TESTS = ("tests/test_jax_compat.py", "tests/test_parallel.py",
                 "tests/test_equivalence.py", "tests/test_checkpoint.py", "tests/test_lm.py")
SMOKE_TESTS = ("tests/test_jax_compat.py",)
WORKLOADS = ("vit_b16", "gpt2_small")
SMOKE_WORKLOADS = ("smoke_vit", "smoke_lm")
ARMS = ("on", "off")


def add_arguments(parser, name: str) -> None:
    parser.add_argument("--out", required=True, help="folder for gpu_bench.json and .txt")
    parser.add_argument("--wheels", default="", help="install the wheels in this folder "
                        "first (pip install --no-index --find-links)")
    parser.add_argument("--smoke", action="store_true",
                        help="the same code paths on CPU with tiny shapes, in under a minute")
    parser.add_argument("--steps", type=int, default=0,
                        help="train steps per measurement (default 30; smoke 6)")
    parser.add_argument("--workloads", default="", help="comma-separated, default "
                        f"{','.join(WORKLOADS)} (smoke: {','.join(SMOKE_WORKLOADS)})")
    parser.add_argument("--arms", default="", help="GPU settings arms: on (jdp's defaults, "
                        "and the profile window), off (none); default on,off (smoke: on)")
    parser.add_argument("--skip_tests", action="store_true", help="skip part 2")
    parser.add_argument("--tests_timeout_s", type=float, default=300)


def install_wheels(wheel_dir: str) -> dict:
    """pip install --no-index of the wheelhouse's requirements.txt (else every wheel)."""
    listed = os.path.join(wheel_dir, "requirements.txt")
    targets = (["-r", listed] if os.path.exists(listed)
               else sorted(glob.glob(os.path.join(wheel_dir, "*.whl"))))
    if not targets:
        raise SystemExit(f"--wheels={wheel_dir!r} holds no wheels. Fix: pass the folder "
                         "launch/wheelhouse.py wrote.")
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-index",
                           "--find-links", wheel_dir, *targets], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"installing the wheels from {wheel_dir} failed: "
                         f"{proc.stderr.strip()[-2000:]}")
    return {"wheels": wheel_dir, "seconds": time.perf_counter() - start}


def install_first(argv: list[str]) -> None:
    """Installs `--wheels` before `python -m jdp.bench` imports the other benchmarks (they
    import packages a GPU host may still lack)."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--wheels", default="")
    known, _ = parser.parse_known_args(argv)
    if known.wheels:
        print(f"installed: {install_wheels(known.wheels)}", flush=True)


def run_tests(test_files: tuple[str, ...], timeout_s: float) -> dict:
    """jdp's tests in a subprocess with 8 simulated CPU devices: counts and seconds."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *test_files]
    try:
        import xdist  # noqa: F401 - pytest-xdist: spread the files over the cores

        argv += ["-n", str(max(1, min(4, (os.cpu_count() or 1) // 4)))]
    except ImportError:  # pyproject's addopts ask for workers, which need xdist: run serially
        argv += ["-o", "addopts=-ra"]
    start = time.perf_counter()
    try:
        proc = subprocess.run(argv, cwd=_REPO, env=env, capture_output=True, text=True,
                              timeout=timeout_s)
        output, returncode = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        output, returncode = (e.stdout or b"").decode(errors="replace"), "timeout"
    counts = {kind: int(n) for n, kind in re.findall(
        r"(\d+) (passed|failed|error|errors|skipped)", output.splitlines()[-1] if output else "")}
    return {"files": list(test_files), "returncode": returncode, "counts": counts,
            "seconds": time.perf_counter() - start, "tail": output[-1500:]}


def run(args) -> None:
    import jax

    os.makedirs(args.out, exist_ok=True)
    results = {"jax": jax.__version__, "device": jax.devices()[0].device_kind,
               "platform": jax.devices()[0].platform, "device_count": jax.device_count(),
               "smoke": args.smoke, "workloads": []}
    if args.wheels:
        results["installed_wheels"] = args.wheels
    if not args.skip_tests:
        results["tests"] = run_tests(SMOKE_TESTS if args.smoke else JAX_API_TESTS,
                                     args.tests_timeout_s)
        print(f"tests: {results['tests']['counts']} in {results['tests']['seconds']:.0f} s",
              flush=True)
        _write(args.out, results)
    workloads = args.workloads.split(",") if args.workloads else list(
        SMOKE_WORKLOADS if args.smoke else WORKLOADS)
    steps = args.steps or (6 if args.smoke else 30)
    for workload in workloads:
        for arm in (args.arms or ("on" if args.smoke else ",".join(ARMS))).split(","):
            measured = _measure_in_child(workload, arm, steps, args.smoke)
            results["workloads"].append(measured)
            print(_line(measured), flush=True)
            _write(args.out, results)
    ratios = [m["jdp_over_minimal"] for m in results["workloads"] if "error" not in m]
    figure = f"{min(ratios):.3f} (worst of {len(ratios)})" if ratios else "none measured"
    print(f"gpu: jdp loop / minimal loop examples/s = {figure}; figures in "
          f"{os.path.join(args.out, 'gpu_bench.json')}")


def _write(out: str, results: dict) -> None:
    with open(os.path.join(out, "gpu_bench.json"), "w") as f:
        json.dump(results, f, indent=2)
    with open(os.path.join(out, "gpu_bench.txt"), "w") as f:
        f.write(f"jax {results['jax']}, {results['device_count']} x {results['device']}\n")
        if "tests" in results:
            f.write(f"tests: {results['tests']['counts']} ({results['tests']['seconds']:.0f} s)"
                    "\n")
        f.write("".join(_line(m) + "\n" for m in results["workloads"]))


def _line(m: dict) -> str:
    if "error" in m:
        return f"{m['workload']} settings {m['arm']}: failed: {m['error'][-300:]}"
    rate = (f"{m['tokens_per_s']:.0f} tokens/s" if m.get("tokens_per_s")
            else f"{m['examples_per_s']:.1f} examples/s")
    mfu = f", MFU {m['mfu']:.1%}" if m.get("mfu") is not None else ""
    peak = m.get("measured_peak_bytes")
    memory = (f", memory plan {m['planned_bytes'] / 2**30:.2f} GiB vs peak "
              f"{peak / 2**30:.2f} GiB" if peak else
              f", memory plan {m['planned_bytes'] / 2**30:.2f} GiB (no measured peak)")
    phases = f"; {m['phases_text']}" if m.get("phases_text") else ""
    return (f"{m['workload']} settings {m['arm']}: jdp {rate}, {m['step_time_s'] * 1e3:.1f} "
            f"ms/step{mfu}; minimal loop {m['minimal_examples_per_s']:.1f} examples/s (jdp / "
            f"minimal {m['jdp_over_minimal']:.3f}){memory}{phases}")


def _measure_in_child(workload: str, arm: str, steps: int, smoke: bool) -> dict:
    """What `_child` measured in a fresh process (its XLA flags fixed before jax starts)."""
    argv = [sys.executable, "-m", "jdp.bench.gpu", _CHILD_FLAG, f"--workload={workload}",
            f"--arm={arm}", f"--steps={steps}"]
    proc = subprocess.run(argv, cwd=_REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"workload": workload, "arm": arm, "error": proc.stderr.strip()[-3000:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


# -- in the child process ----------------------------------------------------------------


def _apply_arm(arm: str) -> list[str]:
    """The GPU settings of this arm, put in the environment before jax starts. 'on' sets
    jdp's defaults on any platform (off a GPU, XLA parses and ignores them)."""
    from jdp.runtime import gpu_flags

    if arm == "off":
        return []
    plan = gpu_flags.plan(os.environ, enable_defaults=True, user_flags="",
                          hopper=gpu_flags.is_hopper())
    os.environ["XLA_FLAGS"] = plan.xla_flags
    os.environ.update(plan.env)
    return list(plan.set_by_jdp)


def _child(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(_CHILD_FLAG, action="store_true")
    parser.add_argument("--workload", required=True)
    parser.add_argument("--arm", required=True, choices=ARMS)
    parser.add_argument("--steps", type=int, required=True)
    args = parser.parse_args(argv)
    settings = _apply_arm(args.arm)

    import jax
    import numpy as np

    from jdp import main as jdp_main
    from jdp.bench import overhead
    from jdp.dryrun import estimate
    from jdp.experiment import components, loader, optim
    from jdp.observe import throughput, trace_phases

    log_every = max(args.steps // 3, 1)
    path = f"{_SYNTHETIC}:{args.workload}"
    with tempfile.TemporaryDirectory(prefix="jdp-bench-gpu-") as scratch:
        options = types.SimpleNamespace(config=path, steps=args.steps, log_every=log_every,
                                        backend="pjit", cache_dir=os.path.join(scratch, "cache"),
                                        model="", config_overrides=[])
        config = overhead._load(options)
        profiled = args.arm == "on"
        if profiled:  # inside the first log window, which the rates leave out (warm-up)
            with config.unlocked():
                config.profile.start_step = 1
                config.profile.num_steps = max(min(3, log_every - 1), 1)
        plan = jdp_main.run(config, _SYNTHETIC, os.path.join(scratch, "plan"), dry_run=True)
        workdir = os.path.join(scratch, "run")
        jdp_rate, input_wait, jdp_loss = overhead._jdp_run(config, _SYNTHETIC, workdir)
        stats = jax.devices()[0].memory_stats() or {}
        phases = None
        if profiled:
            trace = trace_phases.latest_trace(os.path.join(workdir, "profile"))
            phases = trace_phases.split_file(trace) if trace else None
        experiment = loader.load(_SYNTHETIC)
        built = components.build(experiment, config)
        tx = experiment.build_optimizer(config, optim.learning_rate_fn(config))
        batch = built.data.train.get_batch(np.arange(config.batch_size))
        minimal_rate, losses = overhead._minimal_run(
            overhead._minimal_pjit(built, tx, config.seed), [batch] * args.steps, log_every,
            config.batch_size)
    step_time_s = config.batch_size / jdp_rate
    model_flops = experiment.flops_per_example(config) * config.batch_size
    peak = throughput.peak_flops_per_s(jax.devices()[0].device_kind)
    tokens = config.model.length if config.model.kind == "lm" else None
    print(json.dumps({
        "workload": args.workload, "arm": args.arm, "settings": settings,
        "global_batch_size": config.batch_size, "steps": args.steps,
        "examples_per_s": jdp_rate, "tokens_per_s": jdp_rate * tokens if tokens else None,
        "step_time_s": step_time_s, "input_wait_fraction": input_wait,
        "model_flops_per_step": model_flops, "peak_flops_per_s": peak,
        "mfu": model_flops / step_time_s / (peak * jax.device_count()) if peak else None,
        "minimal_examples_per_s": minimal_rate, "jdp_over_minimal": jdp_rate / minimal_rate,
        "jdp_loss": jdp_loss, "minimal_loss": float(np.mean(losses[-log_every:])),
        "planned_bytes": estimate.needed_bytes(plan.inputs),
        "measured_peak_bytes": stats.get("peak_bytes_in_use"),
        "phases": phases.as_dict() if phases else None,
        "phases_text": trace_phases.format_split(phases) if phases else ""}))


if __name__ == "__main__":
    _child(sys.argv[1:])
