"""Several processes on one machine as several hosts (gloo over loopback) follow the
trajectory of one process: both backends, the compressed cross-host reduction, a weighted
LM loss, and a one-process checkpoint resumed sharded over two processes. What happens
when a host dies or is stopped: tests/test_multihost_failures.py."""

import shutil

import jax
import numpy as np
import pytest

from jdp import main as jdp_main
from runs import (
    checkpoint_arrays,
    load_config,
    losses,
    main_command,
    read_metrics,
    run_two_processes,
    train,
)

pytestmark = pytest.mark.slow

VIT = "experiments/vit.py"
TRAIN = ("--config.total_steps=8", "--config.warmup_steps=1", "--config.log_every_steps=2",
         "--config.eval_every_steps=0", "--config.batch_size=64")


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """1 process x 8 devices, with checkpoints at steps 4 and 8."""
    workdir = tmp_path_factory.mktemp("one")
    return (*train(VIT, workdir, *TRAIN, "--config.checkpoint.every_steps=4"), workdir)


def launch_local(workdir, devices_per_process, *overrides, experiment=VIT, settings=TRAIN):
    return run_two_processes(
        main_command(f"--config={experiment}", f"--workdir={workdir}", *settings, *overrides),
        devices_per_process, timeout=300)


def assert_params_match(saved, reference_params):
    for (path, leaf), ref_leaf in zip(jax.tree_util.tree_flatten_with_path(saved)[0],
                                      jax.tree.leaves(jax.device_get(reference_params)),
                                      strict=True):
        if "['key']['bias']" not in jax.tree_util.keystr(path):  # see test_equivalence.py
            np.testing.assert_allclose(leaf, ref_leaf, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", ["pjit", "pmap"])
def test_two_processes_of_four_devices_follow_one_process_of_eight(one_process, tmp_path,
                                                                   backend):
    workdir = tmp_path / "two"
    # pjit with the two-level reduction (reduce-scatter in each process, all-reduce
    # across them, all-gather), streaming through grain with input worker processes,
    # each process's workers making only its rows; pmap batches from memory, as the
    # one-process reference does, which reduces flat.
    options = {"pjit": ("--config.data.in_memory=false", "--config.data.num_workers=2",
                        "--config.parallel.reduction=two_level", "--config.parallel.mesh=hybrid"),
               "pmap": ("--config.data.num_workers=0",)}
    proc = launch_local(workdir, 4, f"--config.parallel.backend={backend}", *options[backend])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[p0]" in proc.stderr and "[p1]" in proc.stderr
    # jax's own log line: the coordinator of a one-machine job serves loopback only.
    assert "Starting JAX distributed service on 127.0.0.1:" in proc.stderr
    reference_result, reference, _ = one_process
    got, expected = losses(read_metrics(workdir)), losses(reference)
    assert sorted(got) == sorted(expected) == [2, 4, 6, 8]
    np.testing.assert_allclose([got[s] for s in sorted(got)],
                               [expected[s] for s in sorted(expected)], rtol=1e-5)
    assert_params_match(checkpoint_arrays(workdir, 8)["params"], reference_result.state.params)


def test_int8_across_two_processes_matches_two_virtual_hosts_in_one(tmp_path):
    """The compressed cross-host reduction across real processes (all-to-all and
    all-gather of int8 over gloo) computes what it computes between 2 virtual hosts
    of one process."""
    int8 = ("--config.parallel.reduction=two_level", "--config.parallel.cross_host_reduce=int8")
    reference_result, reference = train(VIT, tmp_path / "one", *TRAIN, *int8,
                                        "--config.parallel.hosts=2")
    proc = launch_local(tmp_path / "two", 4, *int8)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got, expected = losses(read_metrics(tmp_path / "two")), losses(reference)
    assert sorted(got) == sorted(expected) == [2, 4, 6, 8]
    np.testing.assert_allclose([got[s] for s in sorted(got)],
                               [expected[s] for s in sorted(expected)], rtol=1e-5)
    # Where float rounding differs by ~1e-7 (the in-host sums run in another process
    # layout), an int8 rounding can fall the other way: that value's residual moves
    # by a whole int8 step and a few params by ~5e-6.
    saved = checkpoint_arrays(tmp_path / "two", 8)
    for leaf, ref_leaf in zip(jax.tree.leaves(saved["params"]),
                              jax.tree.leaves(jax.device_get(reference_result.state.params)),
                              strict=True):
        np.testing.assert_allclose(leaf, ref_leaf, rtol=1e-4, atol=1e-4)
    for name in ("shard", "chunk"):
        residual, ref_residual = saved["residuals"][name], np.asarray(
            reference_result.state.residuals[name])
        assert np.abs(ref_residual).max() > 0
        # measured: 0.1-0.4% moved; a wrong cross-process exchange moves most of them
        assert np.mean(np.isclose(residual, ref_residual, rtol=1e-4, atol=1e-4)) > 0.98


def test_weighted_lm_loss_on_two_processes_follows_one_process(tmp_path):
    """Answer tokens weigh 1, the rest 0: each host holds a different token count."""
    lm = "experiments/lm.py"
    settings = ("--config.model.size=nano", "--config.data.num_eval=64",
                "--config.eval_batch_size=64", *TRAIN)
    reference_result, reference = train(lm, tmp_path / "one", *settings)
    proc = launch_local(tmp_path / "two", 4, experiment=lm, settings=settings)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got, expected = losses(read_metrics(tmp_path / "two")), losses(reference)
    assert sorted(got) == sorted(expected) == [2, 4, 6, 8]
    np.testing.assert_allclose([got[s] for s in sorted(got)],
                               [expected[s] for s in sorted(expected)], rtol=1e-5)
    assert_params_match(checkpoint_arrays(tmp_path / "two", 8)["params"],
                        reference_result.state.params)


@pytest.mark.parametrize("devices, sharding", [
    # FSDP over all 4 devices: params gathered and gradients reduce-scattered across
    # the processes.
    (2, ("--config.parallel.mesh=hybrid", "--config.parallel.shard_params=true")),
    # Hybrid sharding: FSDP inside each process, one sum of each device's 1/4 of the
    # gradient across them per optimizer step.
    (4, ("--config.parallel.shard_params=host",)),
], ids=["fsdp", "fsdp_inside_hosts"])
def test_a_one_process_checkpoint_resumes_sharded_on_two_processes(one_process, tmp_path,
                                                                   devices, sharding):
    """Replicated state saved by one process, restored sharded over 2 processes: the
    same trajectory."""
    reference_result, reference, reference_dir = one_process
    workdir = tmp_path / "moved"
    shutil.copytree(reference_dir / "checkpoints" / "4", workdir / "checkpoints" / "4")
    shutil.copy(reference_dir / "config.json", workdir / "config.json")
    proc = launch_local(workdir, devices, *sharding, "--config.checkpoint.every_steps=4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resuming from" in proc.stderr
    assert f"over {2 * devices} devices in 2 processes" in proc.stderr
    got, expected = losses(read_metrics(workdir)), losses(reference)
    assert sorted(got) == [6, 8]
    np.testing.assert_allclose([got[6], got[8]], [expected[6], expected[8]], rtol=1e-5)
    assert_params_match(checkpoint_arrays(workdir, 8)["params"], reference_result.state.params)


def test_a_dry_run_of_two_processes_plans_what_one_process_of_two_hosts_plans(tmp_path):
    """Each process of a 2-process job compiles the step from shapes and prints the plan
    one process of 8 devices prints for 2 virtual hosts: the same program, memory and
    bytes inside and across hosts. pmap, whose lowering takes each process's arrays, so
    shapes need their own path; the plan's hosts come from mesh positions, which are
    device ids only on one process (both backends)."""
    from jdp.dryrun import estimate

    pmap = "--config.parallel.backend=pmap"
    workdir = tmp_path / "never"
    config = load_config(VIT, *TRAIN, pmap, "--config.parallel.hosts=2")
    one = estimate.format_plan(jdp_main.run(config, VIT, str(workdir), dry_run=True).inputs)
    proc = launch_local(workdir, 4, pmap, "--dry_run")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not workdir.exists()
    # The same plan, but for the devices and the batch's split over processes.
    same = [line for line in one.splitlines() if not line.startswith(("Devices:", "Batch:"))]
    assert any("leaving a host across hosts" in line for line in same)
    for process in ("[p0] ", "[p1] "):
        plan = [line[len(process):] for line in proc.stdout.splitlines()
                if line.startswith(process)]
        assert "Devices: 8 x cpu (cpu), 2 processes; mesh hosts=2, local=4" in plan
        assert [line for line in plan if not line.startswith(("Devices:", "Batch:"))] \
            == same, "\n".join(plan)
