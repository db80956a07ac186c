"""The two-level gradient reduction, compressed cross-host reduction and hybrid
sharding (FSDP / ZeRO-1 inside hosts), on 8 devices split into 2 virtual hosts of 4:
the collectives XLA compiles (groups, bytes), the memory per device, the trajectory
against the flat reduction, error feedback, and resume."""

import shutil

import jax
import numpy as np
import pytest

from jdp import DATA_AXIS
from jdp import config as config_lib
from jdp.dryrun import estimate as hlo_estimate
from jdp.dryrun import hlo
from jdp.errors import ConfigError
from runs import (
    assert_same_trajectory,
    checkpoint_arrays,
    compiled_step,
    load_config,
    losses,
    lowered_step,
    prepared_step,
    steps_compiled_optimised,
    train,
)

VIT = "experiments/vit.py"
RESNET = "experiments/resnet.py"
STEPS = ("--config.total_steps=12", "--config.warmup_steps=2", "--config.log_every_steps=3",
         "--config.eval_every_steps=0", "--config.batch_size=64")
TWO_HOSTS = ("--config.parallel.hosts=2", "--config.parallel.reduction=two_level")
IN_HOST = ((0, 1, 2, 3), (4, 5, 6, 7))
ACROSS = ((0, 4), (1, 5), (2, 6), (3, 7))
HOST_OF = {device: device // 4 for device in range(8)}


def _gradient_collectives(*overrides, lowered=False):
    """The step's gradient collectives (not the metric sums), compiled or as lowered
    (XLA:CPU widens bfloat16 collectives to float32 when compiling; GPUs do not)."""
    if lowered:
        _, state, program = lowered_step(VIT, *overrides)
        text = program.as_text(dialect="hlo", debug_info=True)
    else:
        _, state, program = compiled_step(VIT, *overrides)
        text = program.as_text()
    ops = [op for op in hlo.collectives(text)
           if "gradient_all_reduce" in op.op_name and op.bytes > 64]
    grad_bytes = sum(x.size * 4 for x in jax.tree.leaves(state.params))
    return ops, grad_bytes


def test_two_level_reduce_scatters_in_hosts_all_reduces_across_and_gathers_in_hosts():
    ops, grad_bytes = _gradient_collectives(*TWO_HOSTS)
    assert [(op.kind, op.replica_groups) for op in ops] == [
        ("reduce-scatter", IN_HOST), ("all-reduce", ACROSS), ("all-gather", IN_HOST)], ops
    across = ops[1]
    # 1/L of the (padded) gradient crosses hosts, in float32.
    assert across.dtypes == {"f32"}
    assert grad_bytes / 4 <= across.bytes < grad_bytes / 4 + 4 * 8 * 4
    flat_ops, _ = _gradient_collectives()
    [flat] = flat_ops
    assert flat.kind == "all-reduce" and flat.group_size in (8, None)
    # Across hosts the two-level reduction sends (H-1)/H of the gradient per host, the
    # flat ring 2 (N-1)/N: 1 against 1.75 times the gradient for 2 hosts of 4.
    two_level = sum(op.traffic(HOST_OF).cross_host_bytes for op in ops)
    assert two_level == pytest.approx(grad_bytes, rel=0.01)
    assert flat.traffic(HOST_OF).cross_host_bytes == pytest.approx(1.75 * grad_bytes, rel=0.01)


@pytest.mark.parametrize("dtype, share", [("bfloat16", 1 / 2), ("int8", 1 / 4)])
def test_compressed_cross_host_traffic_is_a_half_or_a_quarter(dtype, share):
    ops, grad_bytes = _gradient_collectives(
        *TWO_HOSTS, f"--config.parallel.cross_host_reduce={dtype}", lowered=True)
    inside = [op for op in ops if op.replica_groups == IN_HOST]
    across = [op for op in ops if op.replica_groups == ACROSS]
    assert {op.kind for op in inside} == {"reduce-scatter", "all-gather"}
    assert {op.dtypes.pop() for op in inside} == {"f32"}  # float32 inside hosts
    assert {op.kind for op in across} == {"all-to-all", "all-gather"}
    sent = sum(op.traffic(HOST_OF).cross_host_bytes for op in across)
    # A quarter of the float32 two-level traffic for int8, plus one scale per 256 values.
    assert sent == pytest.approx(share * grad_bytes, rel=0.03), (sent, grad_bytes)


@pytest.fixture(scope="module")
def flat_run(tmp_path_factory):
    return train(VIT, tmp_path_factory.mktemp("flat"), *STEPS)


@pytest.mark.slow
def test_two_level_float32_follows_the_flat_trajectory(flat_run, tmp_path):
    assert_same_trajectory(train(VIT, tmp_path, *STEPS, *TWO_HOSTS), flat_run)


@pytest.mark.slow
def test_two_level_with_batchnorm_and_accumulation_follows_the_flat_trajectory(tmp_path):
    # BatchNorm's statistics over jdp.DATA_AXIS = (hosts, local) span both hosts; its
    # statistics are per micro-batch, so both runs accumulate over 2. ResNet's steps run
    # about twice as long from level 0's machine code as their compile saves.
    accumulate = "--config.grad_accum_steps=2"
    with steps_compiled_optimised():
        flat = train(RESNET, tmp_path / "flat", *STEPS, accumulate)
        two = train(RESNET, tmp_path / "two", *STEPS, *TWO_HOSTS, accumulate)
    assert_same_trajectory(two, flat)


@pytest.fixture(scope="module")
def int8_runs(tmp_path_factory):
    """The default ViT digits run, uncompressed and int8 with and without error feedback.
    900 steps in all: their compute, not their compiles, is the cost."""
    full = ("--config.total_steps=300", "--config.log_every_steps=50",
            "--config.eval_every_steps=0", "--config.checkpoint.every_steps=0",
            "--config.parallel.hosts=2")
    with steps_compiled_optimised():
        return {name: train(VIT, tmp_path_factory.mktemp(name), *full, *overrides)
                for name, overrides in [
                    ("float32", ()),
                    ("int8", ("--config.parallel.reduction=two_level",
                              "--config.parallel.cross_host_reduce=int8")),
                    ("int8_no_feedback", ("--config.parallel.reduction=two_level",
                                          "--config.parallel.cross_host_reduce=int8",
                                          "--config.parallel.error_feedback=false")),
                ]}


@pytest.mark.slow
def test_int8_with_error_feedback_ends_at_the_uncompressed_accuracy(int8_runs):
    full = int8_runs["float32"][0].eval_metrics["eval/accuracy"]
    int8 = int8_runs["int8"][0].eval_metrics["eval/accuracy"]
    assert abs(int8 - full) <= 0.01, (int8, full)


@pytest.mark.slow
def test_int8_error_feedback_keeps_the_run_on_the_uncompressed_path(int8_runs):
    # Without feedback what int8 rounds away (values far below their block's largest)
    # is lost at every step; the run drifts measurably further from the uncompressed
    # one (measured: params 0.22 away against 0.09, the losses by 2.5e-3 against
    # 2.2e-3 summed over the logged steps).
    full = int8_runs["float32"]

    def drift(name):
        params = jax.tree.leaves(int8_runs[name][0].state.params)
        return np.sqrt(sum(np.sum((np.asarray(a) - np.asarray(b)) ** 2) for a, b in
                           zip(params, jax.tree.leaves(full[0].state.params), strict=True)))

    assert drift("int8_no_feedback") > 1.5 * drift("int8"), (drift("int8_no_feedback"),
                                                              drift("int8"))
    loss, no_feedback = losses(int8_runs["int8"][1]), losses(int8_runs["int8_no_feedback"][1])
    assert loss != no_feedback  # the feedback changed the trajectory


@pytest.mark.parametrize("feedback", [True, False])
def test_error_feedback_sends_over_steps_what_int8_rounds_away(feedback):
    """The reduction alone, 2 hosts x 4 devices, the same gradient for 20 steps: one
    large value per block of 256 and the rest 1/1000 of it, below int8's resolution
    (1/127 of the largest). With feedback the sum of what was sent tracks 20 x the
    true sum to within one step's rounding (0.03 of 0.16 measured); without it the small
    values never arrive."""
    from jdp.parallel.mesh import make_mesh
    from jdp.parallel.two_level import RESIDUAL_SPECS, TwoLevel

    mesh = make_mesh(hosts=2)
    reduction = TwoLevel(cross_host="int8", error_feedback=feedback, hosts=2, local=4)
    size = 4096
    grads = np.full((8, size), 1e-3, np.float32)
    grads[:, ::256] = 1.0
    residuals = {name: np.zeros(shape, np.float32)
                 for name, shape in TwoLevel(cross_host="int8", hosts=2,
                                              local=4).residual_shapes(size).items()}
    specs = {name: RESIDUAL_SPECS[name] for name in residuals}

    def device(g, r):
        return reduction(g[0], r)

    step = jax.jit(jax.shard_map(device, mesh=mesh, in_specs=(jax.P(DATA_AXIS), specs),
                                 out_specs=(jax.P(), specs), check_vma=False))
    sent = np.zeros(size, np.float32)
    for _ in range(20):
        summed, residuals = step(grads, residuals)
        sent += np.asarray(summed)
    small = ~np.isin(np.arange(size), np.arange(0, size, 256))
    true = 20 * grads.sum(axis=0)
    error = np.abs(sent - true)[small].max()
    if feedback:  # what is still owed is the last rounding: under one int8 step of the sum
        assert error < 8 / 127, error
    else:
        assert error > 0.9 * true[small].max(), error  # the small values are all lost


INT8_LAYOUTS = {
    "two_level": TWO_HOSTS,
    # FSDP inside hosts: its leaves held whole by every device of a host must stay
    # identical replicas, or the checkpoint (one replica) would resume another run.
    "fsdp_inside_hosts": ("--config.parallel.hosts=2", "--config.parallel.shard_params=host"),
}


def _int8_settings(layout: str) -> tuple[str, ...]:
    return (*STEPS, *INT8_LAYOUTS[layout], "--config.parallel.cross_host_reduce=int8",
            "--config.checkpoint.every_steps=6")


@pytest.fixture(scope="module")
def int8_whole_run(tmp_path_factory):
    """layout -> (workdir, result) of a whole 12-step int8 run saving at steps 6 and 12,
    trained once for the module."""
    done = {}

    def whole(layout: str):
        if layout not in done:
            workdir = tmp_path_factory.mktemp(f"int8_{layout}")
            done[layout] = workdir, train(VIT, workdir, *_int8_settings(layout))
        return done[layout]

    return whole


def _resumable_at_6(whole_workdir, workdir) -> None:
    """`workdir` as the whole run's was when killed after its step-6 checkpoint."""
    shutil.copytree(whole_workdir / "checkpoints" / "6", workdir / "checkpoints" / "6")
    shutil.copy(whole_workdir / "config.json", workdir / "config.json")


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(INT8_LAYOUTS))
def test_an_int8_run_resumes_bitwise_with_its_residuals(int8_whole_run, tmp_path, layout):
    """As if killed after its step-6 checkpoint: a run given only that checkpoint
    resumes, error-feedback residuals included, and ends bitwise where the whole run
    ended."""
    whole_workdir, whole = int8_whole_run(layout)
    saved = checkpoint_arrays(whole_workdir, 6)
    assert np.abs(saved["residuals"]["shard"]).max() > 0  # the residuals were saved
    _resumable_at_6(whole_workdir, tmp_path)
    resumed = train(VIT, tmp_path, *_int8_settings(layout))
    assert losses(resumed[1]) == {step: loss for step, loss in losses(whole[1]).items()
                                  if step > 6}
    for a, b in zip(jax.tree.leaves(resumed[0].state), jax.tree.leaves(whole[0].state),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow
def test_a_resume_on_another_topology_starts_the_residuals_at_zero(int8_whole_run, tmp_path,
                                                                    caplog):
    whole_workdir, _ = int8_whole_run("two_level")
    _resumable_at_6(whole_workdir, tmp_path)
    # The same run on 4 hosts of 2 devices: the residuals of 2 hosts' sums mean nothing.
    resumed = train(VIT, tmp_path, *_int8_settings("two_level"), "--config.parallel.hosts=4")
    assert int(resumed[0].state.step) == 12
    assert "its residuals" in caplog.text and "starting it afresh" in caplog.text


@pytest.mark.parametrize("overrides, field", [
    (("--config.parallel.reduction=two_level", "--config.parallel.cross_host_reduce=int8"),
     "parallel.cross_host_reduce"),  # one host: nothing crosses hosts
    (("--config.parallel.cross_host_reduce=int8", "--config.parallel.hosts=2"),
     "parallel.cross_host_reduce"),  # compression without the two-level reduction
    (("--config.parallel.reduction=two_level", "--config.parallel.backend=pmap"),
     "parallel.reduction"),
    (("--config.parallel.reduction=two_level", "--config.parallel.shard_params=true"),
     "parallel.reduction"),
    (("--config.parallel.hosts=3",), "parallel.hosts"),
    (("--config.parallel.shard_params=host",), "parallel.shard_params"),  # one host
    (("--config.parallel.shard_optimizer_state=host",), "parallel.shard_optimizer_state"),
    (("--config.parallel.shard_params=host", "--config.parallel.hosts=2",
      "--config.parallel.backend=pmap"), "parallel.shard_params"),
    (("--config.parallel.shard_params=host", "--config.parallel.hosts=3"), "parallel.hosts"),
    (("--config.parallel.shard_params=host", "--config.parallel.hosts=2",
      "--config.parallel.shard_optimizer_state=true"), "parallel.shard_optimizer_state"),
    (("--config.parallel.shard_params=hosts",), "parallel.shard_params"),  # a typo
])
def test_bad_combinations_fail_at_start_naming_the_field(overrides, field):
    config = load_config(VIT, *overrides)
    with pytest.raises(ConfigError) as error:
        config_lib.validate(config, device_count=8, process_count=1)
    message = str(error.value)
    assert message.startswith(f"config.{field}=") and "Fix:" in message
    assert "\n" not in message


# -- Hybrid sharding: FSDP or ZeRO-1 inside each host, data parallel across hosts -----

HYBRID = {"fsdp": ("--config.parallel.hosts=2", "--config.parallel.shard_params=host"),
          "zero1": ("--config.parallel.hosts=2", "--config.parallel.shard_optimizer_state=host")}


def _host_part_bytes(params, local=4) -> int:
    """What one device holds of `params` when each leaf is split over the host's
    `local` devices where the sharding rule can split it (else held whole)."""
    from jdp.parallel.mesh import sharded_over_data
    from jdp.parallel.reducers import split_dim

    return sum(leaf.size * 4 // (local if split_dim(sharded_over_data(leaf.shape, local, "l"))
                                 is not None else 1) for leaf in jax.tree.leaves(params))


