"""Sources over a user's own .npz and ArrayRecord files, and open_files' config errors."""

from __future__ import annotations

import numpy as np
import pytest

from jdp.data.files import ArrayRecordSource, NpzSource, open_files, write_array_records
from jdp.errors import ConfigError

FIELD = "config.data.train_files"


def _save_npz(path, **arrays) -> str:
    np.savez(path, **arrays)
    return str(path)


def _assert_config_error(pattern: str, *found: str) -> str:
    with pytest.raises(ConfigError) as info:
        open_files(pattern, field=FIELD)
    message = str(info.value)
    assert message.startswith(f"{FIELD}={pattern!r}: ")
    assert "Fix: " in message
    assert "\n" not in message
    for text in found:
        assert text in message
    return message


def test_npz_source_concatenates_files_in_order_keeping_values_and_dtypes(tmp_path):
    images_a = np.arange(3 * 2 * 2, dtype=np.uint8).reshape(3, 2, 2)
    images_b = np.arange(100, 108, dtype=np.uint8).reshape(2, 2, 2)
    a = _save_npz(tmp_path / "a.npz", image=images_a, label=np.array([0, 1, 2], np.int32))
    b = _save_npz(tmp_path / "b.npz", image=images_b, label=np.array([7, 8], np.int32))

    source = NpzSource([b, a])

    assert len(source) == 5
    assert source.feature_names == ("image", "label")
    expected = [(images_b[0], 7), (images_b[1], 8), (images_a[0], 0), (images_a[1], 1),
                (images_a[2], 2)]
    for i, (image, label) in enumerate(expected):
        example = source[i]
        np.testing.assert_array_equal(example["image"], image)
        assert example["image"].dtype == np.uint8
        assert example["label"] == label and example["label"].dtype == np.int32


def test_npz_source_returns_copies_that_callers_may_modify(tmp_path):
    source = NpzSource([_save_npz(tmp_path / "a.npz", x=np.zeros((2, 3), np.float32))])

    source[0]["x"][:] = 5.0

    np.testing.assert_array_equal(source[0]["x"], np.zeros(3, np.float32))


@pytest.mark.parametrize("index", [-1, 4])
def test_npz_source_raises_index_error_outside_range(tmp_path, index):
    source = NpzSource([_save_npz(tmp_path / "a.npz", x=np.arange(4))])

    with pytest.raises(IndexError, match=str(index)):
        source[index]


def test_array_records_round_trip_features_of_several_dtypes_shapes_and_scalars(tmp_path):
    rng = np.random.default_rng(0)
    examples = [{"image": rng.integers(0, 255, (4, 3, 2), dtype=np.uint8),
                 "embedding": rng.normal(size=(5,)).astype(np.float16),
                 "label": np.int64(i),
                 "weight": np.float32(0.5 * i),
                 "mask": np.array(i % 2 == 0)}
                for i in range(5)]
    path = str(tmp_path / "data.array_record")

    assert write_array_records(path, examples) == 5
    source = ArrayRecordSource([path])

    assert len(source) == 5
    assert set(source.feature_names) == set(examples[0])
    for i, expected in enumerate(examples):
        example = source[i]
        assert set(example) == set(expected)
        for name, value in expected.items():
            assert np.shape(example[name]) == np.shape(value), name
            assert example[name].dtype == value.dtype, name
            np.testing.assert_array_equal(example[name], value)


def test_array_record_source_concatenates_files_in_order(tmp_path):
    first, second = str(tmp_path / "1.array_record"), str(tmp_path / "2.array_record")
    write_array_records(first, ({"x": np.array([i])} for i in range(3)))
    write_array_records(second, ({"x": np.array([i])} for i in range(10, 12)))

    source = ArrayRecordSource([second, first])

    assert [int(source[i]["x"][0]) for i in range(len(source))] == [10, 11, 0, 1, 2]


def test_array_record_source_returns_writable_arrays(tmp_path):
    path = str(tmp_path / "a.array_record")
    write_array_records(path, [{"x": np.zeros(3, np.float32)}])
    source = ArrayRecordSource([path])

    source[0]["x"][:] = 1.0  # would raise on the read-only buffer msgpack restores into

    np.testing.assert_array_equal(source[0]["x"], np.zeros(3, np.float32))


def test_array_record_source_raises_index_error_past_the_end(tmp_path):
    path = str(tmp_path / "a.array_record")
    write_array_records(path, [{"x": np.zeros(1)}] * 2)

    with pytest.raises(IndexError, match="2"):
        ArrayRecordSource([path])[2]


