"""Trackers: what metrics.jsonl gets (and the config, texts and the report's plots) reaches
W&B offline and MLflow, read back by their own readers; a killed run resumes the same W&B
and MLflow runs with every step once; a tracker whose backend fails warns once and training
goes on; only process 0 sends; bad tracker settings fail in one line before anything is
written."""

import importlib.machinery
import json
import logging
import os
import sys
import textwrap
import threading
import types

import pytest

from jdp import main as jdp_main
from jdp.config.resume import flatten
from jdp.errors import ConfigError
from jdp.track import configured
from jdp.track import feed as feed_module
from jdp.track.feed import RUN_IDS_FILE, TrackerFeed
from jdp.track.wandb_tracker import offline_run_dirs, wandb_cli
from jdp.train.hooks import HookInfo
from runs import REPO, load_config, read_metrics, run_main, train

VIT = "experiments/vit.py"
TINY = ("--config.batch_size=32", "--config.total_steps=16", "--config.warmup_steps=2",
        "--config.log_every_steps=2", "--config.eval_every_steps=8",
        "--config.eval_batch_size=32", "--config.checkpoint.every_steps=8")
BOTH = "--config.tracker.kind=wandb,mlflow"


def settings(workdir) -> tuple[str, ...]:
    """TINY with both trackers, and the user's tracker writing into the workdir."""
    return (*TINY, BOTH, f"--config.shared_file={workdir}/shared.jsonl")
# The values that are the trajectory: the same in a resumed run as in the one it resumes
# (the times and speeds of a step recomputed after a kill are not).
TRAJECTORY = ("train/loss", "train/accuracy", "train/learning_rate", "train/grad_norm",
              "eval/loss", "eval/accuracy")

# The shipped ViT with hooks of a user's: a text at each evaluation (as a model's sample is
# written); a SIGKILL at step 12 while the workdir holds a KILL file (once the step-8
# checkpoint is complete and both trackers have started); and README's own tracker, which
# appends each step to the file `config.shared_file`.
EXPERIMENT = '''
    import importlib.util
    import json
    import os
    import signal
    import time

    from jdp.hooks import Hook, tracking_hook

    _spec = importlib.util.spec_from_file_location("shipped_vit", {vit!r})
    _vit = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_vit)

    build_model = _vit.build_model


    def get_config(arg=None):
        config = _vit.get_config(arg)
        config.shared_file = ""
        return config


    class JsonLinesTracker:
        name = "shared_file"

        def __init__(self, path):
            self.path = path

        def start(self, run_id, config):      # -> (run id, last step the backend holds)
            steps = [json.loads(line)["step"] for line in open(self.path)] \\
                if os.path.exists(self.path) else []
            return run_id or os.path.basename(self.path), max(steps, default=0)

        def log(self, record):
            with open(self.path, "a") as f:
                row = {{"step": record.step, **record.metrics, **record.texts}}
                f.write(json.dumps(row) + "\\n")

        def finish(self):
            pass


    def build_hooks(config):
        def sample(step, info):
            info.write_text("eval/sample", f"a sample at step {{step}}")

        def kill(step, info):
            if step == 12 and os.path.exists(os.path.join(info.workdir, "KILL")):
                deadline = time.monotonic() + 120
                while not started(info.workdir):
                    if time.monotonic() > deadline:
                        raise TimeoutError("the trackers did not start in 120 s")
                    time.sleep(0.05)
                os.kill(os.getpid(), signal.SIGKILL)

        return [Hook(sample, every=config.eval_every_steps), Hook(kill, every=1),
                tracking_hook(JsonLinesTracker(config.shared_file))]


    def started(workdir):
        """The step-8 checkpoint is complete (it is saved asynchronously) and the three
        trackers have started (their threads write their run ids)."""
        ids = os.path.join(workdir, "trackers.json")
        return (os.path.isdir(os.path.join(workdir, "checkpoints", "8"))
                and os.path.exists(ids) and len(json.load(open(ids))) == 3)
'''


