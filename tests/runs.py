"""Helpers for tests that run the real trainer in-process with tiny settings."""

import collections
import contextlib
import functools
import json
import os
import re
import subprocess
import sys
import time

from jdp import main as jdp_main
from jdp.main import load_config
from jdp.runtime.jax_compat import cpu_fusion_emitters_option


def train(path: str, workdir, *overrides: str, devices=None):
    """Runs the trainer; returns (TrainResult, metrics.jsonl records)."""
    config = load_config(path, *overrides)
    result = jdp_main.run(config, path.split(":")[0], str(workdir), devices=devices)
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    return result, records


# Compiler options for one program: the fusion emitters of users' runs, which
# tests/conftest.py swaps for faster-compiling ones where jaxlib has them. For tests that
# compare two programs XLA fuses differently (remat against none) to float32's last
# digits, where the older emitters' rounding differs by up to 2.5e-5.
USERS_FUSION = cpu_fusion_emitters_option(True)


@contextlib.contextmanager
def steps_compiled_with(options: dict):
    """Train steps built inside compile with the XLA `options` added to jdp's own."""
    import pytest

    from jdp.parallel import factory

    original = factory.compiler_options

    def compiler_options(*args, **kwargs):
        return {**(original(*args, **kwargs) or {}), **options}

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(factory, "compiler_options", compiler_options)
        yield


def steps_compiled_optimised(level: int = 1):
    """Train steps built inside compile at XLA:CPU's backend optimisation `level`; the
    tests compile everything else at level 0 (tests/conftest.py). For the few tests
    whose cost is their steps' compute rather than their compiles: level 0's machine
    code is slower to run. The optimised HLO is the same at every level."""
    return steps_compiled_with({"xla_backend_optimization_level": level})


def losses(records) -> dict[int, float]:
    return {r["step"]: r["train/loss"] for r in records if "train/loss" in r}


# Trajectories that must agree are compared at this tolerance: far above the ~1e-7
# that reduction order changes, far below what a wrong reduction produces.
RTOL = 1e-5
PEAK_LR = 3e-3  # the shipped experiments' Adam LR: bounds 12 steps of a zero-gradient param


def assert_same_trajectory(run, reference, logged_steps=(3, 6, 9, 12)):
    """Same losses at every logged step and the same final params (rtol 1e-5).

    The attention key bias is bounded instead: its true gradient is exactly 0
    (softmax ignores it), and Adam turns the rounding noise into lr-sized steps, so
    the two runs' key biases differ by at most two runs' worth of such steps (from any
    starting value: a model imported with a nonzero one too).
    """
    import jax
    import numpy as np

    (result, records), (ref_result, ref_records) = run, reference
    loss, ref_loss = losses(records), losses(ref_records)
    assert sorted(loss) == sorted(ref_loss) == list(logged_steps)
    np.testing.assert_allclose([loss[s] for s in sorted(loss)],
                               [ref_loss[s] for s in sorted(ref_loss)], rtol=RTOL)
    params = jax.tree_util.tree_flatten_with_path(jax.device_get(result.state.params))[0]
    ref_params = jax.tree.leaves(jax.device_get(ref_result.state.params))
    bound = len(logged_steps) and max(logged_steps) * PEAK_LR
    for (path, leaf), ref_leaf in zip(params, ref_params, strict=True):
        name = jax.tree_util.keystr(path)
        if "['key']['bias']" in name:
            assert np.abs(leaf - ref_leaf).max() < 2 * bound
        else:
            np.testing.assert_allclose(leaf, ref_leaf, rtol=RTOL, atol=1e-6, err_msg=name)


def compiled_step(path: str, *overrides: str, devices=None, global_batch_size=128):
    """(backend, abstract canonical state, compiled train step) for an experiment, from
    shapes: for reading the program, without computing an initial state."""
    backend, parts = _backend(path, *overrides, devices=devices)
    return (backend, *compiled_from_shapes(backend, parts.sample_inputs(), parts.sample,
                                           global_batch_size))


def compiled_from_shapes(backend, sample_inputs: tuple, example: dict, global_batch_size: int):
    """(abstract canonical state, compiled train step) of `backend` for batches of
    examples shaped like `example`, compiled with the backend's XLA options for reading
    (`compile_to_read`: the tests read these programs, never run them), with no initial
    state computed."""
    from jdp.dryrun.lowering import compile_to_read, lower_from_shapes

    lowered, state = lower_from_shapes(backend, sample_inputs, example, global_batch_size)
    return state, compile_to_read(lowered, backend.options.compiler_options)


