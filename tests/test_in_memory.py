"""Splits batched from memory give bitwise grain's batches: for any step (across epoch
boundaries, started mid-stream), any process's rows, with augmentation drawing from each
example's own generator, and for evaluation with its padding and mask. Where a split
cannot be batched from memory, 'auto' streams it through grain and 'true' names why."""

import logging

import numpy as np
import pytest

from jdp.data import default, images, in_memory, splits, streamed
from jdp.data.core import Data
from jdp.errors import ConfigError
from runs import load_config

NUM_EXAMPLES = 40
BATCH = 16  # 2.5 batches per epoch: batches straddle epoch boundaries
# Padded random crops and flips: the batches depend on the per-example generators too.
SPEC = images.ImageSpec(8, 3, (0.5,) * 3, (0.25,) * 3, crop_padding=2, flip=True)


def source(n=NUM_EXAMPLES):
    rng = np.random.default_rng(0)
    return [{"image": rng.integers(0, 256, (8, 8, 3), np.uint8), "label": i} for i in range(n)]


def image_data(augment=True, **fields) -> Data:
    spec = dict(train=source(), eval=source(20),
                preprocess=images.make_preprocess(SPEC, train=True, augment=augment),
                eval_preprocess=images.make_preprocess(SPEC, train=False, augment=False),
                batch_preprocess=images.make_batch_preprocess(SPEC, train=True, augment=augment),
                eval_batch_preprocess=images.make_batch_preprocess(SPEC, train=False,
                                                                   augment=False))
    return Data(**{**spec, **fields})


def assert_bitwise_equal(batches, reference):
    assert len(batches) == len(reference) > 0
    for batch, ref in zip(batches, reference, strict=True):
        assert list(batch) == list(ref)
        for key in ref:
            assert (batch[key].dtype, batch[key].shape) == (ref[key].dtype, ref[key].shape)
            assert batch[key].tobytes() == ref[key].tobytes(), key


def train_batches(split, rows=slice(0, BATCH), start_step=3, num_steps=6):
    return list(split.batches(global_batch_size=BATCH, rows=rows, start_step=start_step,
                              num_steps=num_steps))


@pytest.mark.parametrize("augment", [True, False], ids=["augment", "plain"])
@pytest.mark.parametrize("rows", [slice(0, BATCH), slice(4, 12)], ids=["all_rows", "some_rows"])
def test_train_batches_from_memory_are_grains_from_a_middle_step_over_epochs(augment, rows):
    data = image_data(augment=augment)
    from_memory = splits.open_train(data, seed=7, setting="auto")
    through_grain = splits.open_train(data, seed=7, setting="false")
    assert isinstance(from_memory, in_memory.InMemoryTrain)
    assert isinstance(through_grain, streamed.StreamedTrain)
    # Steps 3-8 hold global examples 48-143: epochs 1 to 3.
    assert_bitwise_equal(train_batches(from_memory, rows), train_batches(through_grain, rows))


def test_a_later_start_continues_the_same_stream_from_memory():
    split = splits.open_train(image_data(), seed=7, setting="true")
    assert_bitwise_equal(train_batches(split, start_step=5, num_steps=4),
                         train_batches(split, start_step=0, num_steps=9)[5:])


@pytest.mark.parametrize("rows", [slice(0, 8), slice(4, 8)], ids=["all_rows", "some_rows"])
def test_eval_batches_from_memory_are_grains_padding_and_mask_included(rows):
    data = image_data()
    from_memory = splits.open_eval(data, setting="auto")
    through_grain = splits.open_eval(data, setting="false")
    assert isinstance(from_memory, in_memory.InMemoryEval)
    batches = list(from_memory.batches(global_batch_size=8, rows=rows))
    assert [b["mask"].tolist() for b in batches][-1] == [1] * (4 - rows.start) + [0] * 4
    assert_bitwise_equal(batches, list(through_grain.batches(global_batch_size=8, rows=rows)))


def test_the_default_digits_data_is_batched_from_memory_as_grain_batches_it():
    config = load_config("experiments/vit.py")
    data = default.build(config)
    from_memory = splits.open_train(data, seed=0, setting=config.data.in_memory)
    assert isinstance(from_memory, in_memory.InMemoryTrain)
    through_grain = splits.open_train(data, seed=0, setting="false")
    # Steps 10-12 of 128 cross the first epoch's end (1,437 examples).
    assert_bitwise_equal(
        list(from_memory.batches(global_batch_size=128, rows=slice(0, 128), start_step=10,
                                 num_steps=3)),
        list(through_grain.batches(global_batch_size=128, rows=slice(0, 128), start_step=10,
                              num_steps=3)))
    assert isinstance(splits.open_eval(data, setting="auto"), in_memory.InMemoryEval)


