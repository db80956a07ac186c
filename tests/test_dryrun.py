"""The dry run: the train step compiled for the configured topology from shapes alone,
described (memory, FLOPs, collectives, scaling) without training or writing anything."""

import pytest

from jdp import main as jdp_main
from jdp.dryrun import estimate, hlo
from jdp.errors import ConfigError
from runs import load_config, run_main

EXPERIMENTS = ["experiments/vit.py", "experiments/resnet.py", "experiments/lm.py"]


def dry_run(path, *overrides, **options):
    return jdp_main.run(load_config(path, *overrides), path, "/nonexistent/never-written",
                        dry_run=True, **options)


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_the_gradient_all_reduce_carries_4_bytes_per_parameter(experiment, capsys):
    result = dry_run(experiment)
    inputs = result.inputs
    lowered = hlo.collectives(result.lowered_hlo)  # the program jdp hands XLA
    gradients = estimate.gradient_all_reduce_bytes(lowered) - inputs.metric_bytes
    assert gradients == 4 * inputs.num_params
    # On CPU the gradients travel packed in one buffer (reducers.fused_psum), so XLA's
    # all-reduce combiner leaves ResNet's BatchNorm statistics in ops of their own.
    compiled = estimate.gradient_all_reduce_bytes(inputs.collectives) - inputs.metric_bytes
    assert compiled == 4 * inputs.num_params
    assert "Pre-flight plan" in capsys.readouterr().out


def test_a_bfloat16_reduction_carries_2_bytes_per_parameter():
    # In the program jdp hands XLA: XLA:CPU itself reduces bfloat16 in float32.
    result = dry_run("experiments/vit.py", "--config.parallel.grad_reduce_dtype=bfloat16")
    lowered = hlo.collectives(result.lowered_hlo)
    gradients = estimate.gradient_all_reduce_bytes(lowered) - result.inputs.metric_bytes
    assert gradients == 2 * result.inputs.num_params


def test_a_step_too_large_for_the_device_fails_the_plan_naming_the_fixes():
    with pytest.raises(ConfigError, match=r"needs .* per device .* has 1\.0 MiB.*Fix:.*remat"):
        dry_run("experiments/vit.py", device_memory_gib=1 / 1024)


def test_the_dry_run_command_prints_the_plan_and_writes_nothing(tmp_path):
    workdir = tmp_path / "run"
    proc = run_main("--config=experiments/vit.py", f"--workdir={workdir}", "--dry_run",
                    "--step_time_s=0.05")
    assert proc.returncode == 0, proc.stderr[-3000:]
    for line in ("Pre-flight plan", "Memory per device", "Gradient all-reduce", "512"):
        assert line in proc.stdout
    assert not workdir.exists()