@pytest.fixture(scope="module", autouse=True)
def wandb_offline(tmp_path_factory):
    """W&B offline, its settings and caches in a directory of the tests, no error reports;
    no MLflow server from the environment."""
    home = tmp_path_factory.mktemp("wandb_home")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("WANDB_MODE", "offline")
        patch.setenv("WANDB_ERROR_REPORTING", "false")
        for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
            patch.setenv(name, str(home))
        patch.delenv("MLFLOW_TRACKING_URI", raising=False)
        yield
    if "wandb" in sys.modules:  # the service an in-process run started, and its variable
        sys.modules["wandb"].teardown()
    os.environ.pop("WANDB_SERVICE", None)


@pytest.fixture(scope="module")
def experiment(tmp_path_factory):
    path = tmp_path_factory.mktemp("experiment") / "tracked.py"
    path.write_text(textwrap.dedent(EXPERIMENT.format(vit=f"{REPO}/{VIT}")))
    return str(path)


# -- Reading the trackers back ------------------------------------------------------------

def run_ids(workdir) -> dict:
    return json.loads((workdir / RUN_IDS_FILE).read_text())


def by_step(records) -> dict[int, dict]:
    """metrics.jsonl's records merged per step, as a tracker gets them."""
    merged = {}
    for record in records:
        merged.setdefault(record["step"], {}).update(
            (k, v) for k, v in record.items() if k != "step")
    return merged


def wandb_records(workdir, kind: str) -> list[tuple[str, dict]]:
    """(run directory, record) of every `kind` record in the workdir's offline W&B run
    directories, oldest first, read by W&B's own reader (`wandb leet inspect`)."""
    found = []
    for run_dir in offline_run_dirs(str(workdir / "wandb"), run_ids(workdir)["wandb"]):
        for line in wandb_cli("leet", "inspect", "--json", run_dir).splitlines():
            record = json.loads(line)
            if record["type"] == kind:
                found.append((run_dir, record[kind]))
    return found


def wandb_rows(workdir) -> list[tuple[int, dict]]:
    """(step, values) of every W&B history row, W&B's own keys (`_step`, ...) left out."""
    return [(int(row["step"]["num"]),
             {k: v for k, v in row["item"].items() if not k.startswith("_")})
            for _, row in wandb_records(workdir, "history")]


def numbers(values: dict) -> dict:
    """The metrics of a W&B row: no texts, no images (W&B rows hold an image as keys
    `report/<name>.<field>`)."""
    return {k: v for k, v in values.items()
            if not k.startswith("report/") and not isinstance(v, str)}


def mlflow_client(workdir):
    from mlflow.tracking import MlflowClient

    return MlflowClient(configured.default_mlflow_uri(str(workdir)))


def mlflow_history(workdir) -> dict[str, list[tuple[int, float]]]:
    """Each metric's (step, value) history in the workdir's MLflow run, by step."""
    client = mlflow_client(workdir)
    run_id = run_ids(workdir)["mlflow"]
    keys = client.get_run(run_id).data.metrics
    return {key: sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
            for key in keys}


def jsonl_history(records) -> dict[str, list[tuple[int, float]]]:
    history = {}
    for step, values in sorted(by_step(records).items()):
        for key, value in values.items():
            history.setdefault(key, []).append((step, value))
    return history


# -- One run, both trackers ---------------------------------------------------------------