def test_write_array_records_rejects_string_features_it_cannot_round_trip(tmp_path):
    with pytest.raises(TypeError, match="'name'.*uint8"):
        write_array_records(str(tmp_path / "a.array_record"), [{"name": np.array(["cat"])}])


def test_write_array_records_rejects_examples_with_different_features(tmp_path):
    with pytest.raises(ValueError, match="example 1"):
        write_array_records(str(tmp_path / "a.array_record"), [{"x": 1}, {"y": 2}])


def test_open_files_reads_glob_matches_in_sorted_order(tmp_path):
    for i in (2, 0, 1):
        _save_npz(tmp_path / f"train-{i}.npz", x=np.array([i]))

    source = open_files(str(tmp_path / "train-*.npz"), field=FIELD)

    assert isinstance(source, NpzSource)
    assert [int(source[i]["x"]) for i in range(3)] == [0, 1, 2]


def test_open_files_sorts_the_union_of_comma_separated_globs(tmp_path):
    for name in ("b", "a", "c"):
        write_array_records(str(tmp_path / f"{name}.array_record"), [{"name": np.int32(ord(name))}])

    source = open_files(f"{tmp_path}/c.*, {tmp_path}/[ab].array_record", field=FIELD)

    assert isinstance(source, ArrayRecordSource)
    assert [chr(int(source[i]["name"])) for i in range(3)] == ["a", "b", "c"]


@pytest.mark.parametrize("name", ["x.arrayrecord", "mnist-train.array_record-00000-of-00001"])
def test_open_files_recognises_other_array_record_names(tmp_path, name):
    write_array_records(str(tmp_path / name), [{"x": np.int32(1)}])

    assert isinstance(open_files(str(tmp_path / name), field=FIELD), ArrayRecordSource)


def test_open_files_error_when_no_file_matches(tmp_path):
    pattern = str(tmp_path / "*.npz")

    message = _assert_config_error(pattern, "no file matches")

    assert f"--{FIELD}=" in message


def test_open_files_error_for_unknown_extension(tmp_path):
    (tmp_path / "train.csv").write_text("1,2\n")

    _assert_config_error(str(tmp_path / "*"), "train.csv", "neither .npz nor ArrayRecord")


def test_open_files_error_for_mixed_extensions(tmp_path):
    _save_npz(tmp_path / "a.npz", x=np.zeros(1))
    write_array_records(str(tmp_path / "b.array_record"), [{"x": np.zeros(1)}])

    _assert_config_error(str(tmp_path / "*"), "a.npz", "b.array_record")


def test_open_files_error_names_npz_arrays_of_different_lengths(tmp_path):
    path = _save_npz(tmp_path / "a.npz", image=np.zeros((4, 2)), label=np.zeros(3))

    _assert_config_error(path, path, "image has 4", "label has 3")


def test_open_files_error_names_npz_scalar_arrays(tmp_path):
    path = _save_npz(tmp_path / "a.npz", image=np.zeros((2, 2)), count=np.array(2))

    _assert_config_error(path, path, "count", "first dimension")


def test_open_files_error_for_npz_files_with_different_features(tmp_path):
    _save_npz(tmp_path / "a.npz", image=np.zeros(2), label=np.zeros(2))
    _save_npz(tmp_path / "b.npz", image=np.zeros(2), target=np.zeros(2))

    _assert_config_error(str(tmp_path / "*.npz"), "b.npz", "'target'", "'label'")


def test_open_files_error_for_array_record_files_with_different_features(tmp_path):
    write_array_records(str(tmp_path / "a.array_record"), [{"image": np.zeros(2)}])
    write_array_records(str(tmp_path / "b.array_record"), [{"pixels": np.zeros(2)}])

    _assert_config_error(str(tmp_path / "*.array_record"), "b.array_record", "'pixels'")


def test_open_files_error_when_the_files_hold_no_examples(tmp_path):
    path = str(tmp_path / "empty.array_record")
    write_array_records(path, [])

    _assert_config_error(path, "no examples")


@pytest.mark.parametrize("name", ["bad.npz", "bad.array_record"])
def test_open_files_error_names_an_unreadable_file(tmp_path, name):
    path = tmp_path / name
    path.write_bytes(b"this is not a data file")

    _assert_config_error(str(path), f"cannot read {path}")


def test_open_files_error_for_array_records_not_written_by_write_array_records(tmp_path):
    from array_record.python.array_record_module import ArrayRecordWriter

    path = str(tmp_path / "protos.array_record")
    writer = ArrayRecordWriter(path, "group_size:1")
    writer.write(b"\n\x0f\n\r\n\x05image\x12\x04\n\x02\x01\x02")  # a tf.train.Example-like proto
    writer.close()

    _assert_config_error(path, path, "not a msgpack-encoded dict", "write_array_records")
