"""Image classification inputs: the presets of the datasets jdp ships configs for,
the per-example preprocessing on the host (decode, resize, crop, flip), its batch
form for images of one size, and the normalisation, which runs on the device.

Images travel to the device as uint8 (4x fewer bytes than float32) and are
normalised inside the compiled step (`make_normalise`, the default data's
`Data.device_preprocess`), with the same float32 arithmetic as on the host.

A preset is a starting point, not a closed list: any dataset gets an
`ImageSpec` from its metadata and the `data.*` config keys (`spec_for`).
"""

from __future__ import annotations

import dataclasses
import io
import math
from collections.abc import Callable, Sequence

import numpy as np

from jdp.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class ImageSpec:
    """What preprocessing and the model need to know about an image dataset."""

    image_size: int  # model input height = width
    channels: int
    mean: tuple[float, ...]  # per channel, on the 0..1 scale
    std: tuple[float, ...]
    crop_padding: int = 0  # pixels of padding for the random-crop augmentation
    flip: bool = False  # horizontal flips are a valid augmentation
    resize: bool = False  # images come in varying sizes (ImageNet): resize and crop
    image_key: str = "image"
    label_key: str = "label"


@dataclasses.dataclass(frozen=True)
class Preset:
    """Known settings of a TFDS dataset: its splits and image geometry."""

    train_split: str
    eval_split: str
    image: ImageSpec


PRESETS = {
    "digits": Preset("train", "test", ImageSpec(8, 1, (0.5,), (0.5,), crop_padding=1)),
    "cifar10": Preset("train", "test", ImageSpec(
        32, 3, (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616), crop_padding=4, flip=True)),
    "imagenet2012": Preset("train", "validation", ImageSpec(
        224, 3, (0.485, 0.456, 0.406), (0.229, 0.224, 0.225), flip=True, resize=True)),
}


def spec_for(data_config, *, preset: ImageSpec | None, image_shape: tuple) -> ImageSpec:
    """The preset's geometry with the config's overrides; else from the image shape.

    `image_shape` is (height, width, channels) with None for a varying size, as in
    TFDS metadata or the first example of the user's files.
    """
    if len(image_shape) == 1:  # encoded bytes (JPEG, PNG) as a uint8 vector, decoded to RGB
        image_shape = (None, None, 3)
    height, width, channels = (*image_shape, 1) if len(image_shape) == 2 else image_shape
    size = data_config.image_size or (preset.image_size if preset else 0)
    if not size:
        if height is None or width is None or height != width:
            raise ConfigError(
                f"config.data.image_size=0: the images have shape {tuple(image_shape)}, so the "
                "model input size cannot be read off them. Fix: pass "
                "--config.data.image_size=<pixels> (images are resized and center-cropped).")
        size = height
    resize = (preset.resize if preset else False) or height != size or width != size
    mean = tuple(data_config.mean) or (preset.mean if preset else (0.5,) * channels)
    std = tuple(data_config.std) or (preset.std if preset else (0.5,) * channels)
    base = preset or ImageSpec(size, channels, mean, std)
    return dataclasses.replace(base, image_size=size, channels=channels, mean=mean, std=std,
                               resize=resize, image_key=data_config.image_key,
                               label_key=data_config.label_key)


# Training augmentation of images of varying size (ImageNet): a random crop covering
# 8-100% of the area with an aspect ratio of 3/4..4/3, resized to the model size
# (torchvision's RandomResizedCrop; big_vision's decode_jpeg_and_inception_crop).
CROP_AREA = (0.08, 1.0)
CROP_ASPECT = (3 / 4, 4 / 3)  # width / height
_CROP_ATTEMPTS = 10
# Evaluation of such images: the shorter side to size / 0.875, then the central square.
EVAL_CROP_FRACTION = 0.875


def _decode(image) -> np.ndarray:
    """Decoded pixels; encoded images come as bytes or as a uint8 vector (files cannot
    hold bytes, see jdp.data.files)."""
    if isinstance(image, bytes) or (isinstance(image, np.ndarray) and image.ndim == 1
                                    and image.dtype == np.uint8):
        from PIL import Image

        return np.asarray(Image.open(io.BytesIO(image)).convert("RGB"))
    return np.asarray(image)