@pytest.fixture(scope="module")
def tracked(experiment, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("tracked")
    _, records = train(experiment, workdir, *settings(workdir))
    return workdir, records


@pytest.mark.slow
def test_wandb_offline_files_hold_the_rows_of_metrics_jsonl(tracked):
    workdir, records = tracked
    rows = wandb_rows(workdir)
    steps = [step for step, _ in rows]
    assert steps == sorted(set(steps)), "one row per step, in order"
    # Exactly: a float goes through JSON both ways, shortest round-trip repr.
    assert {step: numbers(values) for step, values in rows} == by_step(records)
    texts = {step: values["eval/sample"] for step, values in rows if "eval/sample" in values}
    assert texts == {8: "a sample at step 8", 16: "a sample at step 16"}


@pytest.mark.slow
def test_wandb_gets_the_resolved_config_and_the_reports_plots(tracked):
    workdir, _ = tracked
    config = {}
    for _, record in wandb_records(workdir, "config"):
        config.update(record["update"])
    config.pop("_wandb", None)
    assert config == json.loads((workdir / "config.json").read_text())
    last_step, last = wandb_rows(workdir)[-1]
    plots = {k.split(".")[0] for k in last if k.startswith("report/")}
    assert last_step == 16 and {"report/loss", "report/learning_rate"} <= plots


@pytest.mark.slow
def test_mlflow_holds_the_metric_history_and_the_config_as_params(tracked):
    workdir, records = tracked
    assert mlflow_history(workdir) == jsonl_history(records)
    client = mlflow_client(workdir)
    run = client.get_run(run_ids(workdir)["mlflow"])
    config = json.loads((workdir / "config.json").read_text())
    assert run.data.params == {key: str(value) for key, value in flatten(config).items()}
    assert run.info.status == "FINISHED" and run.info.run_name == workdir.name
    text = client.download_artifacts(run.info.run_id, "text/eval/sample/step_8.txt",
                                     str(workdir / "downloaded"))
    assert open(text).read() == "a sample at step 8"
    plots = {a.path for a in client.list_artifacts(run.info.run_id, "report")}
    assert {"report/loss.png", "report/learning_rate.png"} <= plots


def shared_file_rows(workdir) -> list[tuple[int, dict]]:
    with open(workdir / "shared.jsonl") as f:
        return [(r.pop("step"), r) for r in map(json.loads, f)]


@pytest.mark.slow
def test_a_users_tracker_in_build_hooks_gets_every_record(tracked):
    """README's own tracker, in the experiment's build_hooks."""
    workdir, records = tracked
    expected = by_step(records)
    for step in (8, 16):
        expected[step]["eval/sample"] = f"a sample at step {step}"
    assert dict(shared_file_rows(workdir)) == expected
    assert [step for step, _ in shared_file_rows(workdir)] == sorted(expected)


# -- Killed and resumed -------------------------------------------------------------------

@pytest.fixture(scope="module")
def killed_and_resumed(experiment, tracked, tmp_path_factory):
    """The tracked run, SIGKILLed at step 12 (its checkpoint: step 8) and rerun to the end."""
    workdir = tmp_path_factory.mktemp("killed")
    (workdir / "KILL").touch()
    command = (f"--config={experiment}", f"--workdir={workdir}", *settings(workdir))
    with pytest.MonkeyPatch.context() as patch:
        # Each run starts its own W&B service, as a job's processes do, not the one that
        # the tracked run started in this process (which would outlive the kill).
        patch.delenv("WANDB_SERVICE", raising=False)
        killed = run_main(*command)
        assert killed.returncode == -9, killed.stderr[-3000:]
        (workdir / "KILL").unlink()
        resumed = run_main(*command)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stderr
    failed = [line for line in resumed.stderr.splitlines() if "] tracker " in line]
    assert failed == [], resumed.stderr[-6000:]
    return workdir


def assert_each_step_once_with_the_trajectory(history: dict, jsonl: dict) -> None:
    """Every step of metrics.jsonl, each once, and the trajectory's values. (A step the
    tracker held from before the kill keeps that run's record: its speeds, and no
    `time/compile_s` where the resumed run logged its own compile time.)"""
    for key, points in history.items():
        steps = [step for step, _ in points]
        assert steps == sorted(set(steps)), f"{key}: a step twice"
    assert ({step for points in history.values() for step, _ in points}
            == {step for points in jsonl.values() for step, _ in points})
    for key in TRAJECTORY:
        assert history[key] == jsonl[key], key


@pytest.mark.slow
def test_a_killed_run_resumed_continues_its_wandb_run_with_each_step_once(killed_and_resumed):
    workdir = killed_and_resumed
    run_dirs = sorted(p.name for p in (workdir / "wandb").glob("offline-run-*"))
    assert len(run_dirs) == 2 and all(d.endswith("-" + run_ids(workdir)["wandb"])
                                      for d in run_dirs), run_dirs
    history = {}
    for step, values in wandb_rows(workdir):
        for key, value in numbers(values).items():
            history.setdefault(key, []).append((step, value))
    assert_each_step_once_with_the_trajectory(history, jsonl_history(read_metrics(workdir)))


@pytest.mark.slow
def test_a_killed_run_resumed_continues_its_mlflow_run_with_each_step_once(killed_and_resumed):
    workdir = killed_and_resumed
    client = mlflow_client(workdir)
    runs = client.search_runs([client.get_experiment_by_name("jdp").experiment_id])
    assert [run.info.run_id for run in runs] == [run_ids(workdir)["mlflow"]]
    assert runs[0].info.status == "FINISHED"
    assert_each_step_once_with_the_trajectory(mlflow_history(workdir),
                                              jsonl_history(read_metrics(workdir)))


@pytest.mark.slow
def test_a_killed_run_resumed_sends_a_users_tracker_each_step_once(killed_and_resumed):
    workdir = killed_and_resumed
    history = {}
    for step, values in shared_file_rows(workdir):
        for key, value in numbers(values).items():
            history.setdefault(key, []).append((step, value))
    assert_each_step_once_with_the_trajectory(history, jsonl_history(read_metrics(workdir)))


# -- Failing backends ---------------------------------------------------------------------

@pytest.mark.slow
def test_trackers_whose_backends_fail_warn_once_each_and_training_goes_on(
        experiment, tracked, tmp_path, monkeypatch, caplog):
    """W&B's server is gone (every call raises); MLflow's disk fills after the run began
    (every metrics batch raises). Each warns once and the run ends as an untracked one."""
    from mlflow.tracking import MlflowClient

    calls = {"wandb": 0, "mlflow": 0}

    def gone(*args, **kwargs):
        calls["wandb"] += 1
        raise ConnectionError("the W&B server is gone")

    wandb = types.ModuleType("wandb")
    wandb.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    wandb.init = wandb.Image = wandb.log = wandb.finish = gone
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    log_batch = MlflowClient.log_batch

    def full(self, run_id, metrics=(), **kwargs):
        if metrics:
            calls["mlflow"] += 1
            raise OSError(28, "No space left on device")
        return log_batch(self, run_id, metrics, **kwargs)

    monkeypatch.setattr(MlflowClient, "log_batch", full)
    with caplog.at_level(logging.WARNING):
        _, records = train(experiment, tmp_path, *settings(tmp_path))
    assert sorted(w.split(";")[0] for w in warnings_of(caplog)) == [
        "tracker mlflow failed at step 2 (OSError: [Errno 28] No space left on device)",
        "tracker wandb failed starting (ConnectionError: the W&B server is gone)"]
    assert calls == {"wandb": 1, "mlflow": 1}
    assert by_step(records).keys() == by_step(tracked[1]).keys()  # nothing lost


# -- The feed, step by step ---------------------------------------------------------------

class Recording:
    """A tracker that keeps what it is sent; its backend holds steps up to `held_through`;
    it fails from `fail_from_step` on, and each `log` waits for `gate` (set: no wait)."""

    name = "recording"

    def __init__(self, held_through: int = 0, fail_from_step: int | None = None):
        self.held_through = held_through
        self.fail_from_step = fail_from_step
        self.gate = threading.Event()
        self.gate.set()
        self.started: list = []
        self.records: list = []
        self.finished = 0

    def start(self, run_id, config):
        self.started.append((run_id, config))
        return run_id or "run-1", self.held_through

    def log(self, record):
        self.gate.wait()
        if self.fail_from_step is not None and record.step >= self.fail_from_step:
            raise OSError("the disk is full")
        self.records.append(record)

    def finish(self):
        self.finished += 1


def call(feed, workdir, step, written=(), total_steps=100, is_writer=True):
    def unused(*args):
        raise AssertionError("a tracking hook reads no state and writes nothing")

    feed(step, HookInfo(step=step, workdir=str(workdir), is_writer=is_writer,
                        total_steps=total_steps, state_fn=unused, metrics_fn=unused,
                        write_fn=unused, write_text_fn=unused,
                        written_fn=lambda: list(written)))


def write_metrics(workdir, steps) -> None:
    (workdir / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "train/loss": 1.0 / s}) + "\n" for s in steps))