def test_features_that_are_not_numeric_are_left_out_of_memory():
    with_ids = [{**example, "id": f"example-{i}".encode()} for i, example in enumerate(source())]
    arrays = in_memory.read(with_ids)
    assert sorted(arrays) == ["image", "label"]
    assert arrays["image"].shape == (NUM_EXAMPLES, 8, 8, 3)
    split = splits.open_train(image_data(train=with_ids), seed=7, setting="true")
    assert_bitwise_equal(train_batches(split),
                         train_batches(splits.open_train(image_data(), seed=7, setting="true")))


def split_types(data):
    return (type(splits.open_train(data, seed=0, setting="auto")).__name__,
            type(splits.open_eval(data, setting="auto")).__name__)


def test_auto_streams_a_split_without_a_batch_form_and_true_names_the_field():
    data = image_data(batch_preprocess=None, eval_batch_preprocess=None)
    assert split_types(data) == ("StreamedTrain", "StreamedEval")
    with pytest.raises(ConfigError, match=r"config\.data\.in_memory='true': the train split "
                       r"cannot be batched from memory: its Data has no batch form .*"
                       r"Fix: pass --config\.data\.in_memory=auto"):
        splits.open_train(data, seed=0, setting="true")


def test_a_batch_form_stands_for_evaluation_only_where_preprocess_does():
    data = image_data(eval_batch_preprocess=None)  # eval_preprocess is set: no batch form
    assert data.batch_preprocess_for(train=False) is None
    no_eval_preprocess = image_data(eval_preprocess=None, eval_batch_preprocess=None)
    assert no_eval_preprocess.batch_preprocess_for(train=False) is (
        no_eval_preprocess.batch_preprocess)


def test_auto_streams_a_split_above_the_budget_and_true_reads_it(monkeypatch, caplog):
    # Images and labels: 8,000 bytes of training examples, 4,000 of evaluation ones.
    monkeypatch.setattr(in_memory, "BUDGET_BYTES", 5000)
    with caplog.at_level(logging.INFO):
        assert split_types(image_data()) == ("StreamedTrain", "InMemoryEval")
    assert "the train split streams through grain, example by example: its 40 examples take " \
           "0.0 MiB, above the 0.0 MiB that 'auto' reads into memory" in caplog.text
    assert isinstance(splits.open_train(image_data(), seed=0, setting="true"),
                      in_memory.InMemoryTrain)


def test_a_feature_of_varying_shape_is_streamed_and_named():
    varying = source()
    varying[17] = {**varying[17], "image": np.zeros((6, 8, 3), np.uint8)}
    assert split_types(image_data(train=varying))[0] == "StreamedTrain"
    with pytest.raises(ConfigError, match=r"feature 'image' is uint8\[6, 8, 3\] in example 17 "
                       r"but uint8\[8, 8, 3\] in example 0"):
        splits.open_train(image_data(train=varying), seed=0, setting="true")


def test_a_batch_preprocess_that_is_not_preprocess_for_a_batch_is_named():
    exact = images.make_batch_preprocess(SPEC, train=True, augment=True)

    def int64_labels(batch, rngs):
        return {**exact(batch, rngs), "label": batch["label"]}

    with pytest.raises(ConfigError, match=r"config\.data\.in_memory='auto': the train split: "
                       r"its batch_preprocess is not its preprocess for a batch: on examples "
                       r"0-3, feature 'label' is int64\[4\], preprocess gives int32\[4\]\. "
                       r"Fix: .*--config\.data\.in_memory=false"):
        splits.open_train(image_data(batch_preprocess=int64_labels), seed=0, setting="auto")


def test_a_grain_that_orders_examples_otherwise_is_streamed_not_reproduced(monkeypatch):
    monkeypatch.setattr(in_memory, "_grain_seed", lambda seed, depth: seed + depth)
    assert split_types(image_data())[0] == "StreamedTrain"
    with pytest.raises(ConfigError, match=r"grain \S+ orders or seeds the example stream "
                       r"otherwise than jdp reproduces it \(global example 0"):
        splits.open_train(image_data(), seed=0, setting="true")
