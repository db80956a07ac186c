"""The datasets jdp knows: their shapes, splits and preprocessing, and opening
a split as a random-access TFDS source with a clear error when it is missing.
"""

from __future__ import annotations

import dataclasses
import io
import os
from collections.abc import Callable

import numpy as np

from jdp.config import ConfigError


@dataclasses.dataclass(frozen=True)
class DatasetSpec:
    """What the trainer and the model need to know about a dataset."""

    name: str  # the TFDS name
    num_classes: int
    image_size: int  # model input height = width
    channels: int
    train_split: str
    eval_split: str
    mean: tuple[float, ...]  # per channel, on the 0..1 scale
    std: tuple[float, ...]
    crop_padding: int  # pixels of padding for the random-crop augmentation
    flip: bool  # horizontal flips are a valid augmentation
    resize: bool  # images come in varying sizes (ImageNet): resize and crop


_SPECS = {
    "digits": DatasetSpec("digits", 10, 8, 1, "train", "test", (0.5,), (0.5,), 1, False, False),
    "cifar10": DatasetSpec("cifar10", 10, 32, 3, "train", "test",
                           (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616), 4, True, False),
    "imagenet2012": DatasetSpec("imagenet2012", 1000, 224, 3, "train", "validation",
                                (0.485, 0.456, 0.406), (0.229, 0.224, 0.225), 0, True, True),
}


def spec(name: str) -> DatasetSpec:
    if name not in _SPECS:
        raise ConfigError(
            f"config.data.name={name!r}: unknown dataset. Fix: use one of "
            f"{', '.join(map(repr, _SPECS))}.")
    return _SPECS[name]


def resolve_data_dir(data_dir: str) -> str:
    return os.path.expanduser(
        data_dir or os.environ.get("TFDS_DATA_DIR") or "~/tensorflow_datasets")


def check_prepared(name: str, data_dir: str) -> None:
    """Raises ConfigError unless `name` can be read from `data_dir` (digits is built here)."""
    import tensorflow_datasets as tfds

    if name == "digits":
        from jdp.data import digits

        digits.prepare(data_dir)
        return
    try:
        builder = tfds.builder(name, data_dir=data_dir)
        prepared = builder.is_prepared()
    except Exception as e:  # noqa: BLE001 - any failure here means "not readable"
        prepared, builder = False, None
        reason = f" ({type(e).__name__}: {e})"
    else:
        reason = ""
    if not prepared:
        raise ConfigError(
            f"config.data.name={name!r}: the dataset is not prepared in data_dir "
            f"{data_dir!r}{reason}. jdp does not download datasets. Fix: prepare it where "
            f"there is network access with `tfds build {name} --data_dir={data_dir} "
            f"--file_format=array_record` (ImageNet needs its archives placed in the "
            f"manual dir first) and copy it here, or point --config.data.data_dir at the "
            f"directory that holds {name}/.")
    file_format = str(builder.info.file_format or "")
    if "array_record" not in file_format:
        raise ConfigError(
            f"config.data.name={name!r}: the copy in {data_dir!r} is stored as {file_format!r}, "
            f"but random access needs array_record. Fix: rebuild it with "
            f"`tfds build {name} --data_dir={data_dir} --file_format=array_record`.")


def open_split(name: str, data_dir: str, split: str):
    """A random-access source of the split: `len()` and `[index] -> dict`."""
    import tensorflow_datasets as tfds

    if name == "digits":
        from jdp.data import digits  # noqa: F401 - registers the builder with TFDS
    return tfds.data_source(name, split=split, data_dir=data_dir, download=False)


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
    return np.asarray(Image.fromarray(image).resize(new_size, Image.BILINEAR))


def _crop(image: np.ndarray, size: int, top: int, left: int) -> np.ndarray:
    return image[top:top + size, left:left + size]


def make_preprocess(
    dataset: DatasetSpec, *, train: bool, augment: bool
) -> Callable[[dict, np.random.Generator], dict]:
    """Example -> {'image': float32 HWC normalised, 'label': int32}.

    The random generator is seeded from (seed, global example index) by the
    sampler, so augmentation is as topology-independent as the order.
    """
    mean = np.asarray(dataset.mean, np.float32)
    std = np.asarray(dataset.std, np.float32)
    size = dataset.image_size

    def preprocess(example: dict, rng: np.random.Generator) -> dict:
        image = _decode(example["image"])
        if image.ndim == 2:
            image = image[..., None]
        if dataset.resize:
            # Standard ImageNet evaluation geometry: shorter side to size/0.875, then crop.
            image = _resize_shorter_side(image, int(size / 0.875))
        height, width = image.shape[:2]
        if train and augment:
            pad = dataset.crop_padding
            if pad:
                image = np.pad(image, ((pad, pad), (pad, pad), (0, 0)))
                height, width = height + 2 * pad, width + 2 * pad
            image = _crop(image, size, rng.integers(0, height - size + 1),
                          rng.integers(0, width - size + 1))
            if dataset.flip and rng.random() < 0.5:
                image = image[:, ::-1]
        else:
            image = _crop(image, size, (height - size) // 2, (width - size) // 2)
        image = (image.astype(np.float32) / 255.0 - mean) / std
        return {"image": image, "label": np.int32(example["label"])}

    return preprocess
