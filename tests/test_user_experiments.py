"""A user's own experiment, outside the repository, with its own data, objective and
model, trains through `python -m jdp.main`; any prepared TFDS dataset trains by name
and feature keys; the user's .npz and ArrayRecord files train from config keys; and
every mistake in the hooks fails before training with one line naming the hook."""

import json
import textwrap

import numpy as np
import pytest

from jdp.data import files
from runs import losses, read_metrics, run_main, train

VIT = "experiments/vit.py"
TINY = ("--config.batch_size=32", "--config.total_steps=20", "--config.warmup_steps=2",
        "--config.log_every_steps=5", "--config.eval_every_steps=10",
        "--config.eval_batch_size=32")

REGRESSION_EXPERIMENT = '''
    """Regression of y = x . w_true from .npz files, with an NNX model and an MSE objective."""
    import jax.numpy as jnp
    import ml_collections
    from flax import nnx

    from jdp import task
    from jdp.config import defaults
    from jdp.data import Data
    from jdp.data.files import open_files


    def get_config(arg=None):
        config = defaults()
        config.data.train_files = ""
        config.data.eval_files = ""
        config.model = ml_collections.ConfigDict({"hidden": 32})
        config.learning_rate = 5e-2
        return config


    def build_data(config):
        return Data(train=open_files(config.data.train_files, field="config.data.train_files"),
                    eval=open_files(config.data.eval_files, field="config.data.eval_files"))


    def mse(predictions, batch):
        error = predictions[:, 0] - batch["y"]
        weights = jnp.ones_like(error)
        return task.Objective(task.Weighted(error ** 2, weights),
                              {"mae": task.Weighted(jnp.abs(error), weights)})


    def build_task(config):
        return task.Task(mse, inputs=("x",))


    class MLP(nnx.Module):
        def __init__(self, hidden, rngs):
            self.hidden = nnx.Linear(4, hidden, rngs=rngs)
            self.out = nnx.Linear(hidden, 1, rngs=rngs)

        def __call__(self, x):
            return self.out(nnx.relu(self.hidden(x)))


    def build_model(config, *, rngs):
        return MLP(config.model.hidden, rngs)
'''


def _write_regression_data(directory, rng):
    w_true = np.array([1.0, -2.0, 0.5, 3.0], np.float32)
    for split, count in (("train", 512), ("eval", 96)):
        x = rng.normal(size=(count, 4)).astype(np.float32)
        np.savez(directory / f"{split}.npz", x=x, y=(x @ w_true).astype(np.float32))


def test_a_users_experiment_with_its_own_data_objective_and_nnx_model_trains(tmp_path):
    user_dir = tmp_path / "elsewhere"
    user_dir.mkdir()
    (user_dir / "regression.py").write_text(textwrap.dedent(REGRESSION_EXPERIMENT))
    _write_regression_data(user_dir, np.random.default_rng(0))
    workdir = tmp_path / "run"
    proc = run_main(f"--config={user_dir}/regression.py", f"--workdir={workdir}", *TINY,
                    f"--config.data.train_files={user_dir}/train.npz",
                    f"--config.data.eval_files={user_dir}/eval.npz")
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_metrics(workdir)
    loss = losses(records)
    assert loss[20] < 0.5 * loss[5]
    evals = [r for r in records if "eval/loss" in r]
    assert {"eval/mae", "train/mae"} <= set(evals[-1]) | set(records[-2])
    assert evals[-1]["eval/num_examples"] == 96
    assert evals[-1]["eval/loss"] < evals[0]["eval/loss"]


def _images_and_labels(count, rng):
    """8x8 grey images whose label (0..2) is which third of the image is bright."""
    labels = rng.integers(0, 3, count)
    images = rng.integers(0, 60, (count, 8, 8, 1)).astype(np.uint8)
    for image, label in zip(images, labels, strict=True):
        image[:, 3 * label:3 * label + 2] += 180
    return images, labels


@pytest.fixture(scope="module")
def tiny_shapes_dir(tmp_path_factory):
    """A TFDS dataset that exists only in this test, prepared as array_record."""
    import tensorflow_datasets as tfds

    class JdpTestShapes(tfds.core.GeneratorBasedBuilder):
        VERSION = tfds.core.Version("1.0.0")

        def _info(self):
            return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict({
                "img": tfds.features.Tensor(shape=(8, 8, 1), dtype=np.uint8),
                "target": tfds.features.ClassLabel(num_classes=3),
            }))

        def _split_generators(self, dl_manager):
            return {"train": self._generate_examples()}

        def _generate_examples(self):
            images, labels = _images_and_labels(250, np.random.default_rng(0))
            for i, (image, label) in enumerate(zip(images, labels, strict=True)):
                yield i, {"img": image, "target": int(label)}

    data_dir = str(tmp_path_factory.mktemp("tfds"))
    JdpTestShapes(data_dir=data_dir, file_format="array_record").download_and_prepare()
    return data_dir


