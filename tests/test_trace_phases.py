"""Step time split from the profile window's trace: compute, collectives (exposed and
overlapped), host/input wait and idle, and `python -m jdp.report` showing it."""

import os
import textwrap

import pytest
from test_observability import SLOW_INPUT_EXPERIMENT, TINY, VIT

from jdp import report
from jdp.observe import trace_phases
from runs import train

PROFILED = ("--config.profile.start_step=3", "--config.profile.num_steps=3")


def test_a_known_timeline_splits_exactly():
    # One device, two steps dispatched at 0 and 100 (ns). Step 1: compute 10-50, an
    # all-reduce 40-70 (10 of it alongside compute); the device then waits for the
    # host until the dispatch at 100, and step 2's work starts at 110 (10 idle).
    events = {"device 0": [(10, 50, False), (40, 70, True), (110, 150, False)]}
    result = trace_phases.split([0, 100], events)
    assert result.steps == 2 and result.devices == 1
    assert result.step_time_s == pytest.approx(75e-9)  # (150 - 0) / 2
    assert result.compute_s * 2 == pytest.approx(80e-9)
    assert result.collective_overlapped_s * 2 == pytest.approx(10e-9)
    assert result.collective_exposed_s * 2 == pytest.approx(20e-9)
    assert result.host_wait_s * 2 == pytest.approx(30e-9)  # 70 .. 100
    assert result.idle_s * 2 == pytest.approx(20e-9)  # 0 .. 10 and 100 .. 110
    assert sum(result.shares().values()) == pytest.approx(1.0)
    assert result.overlap_fraction() == pytest.approx(1 / 3)


@pytest.mark.parametrize("name, collective", [
    ("all-reduce.3", True), ("psum.7", True), ("psum_scatter.2", True),
    ("all-gather-start.1", True), ("all_gather.4", True), ("ppermute.1", True),
    ("ncclDevKernel_AllReduce_Sum_f32", True), ("fusion.12", False), ("dot.5", False),
    ("copy.3", False), ("reduce.9", False)])
def test_collectives_are_told_by_xlas_names_and_by_jaxs(name, collective):
    # An XLA:CPU trace names an operation as its HLO instruction: jax's psum of one
    # buffer (the CPU gradient all-reduce) keeps jax's name, `psum.N`.
    assert bool(trace_phases._COLLECTIVE.search(name)) is collective


@pytest.fixture(scope="module")
def profiled_run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("profiled")
    train(VIT, workdir, *TINY, "--config.total_steps=8", *PROFILED)
    return workdir


def test_a_real_trace_of_eight_devices_has_compute_and_collectives(profiled_run):
    result = report.profile_phases(str(profiled_run))
    assert result.steps == 3 and result.devices == 8
    assert sum(result.shares().values()) == pytest.approx(1.0)
    assert result.compute_s > 0 and result.collective_s > 0  # the gradient all-reduce
    assert 0 < result.step_time_s < 60


def test_the_report_shows_the_split_for_a_run_with_a_profile_window(profiled_run, tmp_path,
                                                                     capsys):
    assert report.main([str(profiled_run), "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "step time from the profile window" in out
    assert "collectives (exposed)" in out
    assert "Step time from the profile" in (tmp_path / "index.html").read_text()


def test_a_run_without_a_profile_window_has_no_split(tmp_path):
    assert report.profile_phases(str(tmp_path)) is None


def test_a_slow_input_shows_as_host_wait_in_the_trace(tmp_path):
    experiment_file = tmp_path / "slow.py"
    experiment_file.write_text(textwrap.dedent(SLOW_INPUT_EXPERIMENT).replace(
        "{vit}", os.path.abspath(VIT)))
    # Steps 10-13 of 16: the prefetch buffers have drained, each step waits for
    # 64 x 5 ms of input while the step itself computes in ~20-50 ms.
    train(str(experiment_file), tmp_path / "run", *TINY, "--config.data.num_threads=1",
          "--config.total_steps=16", "--config.log_every_steps=4",
          "--config.profile.start_step=9", "--config.profile.num_steps=4")
    shares = report.profile_phases(str(tmp_path / "run")).shares()
    assert max(shares, key=shares.get) == "host/input wait", shares
