"""What a run tells while it trains: TensorBoard scalars equal to metrics.jsonl, train
metrics that are means over the logging window, norms and the learning rate from inside
the step, the share of time spent waiting for input, and profiler traces."""

import glob
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jdp.data import streamed
from jdp.experiment import components, loader, optim
from jdp.parallel import step as step_lib
from jdp.parallel.factory import build_backend
from jdp.parallel.mesh import make_mesh
from jdp.task import weighted_sums
from runs import load_config, losses, train

VIT = "experiments/vit.py"
TINY = ("--config.batch_size=64", "--config.total_steps=10", "--config.warmup_steps=2",
        "--config.eval_every_steps=10", "--config.log_every_steps=5")


@pytest.fixture(scope="module")
def every_step(tmp_path_factory):
    """The same run logged at every step: the reference for windows and profiling."""
    workdir = tmp_path_factory.mktemp("every")
    return (*train(VIT, workdir, *TINY, "--config.log_every_steps=1"), workdir)


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("windowed")
    return (*train(VIT, workdir, *TINY), workdir)


def test_tensorboard_scalars_equal_the_jsonl_values(windowed):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, records, workdir = windowed
    events = EventAccumulator(str(workdir / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    compared = 0
    for record in records:
        for key, value in record.items():
            if key == "step":
                continue
            assert key in tags, key
            by_step = {e.step: e.value for e in events.Scalars(key)}
            np.testing.assert_allclose(by_step[record["step"]], value, rtol=1e-6, err_msg=key)
            compared += 1
    assert compared > 20 and {"train/loss", "eval/accuracy"} <= tags


def test_train_metrics_are_means_of_the_window(every_step, windowed):
    """The sums the step keeps give the mean of the per-step values, for every metric
    the step reports (the loss, the task's metrics, the norms, the loss weight)."""
    per_step = {r["step"]: r for r in every_step[1] if "train/loss" in r}
    window = {r["step"]: r for r in windowed[1] if "train/loss" in r}
    assert sorted(window) == [5, 10]
    keys = ("train/loss", "train/accuracy", "train/grad_norm", "train/param_norm",
            "train/update_norm", "train/loss_weight")
    for end in (5, 10):
        for key in keys:
            np.testing.assert_allclose(
                window[end][key], np.mean([per_step[s][key] for s in range(end - 4, end + 1)]),
                rtol=1e-6, err_msg=f"{key} at step {end}")
    for key in ("train/loss", "train/grad_norm"):  # so the test tells a window from a step
        assert window[5][key] != per_step[5][key], key


def test_learning_rate_is_the_last_step_of_the_window(windowed):
    """Not the window's mean: the value the window's last update used (warmup then
    cosine decay, so every step's value differs)."""
    config = load_config(VIT, *TINY)
    lr = optim.learning_rate_fn(config)
    logged = {r["step"]: r["train/learning_rate"] for r in windowed[1]
              if "train/learning_rate" in r}
    assert sorted(logged) == [5, 10]
    for step, value in logged.items():
        np.testing.assert_allclose(value, float(lr(step - 1)), rtol=1e-6)
        assert value != pytest.approx(np.mean([float(lr(s)) for s in range(step - 5, step)]))


def test_norms_and_learning_rate_come_from_the_step(every_step):
    """Step 1's gradient norm equals a hand computation on the same batch and params."""
    config = load_config(VIT, *TINY)
    exp = loader.load(VIT)
    parts = components.build(exp, config)
    backend = build_backend(config, make_mesh(), parts,
                            exp.build_optimizer(config, optim.learning_rate_fn(config)))
    state = jax.device_get(backend.init_global(jax.random.key(config.seed),
                                               parts.sample_inputs()))
    stream = streamed.example_stream(parts.data.train, parts.data.preprocess_for(train=True),
                                     config.seed)
    batch = parts.data.device_preprocess(next(streamed.train_batches(
        stream, global_batch_size=64, rows=slice(0, 64), start_step=0, num_steps=1,
        num_threads=1)))

    def loss(params):
        outputs, _ = parts.model.apply(params, state.model_state,
                                       parts.task.model_inputs(batch), True,
                                       jax.random.key(0))
        total, weight = weighted_sums(parts.task.objective(outputs, batch))["loss"]
        return total / weight

    grad_norm = float(jax.jit(lambda params: optax.tree.norm(jax.grad(loss)(params)))(
        state.params))
    first, second = every_step[1][:2]
    assert (first["step"], second["step"]) == (1, 2)
    np.testing.assert_allclose(first["train/grad_norm"], grad_norm, rtol=1e-4)
    # The warmup starts at a learning rate of 0: step 1 leaves the params where they were.
    np.testing.assert_allclose(first["train/param_norm"], float(optax.tree.norm(state.params)),
                               rtol=1e-6)
    assert first["train/update_norm"] == 0 and second["train/update_norm"] > 0
    lr = optim.learning_rate_fn(config)
    for record in every_step[1]:
        if "train/learning_rate" in record:
            np.testing.assert_allclose(record["train/learning_rate"],
                                       float(lr(record["step"] - 1)), rtol=1e-6)


def test_packed_norms_equal_leaf_by_leaf_norms_in_one_reduction():
    # On CPU the step packs the small leaves (step_lib.global_norm): one concatenation and one
    # sum for them, where leaf by leaf each has kernels of its own; the value is the same.
    rng = np.random.default_rng(0)
    small = [rng.normal(size=(n,)).astype(np.float32) for n in range(1, 41)]
    large = rng.normal(size=(step_lib.PACKED_NORM_ELEMENTS + 1,)).astype(np.float32)
    tree = {"small": small, "large": large, "bf16": np.ones((3, 5), jnp.bfloat16)}
    packed = jax.jit(lambda t: step_lib.global_norm(t, pack_small=True))
    np.testing.assert_allclose(float(packed(tree)), float(optax.tree.norm(tree)), rtol=1e-6)
    np.testing.assert_allclose(float(step_lib.global_norm(tree)), float(optax.tree.norm(tree)))
    program = packed.lower(tree).compile().as_text()
    entry = program[program.index("ENTRY"):]
    # One concatenation in the whole program (jax 0.10.2 keeps it in the entry, the XLA of
    # jaxlib 0.11.1 and later inside a fusion).
    assert program.count("concatenate(") == 1
    assert entry.count(" fusion(") < 10  # leaf by leaf: at least one per leaf


def test_the_time_breakdown_is_logged(windowed):
    _, records, _ = windowed
    first = next(r for r in records if "train/loss" in r)
    for key in ("train/step_time_s", "train/examples_per_s", "train/examples_per_s_per_device",
                "train/data_wait_fraction", "time/eval_s", "time/checkpoint_s", "time/wall_s",
                "time/compile_s", "memory/host_rss_mib"):
        assert key in first, key
    assert 0 <= first["train/data_wait_fraction"] <= 1
    assert first["train/examples_per_s_per_device"] * 8 == pytest.approx(
        first["train/examples_per_s"])
    # CPU devices report no memory statistics: the compiled step's footprint stands in.
    assert first["memory/compiled_step_mib"] > 0
    later = [r for r in records if "train/loss" in r][1]
    assert "time/compile_s" not in later and later["time/wall_s"] > first["time/wall_s"]
    assert later["time/eval_s"] == 0  # no evaluation inside the second window


SLOW_INPUT_EXPERIMENT = '''
    """digits through a source that takes 5 ms per example: input-bound on purpose."""
    import time

    from jdp.data import Data, default

    import importlib.util
    spec = importlib.util.spec_from_file_location("vit", "{vit}")
    vit = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(vit)
    get_config, build_model = vit.get_config, vit.build_model


    class Slow:
        def __init__(self, source):
            self.source = source

        def __len__(self):
            return len(self.source)

        def __getitem__(self, index):
            time.sleep(0.005)
            return self.source[index]


    def build_data(config):
        data = default.build(config)
        return Data(Slow(data.train), data.eval, data.preprocess, data.eval_preprocess,
                    data.num_classes)
'''


def test_a_slow_input_shows_as_data_wait(tmp_path):
    import os

    experiment_file = tmp_path / "slow.py"
    experiment_file.write_text(textwrap.dedent(SLOW_INPUT_EXPERIMENT).replace(
        "{vit}", os.path.abspath(VIT)))
    _, records = train(str(experiment_file), tmp_path / "run", *TINY,
                       "--config.data.num_threads=1", "--config.total_steps=16",
                       "--config.log_every_steps=4")
    waits = [r["train/data_wait_fraction"] for r in records if "train/loss" in r]
    # The prefetch buffers, filled while the step compiled, hide the first steps;
    # then each step waits for 64 x 5 ms of input (a step computes in ~20-50 ms).
    assert waits[-1] > 0.5 and waits[0] < waits[-1], waits


def test_the_window_clock_splits_a_window_into_steps_input_wait_and_evaluation():
    from jdp.observe.throughput import WindowClock

    now = [100.0]
    clock = WindowClock(global_batch_size=64, device_count=2, clock=lambda: now[0])
    clock.start(10)
    for wait in (0.5, 1.5):  # two waits for input, summed
        with clock.timed("data_wait"):
            now[0] += wait
        now[0] += 3.0  # the step
    with clock.timed("eval"):
        now[0] += 4.0  # left out of the step time
    figures = clock.lap(12)
    assert figures["train/step_time_s"] == 4.0  # (2 + 6) / 2 steps
    assert figures["train/examples_per_s"] == 16.0
    assert figures["train/examples_per_s_per_device"] == 8.0
    assert figures["train/data_wait_fraction"] == 0.25
    assert figures["time/eval_s"] == 4.0 and figures["time/checkpoint_s"] == 0.0
    with clock.timed("checkpoint"):  # the next window starts from nothing spent
        now[0] += 1.0
    now[0] += 2.0
    assert clock.lap(13)["train/step_time_s"] == 2.0


def test_a_profile_window_writes_a_trace_and_changes_no_metric(every_step, tmp_path):
    _, records = train(VIT, tmp_path, *TINY, "--config.log_every_steps=1",
                       "--config.profile.start_step=3", "--config.profile.num_steps=2")
    traces = glob.glob(str(tmp_path / "profile" / "process_0" / "**" / "*.xplane.pb"),
                       recursive=True)
    assert traces, list((tmp_path / "profile").rglob("*"))
    assert losses(records) == losses(every_step[1])
