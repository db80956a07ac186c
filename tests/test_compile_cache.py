"""The persistent compilation cache: where it lives, that a second run reads the step
from it instead of compiling, and that it never changes or stops a run."""

import logging
import os

import jax
import pytest

from jdp import config as config_lib
from jdp import main as jdp_main
from jdp.runtime import compile_cache
from runs import load_config, losses, train

VIT = "experiments/vit.py"
TINY = ("--config.batch_size=64", "--config.total_steps=2", "--config.warmup_steps=1",
        "--config.log_every_steps=1", "--config.tensorboard=false")
HIT = "Persistent compilation cache hit for 'jit_train_step'"


def test_the_environment_variable_names_the_default_directory():
    environ = {"JDP_COMPILE_CACHE_DIR": "/shared/jdp", "XDG_CACHE_HOME": "/xdg"}
    assert compile_cache.resolve_dir("", environ) == "/shared/jdp"


def test_without_the_variable_the_cache_lives_under_xdg_cache_home_else_home():
    assert compile_cache.resolve_dir("", {"XDG_CACHE_HOME": "/xdg"}) == "/xdg/jdp/compile_cache"
    assert compile_cache.resolve_dir("", {}) == os.path.expanduser("~/.cache/jdp/compile_cache")


def test_a_configured_directory_wins_and_none_turns_the_cache_off():
    environ = {"JDP_COMPILE_CACHE_DIR": "/shared/jdp"}
    assert compile_cache.resolve_dir("/mine", environ) == "/mine"
    assert compile_cache.resolve_dir("none", environ) is None


def test_a_cache_enabled_for_a_block_leaves_the_process_settings_as_they_were(tmp_path):
    # A benchmark run in-process (tests/test_bench.py) uses a cache of its own.
    settings = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")
    before = [getattr(jax.config, name) for name in settings]
    with compile_cache.enabled(str(tmp_path)):
        assert jax.config.jax_compilation_cache_dir == str(tmp_path)
    assert [getattr(jax.config, name) for name in settings] == before


def test_a_run_may_resume_with_another_cache_directory():
    saved = {**config_lib.defaults().to_dict(), "compile_cache_dir": "/old"}
    current = {**config_lib.defaults().to_dict(), "compile_cache_dir": "none"}
    assert config_lib.resume_differences(saved, current) == []


class _Log(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _run_logging_compiles(workdir, cache_dir) -> tuple[list[dict], str]:
    """A tiny run: its metrics records and its warnings, every compile and cache hit
    among them."""
    log = _Log()
    logging.getLogger().addHandler(log)
    try:
        with jax.log_compiles():
            _, records = train(VIT, workdir, *TINY, f"--config.compile_cache_dir={cache_dir}")
    finally:
        logging.getLogger().removeHandler(log)
    return records, "\n".join(log.lines)


def _entries(cache_dir) -> dict[str, int]:
    return {path.name: path.stat().st_mtime_ns for path in cache_dir.iterdir()}


@pytest.fixture(scope="module")
def cold_then_warm(tmp_path_factory) -> dict:
    """The same tiny run twice into one new cache directory: what each logged and wrote."""
    root = tmp_path_factory.mktemp("cold_warm")
    cache_dir = root / "cache"
    seen = {"cache_dir": cache_dir}
    seen["cold_records"], seen["cold_log"] = _run_logging_compiles(root / "cold", cache_dir)
    seen["cold_entries"] = _entries(cache_dir)
    seen["warm_records"], seen["warm_log"] = _run_logging_compiles(root / "warm", cache_dir)
    seen["warm_entries"] = _entries(cache_dir)
    yield seen
    compile_cache.enable(compile_cache.resolve_dir(""))  # later tests: the session's cache


def test_a_first_run_compiles_the_step_and_writes_it_to_the_cache(cold_then_warm):
    assert HIT not in cold_then_warm["cold_log"]
    assert any(name.startswith("jit_train_step-") for name in cold_then_warm["cold_entries"])


def test_a_second_run_reads_the_step_from_the_cache(cold_then_warm):
    assert HIT in cold_then_warm["warm_log"]
    assert cold_then_warm["warm_entries"] == cold_then_warm["cold_entries"]  # nothing rewritten


def test_a_run_from_the_cache_trains_bitwise_like_a_compiled_one(cold_then_warm):
    cold, warm = losses(cold_then_warm["cold_records"]), losses(cold_then_warm["warm_records"])
    assert sorted(cold) == [1, 2] and warm == cold


def test_a_dry_run_compiles_the_very_step_the_run_compiles(cold_then_warm, tmp_path):
    """The dry run (and the tuner, which compiles each candidate the same way) lowers
    the step from shapes alone, to the program the run compiles: into the runs' cache
    it reads their step and writes nothing. (jax keys an entry on its cache directory
    too, so a dry run and the run after it must share one, as they do by default.)"""
    cache_dir = cold_then_warm["cache_dir"]
    config = load_config(VIT, *TINY, f"--config.compile_cache_dir={cache_dir}")
    log = _Log()
    logging.getLogger().addHandler(log)
    try:
        with jax.log_compiles():
            jdp_main.run(config, VIT, str(tmp_path / "plan"), dry_run=True)
    finally:
        logging.getLogger().removeHandler(log)
        compile_cache.enable(compile_cache.resolve_dir(""))  # later tests: the session's
    assert HIT in "\n".join(log.lines)
    assert _entries(cache_dir) == cold_then_warm["warm_entries"]


def test_a_torn_cache_entry_is_recompiled_with_a_warning(cold_then_warm, tmp_path):
    """What jdp relies on when processes share a directory (jdp/compile_cache.py): jax
    writes an entry in place, so a reader can find it cut short. (The state
    initialisation's entry: it recompiles faster than the step's.)"""
    [init_entry] = cold_then_warm["cache_dir"].glob("jit_init_state-*")
    init_entry.write_bytes(init_entry.read_bytes()[: init_entry.stat().st_size // 2])

    with pytest.warns(UserWarning, match="Error reading persistent compilation cache entry "
                                         "for 'jit_init_state'"):
        records, log = _run_logging_compiles(tmp_path, cold_then_warm["cache_dir"])
    assert HIT in log  # the step's entry is whole
    assert losses(records) == losses(cold_then_warm["cold_records"])


def test_an_unwritable_cache_directory_only_warns_and_the_run_trains(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    records, log = _run_logging_compiles(tmp_path / "run", blocker / "cache")
    assert f"compilation cache off: config.compile_cache_dir resolved to '{blocker}/cache'" in log
    assert sorted(losses(records)) == [1, 2]
    assert blocker.read_text() == ""
