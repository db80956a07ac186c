"""The real trainer end to end on digits, with tiny settings."""

import multiprocessing
import textwrap

import jax
import numpy as np
import pytest

from runs import losses, train

VIT = "experiments/vit.py"
TINY = ("--config.batch_size=64", "--config.total_steps=30", "--config.warmup_steps=3",
        "--config.log_every_steps=5", "--config.eval_every_steps=15")


@pytest.fixture(scope="module")
def vit_run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("vit")
    return (*train(VIT, workdir, *TINY), workdir)


def test_a_short_run_lowers_the_loss(vit_run):
    _, records, _ = vit_run
    loss = losses(records)
    assert sorted(loss) == [5, 10, 15, 20, 25, 30]
    assert loss[30] < 0.8 * loss[5]


def test_metrics_have_the_documented_keys(vit_run):
    result, records, workdir = vit_run
    train_keys = {"train/loss", "train/learning_rate", "train/examples_per_s",
                  "train/step_time_s", "train/tflops_per_s_per_device"}
    assert all(train_keys <= set(r) for r in records if "train/loss" in r)
    evals = [r for r in records if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [15, 30]
    assert evals[-1]["eval/num_examples"] == 360
    assert result.eval_metrics["eval/accuracy"] == evals[-1]["eval/accuracy"]
    assert (workdir / "config.json").exists()


def test_the_same_command_twice_gives_identical_losses(vit_run, tmp_path):
    _, records, _ = vit_run
    _, again = train(VIT, tmp_path, *TINY)
    assert losses(again) == losses(records)


def test_streaming_through_grain_gives_the_run_of_batches_from_memory_bitwise(vit_run,
                                                                              tmp_path):
    """digits is batched from memory by default; grain's example-by-example path must
    give the very same batches, so the very same losses and evaluations."""
    result, records, _ = vit_run
    streamed, again = train(VIT, tmp_path, *TINY, "--config.data.in_memory=false")
    assert losses(again) == losses(records)
    assert streamed.eval_metrics == result.eval_metrics


def test_worker_processes_give_the_same_run_and_none_is_left_behind(vit_run, tmp_path):
    result, records, _ = vit_run
    workers_before = multiprocessing.active_children()
    # Workers serve only splits streamed through grain.
    with_workers, again = train(VIT, tmp_path, *TINY, "--config.data.in_memory=false",
                                "--config.data.num_workers=2")
    assert losses(again) == losses(records)
    assert with_workers.eval_metrics == result.eval_metrics
    assert multiprocessing.active_children() == workers_before


def test_the_final_state_is_global_and_counts_the_steps(vit_run):
    result, _, _ = vit_run
    assert int(jax.device_get(result.state.step)) == 30
    leaf = jax.tree.leaves(result.state.params)[0]
    assert len(leaf.sharding.device_set) == jax.device_count()


NNX_EXPERIMENT = '''
    """A user's own experiment: an NNX model and a custom Optax chain."""
    import ml_collections
    import optax
    from flax import nnx

    from jdp import DATA_AXIS
    from jdp.config import defaults


    def get_config(arg=None):
        config = defaults()
        config.batch_size = 64
        config.total_steps = 40
        config.warmup_steps = 4
        config.log_every_steps = 10
        config.learning_rate = 0.05
        config.model = ml_collections.ConfigDict({"hidden": 64, "dropout": 0.1})
        return config


    class MLP(nnx.Module):
        def __init__(self, hidden, num_classes, dropout, rngs):
            self.hidden = nnx.Linear(64, hidden, rngs=rngs)
            self.norm = nnx.BatchNorm(hidden, axis_name=DATA_AXIS, rngs=rngs)
            self.dropout = nnx.Dropout(dropout, rngs=rngs)
            self.out = nnx.Linear(hidden, num_classes, rngs=rngs)

        def __call__(self, images):
            x = images.reshape(images.shape[0], -1)
            x = self.dropout(nnx.relu(self.norm(self.hidden(x))))
            return self.out(x)


    def build_model(config, *, num_classes, rngs):
        return MLP(config.model.hidden, num_classes, config.model.dropout, rngs)


    def build_optimizer(config, learning_rate_fn):
        return optax.chain(optax.clip_by_global_norm(1.0),
                           optax.sgd(learning_rate_fn, momentum=0.9))
'''


def test_a_users_nnx_experiment_with_a_custom_optax_chain_trains(tmp_path):
    path = tmp_path / "my_experiment.py"
    path.write_text(textwrap.dedent(NNX_EXPERIMENT))
    result, records = train(str(path), tmp_path / "run")
    loss = losses(records)
    assert loss[40] < 0.5 * loss[10]
    assert result.eval_metrics["eval/accuracy"] > 0.8
    # BatchNorm statistics moved away from their initial values (0 and 1).
    norm = result.state.model_state["norm"]
    assert not np.allclose(np.asarray(norm["mean"]), 0.0)
    assert not np.allclose(np.asarray(norm["var"]), 1.0)


def test_mfu_is_reported_against_the_device_peak_only_where_it_is_known():
    from jdp.observe import throughput

    assert throughput.peak_flops_per_s("cpu") is None
    assert throughput.peak_flops_per_s("NVIDIA H100 80GB HBM3") == 989e12
    # MFU counts the model's FLOPs (no remat recomputation), not XLA's hardware count.
    on_gpu = throughput.flops_metrics(600e12, 494.5e12, 1.0,
                                     throughput.peak_flops_per_s("NVIDIA H100"))
    assert on_gpu == {"train/tflops_per_s_per_device": 600.0,
                      "train/model_tflops_per_s_per_device": 494.5, "train/mfu": 0.5}
    assert "train/mfu" not in throughput.flops_metrics(1e9, 1e9, 1.0, None)  # peak unknown
    assert "train/mfu" not in throughput.flops_metrics(1e9, None, 1.0, 989e12)  # model unknown
