"""Two backends, one trajectory: pjit on 8 devices, pjit on 1 device and pmap on 8
devices give the same losses and final params for the same config and seed, with
and without BatchNorm; gradient accumulation matches one big batch.

float32 throughout. The tolerance (rtol 1e-5) is far above the ~1e-7 that
reduction order changes, and far below what a wrong reduction (a missing or
double mean, per-device BatchNorm statistics, a skipped micro-batch) produces.

One parameter is compared differently: the attention key bias. Softmax is
invariant to it, so its true gradient is exactly 0 and what is computed is
rounding noise (~1e-9), which Adam normalises into steps of about the learning
rate in arbitrary directions. It can only be bounded, not matched.
"""

import jax
import pytest

from runs import assert_same_trajectory, losses, train

STEPS = ("--config.total_steps=12", "--config.warmup_steps=2", "--config.log_every_steps=3",
         "--config.eval_every_steps=0", "--config.batch_size=64")
# The three reference runs of each experiment: name -> (overrides, devices: 1 or all 8).
REFERENCES = {"pjit8": (["--config.parallel.backend=pjit"], None),
              "pjit1": (["--config.parallel.backend=pjit"], 1),
              "pmap8": (["--config.parallel.backend=pmap"], None)}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """(experiment, name) -> the REFERENCES run, trained once for the module."""
    done = {}

    def run(experiment: str, name: str):
        if (experiment, name) not in done:
            overrides, devices = REFERENCES[name]
            done[experiment, name] = train(experiment, tmp_path_factory.mktemp(name), *STEPS,
                                           *overrides, devices=devices and jax.devices()[:devices])
        return done[experiment, name]

    return run


@pytest.fixture(scope="module", params=["experiments/vit.py", "experiments/resnet.py"],
                ids=["vit", "resnet"])
def runs(request, reference):
    experiment = request.param
    return {"experiment": experiment,
            **{name: reference(experiment, name) for name in REFERENCES}}


def test_pjit_on_8_devices_matches_1_device(runs):
    assert_same_trajectory(runs["pjit8"], runs["pjit1"])


def test_pmap_matches_pjit(runs):
    assert_same_trajectory(runs["pmap8"], runs["pjit8"])


def test_sharded_state_follows_the_replicated_trajectory(runs, tmp_path):
    # FSDP on one model (with accumulation: a reduce-scatter per micro-batch into a
    # sharded accumulator), ZeRO-1 on the other: each path once.
    sharding = {"experiments/vit.py": ["--config.parallel.shard_params=true",
                                       "--config.grad_accum_steps=2"],
                "experiments/resnet.py": ["--config.parallel.shard_optimizer_state=true"]}
    sharded = train(runs["experiment"], tmp_path, *STEPS, *sharding[runs["experiment"]])
    assert_same_trajectory(sharded, runs["pjit8"])


def test_the_loss_actually_moved(runs):
    loss = losses(runs["pjit8"][1])
    assert loss[12] < loss[3]  # so that matching trajectories are not trivially flat


@pytest.mark.parametrize("backend", ["pjit", "pmap"])
def test_gradient_accumulation_matches_one_big_batch(backend, reference, tmp_path):
    vit = "experiments/vit.py"
    four = train(vit, tmp_path, *STEPS, f"--config.parallel.backend={backend}",
                 "--config.grad_accum_steps=4")
    assert_same_trajectory(four, reference(vit, f"{backend}8"))


def test_pmap_matches_pjit_with_dropout(tmp_path):
    """Dropout draws its masks from a key per step and device (the device's position on
    jdp.DATA_AXIS), which under pmap is the only value that carries the `hosts` axis
    bound around the step: both backends draw the same masks. (With the key folded
    alike on every device the pmap run leaves this trajectory.)"""
    vit, dropout = "experiments/vit.py", "--config.model.dropout_rate=0.1"
    pjit = train(vit, tmp_path / "pjit", *STEPS, dropout)
    pmap = train(vit, tmp_path / "pmap", *STEPS, dropout, "--config.parallel.backend=pmap")
    assert_same_trajectory(pmap, pjit)