def lowered_step(path: str, *overrides: str, devices=None, global_batch_size=128):
    """(backend, abstract canonical state, the train step lowered from shapes), as the dry
    run lowers it: the program a run with that state compiles, nothing computed."""
    from jdp.dryrun.lowering import lower_from_shapes

    backend, parts = _backend(path, *overrides, devices=devices)
    lowered, state = lower_from_shapes(backend, parts.sample_inputs(), parts.sample,
                                       global_batch_size)
    return backend, state, lowered


def device_bytes(leaf) -> int:
    """What one device holds of `leaf` (an array, or a ShapeDtypeStruct with a sharding),
    in bytes: jdp's shardings split each leaf evenly over the devices."""
    import math

    return math.prod(leaf.sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize


def _backend(path: str, *overrides: str, devices=None):
    from jdp.experiment import components, loader, optim
    from jdp.parallel.factory import build_backend
    from jdp.parallel.mesh import make_mesh

    config = load_config(path, *overrides)
    exp = loader.load(path)
    parts = components.build(exp, config)
    mesh = make_mesh(config.parallel.mesh, devices, config.parallel.hosts,
                     config.parallel.model_parallel)
    return build_backend(config, mesh, parts,
                         exp.build_optimizer(config, optim.learning_rate_fn(config))), parts


def prepared_step(path: str, *overrides: str, devices=None, global_batch_size=128):
    """(backend, state, a zero batch) for an experiment's train step, nothing compiled."""
    import jax
    import numpy as np

    backend, parts = _backend(path, *overrides, devices=devices)
    state = backend.from_global(backend.init_global(jax.random.key(0), parts.sample_inputs()))
    rows = global_batch_size // jax.process_count()
    batch = backend.put_batch({key: np.zeros((rows, *np.shape(value)), np.asarray(value).dtype)
                               for key, value in parts.sample.items()})
    return backend, state, batch


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@functools.cache
def load_launch_script(name: str = "local"):
    """launch/NAME.py as a module (a script, not part of the jdp package), loaded once:
    free_port asks for launch/local.py for every process a test starts."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        f"launch_{name}", os.path.join(REPO, "launch", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def load_netns():
    """launch/netns.py: emulated hosts joined by a shaped link."""
    return load_launch_script("netns")


def free_port() -> int:
    """A free port on 127.0.0.1, picked as launch/local.py picks its coordinator's."""
    return load_launch_script().free_port()


def xla_flags(devices: int) -> str:
    """This session's XLA_FLAGS (tests/conftest.py's, or the caller's own) with `devices`
    CPU devices, as launch/local.py sets them: every process of the tests compiles with
    the same flags."""
    from jdp.runtime.cpu_devices import with_device_count

    return with_device_count(os.environ.get("XLA_FLAGS", ""), devices)


def main_env(devices: int = 8, **extra: str) -> dict:
    return {**os.environ, "XLA_FLAGS": xla_flags(devices), "JAX_PLATFORMS": "cpu", **extra}


def main_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "jdp.main", *args]


def _process_tree(pid: int) -> list[int]:
    """`pid` and its descendants, parents first."""
    children = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True,
                              text=True).stdout.split()
    return [pid, *(p for child in children for p in _process_tree(int(child)))]


def stacks_then_kill(*popens: subprocess.Popen, grace_s: float = 1.0) -> None:
    """Kills these processes and their descendants, after asking each to write its threads'
    stacks to stderr (SIGUSR2, which tests/site/sitecustomize.py registers): a test that
    gives up on a hung job shows where every process of it waited. One process at a
    time, `grace_s` apart: a job's processes often share one stderr."""
    import signal

    pids = [pid for popen in popens if popen.poll() is None for pid in _process_tree(popen.pid)]
    for signum in (signal.SIGUSR2, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                continue
            if signum == signal.SIGUSR2:
                time.sleep(grace_s)


def run_to_end(command, *, env, timeout: float) -> subprocess.CompletedProcess:
    """`command` run from the repository root with its output captured. Past `timeout`
    it is killed (`stacks_then_kill`) and the test fails with the end of what it printed,
    so that a run that hangs in CI says where."""
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stacks_then_kill(proc)
        stdout, stderr = proc.communicate()
        raise AssertionError(f"killed after {timeout} s: {' '.join(command)}\n"
                             f"... its last output:\n{(stdout + stderr)[-12000:]}") from None
    return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)