def sent(tracker) -> list[tuple[int, dict, dict]]:
    return [(r.step, r.metrics, r.texts) for r in tracker.records]


def test_each_step_goes_out_once_complete_as_one_record_the_last_with_the_plots(tmp_path):
    (tmp_path / "config.json").write_text('{"seed": 3}')
    write_metrics(tmp_path, (2, 4))  # as the writers wrote them
    tracker = Recording()
    feed = TrackerFeed(tracker)
    call(feed, tmp_path, 1, total_steps=4)
    call(feed, tmp_path, 2, [(2, {"eval/loss": 1.5}), (2, {"eval/sample": "def f"})],
         total_steps=4)
    call(feed, tmp_path, 3, [(2, {"train/loss": 0.5})], total_steps=4)  # one step late
    call(feed, tmp_path, 4, [(4, {"train/loss": 0.25})], total_steps=4)
    assert tracker.started == [(None, {"seed": 3})]
    assert sent(tracker) == [(2, {"eval/loss": 1.5, "train/loss": 0.5}, {"eval/sample": "def f"}),
                             (4, {"train/loss": 0.25}, {})]
    assert tracker.records[0].images == {}
    assert set(tracker.records[1].images) == {"report/loss"}
    assert tracker.finished == 1
    assert run_ids(tmp_path) == {"recording": "run-1"}


