"""The language-model experiment and the weighted objective: the loss is
sum(loss * weight) / sum(weight) over the whole global batch, whatever the topology,
backend or accumulation, although every device holds a different number of answer
tokens; evaluation reports every task metric with padding masked out."""

import jax
import numpy as np
import pytest

from jdp.experiment import components, loader, optim
from jdp.parallel.factory import build_backend
from jdp.parallel.mesh import make_mesh
from jdp.task import weighted_sums
from runs import RTOL, assert_same_trajectory, load_config, losses, train

LM = "experiments/lm.py"
SMALL = ("--config.model.size=nano", "--config.data.num_eval=200",
         "--config.eval_batch_size=64")
STEPS = (*SMALL, "--config.total_steps=12", "--config.warmup_steps=2",
         "--config.log_every_steps=3", "--config.eval_every_steps=0", "--config.batch_size=64")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """pjit on 8 devices, the trajectory every other topology must follow."""
    return train(LM, tmp_path_factory.mktemp("pjit8"), *STEPS)


@pytest.mark.parametrize("name,overrides,device_count", [
    ("pjit on 1 device", ["--config.parallel.backend=pjit"], 1),
    ("pmap on 8 devices", ["--config.parallel.backend=pmap"], 8),
    ("pjit, 4 micro-batches", ["--config.grad_accum_steps=4"], 8),
    ("pmap, 4 micro-batches", ["--config.parallel.backend=pmap",
                               "--config.grad_accum_steps=4"], 8),
])
def test_weighted_loss_trajectory_is_the_same_on_every_topology(reference, tmp_path, name,
                                                                 overrides, device_count):
    run = train(LM, tmp_path, *STEPS, *overrides, devices=jax.devices()[:device_count])
    assert_same_trajectory(run, reference)
    # Evaluation too: eval/<metric> of the final state, padding masked out.
    np.testing.assert_allclose(run[0].eval_metrics["eval/loss"],
                               reference[0].eval_metrics["eval/loss"], rtol=RTOL)


def test_the_loss_is_the_global_weighted_mean_not_a_mean_of_device_means():
    """One step on 8 devices reports the loss of the whole batch, weighted by tokens.

    The batch is real addition problems: answers of 1 to 4 digits, so the 8 devices
    hold different numbers of weighted tokens and the mean of per-device means is
    measurably different; the test checks that it is, so it can fail.
    """
    config = load_config(LM, *SMALL)
    exp = loader.load(LM)
    parts = components.build(exp, config)
    backend = build_backend(config, make_mesh(), parts,
                            exp.build_optimizer(config, optim.learning_rate_fn(config)))
    state = backend.init_global(jax.random.key(0), parts.sample_inputs())
    examples = [parts.data.train[i] for i in range(64)]
    host_batch = {key: np.stack([e[key] for e in examples]) for key in examples[0]}
    params, model_state = jax.device_get((state.params, state.model_state))

    @jax.jit  # one compile per batch shape; op by op, the 9 forward passes took ~6 s
    def sums(batch):
        outputs, _ = parts.model.apply(params, model_state, parts.task.model_inputs(batch),
                                       False, jax.random.key(0))
        return weighted_sums(parts.task.objective(outputs, batch))["loss"]

    def loss_and_weight(rows):
        return [float(x) for x in sums({key: value[rows] for key, value in host_batch.items()})]

    total, weight = loss_and_weight(slice(None))
    per_device = [loss_and_weight(slice(8 * d, 8 * d + 8)) for d in range(8)]
    assert len({w for _, w in per_device}) > 1, "devices must hold different token counts"
    global_mean = total / weight
    mean_of_means = np.mean([t / w for t, w in per_device])
    assert abs(mean_of_means - global_mean) > 100 * RTOL * global_mean

    _, metrics = backend.compiled_train_step(state, backend.put_batch(host_batch))(
        state, backend.put_batch(host_batch))
    np.testing.assert_allclose(float(metrics["loss"]), global_mean, rtol=RTOL)


def test_a_short_run_learns_and_reports_the_task_metrics(tmp_path):
    result, records = train(LM, tmp_path, *SMALL, "--config.batch_size=64",
                            "--config.total_steps=60", "--config.warmup_steps=6",
                            "--config.log_every_steps=20", "--config.eval_every_steps=30")
    loss = losses(records)
    assert loss[60] < 0.9 * loss[20]
    train_keys = {"train/loss", "train/token_accuracy", "train/exact_match"}
    assert all(train_keys <= set(r) for r in records if "train/loss" in r)
    evals = [r for r in records if "eval/loss" in r]
    assert [r["step"] for r in evals] == [30, 60]
    assert {"eval/token_accuracy", "eval/exact_match"} <= set(evals[-1])
    assert evals[-1]["eval/num_examples"] == 200  # 4 batches of 64, the last one padded
    assert evals[-1]["eval/token_accuracy"] > evals[0]["eval/token_accuracy"]
    assert 0.0 <= evals[-1]["eval/exact_match"] <= evals[-1]["eval/token_accuracy"]


def test_evaluation_ignores_padding(reference, tmp_path):
    """200 eval problems in batches of 64 (56 padded rows) or of 200 (none): same figures."""
    unpadded = train(LM, tmp_path, *STEPS, "--config.eval_batch_size=200")
    for key, value in reference[0].eval_metrics.items():
        np.testing.assert_allclose(unpadded[0].eval_metrics[key], value, rtol=RTOL, err_msg=key)


def test_bfloat16_remat_and_accumulation_train_together(tmp_path):
    _, records = train(LM, tmp_path, *STEPS, "--config.compute_dtype=bfloat16",
                       "--config.remat=full", "--config.grad_accum_steps=2")
    loss = losses(records)
    assert all(np.isfinite(list(loss.values()))) and loss[12] < loss[3]
