"""Goodput over a job's life (jdp/observe/goodput.py): each second of wall time given to
one cause, restarts included; the records a killed process leaves; the live figures in
metrics.jsonl; the table `python -m jdp.report` prints; and a job killed once and
restarted, whose lost time and recomputed steps match what is measured from outside."""

import json
import os
import signal

import pytest

from jdp import report
from jdp.observe import goodput
from jdp.runtime import exit_codes
from runs import REPO, logged_steps, read_metrics, start_main, wait_for


def step(number, at, data_wait=0.0, evaluation=0.0, checkpoint=0.0):
    return {"step": number, "t": at, "data_wait": data_wait, "eval": evaluation,
            "checkpoint": checkpoint}


ONE_ATTEMPT = [
    {"attempt": 1, "start": 100.0, "step": 0},
    step(1, 110.0),  # 10 s of start-up and compilation
    step(2, 111.0, data_wait=0.25),
    step(3, 114.0, data_wait=0.25, evaluation=1.5, checkpoint=0.5),
    {"end": 115.0, "step": 3, "data_wait": 0.25, "eval": 1.5, "checkpoint": 0.75},
]


def test_one_attempt_is_split_into_start_up_steps_and_the_timed_phases():
    accounting = goodput.account(ONE_ATTEMPT)
    assert accounting.seconds == pytest.approx({
        "productive": 0.75 + 1.0, "compilation": 10.0, "data_wait": 0.25,
        "checkpoint": 0.75, "evaluation": 1.5, "failures": 0.0, "other": 0.75})
    assert accounting.total_s == pytest.approx(15.0)
    assert accounting.goodput == pytest.approx(1.75 / 15.0)
    assert (accounting.attempts, accounting.failures, accounting.recomputed_steps) == (1, 0, 0)


def test_a_cut_attempt_costs_its_gap_to_the_next_first_step_and_the_recomputed_steps():
    """Killed after step 7; the next attempt restores step 4's checkpoint: the time from
    step 7 the first time to step 7 the second time is lost, and 3 steps ran twice."""
    records = [{"attempt": 1, "start": 0.0, "step": 0},
               *(step(s, 9.0 + s) for s in range(1, 8)),  # steps 1..7 at 10..16 s
               {"attempt": 2, "start": 20.0, "step": 4},
               *(step(s, 25.0 + s) for s in range(5, 9))]  # steps 5..8 at 30..33 s
    accounting = goodput.account(records)
    assert accounting.seconds["failures"] == pytest.approx(32.0 - 16.0)
    assert accounting.seconds["productive"] == pytest.approx(6.0 + 1.0)
    assert accounting.seconds["compilation"] == pytest.approx(10.0)
    assert accounting.total_s == pytest.approx(33.0)
    assert (accounting.attempts, accounting.failures, accounting.recomputed_steps) == (2, 1, 3)


def test_the_time_between_a_finished_attempt_and_a_later_one_is_not_the_jobs():
    later = [{"attempt": 2, "start": 1000.0, "step": 3}, step(4, 1004.0), step(5, 1005.0)]
    accounting = goodput.account([*ONE_ATTEMPT, *later])
    assert accounting.total_s == pytest.approx(15.0 + 5.0)
    assert accounting.seconds["compilation"] == pytest.approx(10.0 + 4.0)
    assert accounting.failures == 0


def write_lines(path, lines):
    with open(path, "w") as f:
        f.writelines(lines)


def test_a_line_cut_short_by_a_kill_is_left_out_and_a_bad_line_is_named(tmp_path):
    lines = [json.dumps(record) + "\n" for record in ONE_ATTEMPT[:3]]
    write_lines(tmp_path / "goodput.jsonl", [*lines, '{"step": 3, "t": 11'])
    assert goodput.read_records(str(tmp_path)) == ONE_ATTEMPT[:3]
    write_lines(tmp_path / "goodput.jsonl", [lines[0], "not json\n", lines[1]])
    with pytest.raises(goodput.GoodputError, match=r"goodput.jsonl:2 is not JSON"):
        goodput.read_records(str(tmp_path))
    write_lines(tmp_path / "goodput.jsonl", [lines[0], '{"loss": 1.0}\n'])
    with pytest.raises(goodput.GoodputError, match=r"goodput.jsonl:2 is not a goodput record"):
        goodput.read_records(str(tmp_path))


def test_a_ledger_continues_the_accounting_of_the_attempts_before_it(tmp_path):
    write_lines(tmp_path / "goodput.jsonl", [json.dumps(r) + "\n" for r in ONE_ATTEMPT[:4]])
    now = iter([200.0, 203.0, 204.0, 205.0])
    phases = {"data_wait": 0.0, "eval": 0.0, "checkpoint": 0.0}
    ledger = goodput.Ledger(str(tmp_path), enabled=True, start_step=2, phases=phases,
                            clock=lambda: next(now))
    ledger.step(3)
    ledger.step(4)
    ledger.finished(4)
    records = goodput.read_records(str(tmp_path))
    assert records[4:] == [{"attempt": 2, "start": 200.0, "step": 2}, step(3, 203.0),
                           step(4, 204.0), {"end": 205.0, "step": 4, **phases}]
    live = ledger.metrics()
    assert live == goodput.account(records).metrics()
    # The first attempt was cut after step 3 (114 s); the second reached it at 203 s.
    assert live["goodput/failures_s"] == pytest.approx(203.0 - 114.0)
    assert live["goodput/recomputed_steps"] == 1.0


