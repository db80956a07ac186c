"""jdp.report: plots, index.html and the summary table from synthetic metrics.jsonl files."""

import json
import os
import re
import subprocess
import sys

import matplotlib.image
import pytest

from jdp import report

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _write_jsonl(workdir, records, tail=""):
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
        f.write(tail)
    return str(workdir)


def _train_log(step, examples_per_s, **extra):
    return {"step": step, "train/loss": 2.0 / step, "train/examples_per_s": examples_per_s,
            "train/step_time_s": 0.1, "time/wall_s": 1.5 * step, **extra}


def _run_a(workdir):
    """Logs every 10 steps to 100, evals at 50 and 100; resumed at 60 after a first attempt
    had written steps 60-100 with values the resumed run replaces."""
    first_attempt = [_train_log(step, 1.0, **{"train/token_accuracy": 0.1})
                     for step in range(60, 101, 10)]
    first_attempt.append({"step": 100, "eval/loss": 9.0, "eval/token_accuracy": 0.0})
    records = [_train_log(step, 10.0 * step, **{"train/token_accuracy": step / 100,
                                                "train/data_wait_fraction": 0.25})
               for step in range(10, 101, 10)]
    evals = {50: {"step": 50, "eval/loss": 0.8, "eval/token_accuracy": 0.6,
                  "eval/num_examples": 64.0},
             100: {"step": 100, "eval/loss": 0.5, "eval/token_accuracy": 0.9,
                   "eval/num_examples": 64.0}}
    before = [r for r in records if r["step"] < 60] + [evals[50]]
    after = [r for r in records if r["step"] >= 60] + [evals[100]]
    return _write_jsonl(workdir, before + first_attempt + after)


def _run_b(workdir):
    """No task metric, no data-wait fraction; constant 300 examples/s."""
    records = [_train_log(step, 300.0) for step in range(10, 101, 10)]
    records.append({"step": 100, "eval/loss": 0.75, "eval/num_examples": 64.0})
    return _write_jsonl(workdir, records)


def _table_cells(text):
    """{run: {column: cell}} from the printed table, cut at the header's column starts."""
    lines = [line for line in text.splitlines() if line.strip()]
    header = lines[0]
    starts = [m.start() for m in re.finditer(r"\S+(?: \S+)*", header)]
    bounds = list(zip(starts, [*starts[1:], None], strict=True))
    columns = [header[a:b].strip() for a, b in bounds]
    rows = [[line[a:b].strip() for a, b in bounds] for line in lines[1:]]
    return {row[0]: dict(zip(columns, row, strict=True)) for row in rows}


@pytest.fixture
def two_runs(tmp_path):
    return _run_a(tmp_path / "run_a"), _run_b(tmp_path / "run_b")


@pytest.fixture
def written(two_runs, tmp_path, capsys):
    """Runs the report on both runs; returns (out dir, stdout)."""
    out = tmp_path / "out"
    assert report.main([*two_runs, "--out", str(out)]) == 0
    return out, capsys.readouterr().out


def test_writes_a_valid_png_per_panel_that_some_run_has(written):
    out, _ = written
    pngs = sorted(p for p in os.listdir(out) if p.endswith(".png"))
    assert pngs == ["data_wait.png", "loss.png", "metric_token_accuracy.png", "step_time.png",
                    "throughput.png"]
    for name in pngs:
        with open(out / name, "rb") as f:
            assert f.read(8) == PNG_SIGNATURE
        image = matplotlib.image.imread(out / name)
        assert image.ndim >= 2 and image.shape[:2] == (350, 600)


def test_skips_a_panel_no_run_has(written):
    out, _ = written
    # Neither run logs train/learning_rate.
    assert not (out / "learning_rate.png").exists()


def test_index_html_shows_every_png_and_the_summary(written):
    out, _ = written
    page = (out / "index.html").read_text()
    for name in os.listdir(out):
        if name.endswith(".png"):
            assert f'src="{name}"' in page
    assert "<table>" in page and "<td>run_a</td>" in page and "<td>run_b</td>" in page


def test_summary_has_last_eval_and_median_throughput_per_run(written):
    _, stdout = written
    rows = _table_cells(stdout)
    assert set(rows) == {"run_a", "run_b"}
    # run_a's last evaluation is the resumed run's, not the first attempt's 9.0.
    assert rows["run_a"]["eval/loss"] == "0.5000"
    assert rows["run_a"]["eval/token_accuracy"] == "0.9000"
    assert rows["run_b"]["eval/loss"] == "0.7500"
    assert rows["run_b"]["eval/token_accuracy"] == ""
    # Median of 100, 200, ..., 1000; the first attempt's 1.0s were replaced.
    assert rows["run_a"]["examples/s (median)"] == "550.0"
    assert rows["run_b"]["examples/s (median)"] == "300.0"
    assert rows["run_a"]["wall time (s)"] == "150.0"


def test_default_out_dir_is_first_workdirs_report_folder(two_runs, capsys):
    assert report.main([two_runs[0]]) == 0
    assert os.path.isfile(os.path.join(two_runs[0], "report", "index.html"))
    assert "run_a" in capsys.readouterr().out


