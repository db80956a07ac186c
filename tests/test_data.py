"""The sampler: global batch s is a pure function of (seed, s), split by rows over processes;
evaluation covers every example exactly once."""

import numpy as np
import pytest

from jdp.data import images, pipeline, tfds_source
from jdp.errors import ConfigError

NUM_EXAMPLES = 50


def fake_source(n=NUM_EXAMPLES):
    return [{"image": np.full((2, 2, 1), i, np.uint8), "label": i} for i in range(n)]


def identity(example, rng):
    out = {"image": example["image"].astype(np.float32), "label": np.int32(example["label"])}
    if rng is not None:  # augmentation stand-in: a draw from the per-example generator
        out["noise"] = np.float32(rng.random())
    return out


def batches(seed, rows, global_batch_size=8, start_step=0, num_steps=12):
    stream = pipeline.example_stream(fake_source(), identity, seed)
    return list(pipeline.train_batches(stream, global_batch_size=global_batch_size, rows=rows,
                                       start_step=start_step, num_steps=num_steps,
                                       num_threads=2))


def test_same_seed_gives_the_same_batches():
    first, second = batches(0, slice(0, 8)), batches(0, slice(0, 8))
    for a, b in zip(first, second, strict=True):
        np.testing.assert_array_equal(a["label"], b["label"])
        np.testing.assert_array_equal(a["noise"], b["noise"])


def test_another_seed_gives_another_order():
    first, second = batches(0, slice(0, 8)), batches(1, slice(0, 8))
    assert any((a["label"] != b["label"]).any() for a, b in zip(first, second, strict=True))


def test_each_epoch_is_a_permutation_and_epochs_differ():
    labels = np.concatenate([b["label"] for b in batches(0, slice(0, 10), 10, num_steps=10)])
    first, second = labels[:NUM_EXAMPLES], labels[NUM_EXAMPLES:]
    assert sorted(first) == list(range(NUM_EXAMPLES)) == sorted(second)
    assert (first != second).any()


@pytest.mark.parametrize("process_count", [2, 4])
def test_rows_of_all_processes_make_up_exactly_the_global_batch(process_count):
    whole = batches(3, slice(0, 8))
    rows_per_process = 8 // process_count
    parts = [batches(3, slice(p * rows_per_process, (p + 1) * rows_per_process))
             for p in range(process_count)]
    for step, batch in enumerate(whole):
        for key in ("label", "noise"):  # the augmentation draw follows the example too
            joined = np.concatenate([part[step][key] for part in parts])
            np.testing.assert_array_equal(joined, batch[key])


def test_starting_at_a_step_continues_the_same_stream():
    full = batches(5, slice(0, 8), num_steps=12)
    resumed = batches(5, slice(0, 8), start_step=7, num_steps=5)
    for a, b in zip(full[7:], resumed, strict=True):
        np.testing.assert_array_equal(a["label"], b["label"])
        np.testing.assert_array_equal(a["noise"], b["noise"])


@pytest.mark.parametrize("process_count", [1, 2])
def test_evaluation_sees_every_example_exactly_once(process_count):
    global_batch_size = 16  # 50 examples: 4 batches, the last padded with 14 masked rows
    rows_per_process = global_batch_size // process_count
    seen = []
    num_batches = []
    for p in range(process_count):
        rows = slice(p * rows_per_process, (p + 1) * rows_per_process)
        local = list(pipeline.eval_batches(fake_source(), identity,
                                           global_batch_size=global_batch_size, rows=rows))
        num_batches.append(len(local))
        for batch in local:
            assert batch["label"].shape == (rows_per_process,)
            seen.extend(batch["label"][batch["mask"] == 1].tolist())
    assert len(set(num_batches)) == 1, "every process must run the same number of eval steps"
    assert sorted(seen) == list(range(NUM_EXAMPLES))


def test_digits_is_a_real_tfds_dataset(tmp_path):
    found = tfds_source.builder("digits", str(tmp_path))
    train = tfds_source.open_split(found, "train", "data.train_split")
    test = tfds_source.open_split(found, "test", "data.eval_split")
    assert (len(train), len(test)) == (1437, 360)
    example = train[0]
    assert example["image"].shape == (8, 8, 1) and example["image"].dtype == np.uint8
    assert 0 <= int(example["label"]) < 10


def test_a_missing_tfds_dataset_names_it_and_the_data_dir(tmp_path):
    with pytest.raises(ConfigError, match=rf"'cifar10'.*{tmp_path}.*tfds build cifar10"):
        tfds_source.builder("cifar10", str(tmp_path))


def test_preprocessing_normalises_and_augments_within_the_image():
    spec = images.PRESETS["digits"].image
    example = {"image": np.full((8, 8, 1), 255, np.uint8), "label": 3}
    plain = images.make_preprocess(spec, train=False, augment=False)(example, None)
    assert plain["image"].dtype == np.float32 and plain["image"].shape == (8, 8, 1)
    np.testing.assert_allclose(plain["image"], 1.0)  # (1 - 0.5) / 0.5
    augmented = images.make_preprocess(spec, train=True, augment=True)(
        example, np.random.default_rng(0))
    assert augmented["image"].shape == (8, 8, 1)


def test_imagenet_preprocessing_resizes_and_crops_any_image_to_the_model_size():
    spec = images.PRESETS["imagenet2012"].image
    image = np.random.default_rng(0).integers(0, 256, (300, 451, 3), dtype=np.uint8)
    for train, augment in [(False, False), (True, True)]:
        out = images.make_preprocess(spec, train=train, augment=augment)(
            {"image": image, "label": 7}, np.random.default_rng(1))
        assert out["image"].shape == (224, 224, 3) and out["image"].dtype == np.float32
        assert out["label"] == 7


def test_encoded_images_are_decoded():
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(np.full((32, 32, 3), 200, np.uint8)).save(buffer, format="PNG")
    spec = images.PRESETS["cifar10"].image
    out = images.make_preprocess(spec, train=False, augment=False)(
        {"image": buffer.getvalue(), "label": 1}, None)
    assert out["image"].shape == (32, 32, 3)
    np.testing.assert_allclose(out["image"][0, 0], (200 / 255 - np.array(spec.mean)) /
                               np.array(spec.std), rtol=1e-5)