def _resize(image: np.ndarray, height: int, width: int, box=None) -> np.ndarray:
    """Bilinear resize of `image`, or of its region `box` = (left, top, right, bottom)."""
    from PIL import Image

    grey = image.shape[-1] == 1  # PIL wants grey images without a channel axis
    resized = np.asarray(Image.fromarray(image[..., 0] if grey else image)
                         .resize((width, height), Image.BILINEAR, box=box))
    return resized[..., None] if grey else resized


def _resize_shorter_side(image: np.ndarray, size: int) -> np.ndarray:
    height, width = image.shape[:2]
    scale = size / min(height, width)
    return _resize(image, max(size, round(height * scale)), max(size, round(width * scale)))


def _crop(image: np.ndarray, size: int, top: int, left: int) -> np.ndarray:
    """The size x size crop of an HWC image, or of each image of an NHWC batch."""
    return image[..., top:top + size, left:left + size, :]


def _center_crop(image: np.ndarray, size: int) -> np.ndarray:
    height, width = image.shape[-3:-1]
    return _crop(image, size, (height - size) // 2, (width - size) // 2)


def random_resized_crop_box(height: int, width: int,
                            rng: np.random.Generator) -> tuple[int, int, int, int]:
    """(top, left, crop height, crop width) of a random crop of a height x width image
    covering CROP_AREA of its area with a width/height ratio in CROP_ASPECT.

    Up to 10 draws (the aspect ratio log-uniform); when none fits inside the image,
    the central crop of the allowed aspect ratio nearest the image's.
    """
    log_aspect = (math.log(CROP_ASPECT[0]), math.log(CROP_ASPECT[1]))
    for _ in range(_CROP_ATTEMPTS):
        area = height * width * rng.uniform(*CROP_AREA)
        aspect = math.exp(rng.uniform(*log_aspect))
        crop_width = round(math.sqrt(area * aspect))
        crop_height = round(math.sqrt(area / aspect))
        if 0 < crop_width <= width and 0 < crop_height <= height:
            top = int(rng.integers(0, height - crop_height + 1))
            left = int(rng.integers(0, width - crop_width + 1))
            return top, left, crop_height, crop_width
    crop_height, crop_width = height, width
    if width / height < CROP_ASPECT[0]:
        crop_height = round(width / CROP_ASPECT[0])
    elif width / height > CROP_ASPECT[1]:
        crop_width = round(height * CROP_ASPECT[1])
    return (height - crop_height) // 2, (width - crop_width) // 2, crop_height, crop_width


def _random_resized_crop(image: np.ndarray, size: int, rng: np.random.Generator) -> np.ndarray:
    top, left, crop_height, crop_width = random_resized_crop_box(*image.shape[:2], rng)
    # PIL resizes the region directly: no copy of the crop first.
    return _resize(image, size, size, box=(left, top, left + crop_width, top + crop_height))


def _pad(image: np.ndarray, pad: int) -> np.ndarray:
    """Zeros around the height and width of an HWC image or an NHWC batch."""
    if not pad:
        return image
    return np.pad(image, [(0, 0)] * (image.ndim - 3) + [(pad, pad), (pad, pad), (0, 0)])


# The random draws of the augmentation, shared by the per-example and the batch form
# so that both take the same numbers from an example's generator, in the same order.
def _draw_crop(rng: np.random.Generator, height: int, width: int,
               size: int) -> tuple[int, int]:
    """(top, left) of a random size x size crop of a height x width image."""
    top = int(rng.integers(0, height - size + 1))
    return top, int(rng.integers(0, width - size + 1))


def _draw_flip(rng: np.random.Generator) -> bool:
    return bool(rng.random() < 0.5)


def _padded_random_crop(image: np.ndarray, size: int, pad: int,
                        rng: np.random.Generator) -> np.ndarray:
    image = _pad(image, pad)
    return _crop(image, size, *_draw_crop(rng, *image.shape[:2], size))


def _to_device_dtype(image: np.ndarray) -> np.ndarray:
    """uint8 pixels travel as they are (normalised on the device); any other dtype
    (e.g. a user's float images on the 0..255 scale) as float32."""
    return image if image.dtype == np.uint8 else image.astype(np.float32)


def make_preprocess(
    spec: ImageSpec, *, train: bool, augment: bool
) -> Callable[[dict, np.random.Generator], dict]:
    """Example -> {'image': HWC pixels (uint8 for uint8 sources), 'label': int32}.

    Geometry only: `make_normalise` finishes the job on the device. Training with
    `augment` crops at random (padded crops; random-resized crops for images of
    varying size) and flips where the spec allows. The random generator is seeded
    from (seed, global example index) by the sampler, so augmentation is as
    topology-independent as the order.
    """
    size = spec.image_size
    augmenting = train and augment

    def geometry(image: np.ndarray, rng) -> np.ndarray:
        if spec.resize and augmenting:
            return _random_resized_crop(image, size, rng)
        if spec.resize:
            return _center_crop(_resize_shorter_side(image, int(size / EVAL_CROP_FRACTION)), size)
        if augmenting:
            return _padded_random_crop(image, size, spec.crop_padding, rng)
        return _center_crop(image, size)

    def preprocess(example: dict, rng: np.random.Generator) -> dict:
        image = _decode(example[spec.image_key])
        if image.ndim == 2:
            image = image[..., None]
        image = geometry(image, rng)
        if augmenting and spec.flip and _draw_flip(rng):
            image = image[:, ::-1]
        return {"image": _to_device_dtype(image), "label": np.int32(example[spec.label_key])}

    return preprocess


def make_batch_preprocess(
    spec: ImageSpec, *, train: bool, augment: bool
) -> Callable[[dict, Sequence[np.random.Generator] | None], dict] | None:
    """The batch form of `make_preprocess(spec, train=..., augment=...)` (a
    `Data.batch_preprocess`): bitwise the same images and labels for a batch of stacked
    source images at once. With augmentation only the random draws are per example
    (from each example's own generator, as `make_preprocess` draws them); the padding,
    crops and flips are one gather for the batch. None for images that are resized
    (of varying sizes, or encoded): those are prepared one by one.
    """
    if spec.resize:
        return None
    size = spec.image_size
    augmenting = train and augment

    def random_crops(images: np.ndarray, rngs) -> np.ndarray:
        padded = _pad(images, spec.crop_padding)
        count, height, width = padded.shape[:3]
        tops, lefts, flips = np.empty(count, int), np.empty(count, int), np.zeros(count, bool)
        for i in range(count):
            tops[i], lefts[i] = _draw_crop(rngs[i], height, width, size)
            if spec.flip:
                flips[i] = _draw_flip(rngs[i])
        offsets = np.arange(size)
        rows = tops[:, None] + offsets
        columns = lefts[:, None] + offsets
        columns = np.where(flips[:, None], columns[:, ::-1], columns)
        return padded[np.arange(count)[:, None, None], rows[:, :, None], columns[:, None, :]]

    def batch_preprocess(batch: dict, rngs) -> dict:
        images = np.asarray(batch[spec.image_key])
        if images.ndim == 3:
            images = images[..., None]
        images = random_crops(images, rngs) if augmenting else _center_crop(images, size)
        return {"image": _to_device_dtype(images),
                "label": np.asarray(batch[spec.label_key]).astype(np.int32)}

    return batch_preprocess


def make_normalise(spec: ImageSpec) -> Callable[[dict], dict]:
    """The device half of the preprocessing (a `Data.device_preprocess`): batch['image']
    0..255 -> float32 (x / 255 - mean) / std, the arithmetic the host used to do.

    Written with array methods only, so it runs on jax arrays inside the compiled step
    and on numpy arrays alike.
    """
    mean = np.asarray(spec.mean, np.float32)
    std = np.asarray(spec.std, np.float32)

    def normalise(batch: dict) -> dict:
        image = batch["image"].astype(np.float32) / np.float32(255)
        return {**batch, "image": (image - mean) / std}

    return normalise