@pytest.mark.parametrize("mode", ["fsdp", "zero1"])
def test_hybrid_sharding_gathers_and_scatters_inside_hosts_and_reduces_across_once(mode):
    """Per optimizer step (4 accumulated micro-batches): no all-gather or
    reduce-scatter spans hosts, and exactly one gradient reduction crosses them,
    carrying one device's 1/L part."""
    _, state, compiled = compiled_step(VIT, *HYBRID[mode], "--config.grad_accum_steps=4")
    ops = hlo.collectives(compiled.as_text())
    gathers = [op for op in ops if op.kind in ("all-gather", "reduce-scatter")]
    assert gathers and {op.replica_groups for op in gathers} == {IN_HOST}, gathers
    across = [op for op in ops if op.traffic(HOST_OF).cross_host_bytes and op.bytes > 64]
    assert [(op.kind, op.replica_groups) for op in across] == [("all-reduce", ACROSS)], across
    assert "gradient_all_reduce" in across[0].op_name
    assert across[0].bytes == _host_part_bytes(state.params)
    grad_bytes = sum(x.size * 4 for x in jax.tree.leaves(state.params))
    assert across[0].bytes < 0.26 * grad_bytes  # 1/4, and the few leaves held whole


@pytest.mark.parametrize("mode", ["fsdp", "zero1"])
def test_hybrid_sharding_holds_a_host_share_of_the_state_per_device(mode):
    _, state, _ = prepared_step(VIT, *HYBRID[mode])
    _, replicated, _ = prepared_step(VIT)

    def device_bytes(tree):  # what device 0 holds
        return sum(leaf.addressable_shards[0].data.nbytes for leaf in jax.tree.leaves(tree))

    opt_leaves = [x for x in jax.tree.leaves(state.opt_state) if x.ndim]  # not the count
    expected_opt = 2 * _host_part_bytes(state.params)  # Adam's two moments
    assert sum(leaf.addressable_shards[0].data.nbytes for leaf in opt_leaves) == expected_opt
    assert device_bytes(state.opt_state) < 0.26 * device_bytes(replicated.opt_state)
    if mode == "fsdp":
        assert device_bytes(state.params) == _host_part_bytes(state.params)
        assert device_bytes(state.params) < 0.26 * device_bytes(replicated.params)
    else:
        assert device_bytes(state.params) == device_bytes(replicated.params)
    # Replicated across hosts: device 4 (the other host) holds what device 0 holds.
    for leaf in jax.tree.leaves(state.opt_state):
        shards = {shard.device.id: shard.index for shard in leaf.addressable_shards}
        assert shards[0] == shards[4]