def test_any_prepared_tfds_dataset_trains_by_name_keys_and_sliced_splits(tiny_shapes_dir,
                                                                         tmp_path):
    result, records = train(
        VIT, tmp_path, *TINY, "--config.data.name=jdp_test_shapes",
        f"--config.data.data_dir={tiny_shapes_dir}", "--config.data.image_key=img",
        "--config.data.label_key=target", "--config.data.train_split=train[:80%]",
        "--config.data.eval_split=train[80%:]")
    assert result.eval_metrics["eval/num_examples"] == 50  # 20% of 250
    head = result.state.params["head"]["kernel"]
    assert head.shape[-1] == 3  # num_classes read from the ClassLabel feature
    assert result.eval_metrics["eval/accuracy"] > 0.6  # 3 classes, easy to tell apart
    assert len(losses(records)) == 4


def test_a_feature_key_missing_from_the_tfds_dataset_names_the_field(tiny_shapes_dir,
                                                                     tmp_path):
    from jdp.errors import ConfigError

    with pytest.raises(ConfigError, match=r"config\.data\.label_key='label'.*'target'"):
        train(VIT, tmp_path, *TINY, "--config.data.name=jdp_test_shapes",
              f"--config.data.data_dir={tiny_shapes_dir}", "--config.data.image_key=img")
    assert not (tmp_path / "config.json").exists()


@pytest.mark.parametrize("file_format", ["npz", "array_record"])
def test_the_users_image_files_train_from_config_keys(tmp_path, file_format):
    rng = np.random.default_rng(1)
    paths = {}
    for split, count in (("train", 192), ("eval", 64)):
        images, labels = _images_and_labels(count, rng)
        if file_format == "npz":
            paths[split] = tmp_path / f"{split}.npz"
            np.savez(paths[split], pixels=images, y=labels.astype(np.int32))
        else:
            paths[split] = tmp_path / f"{split}-00000.array_record"
            files.write_array_records(str(paths[split]), (
                {"pixels": image, "y": np.int32(label)}
                for image, label in zip(images, labels, strict=True)))
    result, records = train(
        VIT, tmp_path / "run", *TINY, f"--config.data.train_files={tmp_path}/train*",
        f"--config.data.eval_files={paths['eval']}", "--config.data.image_key=pixels",
        "--config.data.label_key=y", "--config.data.num_classes=3")
    assert result.eval_metrics["eval/num_examples"] == 64
    assert result.eval_metrics["eval/accuracy"] > 0.6  # 3 classes, easy to tell apart
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["data"]["image_key"] == "pixels"


BAD_EXPERIMENT = '''
    """Each get_config arg selects one mistake a user can make in the hooks."""
    import flax.linen as nn
    import jax.numpy as jnp
    import ml_collections
    import numpy as np

    from jdp import task
    from jdp.config import defaults
    from jdp.data import Data

    def get_config(arg=None):
        config = defaults()
        config.mistake = arg
        return config

    class Stream:  # iterable, but no random access by index
        def __getitem__(self, index):
            return {"image": np.zeros((4,), np.float32), "label": np.int32(0)}

    class Source:
        def __init__(self, ragged=False):
            self.ragged = ragged
        def __len__(self):
            return 16
        def __getitem__(self, index):
            size = 4 + (index % 2 if self.ragged else 0)
            return {"image": np.full((size,), index, np.float32), "label": np.int32(index % 2)}

    def build_data(config):
        if config.mistake == "no_len":
            return Data(train=Stream(), eval=Source(), num_classes=2)
        if config.mistake == "missing_key":
            return Data(train=Source(), eval=Source(), num_classes=2,
                        preprocess=lambda example, rng: {"image": example["image"]})
        return Data(train=Source(ragged=config.mistake == "ragged"), eval=Source(),
                    num_classes=2)

    def mean_loss(logits, batch):
        loss = jnp.mean((logits[:, 0] - batch["label"]) ** 2)
        return task.Objective(task.Weighted(loss, jnp.ones(())), {})

    def unweighted_loss(logits, batch):
        return task.Objective(logits[:, 0], {})

    def build_task(config):
        objective = {"mean_loss": mean_loss, "no_weights": unweighted_loss}.get(config.mistake)
        if objective is None:
            return task.classification()
        return task.Task(objective, inputs=("image",))

    def build_model(config, *, num_classes):
        return Model(num_classes)

    class Model(nn.Module):
        num_classes: int

        @nn.compact
        def __call__(self, x, train):
            return nn.Dense(self.num_classes)(x)
'''

HOOK_MISTAKES = {
    "no_len": ["build_data() in", "train source (Stream) has no __len__", "Fix:"],
    "missing_key": ["build_task", "batch['label']", "preprocessing", "['image']", "Fix:"],
    "mean_loss": ["build_task() in", "loss has shape ()", "one value per example", "Fix:"],
    "no_weights": ["build_task() in", "not jdp.task.Weighted", "Fix:"],
    "ragged": ["build_data() in", "train example 1", "(5,)", "(4,)", "same keys, shapes",
               "Fix:"],
}


@pytest.mark.parametrize("mistake", sorted(HOOK_MISTAKES))
def test_a_mistake_in_the_hooks_fails_before_training_naming_the_hook(tmp_path, mistake):
    experiment = tmp_path / "bad.py"
    experiment.write_text(textwrap.dedent(BAD_EXPERIMENT))
    workdir = tmp_path / "run"
    proc = run_main(f"--config={experiment}:{mistake}", f"--workdir={workdir}")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    last_line = proc.stderr.strip().splitlines()[-1]
    assert last_line.startswith("jdp: error:")
    for fragment in HOOK_MISTAKES[mistake]:
        assert fragment in last_line, (fragment, last_line)
    assert not workdir.exists()
