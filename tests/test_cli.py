"""`python -m jdp.main` as a user runs it: bad input fails with one clear line, exit
status 2, and nothing written to the workdir."""

import pytest

from runs import run_main

BAD_INPUTS = {
    "batch_not_divisible": (
        ["--config.batch_size=100"],
        ["config.batch_size=100", "device count (8)", "--config.batch_size=96"]),
    "accumulation_not_dividing": (["--config.grad_accum_steps=3"],
                                  ["config.grad_accum_steps=3", "per-device batch"]),
    "unknown_override_key": (["--config.batch_sise=64"], ["key batch_sise", "batch_size"]),
    "unknown_nested_section": (["--config.wandb.mode=offline"],
                               ["key wandb.mode", "--config.wandb.mode=offline"]),
    "unknown_nested_key": (["--config.data.tokenizr=bytes"], ["key data.tokenizr",
                                                              "data.tokenizer"]),
    "key_below_a_value": (["--config.data.image_size.x=3"], ["data.image_size is a value"]),
    "wrong_value_type": (["--config.batch_size=big"], ["--config.batch_size=big", "int"]),
    "unprepared_dataset": (["--config.data.name=mnist2"],
                           ["config.data.name='mnist2'", "not prepared", "tfds build mnist2"]),
    "unknown_flag": (["--dry_runn"], ["unknown flag --dry_runn", "--workdir", "--config.KEY"]),
    "keep_best_unknown_metric": (["--config.checkpoint.keep_best=eval/acc"],
                                 ["config.checkpoint.keep_best='eval/acc'", "'eval/accuracy'"]),
    "absent_feature_key": (["--config.data.image_key=img"],
                           ["config.data.image_key='img'", "no such feature", "'image'"]),
    "unknown_model_size": (["--config.model.size=huge"], ["model.size='huge'", "nano"]),
    "unknown_backend": (["--config.parallel.backend=horovod"],
                        ["config.parallel.backend='horovod'", "'pmap'"]),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_fails_cleanly_with_nothing_written(case, tmp_path):
    overrides, expected = BAD_INPUTS[case]
    workdir = tmp_path / "run"
    proc = run_main("--config=experiments/vit.py", f"--workdir={workdir}", *overrides)
    assert proc.returncode == 2, proc.stderr[-2000:]
    last_line = proc.stderr.strip().splitlines()[-1]
    assert last_line.startswith("jdp: error:"), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    for fragment in expected:
        assert fragment in last_line
    assert not workdir.exists()


def test_missing_experiment_file_fails_cleanly(tmp_path):
    workdir = tmp_path / "run"
    proc = run_main("--config=experiments/no_such.py", f"--workdir={workdir}")
    assert proc.returncode == 2
    assert "experiments/no_such.py" in proc.stderr and "no such experiment file" in proc.stderr
    assert not workdir.exists()


def test_unwritable_workdir_fails_cleanly(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    proc = run_main("--config=experiments/vit.py", f"--workdir={blocker}/run")
    assert proc.returncode == 2
    assert f"--workdir='{blocker}/run'" in proc.stderr and "not a writable directory" in proc.stderr
    assert blocker.read_text() == ""


def test_the_argument_after_the_colon_selects_the_variant(tmp_path):
    workdir = tmp_path / "run"
    proc = run_main("--config=experiments/vit.py:cifar10", f"--workdir={workdir}",
                    f"--config.data.data_dir={tmp_path}/tfds")
    assert proc.returncode == 2
    last_line = proc.stderr.strip().splitlines()[-1]
    assert "config.data.name='cifar10'" in last_line and "tfds build cifar10" in last_line
    assert not workdir.exists()


def test_an_experiment_file_with_a_syntax_error_exits_2_naming_the_file_and_line(tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("def get_config(arg=None):\n    return {\n\ndef build_model(config):\n"
                      "    pass\n")
    proc = run_main(f"--config={broken}", f"--workdir={tmp_path / 'run'}")
    assert proc.returncode == 2, proc.stderr[-2000:]
    message = proc.stderr.strip().splitlines()[-1]
    assert message.startswith("jdp: error:") and str(broken) in message and "line 2" in message
    assert "Traceback" not in proc.stderr and not (tmp_path / "run").exists()