@pytest.mark.parametrize("held_through, expected", [
    (2, [4, 6, 9, 10]),  # the backend lost steps 4 and 6: sent from metrics.jsonl
    (9, [10]),  # the backend has step 9 from before the kill: the recomputed one is dropped
])
def test_a_resumed_feed_sends_what_the_backend_lacks_and_no_step_twice(tmp_path, held_through,
                                                                        expected):
    """Resumed from a checkpoint at step 8: metrics.jsonl holds steps 2-6 of the run before."""
    (tmp_path / RUN_IDS_FILE).write_text('{"recording": "run-7"}')
    write_metrics(tmp_path, (2, 4, 6))
    tracker = Recording(held_through)
    feed = TrackerFeed(tracker)
    for step in (9, 10, 11):
        call(feed, tmp_path, step, [(step - 1, {"train/loss": 1.0})] if step > 9 else [],
             total_steps=11)
    assert [run_id for run_id, _ in tracker.started] == ["run-7"]
    assert [r.step for r in tracker.records] == expected


def test_only_process_0_sends(tmp_path):
    tracker = Recording()
    feed = TrackerFeed(tracker)
    for step in (1, 2, 3):
        call(feed, tmp_path, step, [(step, {"train/loss": 1.0})], total_steps=3,
             is_writer=False)
    assert tracker.started == [] and tracker.records == []


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("tracker ")]


def test_a_tracker_that_fails_warns_once_and_is_sent_nothing_more(tmp_path, caplog):
    write_metrics(tmp_path, range(1, 8))
    tracker = Recording(fail_from_step=3)
    feed = TrackerFeed(tracker)
    with caplog.at_level(logging.WARNING):
        for step in range(1, 8):
            call(feed, tmp_path, step, [(step, {"train/loss": 1.0})], total_steps=7)
        feed.sender.join()
    assert warnings_of(caplog) == [
        "tracker recording failed at step 3 (OSError: the disk is full); training goes on "
        "without it. metrics.jsonl keeps every record, and a resumed run sends the tracker "
        "what it missed."]
    assert [r.step for r in tracker.records] == [1, 2] and tracker.finished == 0


