"""The sampler: global batch s is a pure function of (seed, s), split by rows over processes;
evaluation covers every example exactly once."""

import jax
import numpy as np
import pytest

from jdp.data import images, streamed, tfds_source
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
    stream = streamed.example_stream(fake_source(), identity, seed)
    return list(streamed.train_batches(stream, global_batch_size=global_batch_size, rows=rows,
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
        local = list(streamed.eval_batches(fake_source(), identity,
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


def test_preprocessing_ships_uint8_and_the_device_normalises():
    spec = images.PRESETS["digits"].image
    example = {"image": np.full((8, 8, 1), 255, np.uint8), "label": 3}
    plain = images.make_preprocess(spec, train=False, augment=False)(example, None)
    assert plain["image"].dtype == np.uint8 and plain["image"].shape == (8, 8, 1)
    normalised = jax.jit(images.make_normalise(spec))({k: v[None] for k, v in plain.items()})
    assert normalised["image"].dtype == np.float32
    np.testing.assert_allclose(normalised["image"], 1.0, rtol=1e-6)  # (1 - 0.5) / 0.5
    assert normalised["label"] == 3  # other features pass through
    augmented = images.make_preprocess(spec, train=True, augment=True)(
        example, np.random.default_rng(0))
    assert augmented["image"].shape == (8, 8, 1) and augmented["image"].dtype == np.uint8


@pytest.mark.parametrize("augment", [True, False], ids=["augment", "plain"])
@pytest.mark.parametrize("spec,shape,dtype", [
    (images.ImageSpec(8, 3, (0.5,) * 3, (0.5,) * 3, crop_padding=2, flip=True), (8, 8, 3),
     np.uint8),
    (images.ImageSpec(6, 1, (0.5,), (0.5,), crop_padding=1), (8, 8), np.uint8),  # grey, cropped
    (images.ImageSpec(8, 1, (0.5,), (0.5,), flip=True), (8, 8, 1), np.float64),  # -> float32
], ids=["rgb", "grey", "float"])
def test_the_batch_form_of_the_image_preprocessing_is_bitwise_the_per_example_one(
        spec, shape, dtype, augment):
    pixels = np.random.default_rng(0).integers(0, 256, (6, *shape)).astype(dtype)
    examples = [{"image": image, "label": i} for i, image in enumerate(pixels)]
    per_example = images.make_preprocess(spec, train=True, augment=augment)
    expected = streamed.stack_examples(
        [per_example(e, np.random.default_rng(i)) for i, e in enumerate(examples)])
    batch_form = images.make_batch_preprocess(spec, train=True, augment=augment)
    got = batch_form({"image": pixels, "label": np.arange(6)},
                     [np.random.default_rng(i) for i in range(6)])
    for key in ("image", "label"):
        assert (got[key].dtype, got[key].shape) == (expected[key].dtype, expected[key].shape)
        assert got[key].tobytes() == expected[key].tobytes(), key


def test_images_that_are_resized_have_no_batch_form():
    spec = images.PRESETS["imagenet2012"].image
    assert images.make_batch_preprocess(spec, train=True, augment=True) is None


@pytest.mark.parametrize("name", ["digits", "cifar10", "imagenet2012"])
def test_normalising_on_the_device_equals_the_host_float32_normalisation(name):
    spec = images.PRESETS[name].image
    pixels = np.random.default_rng(0).integers(0, 256, (16, 32, 32, spec.channels), np.uint8)
    host = (pixels.astype(np.float32) / 255.0 - np.asarray(spec.mean, np.float32)) / \
        np.asarray(spec.std, np.float32)  # what the host computed before images went as uint8
    device = jax.jit(images.make_normalise(spec))({"image": pixels})["image"]
    np.testing.assert_allclose(device, host, rtol=0, atol=1e-6)


def test_imagenet_preprocessing_resizes_and_crops_any_image_to_the_model_size():
    spec = images.PRESETS["imagenet2012"].image
    image = np.random.default_rng(0).integers(0, 256, (300, 451, 3), dtype=np.uint8)
    for train, augment in [(False, False), (True, True)]:
        out = images.make_preprocess(spec, train=train, augment=augment)(
            {"image": image, "label": 7}, np.random.default_rng(1))
        assert out["image"].shape == (224, 224, 3) and out["image"].dtype == np.uint8
        assert out["label"] == 7


@pytest.mark.parametrize("height, width", [(375, 500), (500, 375), (64, 64), (40, 400),
                                           (400, 40)])
def test_random_resized_crop_covers_8_to_100_percent_at_a_3_4_to_4_3_aspect(height, width):
    for seed in range(200):
        top, left, crop_height, crop_width = images.random_resized_crop_box(
            height, width, np.random.default_rng(seed))
        assert 0 <= top and top + crop_height <= height
        assert 0 <= left and left + crop_width <= width
        # Rounding each side to whole pixels moves area and aspect by up to half a pixel.
        slack_h, slack_w = 0.5 / crop_height, 0.5 / crop_width
        area = crop_height * crop_width / (height * width)
        assert images.CROP_AREA[0] * (1 - slack_h) * (1 - slack_w) <= area <= 1
        aspect = crop_width / crop_height
        assert images.CROP_ASPECT[0] * (1 - slack_w) / (1 + slack_h) <= aspect
        assert aspect <= images.CROP_ASPECT[1] * (1 + slack_w) / (1 - slack_h)


def test_random_resized_crop_is_a_function_of_the_generator():
    def box(seed):
        return images.random_resized_crop_box(375, 500, np.random.default_rng(seed))

    assert box(3) == box(3)
    assert len({box(seed) for seed in range(20)}) > 15
    spec = images.PRESETS["imagenet2012"].image
    image = np.random.default_rng(0).integers(0, 256, (375, 500, 3), dtype=np.uint8)
    train = images.make_preprocess(spec, train=True, augment=True)
    first, again, other = (train({"image": image, "label": 0}, np.random.default_rng(seed))
                           for seed in (5, 5, 6))
    np.testing.assert_array_equal(first["image"], again["image"])
    assert (first["image"] != other["image"]).any()


def test_imagenet_evaluation_resizes_the_shorter_side_then_takes_the_center():
    spec = images.PRESETS["imagenet2012"].image
    image = np.zeros((300, 600, 3), np.uint8)
    image[:, 300:] = 255  # right half white: the center crop is half black, half white
    out = images.make_preprocess(spec, train=False, augment=False)(
        {"image": image, "label": 0}, None)["image"]
    assert (out[:, :100] == 0).all() and (out[:, 124:] == 255).all()


def test_encoded_images_are_decoded():
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(np.full((32, 32, 3), 200, np.uint8)).save(buffer, format="PNG")
    spec = images.PRESETS["cifar10"].image
    preprocess = images.make_preprocess(spec, train=False, augment=False)
    # bytes, or a uint8 vector (as files store them)
    for encoded in (buffer.getvalue(), np.frombuffer(buffer.getvalue(), np.uint8)):
        out = preprocess({"image": encoded, "label": 1}, None)
        assert out["image"].shape == (32, 32, 3)
        np.testing.assert_array_equal(out["image"], 200)
