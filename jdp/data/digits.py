"""The built-in `digits` dataset: scikit-learn's 1,797 handwritten digits
(8x8, 17 grey levels) as a real TFDS dataset in array_record format.

It needs no network, so it is the dataset that always works. It is prepared
on first use into the data dir and then read through `tfds.data_source`
exactly like any other TFDS dataset.
"""

from __future__ import annotations

import fcntl
import os

import numpy as np
import tensorflow_datasets as tfds

NAME = "digits"
_TEST_EVERY = 5  # every 5th example is in the test split: 1,437 train, 360 test


class Digits(tfds.core.GeneratorBasedBuilder):
    """scikit-learn's handwritten digits; images scaled from 0..16 to 0..255."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Initial release."}

    def _info(self) -> tfds.core.DatasetInfo:
        # A uint8 Tensor rather than tfds.features.Image: encoding PNGs needs
        # TensorFlow, which jdp does not depend on.
        return tfds.core.DatasetInfo(
            builder=self,
            description="scikit-learn handwritten digits, 8x8 grey-scale.",
            features=tfds.features.FeaturesDict({
                "image": tfds.features.Tensor(shape=(8, 8, 1), dtype=np.uint8),
                "label": tfds.features.ClassLabel(num_classes=10),
            }),
            supervised_keys=("image", "label"),
        )

    def _split_generators(self, dl_manager):
        del dl_manager  # nothing to download: scikit-learn ships the data
        return {"train": self._generate_examples(test=False),
                "test": self._generate_examples(test=True)}

    def _generate_examples(self, test: bool):
        from sklearn.datasets import load_digits

        digits = load_digits()
        images = np.rint(digits.images * (255.0 / 16.0)).astype(np.uint8)[..., None]
        for index, (image, label) in enumerate(zip(images, digits.target, strict=True)):
            if (index % _TEST_EVERY == 0) == test:
                yield index, {"image": image, "label": int(label)}


def prepare(data_dir: str) -> None:
    """Builds the dataset into `data_dir` once; safe when several processes race."""
    os.makedirs(data_dir, exist_ok=True)
    # Processes of one job on one machine share the data dir: one builds, the
    # others wait on the lock and then find it prepared.
    with open(os.path.join(data_dir, ".digits.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        builder = Digits(data_dir=data_dir, file_format="array_record")
        if not builder.is_prepared():
            builder.download_and_prepare()