def run_main(*args, devices=8, timeout=300) -> subprocess.CompletedProcess:
    """`python -m jdp.main ARGS` as a user runs it, from the repository root."""
    return run_to_end(main_command(*args), env=main_env(devices), timeout=timeout)


def start_main(*args, devices=8, **popen) -> subprocess.Popen:
    return subprocess.Popen(main_command(*args), cwd=REPO, env=main_env(devices), **popen)


def two_processes_command(command, devices_per_process: int = 4, *launcher_flags: str):
    """`launch/local.py --num_processes=2 [FLAGS] -- COMMAND`: one job of 2 processes over
    loopback, each with `devices_per_process` CPU devices."""
    return [sys.executable, "launch/local.py", "--num_processes=2",
            f"--devices_per_process={devices_per_process}", *launcher_flags, "--", *command]


def run_two_processes(command, devices_per_process: int = 4,
                      timeout: float = 600) -> subprocess.CompletedProcess:
    """`two_processes_command(COMMAND)` run to its end from the repository root. A job that
    failed has its stderr end with each process's last lines, so that the tail a test
    shows names the process that failed first, not only the other's abort."""
    done = run_to_end(two_processes_command(command, devices_per_process), env=main_env(),
                      timeout=timeout)
    if done.returncode != 0:
        done.stderr += each_process_last_lines(done.stderr)
    return done


def each_process_last_lines(stderr: str, count: int = 15) -> str:
    """The last `count` lines each process of a launch/local.py job wrote (its `[pN] `
    prefix), native stack frames left out."""
    lines = collections.defaultdict(list)
    for line in stderr.splitlines():
        match = re.match(r"\[p(\d+)\] ", line)
        if match and not re.match(r"\s*@\s+0x", line[match.end():]):
            lines[int(match.group(1))].append(line)
    return "".join(f"\n--- process {index}'s last lines ---\n" + "\n".join(lines[index][-count:])
                   for index in sorted(lines))


def wait_for(condition, timeout_s: float, what: str, poll_s: float = 0.02) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"gave up after {timeout_s} s waiting for {what}")
        time.sleep(poll_s)


def run_killing_one_trainer(main_args, *, max_restarts: int, reached, timeout_s: float = 240,
                            finish_timeout_s: float = 240) -> tuple[int, str]:
    """`launch/local.py` with 2 processes of 4 devices and `--max_restarts` running
    `python -m jdp.main MAIN_ARGS`; once `reached()` (within `timeout_s`), one trainer is
    SIGKILLed (failing if the launcher ended first), and the job has `finish_timeout_s`
    to end. Returns the launcher's (exit status, stderr)."""
    import signal
    import threading

    launcher = subprocess.Popen(
        two_processes_command(main_command(*main_args), 4, f"--max_restarts={max_restarts}"),
        cwd=REPO, env=main_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    # Read as it comes: a job blocked on a full pipe would look like a hang.
    lines = []
    reader = threading.Thread(target=lambda: lines.extend(launcher.stderr), daemon=True)
    reader.start()

    def stderr() -> str:
        reader.join(timeout=30)
        return "".join(lines)

    def fail_showing_stderr(what: str):
        stacks_then_kill(launcher)
        raise AssertionError(f"{what}; the job's stderr ends:\n{stderr()[-6000:]}") from None

    try:
        try:
            wait_for(lambda: reached() or launcher.poll() is not None, timeout_s,
                     "the kill point", poll_s=0.05)
        except TimeoutError as e:
            fail_showing_stderr(str(e))
        assert launcher.poll() is None, "the launcher ended before the kill point"
        trainers = subprocess.run(["pgrep", "-P", str(launcher.pid)], capture_output=True,
                                  text=True).stdout.split()
        os.kill(int(trainers[-1]), signal.SIGKILL)
        try:
            launcher.wait(timeout=finish_timeout_s)
        except subprocess.TimeoutExpired:
            fail_showing_stderr(f"the job did not end within {finish_timeout_s} s of the kill")
    finally:
        launcher.kill()
    return launcher.returncode, stderr()


def logged_steps(workdir) -> list[int]:
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line)["step"] for line in f if line.endswith("\n")]


def read_metrics(workdir) -> list[dict]:
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def checkpoint_arrays(workdir, step: int) -> dict:
    """A saved train state as host numpy arrays, whatever topology wrote it."""
    from jdp.checkpoint import load_arrays

    return load_arrays(os.path.join(workdir, "checkpoints", str(step), "default"))
