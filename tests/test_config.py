"""Experiment files, `:arg` variants, command-line overrides and config validation."""

import pytest
from absl import flags
from ml_collections import config_flags

from jdp import config as config_lib
from jdp.errors import ConfigError

VIT = "experiments/vit.py"


def parse(*argv):
    flag_values = flags.FlagValues()
    argv = ["prog", *argv]
    # Override flags are declared from the argument list, as jdp.main does from sys.argv.
    config_flags.DEFINE_config_file("config", None, "", flag_values=flag_values,
                                    lock_config=True, sys_argv=argv)
    flag_values(argv)
    return flag_values.config


def test_experiment_file_gives_a_config_built_on_the_defaults():
    config = parse(f"--config={VIT}")
    assert config.data.name == "digits"
    assert config.parallel.backend == "pjit"
    assert set(config_lib.defaults().keys()) <= set(config.keys())


def test_arg_after_colon_is_passed_to_get_config():
    assert parse(f"--config={VIT}:cifar10").data.name == "cifar10"
    assert parse(f"--config={VIT}:imagenet2012").model.patch_size == 16


def test_overrides_reach_nested_leaves_with_their_types():
    config = parse(f"--config={VIT}", "--config.batch_size=256", "--config.data.augment=true",
                   "--config.parallel.backend=pmap", "--config.learning_rate=0.5")
    assert config.batch_size == 256
    assert config.data.augment is True
    assert config.parallel.backend == "pmap"
    assert config.learning_rate == 0.5


def test_batch_plan_derives_every_size_from_the_global_batch():
    plan = config_lib.batch_split(256, grad_accum_steps=4, device_count=8, process_count=2)
    assert (plan.per_process_batch_size, plan.per_device_batch_size, plan.micro_batch_size) == \
        (128, 32, 8)


def test_batch_not_divisible_by_devices_names_the_numbers():
    with pytest.raises(ConfigError, match=r"batch_size=1000.*device count \(48\)"):
        config_lib.batch_split(1000, grad_accum_steps=1, device_count=48, process_count=6)


def test_accumulation_must_divide_the_per_device_batch():
    with pytest.raises(ConfigError, match=r"grad_accum_steps=3.*= 16\)"):
        config_lib.batch_split(128, grad_accum_steps=3, device_count=8, process_count=1)


@pytest.mark.parametrize("field,value,message", [
    ("parallel.backend", "horovod", "unknown value"),
    ("remat", "some", "unknown value"),
    ("compute_dtype", "float16", "unknown value"),
    ("lr_scaling", "cubic", "unknown value"),
    ("data.in_memory", "yes", "unknown value.*'auto', 'true', 'false'"),
    ("data.num_classes", -1, "must be >= 0"),
    ("total_steps", 0, "must be > 0"),
    ("checkpoint.max_to_keep", 0, "must be > 0"),
])
def test_invalid_values_name_the_field(field, value, message):
    config = parse(f"--config={VIT}")
    *parents, leaf = field.split(".")
    node = config
    for parent in parents:
        node = node[parent]
    node[leaf] = value
    with pytest.raises(ConfigError, match=rf"config\.{field}={value!r}: {message}"):
        config_lib.validate(config, device_count=8, process_count=1)


def test_zero_sharding_is_refused_on_pmap():
    config = parse(f"--config={VIT}", "--config.parallel.backend=pmap",
                   "--config.parallel.shard_optimizer_state=true")
    with pytest.raises(ConfigError, match="shard_optimizer_state.*backend=pjit"):
        config_lib.validate(config, device_count=8, process_count=1)


@pytest.mark.parametrize("rule,expected", [("none", 1e-3), ("linear", 4e-3), ("sqrt", 2e-3)])
def test_learning_rate_scaling_rules(rule, expected):
    assert config_lib.scaled_learning_rate(1e-3, rule, 1024, 256) == pytest.approx(expected)
