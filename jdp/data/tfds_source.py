"""Any TFDS dataset by name, read with random access (`tfds.data_source`) from a
prepared array_record copy in the data dir; jdp never downloads.

Opening checks, before anything is trained or written, that the dataset is
prepared and stored as array_record, that the split exists (TFDS slicing
such as `train[:90%]` is allowed) and that the features the config names are
there, each with one error line naming the field and the fix.
"""

from __future__ import annotations

import os

from jdp.errors import ConfigError, first_line
from jdp.runtime import storage


def resolve_data_dir(data_dir: str) -> str:
    return os.path.expanduser(
        data_dir or os.environ.get("TFDS_DATA_DIR") or "~/tensorflow_datasets")


def builder(name: str, data_dir: str):
    """The prepared TFDS builder of `name` (digits is built here on first use). A gs://
    data_dir is read from a local copy of the dataset, made once (array_record, under
    `as_data_source`, reads local files only)."""
    import tensorflow_datasets as tfds

    storage.check_supported(data_dir, "config.data.data_dir")
    if storage.is_bucket(data_dir):
        data_dir = _local_data_dir(name, data_dir)

    if name == "digits":
        from jdp.data import digits

        digits.prepare(data_dir)
    try:
        found = tfds.builder(name, data_dir=data_dir)
        prepared = found.is_prepared()
    except Exception as e:  # noqa: BLE001 - any failure here means "not readable"
        # TFDS's messages run over many lines; the first says what is wrong.
        prepared, reason = False, f" ({type(e).__name__}: {first_line(e)})"
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
    # info.file_format is a FileFormat enum (str() gives 'FileFormat.ARRAY_RECORD').
    file_format = str(getattr(found.info.file_format, "value", found.info.file_format) or "")
    if "array_record" not in file_format:
        raise ConfigError(
            f"config.data.name={name!r}: the copy in {data_dir!r} is stored as {file_format!r}, "
            f"but random access needs array_record. Fix: rebuild it with "
            f"`tfds build {name} --data_dir={data_dir} --file_format=array_record`.")
    return found


def _local_data_dir(name: str, data_dir: str) -> str:
    storage.configure()
    dataset_dir = storage.join(data_dir, name.split("/")[0].split(":")[0])
    if not storage.isdir(dataset_dir):
        return data_dir  # builder() reports it as not prepared there
    return os.path.dirname(storage.local_copy(dataset_dir))


def check_features(found, field_keys: dict[str, str]) -> None:
    """Each config field ('data.image_key' -> 'image') names a feature of the dataset."""
    features = found.info.features
    for field, key in field_keys.items():
        if key not in features:
            raise ConfigError(
                f"config.{field}={key!r}: {found.name} has no such feature (it has "
                f"{', '.join(map(repr, features))}). Fix: pass --config.{field}=<one of those>.")


def open_split(found, split: str, field: str):
    """A random-access source of `split`: `len()` and `[index] -> dict of numpy arrays`."""
    try:
        return found.as_data_source(split=split)
    except Exception as e:  # noqa: BLE001 - a bad split name or slice
        raise ConfigError(
            f"config.{field}={split!r}: {found.name} cannot open this split "
            f"({type(e).__name__}: {first_line(e)}). Fix: use one of "
            f"{', '.join(map(repr, found.info.splits))}, optionally sliced, e.g. "
            "'train[:90%]'.") from e


def num_classes(found, label_key: str) -> int | None:
    """Classes of a ClassLabel feature, None for any other kind of label."""
    return getattr(found.info.features[label_key], "num_classes", None)


def feature_shape(found, key: str) -> tuple:
    return tuple(found.info.features[key].shape)