def test_a_hung_tracker_holds_the_end_of_training_a_bounded_time(tmp_path, caplog,
                                                                 monkeypatch):
    monkeypatch.setattr(feed_module, "END_WAIT_S", 0.5)
    write_metrics(tmp_path, range(1, 6))
    tracker = Recording()
    tracker.gate.clear()  # the backend answers no call
    feed = TrackerFeed(tracker)
    with caplog.at_level(logging.WARNING):
        for step in range(1, 6):
            call(feed, tmp_path, step, [(step, {"train/loss": 1.0})], total_steps=5)
    assert warnings_of(caplog) == [
        "tracker recording failed at the end: still sending after 0.5 s; training goes on "
        "without it. metrics.jsonl keeps every record, and a resumed run sends the tracker "
        "what it missed."]
    tracker.gate.set()


def test_a_tracker_too_far_behind_is_turned_off_with_one_warning(tmp_path, caplog,
                                                                 monkeypatch):
    monkeypatch.setattr(feed_module, "MAX_BEHIND", 3)
    tracker = Recording()
    tracker.gate.clear()
    feed = TrackerFeed(tracker)
    with caplog.at_level(logging.WARNING):
        for step in range(1, 20):
            call(feed, tmp_path, step, [(step, {"train/loss": 1.0})])
    assert feed.off
    assert [w.split(";")[0] for w in warnings_of(caplog)] == [
        "tracker recording failed 3 steps behind"]
    tracker.gate.set()


# -- Bad input ----------------------------------------------------------------------------

@pytest.mark.slow
def test_an_unknown_tracker_is_one_line_and_exit_2_with_nothing_written(tmp_path):
    workdir = tmp_path / "run"
    proc = run_main(f"--config={VIT}", f"--workdir={workdir}",
                    "--config.tracker.kind=wandb,neptune")
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("jdp: error:")]
    assert errors == ["jdp: error: config.tracker.kind='wandb,neptune': unknown tracker "
                      "'neptune'. Fix: use 'wandb' or 'mlflow' or both ('wandb,mlflow'); "
                      "another tracker is a hook in the experiment's build_hooks "
                      "(jdp.hooks.tracking_hook)."], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert not workdir.exists()


@pytest.mark.parametrize("kind, missing, extra", [
    ("wandb", "wandb", "wandb"),
    ("mlflow", "mlflow", "mlflow"),
    ("wandb,mlflow", "sqlalchemy", "mlflow"),  # the default store is SQL (SQLite)
])
def test_a_tracker_whose_package_is_missing_names_the_extra_before_anything_is_written(
        tmp_path, monkeypatch, kind, missing, extra):
    monkeypatch.setitem(sys.modules, missing, None)  # as if not installed
    workdir = tmp_path / "run"
    with pytest.raises(ConfigError) as error:
        jdp_main.run(load_config(VIT, f"--config.tracker.kind={kind}"), VIT, str(workdir))
    message = str(error.value)
    assert "\n" not in message and f"needs {missing}, which is not installed" in message
    assert message.endswith(f"Fix: pip install 'jdp[{extra}]'.")
    assert not workdir.exists()


@pytest.mark.parametrize("overrides, workdir, says", [
    (("--config.tracker.kind=5",), "run", "config.tracker.kind=5: expected tracker names"),
    (("--config.tracker.kind=wandb,wandb",), "run", "names a tracker twice"),
    (("--config.tracker.kind=mlflow",), "gs://bucket/run",
     "config.tracker.mlflow_uri='': MLflow's default store is a SQLite file in the workdir"),
])
def test_bad_tracker_settings_are_refused_naming_the_field(overrides, workdir, says):
    with pytest.raises(ConfigError) as error:
        configured.check(load_config(VIT, *overrides), workdir)
    assert says in str(error.value) and "Fix: " in str(error.value)


def test_no_tracker_by_default_nor_in_a_tuning_trial():
    from jdp.tune import space, trial

    assert configured.configured_hooks(load_config(VIT), "run") == []
    config = load_config(VIT, BOTH)
    assert len(configured.configured_hooks(config, "run")) == 2
    trial_config = space.configured(config, trial.trial_settings(config, trial_steps=10))
    assert configured.configured_hooks(trial_config, "run") == []