def test_names_replace_workdir_base_names(two_runs, tmp_path, capsys):
    report.main([*two_runs, "--out", str(tmp_path / "out"), "--names", "base", "wide"])
    assert set(_table_cells(capsys.readouterr().out)) == {"base", "wide"}


def test_repeated_names_are_made_unique():
    assert report.unique_names(["run", "run", "x", "run"]) == ["run", "run-2", "x", "run-3"]


def test_resumed_steps_keep_the_last_value_of_each_key():
    lines = ['{"step": 5, "train/loss": 3.0, "train/mae": 1.0}\n',
             '{"step": 5, "eval/loss": 2.0}\n',
             '{"step": 5, "train/loss": 1.0}\n',
             '{"step": 2, "train/loss": 4.0}\n']
    assert report.parse_records(lines, "m.jsonl") == [
        {"step": 2, "train/loss": 4.0},
        {"step": 5, "train/loss": 1.0, "train/mae": 1.0, "eval/loss": 2.0}]


def test_a_last_line_still_being_written_is_ignored():
    lines = ['{"step": 1, "train/loss": 1.0}\n', '{"step": 2, "train/lo']
    assert report.parse_records(lines, "m.jsonl") == [{"step": 1, "train/loss": 1.0}]


def test_task_metrics_are_whatever_is_not_a_trainer_metric():
    records = [{"step": 1, "train/loss": 1.0, "train/exact_match": 0.5, "train/mfu": 0.3},
               {"step": 2, "eval/loss": 1.0, "eval/bleu": 20.0, "eval/num_examples": 8.0}]
    assert report.task_metrics(records) == ["bleu", "exact_match"]


# Log windows of 10, 10 and 10 steps: 5 s (1 s waiting), 10 s (5 s waiting), 2.5 s (none);
# an eval-only record at step 25 is not a window boundary.
HAND_MADE = [
    {"step": 10, "train/step_time_s": 0.5, "train/data_wait_fraction": 0.2},
    {"step": 20, "train/step_time_s": 1.0, "train/data_wait_fraction": 0.5, "time/eval_s": 2.0},
    {"step": 25, "eval/loss": 1.0},
    {"step": 30, "train/step_time_s": 0.25, "time/checkpoint_s": 1.5},
]


def test_phase_seconds_split_log_windows_into_compute_and_data_wait():
    assert report.phase_seconds(HAND_MADE) == pytest.approx(
        {"step": 11.5, "data wait": 6.0, "eval": 2.0, "checkpoint": 1.5})


def test_slowest_phase_is_the_one_with_most_seconds():
    name, seconds, share = report.slowest_phase(HAND_MADE)
    assert (name, seconds, share) == ("step", pytest.approx(11.5), pytest.approx(11.5 / 21))
    assert report.summary_row(HAND_MADE, [])[-1] == "step 55% (11.5 s)"


def test_slowest_phase_can_be_data_wait_or_checkpointing():
    starved = [{"step": 10, "train/step_time_s": 1.0, "train/data_wait_fraction": 0.9}]
    assert report.slowest_phase(starved)[:2] == ("data wait", pytest.approx(9.0))
    saving = [{"step": 10, "train/step_time_s": 0.1, "time/checkpoint_s": 4.0}]
    assert report.slowest_phase(saving)[:2] == ("checkpoint", pytest.approx(4.0))


def test_slowest_phase_is_none_without_timings():
    assert report.slowest_phase([{"step": 1, "train/loss": 1.0}]) is None


def test_missing_metrics_exits_2_with_one_line_naming_the_path(tmp_path):
    # Through `python -m`, as a user runs it.
    workdir = tmp_path / "empty_run"
    workdir.mkdir()
    result = subprocess.run([sys.executable, "-m", "jdp.report", str(workdir)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1
    assert str(workdir / "metrics.jsonl") in result.stderr
    assert not (workdir / "report").exists()


def test_a_file_that_is_not_json_lines_exits_2_naming_path_and_line(tmp_path, capsys):
    workdir = _write_jsonl(tmp_path / "bad", [{"step": 1, "train/loss": 1.0}],
                           tail="step 2 loss 0.5\n")
    assert report.main([workdir]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert os.path.join(workdir, "metrics.jsonl") + ":2" in err


def test_a_record_without_integer_step_exits_2(tmp_path, capsys):
    workdir = _write_jsonl(tmp_path / "nostep", [{"train/loss": 1.0}])
    assert report.main([workdir]) == 2
    assert "integer 'step'" in capsys.readouterr().err


def test_a_language_model_run_gets_its_token_throughput_and_bits_per_byte_panels():
    records = [{"step": 10, "train/loss": 3.0, "train/tokens_per_s": 5000.0,
                "train/tokens_per_s_per_device": 625.0, "train/loss_weight": 4096.0},
               {"step": 10, "eval/loss": 3.1, "eval/bits_per_byte": 2.2, "eval/perplexity": 22.0}]
    assert report.task_metrics(records) == ["bits_per_byte", "perplexity"]
    titles = [panel.title for panel in report.panels_for({"lm": records})]
    assert "throughput (real target tokens/s)" in titles and "bits_per_byte" in titles
    assert "tokens_per_s" not in titles  # a system figure, not a task metric