@pytest.fixture(scope="module")
def fsdp_host_run(tmp_path_factory):
    """FSDP inside hosts, 12 steps with a checkpoint at 6."""
    workdir = tmp_path_factory.mktemp("fsdp_host")
    return (*train(VIT, workdir, *STEPS, *HYBRID["fsdp"], "--config.checkpoint.every_steps=6"),
            workdir)


@pytest.mark.slow
def test_hybrid_fsdp_follows_the_flat_trajectory(flat_run, fsdp_host_run):
    assert_same_trajectory(fsdp_host_run[:2], flat_run)


@pytest.mark.slow
def test_hybrid_zero1_with_accumulation_follows_the_flat_trajectory(flat_run, tmp_path):
    assert_same_trajectory(
        train(VIT, tmp_path, *STEPS, *HYBRID["zero1"], "--config.grad_accum_steps=4"), flat_run)


@pytest.mark.slow
def test_a_hybrid_checkpoint_resumes_replicated_on_one_host(flat_run, fsdp_host_run, tmp_path):
    """Saved sharded inside 2 hosts, restored replicated on one: the same trajectory.
    (The reverse, replicated to hybrid across two processes: test_multihost.py.)"""
    saved_dir = fsdp_host_run[2]
    shutil.copytree(saved_dir / "checkpoints" / "6", tmp_path / "checkpoints" / "6")
    shutil.copy(saved_dir / "config.json", tmp_path / "config.json")
    resumed = train(VIT, tmp_path, *STEPS)
    after_six = (flat_run[0], [r for r in flat_run[1] if r["step"] > 6])
    assert_same_trajectory(resumed, after_six, logged_steps=(9, 12))


def test_the_dry_run_shows_the_bytes_across_hosts_and_the_state_per_device(tmp_path):
    from jdp import main as jdp_main

    def plan(*overrides):
        config = load_config(VIT, *STEPS, "--config.parallel.hosts=2", *overrides)
        inputs = jdp_main.run(config, VIT, str(tmp_path / "never"), dry_run=True).inputs
        line = next(line for line in hlo_estimate.format_plan(inputs).splitlines()
                    if line.startswith("Per step: "))
        return inputs, line

    flat, flat_line = plan()
    hybrid, hybrid_line = plan("--config.parallel.shard_params=host")
    assert "inside its host" in hybrid_line and "leaving a host across hosts" in hybrid_line

    def across(inputs):
        return sum(c.traffic(inputs.host_of).cross_host_bytes for c in inputs.collectives)

    # The flat ring sends 2(N-1)/N of the gradient out of a host, the host modes what
    # the two-level reduction sends: 1.75x less for 2 hosts of 4.
    assert across(flat) == pytest.approx(1.75 * across(hybrid), rel=0.02)
    assert hybrid.state_bytes_per_device < 0.27 * flat.state_bytes_per_device
    assert not (tmp_path / "never").exists()  # a dry run writes nothing
