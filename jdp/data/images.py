"""Image classification inputs: the presets of the datasets jdp ships configs for,
and the per-example preprocessing (decode, resize, crop, flip, normalise).

A preset is a starting point, not a closed list: any dataset gets an
`ImageSpec` from its metadata and the `data.*` config keys (`spec_for`).
"""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Callable

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


def _decode(image) -> np.ndarray:
    if isinstance(image, bytes):  # a source that left images encoded
        from PIL import Image

        return np.asarray(Image.open(io.BytesIO(image)).convert("RGB"))
    return np.asarray(image)


def _resize_shorter_side(image: np.ndarray, size: int) -> np.ndarray:
    from PIL import Image

    height, width = image.shape[:2]
    scale = size / min(height, width)
    new_size = (max(size, round(width * scale)), max(size, round(height * scale)))
    squeeze = image.shape[-1] == 1  # PIL wants grey images without a channel axis
    resized = np.asarray(Image.fromarray(image[..., 0] if squeeze else image)
                         .resize(new_size, Image.BILINEAR))
    return resized[..., None] if squeeze else resized


def _crop(image: np.ndarray, size: int, top: int, left: int) -> np.ndarray:
    return image[top:top + size, left:left + size]


def make_preprocess(
    spec: ImageSpec, *, train: bool, augment: bool
) -> Callable[[dict, np.random.Generator], dict]:
    """Example -> {'image': float32 HWC normalised, 'label': int32}.

    The random generator is seeded from (seed, global example index) by the
    sampler, so augmentation is as topology-independent as the order.
    """
    mean = np.asarray(spec.mean, np.float32)
    std = np.asarray(spec.std, np.float32)
    size = spec.image_size

    def preprocess(example: dict, rng: np.random.Generator) -> dict:
        image = _decode(example[spec.image_key])
        if image.ndim == 2:
            image = image[..., None]
        if spec.resize:
            # Standard ImageNet evaluation geometry: shorter side to size/0.875, then crop.
            image = _resize_shorter_side(image, int(size / 0.875))
        height, width = image.shape[:2]
        if train and augment:
            pad = spec.crop_padding
            if pad:
                image = np.pad(image, ((pad, pad), (pad, pad), (0, 0)))
                height, width = height + 2 * pad, width + 2 * pad
            image = _crop(image, size, rng.integers(0, height - size + 1),
                          rng.integers(0, width - size + 1))
            if spec.flip and rng.random() < 0.5:
                image = image[:, ::-1]
        else:
            image = _crop(image, size, (height - size) // 2, (width - size) // 2)
        image = (image.astype(np.float32) / 255.0 - mean) / std
        return {"image": image, "label": np.int32(example[spec.label_key])}

    return preprocess