def test_other_processes_keep_no_records(tmp_path):
    ledger = goodput.Ledger(str(tmp_path), enabled=False, start_step=0, phases={})
    ledger.step(1)
    ledger.finished(1)
    assert ledger.metrics() == {}
    assert not os.path.exists(tmp_path / "goodput.jsonl")


def test_the_report_prints_goodput_and_the_badput_table(tmp_path, capsys):
    write_lines(tmp_path / "metrics.jsonl", ['{"step": 3, "train/loss": 1.0}\n'])
    write_lines(tmp_path / "goodput.jsonl", [json.dumps(r) + "\n" for r in ONE_ATTEMPT])
    assert report.main([str(tmp_path), "--names", "run"]) == 0
    out = capsys.readouterr().out
    assert ("run: goodput 11.7% (1.8 s productive of 15.0 s over 1 attempt; 0 failures, "
            "0 steps recomputed)") in out
    table = out[out.index("cause"):].splitlines()
    assert table[1].split() == ["productive", "steps", "1.8", "11.7%"]
    assert table[2].split() == ["start-up", "and", "compilation", "10.0", "66.7%"]
    assert "Goodput of run" in (tmp_path / "report" / "index.html").read_text()


def test_the_report_names_goodput_records_it_cannot_read(tmp_path, capsys):
    write_lines(tmp_path / "metrics.jsonl", ['{"step": 3, "train/loss": 1.0}\n'])
    write_lines(tmp_path / "goodput.jsonl", ["{}\n", "{}\n"])
    assert report.main([str(tmp_path)]) == exit_codes.BAD_CONFIG
    assert "goodput.jsonl:1 is not a goodput record" in capsys.readouterr().err


# The shipped ViT with a hook that holds the job at step 7: the first attempt as if it
# hung (it is killed there, so its records end at step 7 whenever the kill lands), the
# second for a few seconds (so that metrics.jsonl's time of change is step 7's while the
# test reads it).
HELD_AT_STEP_7 = """
import importlib.util
import os
import time

from jdp.hooks import Hook

_spec = importlib.util.spec_from_file_location("shipped_vit", {vit!r})
_vit = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_vit)
get_config = _vit.get_config
build_model = _vit.build_model


def build_hooks(config):
    def hold(step, info):
        for marker, seconds in (({first!r}, 600), ({second!r}, 5)):
            if step == 7 and not os.path.exists(marker):
                open(marker, "w").close()
                time.sleep(seconds)
                return

    return [Hook(hold, every=1)]
"""


@pytest.mark.slow
def test_a_job_killed_once_and_restarted_reports_the_time_and_steps_it_lost(tmp_path):
    """The loop logs step s once step s + 1 is dispatched, so in both attempts the line
    of step 6 is written as the job reaches step 7, and the job is then held there: the
    time between the two writes (the file's modification times, set by the kernel) is
    what the kill cost, measured from outside. The first attempt is killed at step 7;
    the steps after its last complete checkpoint (step 4's, unless that save was still
    under way) are computed again."""
    experiment = tmp_path / "held_at_step_7.py"
    held = [tmp_path / "held_first", tmp_path / "held_second"]
    experiment.write_text(HELD_AT_STEP_7.format(
        vit=os.path.join(REPO, "experiments/vit.py"), first=str(held[0]), second=str(held[1])))
    workdir = tmp_path / "run"
    args = (f"--config={experiment}", f"--workdir={workdir}", "--config.total_steps=10",
            "--config.warmup_steps=1", "--config.log_every_steps=1",
            "--config.eval_every_steps=0", "--config.batch_size=64",
            "--config.checkpoint.every_steps=4")
    reached_7 = []  # when each attempt wrote the line of step 6

    def held_at_7(process, marker) -> None:
        wait_for(lambda: marker.exists() or process.poll() is not None, 240, "step 7")
        assert process.poll() is None, "the job ended before step 7"
        assert max(logged_steps(workdir)) == 6
        reached_7.append(os.stat(workdir / "metrics.jsonl").st_mtime)

    first = start_main(*args)
    try:
        held_at_7(first, held[0])
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    # Saved asynchronously, step 4's checkpoint may not have been complete by then.
    restored = max((int(path.name) for path in (workdir / "checkpoints").iterdir()
                    if path.name.isdigit()), default=0)
    second = start_main(*args)
    try:
        held_at_7(second, held[1])
        assert second.wait(timeout=240) == 0
    finally:
        if second.poll() is None:
            second.kill()
    accounting = goodput.account(goodput.read_records(str(workdir)))
    assert (accounting.attempts, accounting.failures) == (2, 1)
    assert accounting.recomputed_steps == 7 - restored
    lost = reached_7[1] - reached_7[0]
    assert abs(accounting.seconds["failures"] - lost) < 1.0, (accounting.seconds, lost)
    # As the job went: the last window's figures in metrics.jsonl and TensorBoard.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    last = [r for r in read_metrics(workdir) if "train/loss" in r][-1]
    assert last["step"] == 10
    assert last["goodput/recomputed_steps"] == 7 - restored
    assert last["goodput/failures_s"] == pytest.approx(accounting.seconds["failures"])
    events = EventAccumulator(str(workdir / "tensorboard"))
    events.Reload()
    [*_, final] = events.Scalars("goodput/failures_s")
    assert (final.step, final.value) == (10, pytest.approx(last["goodput/failures_s"]))
