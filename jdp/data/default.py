"""The data a config names, for experiments that define no `build_data`: image
classification on a TFDS dataset by name (`data.name`, the built-in `digits`
by default, or any dataset prepared in `data.data_dir`) or on the user's own
`.npz` / ArrayRecord files (`data.train_files`, `data.eval_files`); or packed text
for a language model (`data.text_files`, `jdp.data.text.lm`).
"""

from __future__ import annotations

import numpy as np

from jdp.data import files, images, tfds_source
from jdp.data.core import Data
from jdp.data.text import lm as text_lm
from jdp.errors import ConfigError


def build(config, *, workdir: str = "") -> Data:
    data_config = config.data
    if text_lm.uses_text(data_config):
        return text_lm.build(data_config, workdir=workdir,
                             eval_batch_size=config.eval_batch_size or config.batch_size)
    if data_config.train_files or data_config.eval_files:
        return _from_files(data_config)
    return _from_tfds(data_config)


def _from_tfds(data_config) -> Data:
    data_dir = tfds_source.resolve_data_dir(data_config.data_dir)
    found = tfds_source.builder(data_config.name, data_dir)
    tfds_source.check_features(found, {"data.image_key": data_config.image_key,
                                       "data.label_key": data_config.label_key})
    preset = images.PRESETS.get(data_config.name)
    train_split = data_config.train_split or (preset.train_split if preset else "train")
    eval_split = data_config.eval_split or (preset.eval_split if preset else _eval_split(found))
    spec = images.spec_for(data_config, preset=preset and preset.image,
                           image_shape=tfds_source.feature_shape(found, data_config.image_key))
    num_classes = data_config.num_classes or tfds_source.num_classes(found, data_config.label_key)
    return _image_data(
        tfds_source.open_split(found, train_split, "data.train_split"),
        tfds_source.open_split(found, eval_split, "data.eval_split"),
        spec, data_config.augment, num_classes)


def _eval_split(found) -> str:
    for name in ("test", "validation"):
        if name in found.info.splits:
            return name
    raise ConfigError(
        f"config.data.eval_split='': {found.name} has no 'test' or 'validation' split (it has "
        f"{', '.join(map(repr, found.info.splits))}). Fix: pass --config.data.eval_split, "
        "e.g. 'train[90%:]' with --config.data.train_split='train[:90%]'.")


def _from_files(data_config) -> Data:
    for field in ("train_files", "eval_files"):
        if not data_config[field]:
            raise ConfigError(
                f"config.data.{field}='': the other split is read from files, so this one must "
                f"be too. Fix: pass --config.data.{field}=<glob of .npz or .array_record files>.")
    train = files.open_files(data_config.train_files, field="config.data.train_files")
    eval_source = files.open_files(data_config.eval_files, field="config.data.eval_files")
    first = train[0]
    for field in ("image_key", "label_key"):
        if data_config[field] not in first:
            raise ConfigError(
                f"config.data.{field}={data_config[field]!r}: the files of data.train_files have "
                f"no such array (they have {', '.join(map(repr, first))}). Fix: pass "
                f"--config.data.{field}=<one of those>.")
    if not data_config.num_classes:
        raise ConfigError(
            "config.data.num_classes=0: files carry no class count. Fix: pass "
            "--config.data.num_classes=<number of classes>.")
    spec = images.spec_for(data_config, preset=None,
                           image_shape=np.shape(first[data_config.image_key]))
    return _image_data(train, eval_source, spec, data_config.augment, data_config.num_classes)


def _image_data(train, eval_source, spec: images.ImageSpec, augment: bool,
                num_classes: int | None) -> Data:
    return Data(train=train, eval=eval_source,
                preprocess=images.make_preprocess(spec, train=True, augment=augment),
                eval_preprocess=images.make_preprocess(spec, train=False, augment=False),
                batch_preprocess=images.make_batch_preprocess(spec, train=True, augment=augment),
                eval_batch_preprocess=images.make_batch_preprocess(spec, train=False,
                                                                   augment=False),
                device_preprocess=images.make_normalise(spec), num_classes=num_classes)
