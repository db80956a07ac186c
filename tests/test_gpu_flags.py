"""The GPU performance settings: composed with the user's own (theirs win), never set
off a GPU, and named as the installed jaxlib's XLA knows them."""

import mmap
import pathlib

import jaxlib
import ml_collections
import pytest

from jdp.config import defaults, validate
from jdp.errors import ConfigError
from jdp.runtime import gpu_flags


def _flags(xla_flags: str) -> dict[str, str]:
    return gpu_flags.parse_flags(xla_flags, field="XLA_FLAGS")


def test_on_a_fresh_gpu_host_every_default_is_set():
    plan = gpu_flags.plan({}, enable_defaults=True, user_flags="", hopper=False)
    assert _flags(plan.xla_flags) == gpu_flags.DEFAULT_XLA_FLAGS
    assert plan.env == {"XLA_PYTHON_CLIENT_MEM_FRACTION": gpu_flags.DEFAULT_MEM_FRACTION}
    assert plan.kept == ()


def test_hopper_gets_one_device_connection_and_other_gpus_do_not():
    hopper = gpu_flags.plan({}, enable_defaults=True, user_flags="", hopper=True)
    other = gpu_flags.plan({}, enable_defaults=True, user_flags="", hopper=False)
    assert hopper.env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in other.env


def test_a_flag_already_in_xla_flags_wins_and_the_rest_of_it_is_kept():
    existing = "--xla_dump_to=/tmp/d --xla_gpu_enable_latency_hiding_scheduler=false"
    plan = gpu_flags.plan({"XLA_FLAGS": existing}, enable_defaults=True,
                          user_flags="--xla_gpu_enable_latency_hiding_scheduler=true",
                          hopper=False)
    assert plan.xla_flags.startswith(existing + " ")
    assert plan.xla_flags.count("xla_gpu_enable_latency_hiding_scheduler") == 1
    assert "xla_gpu_enable_latency_hiding_scheduler" in plan.kept
    assert _flags(plan.xla_flags)["xla_gpu_all_reduce_combine_threshold_bytes"] == str(2**27)


def test_a_variable_already_set_wins():
    plan = gpu_flags.plan({"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.5",
                           "CUDA_DEVICE_MAX_CONNECTIONS": "8"},
                          enable_defaults=True, user_flags="", hopper=True)
    assert plan.env == {}
    assert set(plan.kept) == {"XLA_PYTHON_CLIENT_MEM_FRACTION", "CUDA_DEVICE_MAX_CONNECTIONS"}


def test_config_flags_override_a_default_and_add_their_own():
    plan = gpu_flags.plan({}, enable_defaults=True, hopper=False,
                          user_flags="--xla_gpu_enable_pipelined_all_reduce=false "
                                     "--xla_gpu_enable_while_loop_double_buffering")
    flags = _flags(plan.xla_flags)
    assert flags["xla_gpu_enable_pipelined_all_reduce"] == "false"
    assert flags["xla_gpu_enable_while_loop_double_buffering"] == "true"


def test_defaults_off_leaves_only_the_users_flags():
    plan = gpu_flags.plan({}, enable_defaults=False, hopper=True,
                          user_flags="--xla_gpu_enable_latency_hiding_scheduler=true")
    assert _flags(plan.xla_flags) == {"xla_gpu_enable_latency_hiding_scheduler": "true"}
    assert plan.env == {}


def test_nothing_is_set_on_a_cpu_host():
    environ = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    before = dict(environ)
    assert not gpu_flags.gpu_expected(environ)
    assert gpu_flags.apply(defaults().gpu, environ) is None
    assert environ == before


def test_this_cpu_machine_is_not_taken_for_a_gpu_host():
    assert not gpu_flags.gpu_expected({})


def test_a_malformed_flag_is_one_config_error_naming_the_field():
    config = defaults()
    config.gpu.flags = "xla_gpu_enable_latency_hiding_scheduler=true"
    with pytest.raises(ConfigError, match=r"config\.gpu\.flags=.*--name=value"):
        validate(config, device_count=8, process_count=1)
    with pytest.raises(ConfigError, match=r"config\.gpu\.flags"):
        gpu_flags.apply(ml_collections.ConfigDict({"enable_defaults": True,
                                                   "flags": "--"}), {"JAX_PLATFORMS": "cpu"})


def _compiled_in(names: list[str]) -> list[str]:
    """The names the installed jaxlib holds as whole strings (the table XLA parses
    XLA_FLAGS with)."""
    library = pathlib.Path(jaxlib.__file__).parent / "libjax_common.so"
    with open(library, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        return [name for name in names if data.find(b"\0" + name.encode() + b"\0") >= 0]


def test_every_default_flag_is_one_the_installed_xla_knows():
    # XLA aborts on an unknown flag in XLA_FLAGS, so a renamed one must fail here first.
    names = list(gpu_flags.DEFAULT_XLA_FLAGS)
    assert _compiled_in(names) == names
    # The check can fail: xla_gpu_graph_level (in MaxText's older scripts) is gone.
    assert _compiled_in(["xla_gpu_graph_level"]) == []
